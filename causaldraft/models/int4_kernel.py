"""causaldraft's own int4 product (``kernels/int4_mm_vnni.cpp`` for AVX-512 VNNI, ``kernels/int4_mm.cpp`` for
AVX-512 bf16, ``kernels/int4_mm_avx2.cpp`` for AVX2 + FMA), built once per machine on first use.

Why: torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) unpacks the weights again for every
block of 4 rows, so a verify pass of 8 rows costs twice one of 4, and even a one-row product runs
far below the memory bandwidth. This kernel unpacks each group of weights once per call (once per 4 rows in the
AVX-512 bf16 build, whose 4 rows keep their totals in registers since stop 33) and uses it for every row
(AVX-512 bf16 dot products): the one-row products of a pass run at about the memory's speed, and a 4-row
product of the default model's pass costs ~2.1 ms against ~1.8 for one row (docs/int4-kernel.md has the
layout, the arithmetic and the measurements).

The AVX-512 build's arithmetic is the same as torch's kernel's in exact terms (``w = (q - 8) * scale +
zero``, scales and zeros in bf16, bf16 activations, fp32 sums, bf16 output); only the summation order
differs. The AVX2 build (since stop 25) first quantizes each row's activations to int8 per group of 32
inputs, as llama.cpp's Q4_1 x Q8_1 product does, and sums exact integer dot products
(``Build.int8_activations``; ``quantize_activations`` is its rounding, docs/int4-kernel.md): a
product of 2 / 4 rows then costs ~1.3x / ~1.7x one row, against ~2x / ~2.7x with fp32
multiply-adds. Every output element is computed by the same instructions whatever the row count and
the thread count, so the product is row-invariant, which exactness needs (docs/exactness.md).

The VNNI build (since stop 32, ``CAUSALDRAFT_INT4_KERNEL=vnni``) computes the AVX2 build's arithmetic bit
for bit with AVX-512 VNNI integer dot products (vpdpbusd: one instruction per row and 4 inputs of 16
channels). The int8 activations cost the default model's int4 output a fourfold KL against fp32 (0.00277
against 0.00066; greedy match 96.3 % against 98.4 %, ``bench/quant_quality.py``), so it runs only where it is
clearly faster: on AMD Zen 5 it is not (4-row products 3.1-3.5 ms against 2.1-2.2 since stop 33), on an Intel
Xeon with AMX it takes about half the time (stop 35). Where the CPU runs both, the first load times them and
keeps the answer (``kernel_choice``).

Both AVX-512 builds carry ``causaldraft::bf16_mm`` (``kernels/bf16_mm.cpp``, built beside either; since stop 33,
in the bf16 build's source until stop 35), the bf16 product bf16 models' layers run through
(``Build.bf16_products``, ``quant.Bf16BlockLinear``), as the AVX2 build does with fp32 multiply-adds since
stop 24.

Used where the CPU has AVX-512 with bf16 (the bf16 build, or the VNNI build where timing chose it), else
AVX2 with FMA (the AVX2 build), all on the same records, when a C++ compiler is found and
``CAUSALDRAFT_INT4_KERNEL`` is not ``torch``; it may name a build (``avx512_bf16``, ``vnni``, ``avx2``) to
pick it where the CPU runs it. Otherwise int4 linears use torch's kernel (with a message when a build failed).
The builds use OpenMP threads (``-fopenmp``: ``at::parallel_for`` is inline and runs serially without it).
The build (~10 s) lands in ``$CAUSALDRAFT_HOME/kernels/<digest of the source, flags and torch>``.

Layout (``pack_blocks``): [out / 16, in / 32, 320] bytes, one record per block of 16 output
channels and group of 32 inputs: 256 bytes of values, then the 16 scales and the 16 zeros in bf16.
Value bytes: 8 chunks of 32 bytes; chunk c, byte j holds in its low nibble the value of channel
j // 2 at input 4c + j % 2, and in its high nibble that of the same channel at input 4c + 2 + j % 2.
So a chunk widened to 32 16-bit words gives, through its low and then its high nibbles, the two
operands of two bf16 dot-product steps (inputs 4c, 4c + 1 and 4c + 2, 4c + 3 of the 16 channels).
The VNNI build reads its records with the value bytes in another order (``pack_blocks(..., quads=True)``,
``Build.quads``, since stop 46): 4 pieces of 64 bytes; piece p, byte 4n + i holds in its low nibble the value of
channel n at input 8p + i and in its high nibble that at input 8p + 4 + i. So a piece's low nibbles are the
operand of one integer dot-product step over inputs 8p .. 8p + 3 of the 16 channels, its high nibbles that of
the step over 8p + 4 .. 8p + 7, with no permutation. Records are packed at load, for the build loaded.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from causaldraft.paths import causaldraft_home

KERNELS = Path(__file__).resolve().parent / "kernels"


@dataclass(frozen=True)
class Build:
    """One instruction-set variant of the kernel: its source, compiler flags and the CPU flags it needs."""

    isa: str
    source: Path
    flags: tuple[str, ...]
    cpu_flags: tuple[str, ...]
    int8_products: bool = False  # also defines ``causaldraft::int8_mm``
    bf16_products: bool = False  # also defines ``causaldraft::bf16_mm`` (in ``source``, or built from ``bf16_source``)
    int8_activations: bool = False  # int4_mm (and int8_mm) round activations as ``quantize_activations`` does
    quads: bool = False  # records in ``pack_blocks``'s quads order
    bf16_source: Path | None = None  # ``bf16_mm`` built beside ``source`` (with ``BF16_FLAGS``)

    @property
    def sources(self) -> tuple[Path, ...]:
        return (self.source,) if self.bf16_source is None else (self.source, self.bf16_source)


# In order of preference. All read the same records; the VNNI and AVX2 builds round activations to int8
# per group and compute the same bits (compiled graphs are keyed by the build, so each has its own).
# Where both the AVX-512 bf16 and the VNNI build run, the first load times both and keeps the faster, the
# bf16 build unless the VNNI build is clearly faster (``kernel_choice``; ``SWITCH`` names one instead). Both
# carry the AVX-512 bf16 product for bf16 models' layers (``BF16_SOURCE``). A CPU with VNNI but no AVX-512
# bf16 keeps the AVX2 build, whose int8 and bf16 products it uses where oneDNN lacks bf16 products.
BF16_SOURCE = KERNELS / "bf16_mm.cpp"
# the AVX-512 bf16 build's flags too
BF16_FLAGS = ("-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma")
VNNI_FLAGS = ("-O3", "-fopenmp", "-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
VNNI_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16")
BUILDS = (
    Build(
        "avx512_bf16", KERNELS / "int4_mm.cpp", BF16_FLAGS,
        ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"), bf16_products=True, bf16_source=BF16_SOURCE,
    ),
    Build(
        "vnni", KERNELS / "int4_mm_vnni.cpp", VNNI_FLAGS, VNNI_CPU_FLAGS, int8_activations=True, quads=True,
        bf16_products=True, bf16_source=BF16_SOURCE,
    ),
    Build(
        "avx2", KERNELS / "int4_mm_avx2.cpp", ("-O3", "-fopenmp", "-mavx2", "-mfma"), ("avx2", "fma"),
        int8_products=True, bf16_products=True, int8_activations=True,
    ),
)  # fmt: skip
SOURCES = tuple(sorted({source for build in BUILDS for source in build.sources}))  # graph keys hash them
CHOICES = ("avx512_bf16", "vnni")  # builds timed against each other where both run (``kernel_choice``)
BLOCK = 16  # output channels per record
GROUP = 32  # inputs per record (the quantization group)
INT8_BLOCK = 8  # output channels per record of ``int8_mm`` (one int32 lane each)
RECORD_BYTES = BLOCK * GROUP // 2 + 4 * BLOCK
SWITCH = "CAUSALDRAFT_INT4_KERNEL"  # "torch": torch's kernel; a build's isa: that build where the CPU runs it


@functools.cache
def cpu_flags() -> tuple[str, ...]:
    """The CPU's flags from /proc/cpuinfo (read once per process: every Int8Linear asks)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    return tuple(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def build_for_cpu() -> Build | None:
    """The build ``SWITCH`` names, where this CPU runs it; without a switch, the first build this CPU runs, or
    where it runs both ``CHOICES`` the one measured faster on it (``kernel_choice.chosen_build``). None: none."""
    wanted = os.environ.get(SWITCH, "").lower()
    if wanted == "torch":
        return None
    flags = cpu_flags()
    runnable = [b for b in BUILDS if wanted in ("", b.isa) and all(flag in flags for flag in b.cpu_flags)]
    if not runnable:
        return None
    contenders = [build for build in runnable if build.isa in CHOICES]
    if wanted or len(contenders) < 2 or runnable[0] is not contenders[0]:
        return runnable[0]
    from causaldraft.models.kernel_choice import chosen_build

    return chosen_build(tuple(contenders))


