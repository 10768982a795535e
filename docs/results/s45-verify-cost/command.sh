#!/bin/bash
# stop 45: verify pass cost, AMX attention (working tree) against fe5b9fa, alternating
cd /work/main
for round in 1 2; do
 for code in new old; do
  for dtype in bfloat16 int4; do
   rows=1,2,4,8,16; [ $dtype = bfloat16 ] && rows=1,2,4,8,16,32
   if [ $code = old ]; then
     (cd /tmp/wt-old && PYTHONPATH=/tmp/wt-old /work/main/.venv/bin/python /work/main/bench/verify_cost.py --dtype $dtype --rows $rows --contexts 64,256,512,1024 --repeats 21) > runs/s45/vc-$dtype-$code-$round.txt 2>&1
   else
     .venv/bin/python bench/verify_cost.py --dtype $dtype --rows $rows --contexts 64,256,512,1024 --repeats 21 > runs/s45/vc-$dtype-$code-$round.txt 2>&1
   fi
  done
 done
done
echo done > runs/s45/vc.done
