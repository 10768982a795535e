#!/bin/bash
# stop 49: the two int4 builds end to end on the AMD EPYC (default int4, compiled), alternating runs
cd /work/main
for round in 1 2 3; do
  for isa in avx512_bf16 vnni; do
    CAUSALDRAFT_INT4_KERNEL=$isa .venv/bin/causaldraft bench --prompts bench/prompts/mt-bench-8.jsonl --limit 4 \
      --compile --max-new-tokens 256 --no-progress --methods ar,lookup,markov:dynamic \
      --out runs/s49/int4-builds/$isa-$round 2>&1 | grep tokens_per_s | sed "s/^/$isa-$round /" | cut -c1-110
  done
done
