"""Loading a quantized native model, with a cache of its quantized weights.

Quantized weights are cached in an architecture-independent form (int4 values two per byte,
fp32 scales and zeros) as ``quant-int8.safetensors`` / ``quant-int4.safetensors`` beside the
checkpoint, or under ``$CAUSALDRAFT_HOME/quant/`` when the checkpoint directory is read-only; the
kernel's own packing (which depends on the CPU) is redone at every load, which is fast. For int4,
layers stored as Q4_1 in the GGUF file a checkpoint was converted from are taken from it as they are.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from causaldraft.errors import CausalDraftError
from causaldraft.models import q8_0_head, tensor_cache
from causaldraft.models.gguf_q4 import read_q4_1_weights
from causaldraft.models.native import QUANT_CACHE_PREFIX, NativeLlama, checkpoint_files
from causaldraft.models.packed import prefill_model, use_packed_head
from causaldraft.models.quant import (
    ACTIVATION_DTYPE,
    CACHE_FORMAT,
    GROUP_SIZE,
    QUANT_DTYPES,
    Int4Weights,
    Int8Weights,
    QuantWeights,
    checkpoint_linear_names,
    dequantize_int4,
    dequantize_int8,
    install_quantized,
    linear_names,
    notify,
    pack_nibbles,
    quantize_model_weights,
    unpack_nibbles,
)
from causaldraft.paths import causaldraft_home

# ---------------------------------------------------------------- cache


def source_key(model_dir: Path, dtype: str, gguf_path: Path | None) -> str:
    """Invalidates the cache when the weights, the GGUF source or the format change."""
    digest = hashlib.sha256(f"{CACHE_FORMAT}:{dtype}:{GROUP_SIZE}".encode())
    sources = checkpoint_files(model_dir)
    if gguf_path is not None:
        sources.append(gguf_path)
    for path in sources:
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def cache_path(model_dir: Path, dtype: str) -> Path:
    beside = model_dir / f"{QUANT_CACHE_PREFIX}{dtype}.safetensors"
    if os.access(model_dir, os.W_OK):
        return beside
    key = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:12]
    return causaldraft_home() / "quant" / f"{model_dir.name}-{key}" / beside.name


def save_cache(path: Path, weights: dict[str, QuantWeights], key: str) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for name, quantized in weights.items():
        if isinstance(quantized, Int4Weights):
            tensors[f"{name}.nibbles"] = pack_nibbles(quantized.values)
            tensors[f"{name}.scales"] = quantized.scales.float()
            tensors[f"{name}.zeros"] = quantized.zeros.float()
        else:
            tensors[f"{name}.int8"] = quantized.values
            tensors[f"{name}.scales"] = quantized.scales.float()
    tensor_cache.write(path, tensors, CACHE_FORMAT, key)


def load_cache(path: Path, key: str) -> dict[str, QuantWeights] | None:
    """The cached weights, or None when absent, stale or unreadable."""
    tensors = tensor_cache.read(path, CACHE_FORMAT, key)
    if tensors is None:
        return None
    weights: dict[str, QuantWeights] = {}
    for tensor_name, tensor in tensors.items():
        name, _, kind = tensor_name.rpartition(".")
        if kind == "nibbles":
            weights[name] = Int4Weights(unpack_nibbles(tensor), tensors[f"{name}.scales"], tensors[f"{name}.zeros"])
        elif kind == "int8":
            weights[name] = Int8Weights(tensor, tensors[f"{name}.scales"])
    return weights


# ---------------------------------------------------------------- loading


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted checkpoint came from (causaldraft_source.json), if it still exists."""
    source = model_dir / "causaldraft_source.json"
    if not source.is_file():
        return None
    path = Path(json.loads(source.read_text()).get("gguf", ""))
    return path if path.is_file() else None


@dataclass(frozen=True)
class QuantizedModel:
    """A quantized model and its prefill twin (``packed.prefill_model``; None where it has none)."""

    model: NativeLlama
    prefill: NativeLlama | None


def load_quantized(model_dir: Path, dtype: str) -> QuantizedModel:
    """A NativeLlama in bfloat16 whose linears are int8 or int4 (cached beside the checkpoint).

    For int4, layers stored as Q4_1 in the GGUF file the checkpoint was converted from are taken
    from the GGUF blocks as they are; other layers are quantized from the checkpoint's weights. The LM
    head is that file's Q8_0 matrix where ``q8_0_head`` runs, else the checkpoint's in bf16 (``packed``).
    """
    if dtype not in QUANT_DTYPES:
        raise CausalDraftError(f"quantized dtype must be int8 or int4, got {dtype!r}")
    gguf_path = gguf_source(model_dir) if dtype == "int4" else None
    key = source_key(model_dir, dtype, gguf_path)
    path = cache_path(model_dir, dtype)
    weights = load_cache(path, key)
    if weights is None:
        full = NativeLlama.from_pretrained(model_dir, torch.float32)
        provided: dict[str, Int4Weights] = {}
        if gguf_path is not None:
            provided = read_q4_1_weights(gguf_path, full.llama_shape, checkpoint_linear_names(full))
        weights = quantize_model_weights(full, dtype, provided)
        del full
        try:
            save_cache(path, weights, key)
        except OSError as error:
            notify(f"cannot cache quantized weights at {path}: {error}")
    model = NativeLlama.from_pretrained(model_dir, ACTIVATION_DTYPE)
    missing = set(linear_names(model)) - set(weights)
    if missing:
        raise CausalDraftError(f"quantized cache {path} lacks {sorted(missing)[:3]}")
    if use_gguf_head(model, model_dir) or use_packed_head(model):
        # the GGUF file's Q8_0 head (models/q8_0_head.py), else the checkpoint's in bf16 through oneDNN (packed.py)
        weights = {name: quantized for name, quantized in weights.items() if name != "lm_head"}
    model = install_quantized(model, weights)
    return QuantizedModel(model, prefill_model(model, lambda name: as_used(weights[name]) if name in weights else None))


def use_gguf_head(model: NativeLlama, model_dir: Path) -> bool:
    """Whether the model's LM head is now the Q8_0 matrix of the GGUF file it was converted from
    (``q8_0_head.use_q8_0_head``; int8 and int4 alike), its blocks cached beside the quantized weights."""
    gguf_path = gguf_source(model_dir)
    if gguf_path is None or not q8_0_head.available():
        return False
    out_features, in_features = model.lm_head.weight.shape
    key = source_key(model_dir, "head-q8_0", gguf_path)
    weights = q8_0_head.gguf_head(gguf_path, cache_path(model_dir, "head-q8_0"), key, out_features, in_features)
    return weights is not None and q8_0_head.use_q8_0_head(model, weights)


def as_used(weights: QuantWeights) -> torch.Tensor:
    """The dequantized weight [out, in] (float32) with scales and zeros rounded to bf16, as the
    modules hold them."""
    if isinstance(weights, Int4Weights):
        rounded = Int4Weights(weights.values, bf16_rounded(weights.scales), bf16_rounded(weights.zeros))
        return dequantize_int4(rounded)
    return dequantize_int8(Int8Weights(weights.values, bf16_rounded(weights.scales)))


def bf16_rounded(values: torch.Tensor) -> torch.Tensor:
    return values.to(ACTIVATION_DTYPE).float()
