#!/bin/bash
# A/B: stop 49's code (worktree at 2c471e3) and this stop's, alternating, int4, Spec-Bench-15 and mt-bench-8.
# BEFORE: a git worktree of 2c471e3 (git worktree add BEFORE 2c471e3); specbench-15.jsonl: made as in docs/results/s45-specbench-int4/command.sh
BEFORE=${BEFORE:-/work/runs50/before}
set -e
for round in 1 2; do
  for side in before after; do
    if [ $side = before ]; then dir=$BEFORE; else dir=/work/main; fi
    for prompts in /work/runs50/specbench-15.jsonl /work/main/bench/prompts/mt-bench-8.jsonl; do
      name=$(basename $prompts .jsonl)
      (cd $dir && PYTHONPATH=$dir /work/main/.venv/bin/causaldraft bench --prompts $prompts --compile --max-new-tokens 256 \
        --no-progress --methods ar,lookup --dtype int4 --out /work/runs50/ab/$name-$side-$round > /dev/null 2>&1)
      echo "$name $side $round"; grep -E "^\| (ar|lookup) \|" /work/runs50/ab/$name-$side-$round/report.md | head -2 | cut -d'|' -f2-4
    done
  done
done
