#!/bin/bash
# stop 54: stop 53's final code (563dc36) and this stop's, alternating (int4, first turns, 128 tokens)
for round in 1 2; do
  for side in old new; do
    if [ $side = old ]; then root=/tmp/old54; else root=/work/main; fi
    (cd $root && PYTHONPATH=$root /work/main/.venv/bin/python -m causaldraft.cli bench --prompts /work/main/bench/prompts/mt-bench-8.jsonl \
      --compile --max-new-tokens 128 --no-progress --methods ar,lookup --dtype int4 --out /tmp/ab54/$side-$round 2>/dev/null \
      | grep tokens_per_s | sed "s/^/$side $round /")
  done
done
