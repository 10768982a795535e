"""The LM head through oneDNN with its weight reordered once ("packed"), for bfloat16 activations.

The LM head is the widest product of a pass ([rows, hidden] x [hidden, vocab]: 49152 x 576 for
the default model) and it runs outside the compiled graphs. Measured on this CPU (torch 2.13,
2 threads), milliseconds per call by rows:

    rows                          1     4     8     16    32
    int8 kernel (_weight_int8pack_mm)     3.5   4.0   9.1   19.0  37.8
    bf16 F.linear                 6.0   6.7   7.5   10.4  14.1
    bf16 packed (this module)     3.1   2.5   3.9   5.8   9.8

so the packed head is the fastest at every row count, for a one-row plain step and for the many
rows of a draft tree or a batch alike. Quantized models (int8, int4) use it too: their LM head is
then the checkpoint's matrix in bf16 (56 MB for the default model against 28 MB in int8), which is
also closer to the checkpoint than an int8 requantization.

Row invariance (docs/exactness.md): every pass must compute each row bit for bit as a one-row pass
would. oneDNN's one-row product rounds differently from its products of more rows for some shapes
(measured: in_features 1536, data-dependent), while calls of 2 to 64 rows agree row for row with
each other whatever the other rows hold (measured for in_features 576, 960, 1536 and 2048). So the
module never makes a call of fewer than ``MIN_ROWS_PER_CALL`` rows (a shorter input is padded
with zero rows; 4 rows also cost less than 1 here) nor more than ``MAX_ROWS_PER_CALL``, and it
checks this on seeded random rows for the actual weight when it is made; a weight that fails the
check keeps the plain linear (``packed_head`` returns None).

Drafters' products (``DraftLinear``: the eagle3 layer, the heads' output rows) need no row
invariance, only speed: int8 weights for calls of one or two rows, packed bf16 above.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from causaldraft.models import q8_0_head
from causaldraft.models.native import Attention, NativeLlama
from causaldraft.models.products import native_bf16_products
from causaldraft.models.quant import INT8_IN_MULTIPLE, Int4Linear, Int8Linear, quantize_int8

MAX_ROWS_PER_CALL = 32  # rows of one oneDNN call (longer inputs are split)
MIN_ROWS_PER_CALL = 4  # shorter calls are padded with zero rows
CHECKED_ROW_COUNTS = (4, 5, 8, 16, 17, 31, 32)  # call sizes compared row for row when a head is made
CHECK_SEED = 0


def pack(weight: torch.Tensor, rows_hint: int) -> torch.Tensor:
    """The weight [out, in] reordered for oneDNN's linear (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows_hint)


