#!/bin/bash
cd /work/main
.venv/bin/causaldraft bench --prompts bench/prompts/mt-bench-other16.jsonl --compile --max-new-tokens 128 --no-progress --methods ar,lookup,markov:dynamic,eagle3:dynamic,llamacpp --dtype int4 --out runs/s42/other16-int4