def records_in_quads() -> bool:
    """Whether int4 records are packed in ``pack_blocks``'s quads order: the order the loaded build reads."""
    build = build_for_cpu()
    return build is not None and build.quads


def cpu_supported() -> bool:
    return build_for_cpu() is not None


def source_digest(source: Path, flags: tuple[str, ...]) -> str:
    digest = hashlib.sha256(source.read_bytes())
    digest.update(" ".join(flags).encode())
    digest.update(torch.__version__.encode())
    return digest.hexdigest()[:16]


def load_source(what: str, source: Path, flags: tuple[str, ...], instead: str = "torch's") -> bool:
    """Build ``source`` (once per machine, in ``$CAUSALDRAFT_HOME/kernels/<digest>``) and load its
    operators into this process; False, with a message naming ``what`` and what serves ``instead``, when it fails."""
    from torch.utils import cpp_extension

    from causaldraft.models.quant import notify

    digest = source_digest(source, flags)
    directory = causaldraft_home() / "kernels" / digest
    try:
        directory.mkdir(parents=True, exist_ok=True)
        clear_stale_lock(directory / "lock")
        cpp_extension.load(
            name=f"causaldraft_{source.stem}_{digest}", sources=[str(source)], extra_cflags=list(flags),
            build_directory=str(directory), is_python_module=False, verbose=False,
        )  # fmt: skip
    except Exception as error:  # no compiler, no ninja, a failed build: torch's kernel serves
        notify(f"{what} kernel not built ({type(error).__name__}: {str(error).strip()[:200]}); using {instead}")
        return False
    return True