def packed_product(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """rows [m, in] @ W.T (+ bias) -> [m, out] through oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [None], "")


def padded_product(
    rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None, rows_per_call: int = MAX_ROWS_PER_CALL
) -> torch.Tensor:
    """rows [m, in] @ W.T (+ bias) -> [m, out] in calls of MIN_ROWS_PER_CALL..rows_per_call rows.

    Example: 37 rows run as calls of 32 and 5 rows; 2 rows run as one call of 4 (2 zero rows)."""
    parts = []
    for part in rows.split(rows_per_call):
        count = part.shape[0]
        if count < MIN_ROWS_PER_CALL:
            part = torch.cat([part, part.new_zeros(MIN_ROWS_PER_CALL - count, part.shape[1])])
        parts.append(packed_product(part, packed, bias)[:count])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def rows_agree(packed: torch.Tensor, in_features: int, dtype: torch.dtype) -> bool:
    """Whether calls of every size in CHECKED_ROW_COUNTS give each row bit for bit as a call with
    that row alone (padded), on seeded random rows."""
    generator = torch.Generator().manual_seed(CHECK_SEED)
    rows = torch.randn(MAX_ROWS_PER_CALL, in_features, generator=generator).to(dtype)  # [32, in]
    alone = torch.cat([padded_product(rows[i : i + 1], packed) for i in range(MAX_ROWS_PER_CALL)])
    return all(torch.equal(packed_product(rows[:count], packed), alone[:count]) for count in CHECKED_ROW_COUNTS)


class PackedLinear(nn.Module):
    """``y = x @ W.T (+ bias)`` for bfloat16 ``x`` in oneDNN calls of 4 to ``rows_per_call`` rows, so
    each row is computed bit for bit alike whatever the call's other rows (see the module docstring).

    ``weight``: the dense parameter, kept where others read it (the LM head's ``lm_head.weight``, what
    drafters and graphs take), else None; ``packed`` is W's oneDNN reordering, a plain attribute (not
    a buffer: it is derived, opaque, and no graph or state dict takes it).
    """

    def __init__(
        self,
        packed: torch.Tensor,
        shape: tuple[int, int],
        weight: nn.Parameter | None = None,
        bias: torch.Tensor | None = None,
        rows_per_call: int = MAX_ROWS_PER_CALL,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = shape
        self.weight = weight
        self.packed = packed
        self.bias = bias
        self.rows_per_call = rows_per_call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()  # [m, in]
        out = padded_product(rows, self.packed, self.bias, self.rows_per_call)  # [m, out]
        return out.reshape(*x.shape[:-1], self.out_features)


# Calls of up to this many rows read int8 weights. A drafting call follows the target's pass, which
# has evicted the layer from the caches, so a few-row product costs what reading its weight from
# memory costs: measured (this CPU, 2 threads, cold cache) for the default model's shapes, int8
# takes 0.09-0.43 ms per product at 1 row against 0.21-0.49 ms packed bf16 (a one-row level: 0.94
# against 1.64 ms for the five products), ties at 4 rows and loses at 16 (int8's kernel is slower
# per row).
INT8_MAX_ROWS = 2
# Where the Q8_0 kernel runs (models/q8_0_head.py: AVX-512 with bf16), calls of up to this many rows
# use the weight quantized to Q8_0 instead: it reads int8 at about the memory's speed (the default
# model's LM head: 0.55 ms at 1-4 rows, 1.45 at 16, against 1.24-1.75 for packed bf16; torch's int8
# kernel reads at ~11 GB/s).
Q8_0_MAX_ROWS = 16


class DraftLinear(nn.Module):
    """A drafting product: Q8_0 weights for calls of at most Q8_0_MAX_ROWS rows where that kernel runs
    and the shape fits it, else int8 per output row for calls of at most INT8_MAX_ROWS rows, oneDNN's
    packed bf16 above. Where oneDNN takes no bf16 weights (``products.native_bf16_products``: AVX2 CPUs, whose
    bf16 ``F.linear`` is a generic kernel, ~3 ms a row for a 49152 x 576 head), int8 serves every
    call (fp32 for a weight int8 cannot hold: in_features not a multiple of INT8_IN_MULTIPLE).
    Drafts need not be bit-exact (the verify pass decides the output), so the paths may round
    differently."""

    def __init__(self, weight: torch.Tensor) -> None:
        """``weight`` [out, in] bfloat16 (a parameter stays registered, where others read it)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.q8_0: torch.Tensor | None = None  # Q8_0 records (q8_0_head.pack)
        if q8_0_head.fits(self.out_features, self.in_features) and q8_0_head.available():
            self.q8_0 = q8_0_head.pack(q8_0_head.quantize(weight))
        quantizable = self.in_features % INT8_IN_MULTIPLE == 0 and self.q8_0 is None  # (Q8_0 serves few rows)
        self.int8 = Int8Linear(quantize_int8(weight.detach()), None) if quantizable else None
        self.packed: PackedLinear | None = None
        self.float32: torch.Tensor | None = None
        if native_bf16_products():
            self.packed = PackedLinear(pack(weight, MIN_ROWS_PER_CALL), (self.out_features, self.in_features), None)
        elif self.int8 is None:
            self.float32 = weight.detach().float()
        self.warm_up()

    def warm_up(self) -> None:
        """One call of every size up to MAX_ROWS_PER_CALL rows (int8 and packed paths alike): oneDNN
        builds its kernel for a call size at its first call, ~1.5 ms per product (measured: a 3-row
        lm_head + gate_up call took 2.3 ms the first time, 0.8 ms after). Drafting is timed level by
        level (adapt.DepthGate), so that one-off cost, met mid-request, was taken for what a level
        costs: a second eagle3 level timed at 6.6 ms instead of ~1-3 was then not drafted again."""
        with torch.inference_mode():
            for rows in range(1, MAX_ROWS_PER_CALL + 1):
                self(torch.zeros(rows, self.in_features, dtype=self.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.q8_0 is not None and rows <= Q8_0_MAX_ROWS:
            flat = x.reshape(rows, self.in_features).to(torch.bfloat16).contiguous()
            return q8_0_head.product(flat, self.q8_0).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        if self.packed is not None and (self.int8 is None or rows > INT8_MAX_ROWS):
            return self.packed(x)
        if self.int8 is not None:
            return self.int8(x)
        assert self.float32 is not None
        return F.linear(x.float(), self.float32).to(x.dtype)


def packed_head(weight: nn.Parameter) -> PackedLinear | None:
    """A PackedLinear over ``weight`` [vocab, hidden] (bf16), or None where oneDNN is missing or
    its products are not row-invariant for this weight."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not native_bf16_products():
        return None
    packed = pack(weight, MAX_ROWS_PER_CALL)
    if not rows_agree(packed, weight.shape[1], weight.dtype):
        return None
    return PackedLinear(packed, (weight.shape[0], weight.shape[1]), weight)


def use_packed_head(model: NativeLlama) -> bool:
    """Replace ``model.lm_head`` (a bf16 linear without bias) by its PackedLinear; False (nothing
    changed) where that is not possible."""
    linear = model.lm_head
    if not isinstance(linear, nn.Linear) or linear.bias is not None:
        return False
    head = packed_head(linear.weight)
    if head is None:
        return False
    model.lm_head = head
    return True


# ---------------------------------------------------------------- prefill of quantized models

PREFILL_ROWS_PER_CALL = 512  # a prompt's rows need no row invariance: large calls
MAX_PREFILL_BYTES = 1 << 30  # no prefill copy for models whose twin layers exceed this


FLOAT32_MIN_ROWS = 80  # shorter prompts: the quantized product is cheaper than reading 4-byte weights


class Float32Linear(nn.Module):
    """A prompt twin's product where oneDNN takes no bf16 weights (AVX2-only CPUs): ``y = x @ W.T
    (+ bias)`` in float32 for bfloat16 ``x`` (rounded back to bf16) through torch's fp32 GEMM for
    calls of at least ``FLOAT32_MIN_ROWS`` rows, the quantized module's own product below that.
    Measured on an AVX2 machine (default model, whole prompt): 40 tokens 157 ms quantized against
    183 ms fp32, 300 tokens 775 against 570 ms; even at ~70 rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quantized: nn.Module) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight.float().contiguous()  # a plain attribute, like PackedLinear.packed
        self.bias = None if bias is None else bias.float()
        self.quantized = quantized  # shared with the model, not copied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() < FLOAT32_MIN_ROWS * self.in_features:
            return self.quantized(x)
        return F.linear(x.float(), self.weight, self.bias).to(x.dtype)


def prefill_model(
    model: NativeLlama,
    dequantized: Callable[[str], torch.Tensor | None],
    max_bytes: int = MAX_PREFILL_BYTES,
) -> NativeLlama | None:
    """A twin of a quantized ``model`` for prompts: the same embeddings, norms, rope and LM head (shared,
    not copied), with every layer linear computed from ``dequantized(name)`` (a module's dequantized
    weight, e.g. ``layers.0.mlp.down_proj`` -> [out, in]; None if absent), eagerly: in bf16 through
    oneDNN where the CPU takes bf16 weights there (``PackedLinear``), else in float32
    (``Float32Linear``, from 80 prompt rows). The size bound is checked from the modules' shapes before anything is
    dequantized, and the layers are dequantized one at a time.

    Why: the int4 kernels cost ~1.5 ms (torch's, AVX-512 machine) to ~3.4 ms (causaldraft's AVX2
    build, AVX2 machine) per prompt row for the default model, while a packed bf16 product of a
    40-row prompt costs ~0.6 ms per row (measured), so a prompt is read 1.3-1.7x faster (40 tokens
    117 -> 91 ms, 300 tokens 598 -> 344 ms); the fp32 twin on the AVX2 machine: docs/int4-kernel.md.
    Plain and speculative decoding share the prefill (``Decoder.prefill_target``), so both start
    from the same cache; the decode passes themselves stay quantized. Costs the copy of the layers
    (bf16: 212 MB for the default model, fp32: 424 MB); None where that exceeds ``max_bytes``,
    oneDNN is missing, or a weight is absent.
    """
    linears = [
        (name, module) for name, module in model.named_modules() if name.startswith("layers.") and is_linear(module)
    ]
    if not torch.backends.mkldnn.is_available():
        return None
    packed = native_bf16_products()
    element_bytes = 2 if packed else 4
    if sum(module.out_features * module.in_features * element_bytes for _, module in linears) > max_bytes:
        return None
    with torch.device("meta"):
        twin = NativeLlama(model.llama_shape, torch.empty(0), model.rope_scaling)
    twin.embed_tokens, twin.norm, twin.lm_head = model.embed_tokens, model.norm, model.lm_head
    twin.inv_freq = model.inv_freq
    for twin_layer, layer in zip(twin.layers, model.layers, strict=True):
        twin_layer.input_layernorm = layer.input_layernorm
        twin_layer.post_attention_layernorm = layer.post_attention_layernorm
        twin_attention, attention = cast(Attention, twin_layer.self_attn), cast(Attention, layer.self_attn)
        twin_attention.q_norm, twin_attention.k_norm = attention.q_norm, attention.k_norm
    for name, source in linears:
        full = dequantized(name)
        if full is None:
            return None
        bias = source.bias if isinstance(source.bias, torch.Tensor) else None
        linear: nn.Module
        if packed:
            weight = full.to(torch.bfloat16)  # [out, in]
            linear = PackedLinear(
                pack(weight, PREFILL_ROWS_PER_CALL), (weight.shape[0], weight.shape[1]), bias=bias,
                rows_per_call=PREFILL_ROWS_PER_CALL,
            )  # fmt: skip
        else:
            linear = Float32Linear(full, bias, source)
        parent_name, _, child = name.rpartition(".")
        setattr(twin.get_submodule(parent_name), child, linear)
    leftover = [name for name, tensor in [*twin.named_parameters(), *twin.named_buffers()] if tensor.is_meta]
    if leftover:
        return None
    return twin.eval()


def is_linear(module: nn.Module) -> bool:
    """A layer's linear of a quantized model: its int4/int8 modules (or an nn.Linear left as is)."""
    return isinstance(module, (nn.Linear, Int4Linear, Int8Linear))
