#!/bin/bash
# stop 46: the Q8_0 head's AMX build (default) against its AVX-512 build (CAUSALDRAFT_Q8_0_HEAD=avx512), alternating
cd /work/main
M=ar,lookup,markov:dynamic,eagle3:dynamic
run() { # name head prompts
  CAUSALDRAFT_Q8_0_HEAD=$2 .venv/bin/causaldraft bench --prompts $3 --compile --max-new-tokens 256 --no-progress --methods $M --dtype int4 --out runs/s46/ab2-$1 > runs/s46/ab2-$1.log 2>&1
}
run mt-amx "" bench/prompts/mt-bench-8.jsonl
run mt-avx512 avx512 bench/prompts/mt-bench-8.jsonl
run sb-amx "" runs/s45/specbench-15.jsonl
run sb-avx512 avx512 runs/s45/specbench-15.jsonl
run mt-amx2 "" bench/prompts/mt-bench-8.jsonl
run mt-avx5122 avx512 bench/prompts/mt-bench-8.jsonl
echo done > runs/s46/ab2.done
