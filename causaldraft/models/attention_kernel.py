"""causaldraft's attention kernel for fp32 and bf16 KV caches (``kernels/attention.cpp``, AVX2 + FMA), built
once per machine on first use, like the int4 kernel (``int4_kernel.load_source``).

Why: the blocked layout's attention (``blocked.attend_blocked``) written in torch ops runs about 20
kernels per layer (products, gathers, masks, a split softmax). On the 2-core AVX2 machine a one-row
int4 pass spent ~2.7 ms in them at 256 cached positions, a third of the pass. This kernel does a
row's whole attention in one task: the dot products with the keys it sees, in position order, the
softmax and the weighted sum of values, in fp32 (docs/exactness.md has its arithmetic).

Used for every cache of the blocked layout, fp32 (every dtype's cache on a CPU without native bf16
products, and fp32 models) or bf16 (bf16, int8 and int4 models where bf16 products are native; since
stop 27: a bf16 entry is widened to fp32 exactly as it is loaded, and the arithmetic is fp32), where
the CPU has AVX2 and FMA, the build succeeds and ``CAUSALDRAFT_ATTENTION_KERNEL`` is not ``torch``;
otherwise attention runs in torch's ops. The two round differently, so compiled graphs are keyed by
the choice (``compiled.code_digest``).

On the AVX-512 machine of stop 27 (2 cores, bf16 cache, 448 cached positions, 30 layers, each pass
after a cache flush) torch's ops compiled by inductor took 5.9 / 4.5 / 4.8 / 6.3 ms per pass of
2 / 4 / 8 / 16 rows, this kernel 1.3 / 1.8 / 3.2 / 6.1 ms (``runs/`` scratch script, not kept).

Two builds of the same fp32 arithmetic (the source's header): AVX2 (a task per query head and row) and, where
the CPU has AVX-512F, AVX-512 (a task per kv head and row, each key and value widened once for the
heads that share it, 16 lanes, eight horizontal sums at once). They give the same bits (a test runs
both). On that machine, 30 layers of 9 heads over a bf16 cache of 448 positions (cache-warm, median of
25), ms for 1 / 2 / 4 / 8 / 16 / 32 rows: AVX2 build 0.51 / 0.79 / 1.48 / 2.77 / 5.42 / 10.69, AVX-512
build 0.35 / 0.48 / 0.81 / 1.47 / 2.83 / 5.73. Since stop 50 the AVX-512 build widens each key into registers once
for its query heads (it had stored it and loaded it again per head): the same bits, 20-32 % less time
(docs/exactness.md).

The AMX build (since stop 45, where the CPU has AMX bf16 tiles; ``avx512`` forces the build above): bf16 caches
of head size 64 through tiles, a task per kv head and up to 16 / group rows (another arithmetic: the query and the
weights rounded to bf16; as row-invariant, docs/exactness.md "The AMX build"). 1 / 4 / 16 / 32 rows over 1,024
positions: 0.80 / 1.30 / 3.84 / 7.17 ms against the AVX-512 build's 0.91 / 2.62 / 10.12 / 21.30.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
from collections.abc import Callable

import torch

from causaldraft.models.int4_kernel import KERNELS, cpu_flags, load_source

SOURCE = KERNELS / "attention.cpp"
# -ffp-contract=off: no multiply-add the source does not write (both builds must keep its arithmetic)
FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-mavx2", "-mfma")
CPU_FLAGS = ("avx2", "fma")
AVX512_FLAGS = (*FLAGS, "-mavx512f")  # the same arithmetic, a task per kv head (attention.cpp's header)
AVX512_CPU_FLAGS = (*CPU_FLAGS, "avx512f")
# the AVX-512 build plus AMX tiles for bf16 caches of head size 64 (attention.cpp: "The AMX build")
AMX_FLAGS = (*AVX512_FLAGS, "-mavx512bw", "-mavx512bf16", "-mamx-tile", "-mamx-bf16")
AMX_CPU_FLAGS = (*AVX512_CPU_FLAGS, "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16")
# "torch": attention in torch's ops; "avx2" / "avx512" / "amx": that build where the CPU runs it (unset: the best)
SWITCH = "CAUSALDRAFT_ATTENTION_KERNEL"
ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18  # x86-64 Linux: the AMX tile data permission


def wanted() -> bool:
    """Whether this process uses the kernel where it can (the switch, and the CPU's flags)."""
    return os.environ.get(SWITCH, "").lower() != "torch" and all(flag in cpu_flags() for flag in CPU_FLAGS)


@functools.cache
def amx_permitted() -> bool:
    """Whether Linux lets this process use AMX tile data (``arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)``, the
    request the AMX build makes before its first tile): False elsewhere, or where the kernel refuses."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):
        return False


def build_flags() -> tuple[str, ...]:
    """The build the switch names, else the best the CPU runs: AMX, AVX-512, AVX2 (where the CPU lacks the
    named build, or Linux refuses AMX tiles: the next one down)."""
    switch = os.environ.get(SWITCH, "").lower()
    flags = cpu_flags()
    if switch not in ("avx2", "avx512") and all(flag in flags for flag in AMX_CPU_FLAGS) and amx_permitted():
        return AMX_FLAGS
    if switch != "avx2" and all(flag in flags for flag in AVX512_CPU_FLAGS):
        return AVX512_FLAGS
    return FLAGS


BUILDS = (AMX_FLAGS, AVX512_FLAGS, FLAGS)  # best first
NAMES = {AMX_FLAGS: "AMX", AVX512_FLAGS: "AVX-512", FLAGS: "AVX2"}


Build = tuple[str, ...]  # a build's compiler flags


def first_build(choices: tuple[Build, ...], load: Callable[[Build], bool]) -> Build | None:
    """The first of ``choices`` that ``load`` builds and loads, trying them in order, or None."""
    return next((flags for flags in choices if load(flags)), None)


@functools.cache
def loaded_flags() -> tuple[str, ...] | None:
    """The build loaded into this process (built first when needed): ``build_flags``' choice, else the next one
    down (a compiler too old for AMX code still builds the AVX-512 one); None where none loads."""
    if not wanted():
        return None
    choices = BUILDS[BUILDS.index(build_flags()) :]

    def load(flags: tuple[str, ...]) -> bool:
        below = choices.index(flags) + 1
        instead = f"the {NAMES[choices[below]]} build" if below < len(choices) else "torch's"
        return load_source(f"attention ({NAMES[flags]} build)", SOURCE, flags, instead)

    flags = first_build(choices, load)
    if flags is not None:
        torch.library.register_fake("causaldraft::attend_blocked")(shape_of_attention)
    return flags


def available() -> bool:
    """Whether ``torch.ops.causaldraft.attend_blocked`` is loaded (built first when needed)."""
    return loaded_flags() is not None


MAX_HEAD_DIM = 128  # the kernel's head sizes: multiples of 16 up to this (attention.cpp's check)


def takes(keys: torch.Tensor) -> bool:
    """Whether the kernel attends over ``keys`` [..., hd]: fp32 or bf16, a head size it is built for, and loaded.
    Any other cache goes through torch's operations (models/blocked.py), as where the kernel is not built."""
    head_dim = keys.shape[-1]
    return (
        keys.dtype in (torch.float32, torch.bfloat16) and head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM
        and available()
    )  # fmt: skip


def shape_of_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor, tail_slots: torch.Tensor
) -> torch.Tensor:
    """What ``attend_blocked`` returns, for tracing: [S, nh, n, hd] fp32."""
    return q.new_empty(q.shape)


def attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor, tail_slots: torch.Tensor
) -> torch.Tensor:
    """q [S, nh, n, hd] (any float dtype); keys, values [S, kvh, capacity, hd], both fp32 or both bf16; the blocked
    layout's ``seen`` [S, n, T + B] and ``tail_slots`` [S, n, B] -> [S, nh, n, hd] fp32."""
    return torch.ops.causaldraft.attend_blocked(q.float().contiguous(), keys, values, seen, tail_slots)