STALE_LOCK_SECONDS = 900  # a build here takes at most a few minutes; an older lock was left by a killed process


def clear_stale_lock(lock: Path) -> bool:
    """Remove a build directory's ``lock`` older than ``STALE_LOCK_SECONDS``, with a message; True if removed.

    torch's extension builder holds that file while it builds and waits, without end or message, for it to go
    before building or loading the same extension: a process killed during a build (stop 55) left one, and the next
    process loading the kernel waited silently until the file was deleted by hand."""
    from causaldraft.models.quant import notify

    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:  # no lock: nothing to clear
        return False
    if age < STALE_LOCK_SECONDS:
        return False
    try:
        lock.unlink()
    except OSError:
        return False
    notify(f"removed {lock}, a build lock {age / 60:.0f} min old left by a process that ended while building")
    return True


def refused_switch() -> None:
    """A message when ``SWITCH`` names no build this CPU runs (torch's kernel serves instead)."""
    from causaldraft.models.quant import notify

    wanted = os.environ.get(SWITCH, "").lower()
    if wanted in ("", "torch"):
        return
    known = {build.isa: build for build in BUILDS}
    if wanted not in known:
        reason = f"not a build (one of {', '.join(known)}, or torch)"
    else:
        missing = [flag for flag in known[wanted].cpu_flags if flag not in cpu_flags()]
        reason = f"this CPU lacks {' '.join(missing)}"
    notify(f"{SWITCH}={wanted}: {reason}; int4 linears use torch's kernel")


