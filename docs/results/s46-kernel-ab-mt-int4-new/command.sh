#!/bin/bash
# stop 46: the VNNI build's quads records + vector rounding (working tree) against a3a6cbe, alternating, nothing else running
cd /work/main
M=ar,lookup,markov:dynamic,eagle3:dynamic
run() { # name code prompts dtype
  if [ "$2" = old ]; then
    (cd /tmp/wtA && PYTHONPATH=/tmp/wtA /work/main/.venv/bin/python -m causaldraft.cli bench --prompts /work/main/$3 --compile --max-new-tokens 256 --no-progress --methods $M --dtype $4 --out /work/main/runs/s46/ab-$1) > runs/s46/ab-$1.log 2>&1
  else
    .venv/bin/causaldraft bench --prompts $3 --compile --max-new-tokens 256 --no-progress --methods $M --dtype $4 --out runs/s46/ab-$1 > runs/s46/ab-$1.log 2>&1
  fi
}
run mt-int4-new new bench/prompts/mt-bench-8.jsonl int4
run mt-int4-old old bench/prompts/mt-bench-8.jsonl int4
run sb-int4-new new runs/s45/specbench-15.jsonl int4
run sb-int4-old old runs/s45/specbench-15.jsonl int4
run mt-int4-new2 new bench/prompts/mt-bench-8.jsonl int4
run mt-int4-old2 old bench/prompts/mt-bench-8.jsonl int4
echo done > runs/s46/ab.done
