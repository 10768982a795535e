#!/bin/bash
# stop 45: the AMX attention build (working tree) against fe5b9fa (AVX-512 fp32 attention), alternating, nothing else running
cd /work/main
M=ar,lookup,markov:dynamic,eagle3:dynamic
run() { # name code prompts dtype
  if [ "$2" = old ]; then
    (cd /tmp/wt-old && PYTHONPATH=/tmp/wt-old /work/main/.venv/bin/python -m causaldraft.cli bench --prompts /work/main/$3 --compile --max-new-tokens 256 --no-progress --methods $M --dtype $4 --out /work/main/runs/s45/ab-$1) > runs/s45/ab-$1.log 2>&1
  else
    .venv/bin/causaldraft bench --prompts $3 --compile --max-new-tokens 256 --no-progress --methods $M --dtype $4 --out runs/s45/ab-$1 > runs/s45/ab-$1.log 2>&1
  fi
}
run mt-bf16-new new bench/prompts/mt-bench-8.jsonl bfloat16
run mt-bf16-old old bench/prompts/mt-bench-8.jsonl bfloat16
run mt-int4-new new bench/prompts/mt-bench-8.jsonl int4
run mt-int4-old old bench/prompts/mt-bench-8.jsonl int4
run sb-bf16-new new runs/s45/specbench-15.jsonl bfloat16
run sb-bf16-old old runs/s45/specbench-15.jsonl bfloat16
run sb-int4-new new runs/s45/specbench-15.jsonl int4
run sb-int4-old old runs/s45/specbench-15.jsonl int4
echo done > runs/s45/ab.done
