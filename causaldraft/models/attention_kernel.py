"""causaldraft's attention kernel for fp32 KV caches (``kernels/attention.cpp``, AVX2 + FMA), built
once per machine on first use, like the int4 kernel (``int4_kernel.load_source``).

Why: the blocked layout's attention (``blocked.attend_blocked``) written in torch ops runs about 20
kernels per layer (products, gathers, masks, a split softmax). On the 2-core AVX2 machine a one-row
int4 pass spent ~2.7 ms in them at 256 cached positions, a third of the pass. This kernel does a
row's whole attention in one task: the dot products with the keys it sees, in position order, the
softmax and the weighted sum of values, in fp32 (docs/exactness.md has its arithmetic).

Used for fp32 caches (every dtype's cache on a CPU without native bf16 products, and fp32 models)
where the CPU has AVX2 and FMA, the build succeeds and ``CAUSALDRAFT_ATTENTION_KERNEL`` is not
``torch``; otherwise attention runs in torch's ops. The two round differently, so compiled graphs
are keyed by the choice (``compiled.code_digest``).
"""

from __future__ import annotations

import functools
import os

import torch

from causaldraft.models.int4_kernel import KERNELS, cpu_flags, load_source

SOURCE = KERNELS / "attention.cpp"
FLAGS = ("-O3", "-fopenmp", "-mavx2", "-mfma")
CPU_FLAGS = ("avx2", "fma")
SWITCH = "CAUSALDRAFT_ATTENTION_KERNEL"  # "torch": attention in torch's ops


def wanted() -> bool:
    """Whether this process uses the kernel where it can (the switch, and the CPU's flags)."""
    return os.environ.get(SWITCH, "").lower() != "torch" and all(flag in cpu_flags() for flag in CPU_FLAGS)


@functools.cache
def available() -> bool:
    """Whether ``torch.ops.causaldraft.attend_blocked`` is loaded (built first when needed)."""
    if not wanted() or not load_source("attention", SOURCE, FLAGS):
        return False
    torch.library.register_fake("causaldraft::attend_blocked")(shape_of_attention)
    return True


def shape_of_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor, tail_slots: torch.Tensor
) -> torch.Tensor:
    """What ``attend_blocked`` returns, for tracing: [S, nh, n, hd] fp32."""
    return q.new_empty(q.shape)


def attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor, tail_slots: torch.Tensor
) -> torch.Tensor:
    """q [S, nh, n, hd] (any float dtype); keys, values [S, kvh, capacity, hd] fp32; the blocked
    layout's ``seen`` [S, n, T + B] and ``tail_slots`` [S, n, B] -> [S, nh, n, hd] fp32."""
    return torch.ops.causaldraft.attend_blocked(q.float().contiguous(), keys, values, seen, tail_slots)
