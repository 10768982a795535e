"""``causaldraft export-heads DIR --format eagle3 --out OUT``: a trained eagle3 layer in the
``speculators`` EAGLE-3 layout, which vLLM serves directly as a speculative-decoding draft:

    vllm serve TARGET --speculative-config '{"model": "OUT", "method": "eagle3", "num_speculative_tokens": 5}'

Layout (docs/eagle3.md has the field-by-field account): ``config.json`` with
``speculators_model_type`` "eagle3", the decoder layer's ``transformer_layer_config`` (a one-layer
Llama config), ``draft_vocab_size``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids``
and the verifier; ``model.safetensors`` with ``fc``, ``layers.0.*`` (q/k/v/o, gate/up/down,
input_layernorm, hidden_norm, post_attention_layernorm), ``norm``, ``lm_head``, ``embed_tokens``
(the target's, frozen), ``d2t`` (target id = draft id + d2t[draft id]) and ``t2d`` (a mask over
the target vocabulary).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from causaldraft.drafters.eagle3_model import Eagle3Layer, load_layer, read_config
from causaldraft.errors import CausalDraftError
from causaldraft.models.loading import LoadedModel

SPECULATORS_VERSION = "0.9.0"  # the speculators release whose loader the export check runs


def speculators_weights(layer: Eagle3Layer, embed: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our fused projections split back into the names vLLM and speculators load."""
    c = layer.config
    q, k, v = layer.qkv_proj.weight.detach().split(c.part_rows(), dim=0)
    gate, up = layer.gate_up_proj.weight.detach().chunk(2, dim=0)
    ids = layer.vocab_ids
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors = {
        "fc.weight": layer.fc.weight,
        "layers.0.self_attn.q_proj.weight": q,
        "layers.0.self_attn.k_proj.weight": k,
        "layers.0.self_attn.v_proj.weight": v,
        "layers.0.self_attn.o_proj.weight": layer.o_proj.weight,
        "layers.0.input_layernorm.weight": layer.input_layernorm.weight,
        "layers.0.hidden_norm.weight": layer.hidden_norm.weight,
        "layers.0.post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
        "layers.0.mlp.gate_proj.weight": gate,
        "layers.0.mlp.up_proj.weight": up,
        "layers.0.mlp.down_proj.weight": layer.down_proj.weight,
        "norm.weight": layer.norm.weight,
        "lm_head.weight": layer.lm_head.weight,
        "embed_tokens.weight": embed,
    }
    weights = {name: value.detach().to(torch.bfloat16).contiguous() for name, value in tensors.items()}
    weights["d2t"] = (ids - torch.arange(ids.numel())).long().contiguous()
    weights["t2d"] = t2d
    return weights


def speculators_config(layer: Eagle3Layer, verifier: str, architectures: list[str]) -> dict[str, object]:
    c = layer.config
    rope = c.rope
    layer_config: dict[str, object] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_eps,
        "max_position_embeddings": c.max_positions,
        "rope_theta": c.rope_theta,
        "rope_parameters": rope,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    if c.rope_parameters:  # the same rope under the name transformers 4 (and the vLLM releases on it) read
        layer_config["rope_scaling"] = {name: value for name, value in rope.items() if name != "rope_theta"}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer_config,
        "draft_vocab_size": c.draft_vocab,
        "norm_before_residual": False,
        "target_hidden_size": c.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "torch_dtype": "bfloat16",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": architectures},
        },
    }


def export_eagle3(directory: Path, target: LoadedModel, out: Path, verifier: str | None = None) -> Path:
    """Write ``directory``'s eagle3 layer for ``target`` to ``out`` in the speculators layout.
    ``verifier``: the name vLLM will serve the target under (default: its local checkpoint dir)."""
    config, _ = read_config(directory)
    shape = target.backend.shape
    layer = load_layer(directory, target.base_fingerprint, shape.vocab_size, shape.hidden_size)
    if config.aux_layers != tuple(sorted(config.aux_layers)):
        raise CausalDraftError(f"aux layers {config.aux_layers} must be increasing to export (vLLM's order)")
    source = json.loads((target.model_dir / "config.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    embed = target.backend.embed(torch.arange(shape.vocab_size)).detach()
    save_file(speculators_weights(layer, embed), str(out / "model.safetensors"), metadata={"format": "pt"})
    verifier = verifier or str(target.model_dir.resolve())  # vLLM may start from another directory
    record = speculators_config(layer, verifier, source.get("architectures") or [])
    (out / "config.json").write_text(json.dumps(record, indent=2) + "\n")
    return out


def write_reference(directory: Path, target: LoadedModel, path: Path, rows: int = 24, seed: int = 0) -> Path:
    """Inputs and causaldraft's float32 logits of one causal pass of the layer, for the export
    check (bench/eagle3_export_check.py): features from a real target pass over ``rows`` tokens."""
    shape = target.backend.shape
    layer = load_layer(directory, target.base_fingerprint, shape.vocab_size, shape.hidden_size)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, shape.vocab_size, (rows + 1,), generator=generator)
    cache = target.backend.new_cache(rows)
    causal = torch.ones(rows, rows, dtype=torch.bool).tril()
    with torch.inference_mode():
        features = target.backend.forward(tokens[:rows], torch.arange(rows), causal, cache,
                                          aux_layers=layer.config.aux_layers).aux  # fmt: skip
        assert features is not None
        features = features.float()  # [rows, F]
        ids = tokens[1:]  # row p reads x_{p+1}
        embeds = target.backend.embed(ids).float()
        keys = torch.zeros(layer.config.kv_heads, rows, layer.config.head_dim)
        values = torch.zeros_like(keys)
        positions = torch.arange(rows)
        out = layer.step(embeds, layer.fc(features), positions, causal, keys, values, positions)
        logits = layer.logits(out)  # [rows, V']
    torch.save({"features": features, "ids": ids, "positions": positions, "logits": logits,
                "vocab_ids": layer.vocab_ids}, path)  # fmt: skip
    return path
