"""The LM head of a GGUF model whose output matrix is stored as Q8_0, through causaldraft's own product
(``kernels/q8_0_mm.cpp``, AVX-512 with bf16), built once per machine on first use.

Why: the LM head is the widest product of a pass (49152 x 576 for the default model). Until stop 29 an
int4 or int8 model ran it as the checkpoint's matrix in bf16 through oneDNN (``packed``): 56.6 MB read per
pass, ~1.0-1.3 ms of a ~4.5 ms one-row int4 pass on the AVX-512 machine. The GGUF file stores that
matrix (``token_embd``, tied, or ``output``) as Q8_0: blocks of 32 int8 values ``q`` with one fp16
scale ``d``, ``w = q * d``. Reading those blocks as they are is 30 MB, and it keeps the checkpoint's
values, which bf16 cannot hold (``q * d`` has up to 19 significant bits, bf16 keeps 8).

Measured on the AVX-512 machine of stop 29 (2 threads, caches flushed before each call), ms per call
for 1 / 4 / 8 / 16 / 32 rows: this product 0.55 / 0.56 / 0.77 / 1.45 / 2.87, the packed bf16 head
1.27 / 1.24 / 1.39 / 1.75 / 2.64.

Arithmetic (docs/q8_0-head.md): for a row ``x`` (bf16) and a record of 16 channels and 32 inputs,
the kernel widens each ``q`` to bf16 (exact: at most 8 significant bits) and sums ``q * x`` with bf16
dot-product steps in fp32 (each product exact), in two chains (even and odd input pairs) that are
then added; the record's sum times ``d`` (fp16 widened to fp32, exact) is added to the channel's
total by one fused multiply-add, record after record in input order. Logits are fp32. Every output
element is computed by the same instructions whatever the row count and the thread count, so the
product is row-invariant, which exactness needs (docs/exactness.md); ``tests/test_q8_0_head.py``
checks it on every row count up to 33.

The AMX build (since stop 46, where the CPU has AMX bf16 tiles and Linux grants them; ``CAUSALDRAFT_Q8_0_HEAD=avx512``
keeps the build above): the same widened records are B tiles, up to 16 rows' inputs an A tile, and one tile
product sums a record's 32 exact products per channel and row in fp32 in the tile unit's own order; then
total = fma(sum, d, total) record by record as above. Another order of fp32 sums (logits differ from the other
build's in their last bits), as row-invariant: a tile's element depends on its row of A and column of B alone,
and every call, one row included, takes the tiles. Extra rows cost almost nothing there (default model, ms per
call, 1 / 4 / 8 / 16 rows: 1.12 / 1.11 / 1.23 / 1.62 against 0.94 / 1.86 / 3.04 / 6.04; docs/q8_0-head.md).

Layout (``pack``): [out / 16, in / 32, 544] bytes, one record per block of 16 output channels and
block of 32 inputs: 512 value bytes, pair p (inputs 2p and 2p + 1) in bytes 32p .. 32p + 31, byte
2n + t holding channel n's value at input 2p + t; then the 16 channels' fp16 scales.

Used for int4 and int8 models converted from a GGUF file whose head matrix is Q8_0 and equals the checkpoint's
(rounded to bf16, checked at load), where the CPU has AVX-512 with bf16, the build succeeds and
``CAUSALDRAFT_Q8_0_HEAD`` is not ``off``; otherwise the head stays the packed bf16 one. The blocks are
cached beside the quantized weights (reading a GGUF file's header takes ~1.5 s).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from causaldraft.models import attention_kernel, tensor_cache
from causaldraft.models.int4_kernel import KERNELS, cpu_flags, load_source

SOURCE = KERNELS / "q8_0_mm.cpp"
FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mf16c")
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "f16c")
# the same source with AMX tiles (since stop 46; q8_0_mm.cpp, "The AMX build"), where the CPU has them
AMX_FLAGS = (*FLAGS, "-mamx-tile", "-mamx-bf16")
AMX_CPU_FLAGS = (*CPU_FLAGS, "amx_tile", "amx_bf16")
NAMES = {AMX_FLAGS: "amx", FLAGS: "avx512"}
# "off": the packed bf16 head even where this one runs; "avx512": the build without AMX tiles
SWITCH = "CAUSALDRAFT_Q8_0_HEAD"
CHANNELS = 16  # output channels per record
GROUP = 32  # inputs per Q8_0 block
BLOCK_BYTES = 2 + GROUP  # a GGUF Q8_0 block: fp16 scale, then 32 int8 values
RECORD_BYTES = CHANNELS * GROUP + 2 * CHANNELS
CACHE_FORMAT = "causaldraft-q8_0-head-1"


@dataclass(frozen=True)
class Q8_0Weights:
    values: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out, in / 32] float16

    def dequantize(self) -> torch.Tensor:
        """The matrix [out, in] in float32 (exact: ``q * d``)."""
        out_features, in_features = self.values.shape
        blocks = self.values.float().reshape(out_features, in_features // GROUP, GROUP)
        return (blocks * self.scales.float().unsqueeze(-1)).reshape(out_features, in_features)


def quantize(weight: torch.Tensor) -> Q8_0Weights:
    """A matrix [out, in] (in % 32 == 0) as Q8_0, the way llama.cpp quantizes it: per block of 32 inputs
    d = amax / 127 (fp16), q = round(w / d). For drafters' products (``packed.DraftLinear``), which
    need no exactness. Example: a block whose largest magnitude is 0.254 gets d = 0.002 and 0.1 -> 50."""
    out_features, in_features = weight.shape
    blocks = weight.detach().float().reshape(out_features, in_features // GROUP, GROUP)
    scales = (blocks.abs().amax(dim=-1) / 127).to(torch.float16)  # [out, in / 32]
    steps = scales.float().unsqueeze(-1)
    values = torch.where(steps > 0, blocks / steps, torch.zeros_like(blocks)).round().clamp(-127, 127)
    return Q8_0Weights(values.to(torch.int8).reshape(out_features, in_features), scales)


def wanted() -> bool:
    return os.environ.get(SWITCH, "").lower() != "off" and all(flag in cpu_flags() for flag in CPU_FLAGS)


def builds() -> tuple[tuple[str, ...], ...]:
    """The builds to try, best first: AMX where the CPU has it, Linux grants the tiles and the switch does not
    say ``avx512``; then the one without tiles."""
    if os.environ.get(SWITCH, "").lower() != "avx512" and all(f in cpu_flags() for f in AMX_CPU_FLAGS):
        if attention_kernel.amx_permitted():
            return (AMX_FLAGS, FLAGS)
    return (FLAGS,)


@functools.cache
def loaded_build() -> str | None:
    """The build loaded into this process (built first when needed), "amx" or "avx512": ``builds`` in order (a
    compiler too old for AMX code still builds the other); None where none loads; once per process."""
    if not wanted():
        return None
    choices = builds()

    def load(flags: tuple[str, ...]) -> bool:
        below = choices.index(flags) + 1
        instead = f"the {NAMES[choices[below]]} build" if below < len(choices) else "the packed bf16 head"
        return load_source(f"Q8_0 head ({NAMES[flags]} build)", SOURCE, flags, instead)

    flags = attention_kernel.first_build(choices, load)
    if flags is None:
        return None
    torch.library.register_fake("causaldraft::q8_0_mm")(shape_of_product)
    return NAMES[flags]


def available() -> bool:
    """Whether ``torch.ops.causaldraft.q8_0_mm`` is loaded (built first when needed)."""
    return loaded_build() is not None


def shape_of_product(x: torch.Tensor, records: torch.Tensor) -> torch.Tensor:
    """What ``q8_0_mm`` returns, for tracing: [rows, out] fp32."""
    return x.new_empty((x.shape[0], records.shape[0] * CHANNELS), dtype=torch.float32)


def fits(out_features: int, in_features: int) -> bool:
    return out_features % CHANNELS == 0 and in_features % GROUP == 0 and out_features > 0 and in_features > 0


def from_blocks(blocks: np.ndarray, out_features: int, in_features: int) -> Q8_0Weights:
    """GGUF Q8_0 bytes ([out, in / 32 * 34] or flat) -> values and scales."""
    raw = torch.from_numpy(np.array(blocks, dtype=np.uint8)).reshape(out_features, -1, BLOCK_BYTES)
    if raw.shape[1] * GROUP != in_features:
        raise ValueError(f"Q8_0 blocks do not fit [{out_features}, {in_features}]")
    scales = raw[..., :2].contiguous().view(torch.float16).reshape(out_features, -1)
    values = raw[..., 2:].contiguous().view(torch.int8).reshape(out_features, in_features)
    return Q8_0Weights(values, scales)


def pack(weights: Q8_0Weights) -> torch.Tensor:
    """Values and scales -> the kernel's records [out / 16, in / 32, 544] uint8 (module docstring)."""
    out_features, in_features = weights.values.shape
    if not fits(out_features, in_features):
        shape = (out_features, in_features)
        raise ValueError(f"Q8_0 records need out % {CHANNELS} == 0 and in % {GROUP} == 0, got {shape}")
    blocks, groups = out_features // CHANNELS, in_features // GROUP
    # [block, channel, group, pair, parity] -> [block, group, pair, channel, parity]
    values = weights.values.view(torch.uint8).reshape(blocks, CHANNELS, groups, GROUP // 2, 2)
    values = values.permute(0, 2, 3, 1, 4).reshape(blocks, groups, CHANNELS * GROUP)
    scales = weights.scales.reshape(blocks, CHANNELS, groups).permute(0, 2, 1).contiguous().view(torch.uint8)
    return torch.cat((values, scales.reshape(blocks, groups, 2 * CHANNELS)), dim=-1).contiguous()


def unpack(records: torch.Tensor) -> Q8_0Weights:
    """``pack``'s inverse."""
    blocks, groups, _ = records.shape
    values = records[..., : CHANNELS * GROUP].reshape(blocks, groups, GROUP // 2, CHANNELS, 2)
    values = values.permute(0, 3, 1, 2, 4).reshape(blocks * CHANNELS, groups * GROUP).contiguous().view(torch.int8)
    scales = records[..., CHANNELS * GROUP :].contiguous().view(torch.float16).reshape(blocks, groups, CHANNELS)
    return Q8_0Weights(values, scales.permute(0, 2, 1).reshape(blocks * CHANNELS, groups).contiguous())


def product(x: torch.Tensor, records: torch.Tensor) -> torch.Tensor:
    """[m, in] bf16 contiguous rows times the records: [m, out] fp32."""
    return torch.ops.causaldraft.q8_0_mm(x, records)


class Q8_0Head(nn.Module):
    """``logits = x @ W.T`` with W the checkpoint's Q8_0 matrix, fp32 out, row-invariant.

    ``weight``: the model's dense head parameter (bf16), kept where others read it (drafters take the
    target's output rows from ``lm_head.weight``); ``records`` is the kernel's packing, a plain
    attribute (derived; no graph or state dict takes it)."""

    def __init__(self, weights: Q8_0Weights, weight: nn.Parameter) -> None:
        super().__init__()
        self.out_features, self.in_features = weights.values.shape
        self.weight = weight
        self.records = pack(weights)
        self.build = loaded_build()  # "amx" or "avx512": which arithmetic order the logits have

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        return product(rows, self.records).reshape(*x.shape[:-1], self.out_features)


# ---------------------------------------------------------------- the GGUF file's head, cached


def read_gguf_head(gguf_path: Path, out_features: int, in_features: int) -> Q8_0Weights | None:
    """The file's LM head (``output.weight``, else the tied ``token_embd.weight``) where it is Q8_0
    and has the model's shape; None otherwise."""
    from gguf import GGMLQuantizationType, GGUFReader

    try:
        reader = GGUFReader(str(gguf_path))
    except Exception:  # gguf raises several types for bad files; the packed head serves
        return None
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    tensor = tensors.get("output.weight", tensors.get("token_embd.weight"))
    if tensor is None or GGMLQuantizationType(tensor.tensor_type) != GGMLQuantizationType.Q8_0:
        return None
    if (int(tensor.shape[0]), int(tensor.shape[1])) != (in_features, out_features):
        return None
    return from_blocks(np.asarray(tensor.data), out_features, in_features)


def save_head(path: Path, weights: Q8_0Weights, key: str) -> None:
    tensor_cache.write(path, {"values": weights.values, "scales": weights.scales}, CACHE_FORMAT, key)


def load_head(path: Path, key: str) -> Q8_0Weights | None:
    """The cached head, or None when absent, stale or unreadable."""
    tensors = tensor_cache.read(path, CACHE_FORMAT, key)
    if tensors is None or set(tensors) != {"values", "scales"}:
        return None
    return Q8_0Weights(tensors["values"], tensors["scales"])


def gguf_head(gguf_path: Path, cache: Path, key: str, out_features: int, in_features: int) -> Q8_0Weights | None:
    """The GGUF file's Q8_0 head from ``cache`` (keyed like the quantized weights), read and kept there
    when missing or stale; None where the file's head is not Q8_0 of the model's shape."""
    weights = load_head(cache, key)
    if weights is not None and tuple(weights.values.shape) == (out_features, in_features):
        return weights
    weights = read_gguf_head(gguf_path, out_features, in_features)
    if weights is not None:
        try:
            save_head(cache, weights, key)
        except OSError:  # a read-only cache: read the file again next time
            pass
    return weights


def use_q8_0_head(model: nn.Module, weights: Q8_0Weights) -> bool:
    """Replace ``model.lm_head`` (a bf16 linear without bias) by a Q8_0Head over ``weights`` where the
    kernel runs and ``weights`` rounded to bf16 are the model's head; False (nothing changed) otherwise."""
    linear = getattr(model, "lm_head", None)
    if not isinstance(linear, nn.Linear) or linear.bias is not None or not available():
        return False
    if not fits(*weights.values.shape) or tuple(weights.values.shape) != tuple(linear.weight.shape):
        return False
    if not torch.equal(weights.dequantize().to(linear.weight.dtype), linear.weight.detach()):
        return False  # not the checkpoint's head (e.g. a GGUF file changed after conversion)
    model.lm_head = Q8_0Head(weights, linear.weight)
    return True