@functools.cache
def available() -> bool:
    """Whether ``torch.ops.causaldraft.int4_mm`` is loaded (built first when needed); once per process."""
    build = build_for_cpu()
    if build is None:
        refused_switch()
        return False
    if not load_source("int4", build.source, build.flags):
        return False
    torch.library.register_fake("causaldraft::int4_mm")(shape_of_product)
    if build.int8_products:
        torch.library.register_fake("causaldraft::int8_mm")(shape_of_int8_product)
    return True


@functools.cache
def bf16_loaded() -> bool:
    """Whether the build's ``bf16_mm`` is loaded: part of its source, or built beside it from ``bf16_source``
    (where that fails, bf16 models' layers go through oneDNN); once per process."""
    build = build_for_cpu()
    if build is None or not build.bf16_products or not available():
        return False
    if build.bf16_source is not None and not load_source("bf16", build.bf16_source, BF16_FLAGS):
        return False
    torch.library.register_fake("causaldraft::bf16_mm")(shape_of_bf16_product)
    return True


def int8_available() -> bool:
    """Whether ``torch.ops.causaldraft.int8_mm`` is loaded: the AVX2 build's int8 product over
    per-channel records (where oneDNN takes no bf16 weights, quantized models' LM heads are int8)."""
    build = build_for_cpu()
    return build is not None and build.int8_products and available()


def bf16_available() -> bool:
    """Whether ``torch.ops.causaldraft.bf16_mm`` is loaded: bf16 products over per-channel records
    (``pack_channels``), which bf16 models' layer linears run through (``quant.use_block_linears``).
    The AVX-512 bf16 build's (vdpbf16ps, since stop 33) reads the weights at about the memory's speed
    where oneDNN's reach ~2/3 of it; the AVX2 build's (fp32 multiply-adds) replaces torch's generic
    bf16 product on CPUs without native bf16 products."""
    build = build_for_cpu()  # asked each time, as ``SWITCH`` may have changed: ``bf16_loaded`` is once per process
    return build is not None and build.bf16_products and bf16_loaded()


def shape_of_int8_product(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What ``int8_mm`` returns, for tracing: [rows, out] bf16."""
    return x.new_empty((x.shape[0], packed.shape[0] * INT8_BLOCK))


def shape_of_bf16_product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """What ``bf16_mm`` returns, for tracing: [rows, out] bf16."""
    return x.new_empty((x.shape[0], packed.shape[0] * BLOCK))


def pack_channels(values: torch.Tensor) -> torch.Tensor:
    """bf16 weights [out, in] -> ``bf16_mm``'s records [out / 16, in, 16] (each input's 16 channels)."""
    out_features, in_features = values.shape
    if out_features % BLOCK or in_features % 2:
        raise ValueError(f"channel blocks need out % {BLOCK} == 0 and an even in, got {tuple(values.shape)}")
    return values.reshape(out_features // BLOCK, BLOCK, in_features).permute(0, 2, 1).contiguous()


def unpack_channels(packed: torch.Tensor) -> torch.Tensor:
    """``pack_channels``'s inverse: [out, in]."""
    blocks, in_features, _ = packed.shape
    return packed.permute(0, 2, 1).reshape(blocks * BLOCK, in_features)


