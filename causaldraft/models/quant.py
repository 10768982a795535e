"""Weight-only int8 and int4 linears for the native backend (CPU kernels of torch), with a cache.

int8: symmetric per output channel, ``w = q * scale`` with q in [-127, 127]; matmul by
``torch.ops.aten._weight_int8pack_mm(x, q, scales)``.

int4: asymmetric in groups of 32 along the input dimension, in the kernel's convention
``w = (q - 8) * scale + zero`` with q in [0, 15] (found by experiment on torch 2.13: the kernel
takes ``scales_and_zeros`` as [in / group, out, 2] with [..., 0] = scale and [..., 1] = zero).
A min/max quantization ``w ≈ q * step + low`` is therefore stored as scale = step and
zero = low + 8 * step; a GGUF Q4_1 block (``w = q * d + m``) maps exactly to scale = d and
zero = m + 8 * d (see ``gguf_q4``). Worked example, one group of 32 weights spanning
[-0.3, 0.45]: step = 0.75 / 15 = 0.05, q = round((w + 0.3) / 0.05), zero = -0.3 + 8 * 0.05 = 0.1,
and w = 0.2 gives q = 10, dequantized (10 - 8) * 0.05 + 0.1 = 0.2.

Activations are bfloat16; token embeddings and norms stay bfloat16. The LM head is quantized to int8
here, but a loaded model replaces it by the checkpoint's bf16 head through oneDNN where it can
(``packed``: faster at every row count and closer to the checkpoint).
A layer the int4 kernel cannot take (in_features not a multiple of 32, out_features not a
multiple of 16) falls back to int8 with a message.

Loading a quantized model and its weight cache live in ``quant_load`` (which reads GGUF files
through ``gguf_q4``); this module holds the formats and the modules only.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from causaldraft.errors import CausalDraftError
from causaldraft.models import int4_kernel
from causaldraft.models.native import FUSED_PROJECTIONS, Linear, NativeLlama

GROUP_SIZE = 32
INT4_OUT_MULTIPLE = 16  # the int4 packing kernel needs out_features % 16 == 0
INT8_IN_MULTIPLE = 16  # the int8 kernel crashes unless in_features % 16 == 0 (torch 2.13, CPU)
CACHE_FORMAT = "causaldraft-quant-2"  # 2: fused q/k/v and gate/up projections
QUANT_DTYPES = ("int8", "int4")
ACTIVATION_DTYPE = torch.bfloat16


def notify(message: str) -> None:
    print(f"causaldraft: {message}", file=sys.stderr)


# ---------------------------------------------------------------- quantize / dequantize (pure)


@dataclass(frozen=True)
class Int8Weights:
    values: torch.Tensor  # [out, in] int8 in [-127, 127]
    scales: torch.Tensor  # [out] float32


@dataclass(frozen=True)
class Int4Weights:
    values: torch.Tensor  # [out, in] uint8 in [0, 15]
    scales: torch.Tensor  # [out, in / group] float32
    zeros: torch.Tensor  # [out, in / group] float32: w = (q - 8) * scale + zero

    @property
    def group_size(self) -> int:
        return self.values.shape[1] // self.scales.shape[1]


def quantize_int8(weight: torch.Tensor) -> Int8Weights:
    """Symmetric per-output-channel int8 of ``weight`` [out, in]."""
    if weight.shape[1] % INT8_IN_MULTIPLE:
        raise CausalDraftError(
            f"int8 needs in_features % {INT8_IN_MULTIPLE} == 0 (a kernel limit), got {weight.shape[1]}; "
            "use --dtype bfloat16 for this model"
        )
    weight = weight.float()
    scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [out]
    values = (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return Int8Weights(values, scales)


def dequantize_int8(weights: Int8Weights) -> torch.Tensor:
    return weights.values.float() * weights.scales[:, None]  # [out, in]


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> Int4Weights:
    """Asymmetric min/max int4 of ``weight`` [out, in] in groups of ``group_size`` inputs."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise CausalDraftError(f"int4 needs in_features a multiple of {group_size}, got {in_features}")
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    low = groups.amin(dim=-1)  # [out, groups]
    step = ((groups.amax(dim=-1) - low) / 15.0).clamp(min=1e-12)  # [out, groups]
    values = ((groups - low[..., None]) / step[..., None]).round().clamp(0, 15)
    return Int4Weights(values.reshape(out_features, in_features).to(torch.uint8), step, low + 8.0 * step)


