#!/bin/bash
# stop 49: which drafter `auto` should run for a bf16 target on a CPU whose verify passes are not flat (an AMD
# EPYC VM, no AMX: 14.0 / 26.3 ms at 2 / 16 rows): lookup against the shipped eagle3 layer, T=0 and seeded T=1,
# mt-bench-8 and 15 Spec-Bench questions (the 6th, 38th and 72nd of each of its five categories; see
# docs/results/s45-specbench-int4/command.sh for where the file comes from). `auto` ran the code of that moment
# with a flat-cost rule that chose lookup here; the rule was not kept (history.md, stop 49).
cd /work/main
run() { .venv/bin/causaldraft bench --compile --max-new-tokens 256 --no-progress --dtype bfloat16 "$@"; }
SB=runs/s49/specbench-15.jsonl
run --prompts bench/prompts/mt-bench-8.jsonl --methods ar,lookup,eagle3:dynamic,auto --out runs/s49/bf16-mt-bench-8
run --prompts $SB --methods ar,lookup,eagle3:dynamic,auto --out runs/s49/bf16-specbench-15
run --prompts bench/prompts/mt-bench-8.jsonl --methods ar,lookup,eagle3:dynamic --temperature 1 --seed 0 \
  --out runs/s49/t1-bf16-mt-bench-8
run --prompts $SB --methods ar,lookup,eagle3:dynamic --temperature 1 --seed 0 --out runs/s49/t1-bf16-specbench-15
run --prompts bench/prompts/mt-bench-8.jsonl --methods ar,lookup,eagle3:dynamic --out runs/s49/bf16-mt-bench-8-b
