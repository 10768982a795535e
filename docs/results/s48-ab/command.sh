#!/bin/bash
# stop 48: the Markov heads retrained on 500k tokens (/work/runs48/new-heads/markov) against the shipped ones
# (85.6k tokens). Fixed trees first (mean accepted independent of timings), then the default adaptive path.
cd /work/main
B=".venv/bin/causaldraft bench --compile --max-new-tokens 256 --no-progress --temperature 0 --seed 0"
MT=bench/prompts/mt-bench-8.jsonl
SB=/work/runs48/sb/specbench-15.jsonl
NEW=/work/runs48/new-heads/markov
O=/work/runs48/ab
for set in mt sb; do
  P=$MT; [ $set = sb ] && P=$SB
  $B --prompts $P --dtype int4 --methods markov:dynamic --no-adapt --no-fallback --out $O/fixed-$set-int4-old
  $B --prompts $P --dtype int4 --methods markov:dynamic --no-adapt --no-fallback --heads $NEW --out $O/fixed-$set-int4-new
done
for set in mt sb; do
  P=$MT; [ $set = sb ] && P=$SB
  $B --prompts $P --dtype int4 --methods ar,lookup,markov:dynamic --out $O/int4-$set-old
  $B --prompts $P --dtype int4 --methods ar,lookup,markov:dynamic --heads $NEW --out $O/int4-$set-new
done
$B --prompts $MT --dtype bfloat16 --methods ar,lookup,markov:dynamic --out $O/bf16-mt-old
$B --prompts $MT --dtype bfloat16 --methods ar,lookup,markov:dynamic --heads $NEW --out $O/bf16-mt-new
