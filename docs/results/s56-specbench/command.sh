#!/bin/bash
# stop 56: the 15 Spec-Bench questions of stop 45 (hemingkx/Spec-Bench, data/spec_bench/question.jsonl, Apache-2.0;
# not copied here): the 6th, 38th and 72nd of each of translation, summarization, qa, math_reasoning, rag (question
# ids 166 198 232 246 278 312 326 358 392 406 438 472 486 518 552), on the AMD EPYC VM (stop 45 ran on the Xeon).
cd /work/main
python3 -c "
import json
rows = [json.loads(line) for line in open('runs/s56/question.jsonl')]
with open('runs/s56/specbench-15.jsonl', 'w') as out:
    for category in ('translation', 'summarization', 'qa', 'math_reasoning', 'rag'):
        kept = [row for row in rows if row['category'] == category]
        for index in (5, 37, 71):
            out.write(json.dumps(kept[index]) + '\n')
"
.venv/bin/causaldraft bench --prompts runs/s56/specbench-15.jsonl --compile --max-new-tokens 256 --no-progress \
  --methods ar,lookup,markov:dynamic,eagle3:dynamic,llamacpp --dtype int4 --out runs/s56/sb-int4
.venv/bin/causaldraft bench --prompts runs/s56/specbench-15.jsonl --compile --max-new-tokens 256 --no-progress \
  --methods ar,lookup,markov:dynamic,eagle3:dynamic --dtype bfloat16 --out runs/s56/sb-bfloat16