def pack_int8_records(values: torch.Tensor) -> torch.Tensor:
    """int8 weights [out, in] -> ``int8_mm``'s records [out / 8, in / 32, 8, 32]: per block of 8
    channels and group of 32 inputs, each channel's 32 weights in input order."""
    out_features, in_features = values.shape
    if out_features % INT8_BLOCK or in_features % GROUP:
        raise ValueError(f"int8 records need out % {INT8_BLOCK} == 0 and in % {GROUP} == 0, got {tuple(values.shape)}")
    grouped = values.reshape(out_features // INT8_BLOCK, INT8_BLOCK, in_features // GROUP, GROUP)
    return grouped.permute(0, 2, 1, 3).contiguous()


def unpack_int8_records(packed: torch.Tensor) -> torch.Tensor:
    """``pack_int8_records``'s inverse: [out, in]."""
    blocks, groups, channels, group = packed.shape
    return packed.permute(0, 2, 1, 3).reshape(blocks * channels, groups * group)


def int8_product(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[m, in] bf16 contiguous rows times int8 records with [out] bf16 scales: [m, out] bf16. The
    activations are rounded to int8 per group as ``quantize_activations`` states and the products
    summed in exact integers per group (docs/int4-kernel.md)."""
    return torch.ops.causaldraft.int8_mm(x, packed, scales)


def bf16_product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """[m, in] bf16 contiguous rows times bf16 records: [m, out] bf16."""
    return torch.ops.causaldraft.bf16_mm(x, packed)


def shape_of_product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """What ``int4_mm`` returns, for tracing: [rows, out] bf16."""
    return x.new_empty((x.shape[0], packed.shape[0] * BLOCK))


def pack_blocks(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, quads: bool = False) -> torch.Tensor:
    """int4 weights (``values`` [out, in] in [0, 15], ``scales``/``zeros`` [out, in / 32]) -> the
    kernel's records [out / 16, in / 32, 320] uint8 (layout: module docstring; ``quads``: the VNNI
    build's order of the 256 value bytes)."""
    out_features, in_features = values.shape
    if out_features % BLOCK or in_features % GROUP or scales.shape != (out_features, in_features // GROUP):
        raise ValueError(f"int4 blocks need out % {BLOCK} == 0 and in % {GROUP} == 0, got {tuple(values.shape)}")
    blocks, groups = out_features // BLOCK, in_features // GROUP
    if quads:
        # [block, channel, group, piece, half, input] -> [block, group, piece, half, channel * 4 + input]
        split = values.to(torch.uint8).reshape(blocks, BLOCK, groups, GROUP // 8, 2, 4)
        words = split.permute(0, 2, 3, 4, 1, 5).reshape(blocks, groups, GROUP // 8, 2, 4 * BLOCK)
    else:
        # [block, channel, group, chunk, half, parity] -> [block, group, chunk, half, channel * 2 + parity]
        split = values.to(torch.uint8).reshape(blocks, BLOCK, groups, GROUP // 4, 2, 2)
        words = split.permute(0, 2, 3, 4, 1, 5).reshape(blocks, groups, GROUP // 4, 2, 2 * BLOCK)
    nibbles = (words[:, :, :, 0] | (words[:, :, :, 1] << 4)).reshape(blocks, groups, BLOCK * GROUP // 2)

    def per_record(table: torch.Tensor) -> torch.Tensor:  # [out, groups] -> [blocks, groups, 32] bytes
        grouped = table.to(torch.bfloat16).reshape(blocks, BLOCK, groups).permute(0, 2, 1).contiguous()
        return grouped.view(torch.uint8)

    return torch.cat((nibbles, per_record(scales), per_record(zeros)), dim=-1).contiguous()


ACTIVATION_LEVELS = 127  # int8 activations lie in [-127, 127]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How a build with ``int8_activations`` rounds rows [m, in] before its integer products: per row
    and group of GROUP inputs, step d = amax / 127 and values round(x * (127 / amax)) (half to even,
    fp32), so x ~ d * values. Returns (values [m, in / GROUP, GROUP] float32 integers, d [m, in / GROUP, 1]).
    The kernel computes this in C++; this is its statement for tests and readers."""
    groups = x.float().reshape(x.shape[0], -1, GROUP)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    # a true fp32 division, as the kernel's (``127 / tensor`` multiplies by a reciprocal: another rounding)
    inverse = torch.where(amax > 0, torch.full_like(amax, ACTIVATION_LEVELS) / amax, torch.zeros_like(amax))
    values = torch.round(groups * inverse).clamp(-ACTIVATION_LEVELS, ACTIVATION_LEVELS)
    return values, amax / ACTIVATION_LEVELS


def product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """[m, in] bf16 contiguous rows times the packed weights: [m, out] bf16."""
    return torch.ops.causaldraft.int4_mm(x, packed)
