#!/bin/bash
cd /work/main
B=".venv/bin/causaldraft bench --compile --no-progress --dtype int4 --methods lookup --no-adapt --no-fallback"
for S in 450 900; do
  if [ $S = 900 ]; then ST="--store runs/s47/store-900k"; else ST=""; fi
  $B --prompts bench/prompts/mt-bench-other16.jsonl --max-new-tokens 128 $ST --out runs/s47/sna-other16-$S > runs/s47/sna-other16-$S.log 2>&1
  $B --prompts bench/prompts/mt-bench-8.jsonl --max-new-tokens 256 $ST --out runs/s47/sna-mt8-$S > runs/s47/sna-mt8-$S.log 2>&1
  $B --prompts runs/s45/specbench-15.jsonl --max-new-tokens 256 $ST --out runs/s47/sna-sb15-$S > runs/s47/sna-sb15-$S.log 2>&1
done
echo done > runs/s47/store-ab2.done
