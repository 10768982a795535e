"""GGUF Q4_1 tensors as int4 groups, without dequantizing and re-quantizing.

A Q4_1 block holds 32 consecutive weights of one row: d (f16), m (f16) and 16 bytes of 4-bit
values, byte j carrying element j in its low nibble and element j + 16 in its high nibble; the
weights are ``w = q * d + m``. In the int4 kernel's convention ``w = (q - 8) * scale + zero`` that
is scale = d and zero = m + 8 * d, the same q. Example block: d = 0.01, m = -0.08, q = 3 gives
w = -0.05 = (3 - 8) * 0.01 + 0.0.

llama.cpp permutes the rows of attn_q / attn_k of Llama-architecture models (to interleave the
two rotary halves); like transformers' GGUF loader we undo that permutation, on the rows of the
values, scales and zeros alike (a row permutation keeps every block intact).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from causaldraft.errors import CausalDraftError
from causaldraft.models.native import LlamaShape
from causaldraft.models.quant import GROUP_SIZE, Int4Weights, int4_supported, notify

Q4_1_BLOCK_BYTES = 20  # 2 (d) + 2 (m) + 16 (nibbles)
PERMUTED_ARCHITECTURES = ("llama", "mistral")
GGUF_LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def our_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``layers.3.self_attn.q_proj``; ``output.weight`` -> ``lm_head``."""
    if gguf_name == "output.weight":
        return "lm_head"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in GGUF_LINEARS:
        return f"layers.{parts[1]}.{GGUF_LINEARS[parts[2]]}"
    return None


def q4_1_blocks_to_int4(blocks: np.ndarray, in_features: int) -> Int4Weights:
    """Q4_1 bytes [out, in / 32 * 20] -> Int4Weights with scale d and zero m + 8 d (exact q)."""
    out_features = blocks.shape[0]
    groups = in_features // GROUP_SIZE
    raw = torch.from_numpy(np.array(blocks, dtype=np.uint8)).reshape(out_features, groups, Q4_1_BLOCK_BYTES)
    d = raw[..., 0:2].contiguous().view(torch.float16)[..., 0].float()  # [out, groups]
    m = raw[..., 2:4].contiguous().view(torch.float16)[..., 0].float()  # [out, groups]
    nibbles = raw[..., 4:]  # [out, groups, 16]
    values = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1)  # [out, groups, 32]
    return Int4Weights(values.reshape(out_features, in_features), d, m + 8.0 * d)


def unpermute_order(rows: int, heads: int) -> torch.Tensor:
    """Row order undoing llama.cpp's q/k permutation: hf_rows = gguf_rows[order].

    Per head of size 2h, llama.cpp stores HF rows [0, h, 1, h + 1, ...]; e.g. rows = 8, heads = 1:
    order = [0, 2, 4, 6, 1, 3, 5, 7].
    """
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def permute_rows(weights: Int4Weights, order: torch.Tensor) -> Int4Weights:
    return Int4Weights(weights.values[order], weights.scales[order], weights.zeros[order])


def read_q4_1_weights(gguf_path: Path, shape: LlamaShape, wanted: set[str]) -> dict[str, Int4Weights]:
    """The Q4_1 linears of a GGUF file by our module names; other formats are reported as re-quantized."""
    from gguf import GGMLQuantizationType, GGUFReader

    try:
        reader = GGUFReader(str(gguf_path))
    except Exception as error:  # gguf raises several types for bad files
        raise CausalDraftError(f"cannot read GGUF file {gguf_path}: {error}") from error
    field = reader.get_field("general.architecture")
    architecture = field.contents() if field is not None else ""
    weights: dict[str, Int4Weights] = {}
    requantized: dict[str, int] = {}
    for tensor in reader.tensors:
        name = our_name(tensor.name)
        if name is None or name not in wanted or name == "lm_head":
            continue
        in_features, out_features = (int(size) for size in tensor.shape[:2])
        kind = GGMLQuantizationType(tensor.tensor_type)
        if kind != GGMLQuantizationType.Q4_1 or not int4_supported(out_features, in_features):
            requantized[kind.name] = requantized.get(kind.name, 0) + 1
            continue
        int4 = q4_1_blocks_to_int4(np.asarray(tensor.data), in_features)
        if architecture in PERMUTED_ARCHITECTURES and name.endswith(("q_proj", "k_proj")):
            heads = shape.num_heads if name.endswith("q_proj") else shape.kv_heads
            int4 = permute_rows(int4, unpermute_order(out_features, heads))
        weights[name] = int4
    if requantized:
        counts = ", ".join(f"{count} {kind}" for kind, count in sorted(requantized.items()))
        notify(
            f"{gguf_path.name}: {counts} layer tensor(s) are not Q4_1 (or not int4-shaped): "
            "re-quantized from their dequantized values"
        )
    notify(
        f"{gguf_path.name}: {len(weights)} Q4_1 tensors loaded as int4 without re-quantization; "
        "the LM head is read on its own (models/q8_0_head.py)"
    )
    return weights


def is_4bit_gguf(gguf_path: Path) -> bool:
    """Whether most of the file's layer weights are stored in a 4-bit format (Q4_0, Q4_1, Q4_K...)."""
    from gguf import GGMLQuantizationType, GGUFReader

    try:
        reader = GGUFReader(str(gguf_path))
    except Exception:  # gguf raises several types for bad files; such a file is not int4 material
        return False
    kinds = [GGMLQuantizationType(tensor.tensor_type).name for tensor in reader.tensors if our_name(tensor.name)]
    return bool(kinds) and sum(kind.startswith("Q4") for kind in kinds) * 2 > len(kinds)
