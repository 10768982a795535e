#!/bin/bash
# T=1 seeded, bf16: stop 49's code (worktree at 2c471e3) and this stop's, alternating.
BEFORE=${BEFORE:-/work/runs50/before}  # a git worktree of 2c471e3
for round in 1 2; do
  for side in before after; do
    if [ $side = before ]; then dir=$BEFORE; else dir=/work/main; fi
    (cd $dir && PYTHONPATH=$dir /work/main/.venv/bin/causaldraft bench --prompts /work/main/bench/prompts/mt-bench-8.jsonl \
      --compile --max-new-tokens 256 --no-progress --methods ar,eagle3:dynamic --dtype bfloat16 --temperature 1 --seed 0 \
      --out /work/runs50/ab/t1-$side-$round > /work/runs50/ab/t1-$side-$round.log 2>&1)
    echo "t1 $side $round"; grep -E "^\| (ar|eagle3:dynamic) \|" /work/runs50/ab/t1-$side-$round/report.md | head -2 | cut -d'|' -f2-4,8-9
  done
done