def dequantize_int4(weights: Int4Weights) -> torch.Tensor:
    group = weights.group_size
    scales = weights.scales.repeat_interleave(group, dim=1)  # [out, in]
    zeros = weights.zeros.repeat_interleave(group, dim=1)  # [out, in]
    return (weights.values.float() - 8.0) * scales + zeros


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """[out, in] uint8 in [0, 15] -> [out, in / 2] uint8: low nibble = even column, high = odd.

    Example: row [1, 2, 15, 0] -> [0x21, 0x0F].
    """
    return values[:, 0::2] | (values[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_nibbles``: [out, in / 2] -> [out, in]."""
    pairs = torch.stack((packed & 0x0F, packed >> 4), dim=-1)  # [out, in / 2, 2]
    return pairs.reshape(packed.shape[0], -1)


def int4_supported(out_features: int, in_features: int, group_size: int = GROUP_SIZE) -> bool:
    return in_features % group_size == 0 and out_features % INT4_OUT_MULTIPLE == 0


# ---------------------------------------------------------------- modules


def as_rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """[..., in] activations -> [m, in] contiguous bfloat16, as the kernels expect."""
    if x.dim() != 2:
        x = x.reshape(-1, in_features)
    if x.dtype != ACTIVATION_DTYPE:
        x = x.to(ACTIVATION_DTYPE)
    return x.contiguous()


class Int8Linear(nn.Module):
    """``y = x @ (q * scale).T + bias`` with bfloat16 activations (which the AVX2 kernel rounds to
    int8 per group before its integer products).

    ``kernel``: "blocks" (causaldraft's AVX2 build, ``int4_kernel.int8_product``: activations
    rounded to int8 per group of 32 inputs, exact integer dot products, row-invariant by
    construction) where it is loaded, out_features is a multiple of 8 and in_features of 32, else
    "torch" (``_weight_int8pack_mm``, bf16 activations). Both take the scales in bf16."""

    qweight: torch.Tensor  # torch: [out, in] int8; blocks: [out / 8, in / 32, 8, 32] int8
    scales: torch.Tensor  # [out] bfloat16
    bias: torch.Tensor | None  # [out] bfloat16

    def __init__(self, weights: Int8Weights, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weights.values.shape
        fits = self.out_features % int4_kernel.INT8_BLOCK == 0 and self.in_features % int4_kernel.GROUP == 0
        blocks = fits and int4_kernel.int8_available()
        self.kernel = "blocks" if blocks else "torch"
        if blocks:
            self.register_buffer("qweight", int4_kernel.pack_int8_records(weights.values))
        else:  # a fresh (aligned) copy: the kernel crashes on tensors read unaligned from safetensors
            self.register_buffer("qweight", weights.values.clone(memory_format=torch.contiguous_format))
        self.register_buffer("scales", weights.scales.to(ACTIVATION_DTYPE))  # [out]
        self.register_buffer("bias", None if bias is None else bias.to(ACTIVATION_DTYPE))

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [out, in] in bfloat16 (materialised on every call)."""
        values = int4_kernel.unpack_int8_records(self.qweight) if self.kernel == "blocks" else self.qweight
        return (values.float() * self.scales.float()[:, None]).to(ACTIVATION_DTYPE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = as_rows(x, self.in_features)  # [m, in]
        if self.kernel == "blocks":
            out = int4_kernel.int8_product(rows, self.qweight, self.scales)  # [m, out]
        else:
            out = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)  # [m, out]
        if self.bias is not None:
            out = out + self.bias
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)


class Bf16BlockLinear(nn.Module):
    """``y = x @ W.T + bias`` for a bf16 model's linear through causaldraft's ``bf16_mm`` over W in
    records of 16 channels per input (exact products of the bf16 numbers, fp32 sums, each output rounded
    once to bf16, as a bf16 product with fp32 sums rounds), row-invariant by construction from one row.

    - AVX-512 bf16 CPUs (since stop 33; the layers, not the LM head): vdpbf16ps products. The default
      model's layer linears take ~3.8-5.2 ms at 1 row and ~5-6 ms at 8 rows, against ~6-7 ms and
      ~7.5 ms through oneDNN with reordered weights, whose products also round one row differently
      from two (so bf16 graphs had no one-row bucket).
    - AVX2 CPUs, where oneDNN takes no bf16 weights (``products.native_bf16_products``): fp32
      multiply-adds, every linear and the LM head. torch's bf16 product there is a generic kernel:
      ~15 ms a row for the default model's layers, against ~2 ms a row plus one read of the weights
      with this one (docs/int4-kernel.md)."""

    packed: torch.Tensor  # [out / 16, in, 16] bfloat16
    bias: torch.Tensor | None  # [out] bfloat16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if not int4_kernel.bf16_available():  # loads the build's bf16 product where it is separate
            raise RuntimeError("causaldraft's bf16 product is not built on this machine (int4_kernel.bf16_available)")
        self.out_features, self.in_features = weight.shape
        padding = -self.out_features % int4_kernel.BLOCK  # zero channels up to a whole block, cut off after
        padded = torch.cat((weight.detach(), weight.new_zeros(padding, self.in_features)))
        self.register_buffer("packed", int4_kernel.pack_channels(padded.to(ACTIVATION_DTYPE)))
        self.register_buffer("bias", None if bias is None else bias.detach().to(ACTIVATION_DTYPE))

    @property
    def weight(self) -> torch.Tensor:
        """W [out, in] bfloat16 (a copy, made on every call)."""
        return int4_kernel.unpack_channels(self.packed)[: self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = int4_kernel.bf16_product(as_rows(x, self.in_features), self.packed)  # [m, out + padding]
        if out.shape[1] != self.out_features:
            out = out[:, : self.out_features]
        if self.bias is not None:
            out = out + self.bias
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)


def has_block_linears(model: nn.Module) -> bool:
    """Whether the model's linears run through ``Bf16BlockLinear`` (``use_block_linears``)."""
    return any(isinstance(module, Bf16BlockLinear) for module in model.modules())


def use_block_linears(model: NativeLlama, head: bool = True) -> bool:
    """Replace a bf16 model's linears (the layers', and the LM head's if ``head``) by ``Bf16BlockLinear``
    where its kernel is loaded and every input width is even; False (nothing changed) otherwise."""
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if not head:
        names = [name for name in names if name != "lm_head"]
    if model.dtype != torch.bfloat16 or not names or not int4_kernel.bf16_available():
        return False
    modules = dict(model.named_modules())
    if any(modules[name].in_features % 2 for name in names):
        return False
    for name in names:
        linear = modules[name]
        assert isinstance(linear, nn.Linear)
        parent_name, _, attribute = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        setattr(parent, attribute, Bf16BlockLinear(linear.weight, linear.bias))
    return True


def use_plain_linears(model: nn.Module) -> bool:
    """Replace the model's ``Bf16BlockLinear`` by its own ``native.Linear`` over the same bf16 numbers
    (``use_block_linears``'s inverse: the layers then run through torch's products, oneDNN's where it takes bf16
    weights); False where there was none."""
    blocks = [(name, module) for name, module in model.named_modules() if isinstance(module, Bf16BlockLinear)]
    for name, block in blocks:
        model.set_submodule(name, plain_linear(block))
    return bool(blocks)


def plain_linear(block: Bf16BlockLinear) -> Linear:
    """The model's own linear (``native.Linear``) computing ``block``'s product with torch's kernels (the weight
    unpacked: a copy)."""
    linear = Linear(block.in_features, block.out_features, bias=block.bias is not None, device="meta")
    linear.weight = nn.Parameter(block.weight.contiguous(), requires_grad=False)
    if block.bias is not None:
        linear.bias = nn.Parameter(block.bias.clone(), requires_grad=False)
    return linear


class Int4Linear(nn.Module):
    """``y = x @ ((q - 8) * scale + zero).T + bias`` in groups of 32 inputs, bf16 activations.

    ``kernel``: "blocks" (causaldraft's own, ``int4_kernel``: weights unpacked once per call for
    every row; an AVX-512 bf16 or an AVX2 build) where it is available, else "torch"
    (``_weight_int4pack_mm_for_cpu``). Both take the
    scales and zeros in bf16; their sums round in different orders, and each is row-invariant."""

    packed: torch.Tensor  # blocks: [out / 16, in / 32, 320] records; torch: [out, in / 2] in its CPU layout
    scales_and_zeros: torch.Tensor | None  # torch: [in / group, out, 2] bfloat16
    bias: torch.Tensor | None  # [out] bfloat16

    def __init__(self, weights: Int4Weights, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weights.values.shape
        self.group_size = weights.group_size
        self.kernel = "blocks" if weights.group_size == int4_kernel.GROUP and int4_kernel.available() else "torch"
        if self.kernel == "blocks":
            quads = int4_kernel.records_in_quads()
            packed = int4_kernel.pack_blocks(weights.values, weights.scales, weights.zeros, quads=quads)
            self.register_buffer("packed", packed)
            self.register_buffer("scales_and_zeros", None)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weights.values.to(torch.int32), 1)
            scales_and_zeros = torch.stack((weights.scales.t(), weights.zeros.t()), dim=-1)  # [groups, out, 2]
            self.register_buffer("packed", packed)  # [out, in / 2] uint8, the kernel's CPU layout
            self.register_buffer("scales_and_zeros", scales_and_zeros.to(ACTIVATION_DTYPE).contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(ACTIVATION_DTYPE))

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """[m, in] contiguous bf16 rows -> [m, out] bf16, without the bias."""
        if self.kernel == "blocks":
            return int4_kernel.product(rows, self.packed)
        assert self.scales_and_zeros is not None  # torch's layout
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scales_and_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(as_rows(x, self.in_features))  # [m, out]
        if self.bias is not None:
            out = out + self.bias
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] as the kernel sees it (multiplying the identity), float32."""
        identity = torch.eye(self.in_features, dtype=ACTIVATION_DTYPE)
        return self.product(identity).t().float()  # [out, in]


def int4_kernels(model: nn.Module) -> tuple[str, ...]:
    """The kernels ``model``'s int4 linears use, sorted ("blocks", "torch"); empty without int4."""
    return tuple(sorted({module.kernel for module in model.modules() if isinstance(module, Int4Linear)}))


