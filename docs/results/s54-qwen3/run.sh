#!/usr/bin/env bash
# Plain decoding of a random Qwen3-0.6B-shaped model (make_model.py) on the native backend (bf16, int4; compiled,
# as a user gets it) against transformers (--backend hf, bf16), and speculation's equality with plain decoding.
set -euo pipefail
cd "$(dirname "$0")/../../.."
MODEL=${MODEL:-/tmp/qwen3-0.6b-random}
[ -d "$MODEL" ] || PYTHONPATH=. .venv/bin/python docs/results/s54-qwen3/make_model.py "$MODEL"
PROMPT="the cat sat on the mat and the dog sat on the log; the cat sat on the mat and"
for args in "--backend hf --dtype bfloat16 --no-compile" "--dtype bfloat16" "--dtype int4"; do
  for drafter in none lookup; do
    [[ "$args" == *hf* && $drafter == lookup ]] && continue
    echo "== $args --drafter $drafter"
    .venv/bin/causaldraft generate --model "$MODEL" $args --drafter $drafter --prompt "$PROMPT" \
      --max-new-tokens 128 --json 2>/dev/null | .venv/bin/python -c "
import json, sys; r = json.load(sys.stdin); s = r['stats']
print(json.dumps({k: s[k] for k in ('tokens_per_s', 'mean_accepted', 'verify_ms_per_step', 'dtype', 'compiled')}),
      'first ids', r['token_ids'][:8], 'hash', hash(tuple(r['token_ids'])))"
  done
done
