"""Load an exported eagle3 drafter with the ``speculators`` package and compare its draft logits with
causaldraft's on the same inputs. Runs in a Python environment that has speculators (its pins clash
with the project's transformers, so it lives in a venv of its own: ``make .venv-speculators/bin/python``);
it imports nothing from causaldraft.

Inputs and causaldraft's logits come from ``reference.pt`` (written by
``causaldraft.export.write_reference``): target features [T, F], token ids [T], positions [T] and
the logits [T, V'] of one causal pass of the layer over those rows (the draft cache catch-up).

    .venv-speculators/bin/python bench/eagle3_export_check.py OUT reference.pt
"""

from __future__ import annotations

import json
import sys

import torch
from speculators.models.eagle3 import Eagle3DraftModel


def speculators_logits(
    model: Eagle3DraftModel, features: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """One causal pass of speculators' EAGLE-3 modules: fc, the first decoder layer, norm, lm_head."""
    layer = model.layers[0]
    layer.self_attn.config._attn_implementation = "eager"  # its CPU-friendly reference kernel
    rows = ids.shape[0]
    hidden = model.fc(features[None])  # [1, T, h]
    mixed = torch.cat([model.embed_tokens(ids[None]), hidden], dim=-1)  # [1, T, 2h]
    position_ids = positions[None]
    embeddings = model.rotary_emb(mixed, position_ids)
    mask = torch.full((rows, rows), float("-inf")).triu(1)[None, None]  # [1, 1, T, T] additive causal
    out = layer(mixed, attention_mask=mask, position_ids=position_ids, position_embeddings=embeddings)
    return model.lm_head(model.norm(out))[0]  # [T, V']


def main(export_dir: str, reference_path: str) -> int:
    reference = torch.load(reference_path, weights_only=True)
    model = Eagle3DraftModel.from_pretrained(export_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = speculators_logits(model, reference["features"].float(), reference["ids"], reference["positions"])
    expected = reference["logits"].float()
    difference = float((logits - expected).abs().max())
    same_top1 = bool(torch.equal(logits.argmax(-1), expected.argmax(-1)))
    target_ids = torch.arange(model.d2t.numel()) + model.d2t  # vLLM's draft -> target map
    same_map = bool(torch.equal(target_ids, reference["vocab_ids"]))
    ok = difference <= 1e-3 * max(1.0, float(expected.abs().max())) and same_top1 and same_map
    print(json.dumps({"rows": int(expected.shape[0]), "draft_vocab": int(expected.shape[1]),
                      "max_abs_logit_difference": difference, "same_top1": same_top1,
                      "draft_to_target_map_equal": same_map, "ok": ok}))  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