QuantWeights = Int8Weights | Int4Weights


def make_linear(weights: QuantWeights, bias: torch.Tensor | None) -> nn.Module:
    if isinstance(weights, Int4Weights):
        return Int4Linear(weights, bias)
    return Int8Linear(weights, bias)


# ---------------------------------------------------------------- quantizing a model


def linear_names(model: NativeLlama) -> Iterator[str]:
    """Names of the layers' linears and the LM head, e.g. ``layers.0.self_attn.qkv_proj``."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            yield name


def parts_of(model: NativeLlama, name: str) -> list[tuple[str, int]]:
    """The checkpoint linears a module stacks, with their rows: ``layers.0.mlp.gate_up_proj`` ->
    [("layers.0.mlp.gate_proj", 1536), ("layers.0.mlp.up_proj", 1536)]; a plain linear is itself."""
    for fused, parts in FUSED_PROJECTIONS.items():
        if name.endswith(f".{fused}"):
            prefix = name.removesuffix(fused)
            return list(zip((prefix + part for part in parts), model.llama_shape.part_rows(fused), strict=True))
    linear = model.get_submodule(name)
    assert isinstance(linear, nn.Linear)
    return [(name, linear.out_features)]


def checkpoint_linear_names(model: NativeLlama) -> set[str]:
    """Checkpoint (and GGUF) granularity: ``layers.0.self_attn.q_proj``, ..."""
    return {part for name in linear_names(model) for part, _ in parts_of(model, name)}


def stack_int4(parts: list[Int4Weights]) -> Int4Weights:
    """Row-wise concatenation; exact, since int4 groups lie within one row."""
    return Int4Weights(
        torch.cat([part.values for part in parts]),
        torch.cat([part.scales.float() for part in parts]),
        torch.cat([part.zeros.float() for part in parts]),
    )


def quantize_weights(name: str, weight: torch.Tensor, dtype: str, fallbacks: list[str]) -> QuantWeights:
    """The LM head is always int8; int4 layers the kernel cannot take fall back to int8."""
    out_features, in_features = weight.shape
    if dtype == "int8" or name == "lm_head":
        return quantize_int8(weight)
    if not int4_supported(out_features, in_features):
        fallbacks.append(f"{name} [{out_features}x{in_features}]")
        return quantize_int8(weight)
    return quantize_int4(weight)


def quantize_model_weights(
    model: NativeLlama, dtype: str, provided: dict[str, Int4Weights] | None = None
) -> dict[str, QuantWeights]:
    """Quantize every linear of an fp32 model; ``provided`` int4 weights (from GGUF, by checkpoint
    name) are used as they are, stacked with their fused siblings."""
    provided = provided or {}
    fallbacks: list[str] = []
    result: dict[str, QuantWeights] = {}
    for name in linear_names(model):
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear)
        weight = linear.weight.data
        if dtype == "int4" and name != "lm_head" and int4_supported(*weight.shape):
            parts = parts_of(model, name)
            rows = weight.split([count for _, count in parts])
            stacked = [provided.get(part) or quantize_int4(block) for (part, _), block in zip(parts, rows, strict=True)]
            result[name] = stack_int4(stacked)
            continue
        result[name] = quantize_weights(name, weight, dtype, fallbacks)
    if fallbacks:
        notify(
            f"int4 needs in_features % {GROUP_SIZE} == 0 and out_features % {INT4_OUT_MULTIPLE} == 0; "
            f"{len(fallbacks)} layer(s) use int8 instead: {', '.join(fallbacks[:4])}"
            + (" ..." if len(fallbacks) > 4 else "")
        )
    return result


def install_quantized(model: NativeLlama, weights: dict[str, QuantWeights]) -> NativeLlama:
    """Replace each nn.Linear of our own model by its quantized module (same name and bias)."""
    for name, quantized in weights.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        bias = linear.bias.data if isinstance(linear, nn.Linear) and linear.bias is not None else None
        setattr(parent, child, make_linear(quantized, bias))
    model.quantized = True
    return model
