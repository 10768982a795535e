"""The attention kernel for fp32 and bf16 caches (causaldraft/models/kernels/attention.cpp): it
computes attention over exactly the slots a row sees, and each row's result depends on nothing else:
not the pass's other rows, the tree, the padding, the other sequences of a batch or the thread
count. In the AVX2 and AVX-512 builds a bf16 cache gives the bits its numbers give in an fp32 one; the
AMX build takes bf16 caches of head size 64 through bf16 tiles (its own arithmetic, as row-invariant)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from causaldraft.models import attention_kernel
from causaldraft.models.blocked import KEY_BLOCK, BlockedKeys, SequenceKeys, blocked_keys, sequence_keys, stack_keys

pytestmark = pytest.mark.skipif(not attention_kernel.available(), reason="needs AVX2 + FMA and a C++ compiler")

KV_HEADS, HEADS, HEAD_DIM, CAPACITY = 2, 6, 64, 3 * KEY_BLOCK


CACHE_DTYPES = [torch.float32, torch.bfloat16]  # bf16 caches of head size 64 run the AMX build where it is built
AMX = attention_kernel.loaded_flags() == attention_kernel.AMX_FLAGS


def cache(seed: int, sequences: int = 1, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(sequences, KV_HEADS, CAPACITY, HEAD_DIM, generator=generator)
    values = torch.randn(sequences, KV_HEADS, CAPACITY, HEAD_DIM, generator=generator)
    return keys.to(dtype), values.to(dtype)


def tolerance(dtype: torch.dtype) -> float:
    """Of the kernel against float64 attention over the same numbers: fp32 arithmetic, or the AMX build's
    queries and weights rounded to bf16."""
    return 1e-2 if AMX and dtype == torch.bfloat16 else 1e-5


def queries(seed: int, rows: int, sequences: int = 1) -> torch.Tensor:
    return torch.randn(sequences, HEADS, rows, HEAD_DIM, generator=torch.Generator().manual_seed(seed))


def tree_layout(length: int, parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft tree's mask [n, length + n] and positions [n] over ``length`` committed slots."""
    n = len(parents)
    mask = torch.zeros(n, length + n, dtype=torch.bool)
    mask[:, :length] = True
    depths = []
    for node, parent in enumerate(parents):
        depths.append(0 if parent < 0 else depths[parent] + 1)
        ancestor = node
        while ancestor >= 0:
            mask[node, length + ancestor] = True
            ancestor = parents[ancestor]
    return mask, torch.tensor(depths) + length


def layout_of(mask: torch.Tensor, positions: torch.Tensor, length: int, rows: int | None = None) -> BlockedKeys:
    layout = blocked_keys(mask, positions, length, rows or mask.shape[0])
    assert layout is not None
    return layout


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention in float64 over the mask [n, span] (one sequence): [nh, n, hd]."""
    group = HEADS // KV_HEADS
    span = mask.shape[1]
    k = keys[0, :, :span].double().repeat_interleave(group, dim=0)
    v = values[0, :, :span].double().repeat_interleave(group, dim=0)  # bf16 numbers are exact in float64
    scores = (q[0].double() @ k.transpose(1, 2)) / HEAD_DIM**0.5
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return weights @ v


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("length", [5, KEY_BLOCK - 3, KEY_BLOCK + 7, 2 * KEY_BLOCK + 1])
def test_kernel_computes_attention_over_the_slots_each_row_sees(length: int, dtype: torch.dtype) -> None:
    keys, values = cache(length, dtype=dtype)
    parents = [-1, 0, 0, 1, 2][: KEY_BLOCK - length % KEY_BLOCK]
    mask, positions = tree_layout(length, parents)
    q = queries(1, len(parents))
    out = attention_kernel.attend(q, keys, values, *layout_of(mask, positions, length).tensors())
    tol = tolerance(dtype)
    torch.testing.assert_close(out.double(), reference(q, keys, values, mask)[None], rtol=tol, atol=tol)


# a chain 0 -> 1 -> 3 -> 5 among decoy siblings; a 3-row tree; a wide tree of 24 nodes (5 tasks of AMX rows)
TREES = [
    ([-1, 0, 0, 1, 1, 3, 3], [0, 1, 3, 5]),
    ([-1, 0, 0], [0, 2]),
    ([-1, 0, 0, 0, 1, 1, 2, 2, 3, 4, 4, 5, 6, 7, 8, 8, 9, 10, 11, 12, 13, 14, 15, 16], [0, 1, 4, 10, 17]),
]


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("length", [KEY_BLOCK + 9, 2 * KEY_BLOCK - 10, 2 * KEY_BLOCK + 31])
@pytest.mark.parametrize(("parents", "chain"), TREES)
def test_a_row_computes_the_same_bits_in_any_pass(
    length: int, dtype: torch.dtype, parents: list[int], chain: list[int]
) -> None:
    """A chain row in a tree among decoy siblings, padded to 32 rows, against the one-row pass at
    its position once its ancestors are committed at consecutive slots (prefixes that end inside and at
    the edge of the AMX build's tiles of 32 keys)."""
    keys, values = cache(3, dtype=dtype)
    mask, positions = tree_layout(length, parents)
    q = queries(4, 32)  # rows past the tree's are padding
    tree = attention_kernel.attend(q, keys, values, *layout_of(mask, positions, length, rows=32).tensors())
    committed_keys, committed_values = keys.clone(), values.clone()
    for depth, node in enumerate(chain):  # commit: the chain's entries move to consecutive slots
        committed_keys[:, :, length + depth] = keys[:, :, length + node]
        committed_values[:, :, length + depth] = values[:, :, length + node]
    for depth, node in enumerate(chain):
        one_mask = torch.ones(1, length + depth + 1, dtype=torch.bool)
        one_layout = layout_of(one_mask, torch.tensor([length + depth]), length + depth)
        one_row = attention_kernel.attend(
            q[:, :, node : node + 1], committed_keys, committed_values, *one_layout.tensors()
        )
        assert torch.equal(tree[:, :, node], one_row[:, :, 0]), (node, depth)


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_a_sequence_computes_the_same_bits_alone_and_batched(dtype: torch.dtype) -> None:
    """Two sequences of different lengths in one pass (the shorter one's head padded) against each
    alone, and on one thread against all threads."""
    keys, values = cache(5, sequences=2, dtype=dtype)
    lengths = (KEY_BLOCK + 3, 2 * KEY_BLOCK + 10)
    parents = [-1, 0, 0]
    q = queries(6, len(parents), sequences=2)
    own: list[SequenceKeys] = []
    alone = []
    for index, length in enumerate(lengths):
        mask, positions = tree_layout(length, parents)
        keys_of = sequence_keys(mask, positions, length, len(parents))
        assert keys_of is not None
        own.append(keys_of)
        layout = stack_keys([keys_of])
        alone.append(attention_kernel.attend(q[index : index + 1], keys[index : index + 1],
                                             values[index : index + 1], *layout.tensors()))  # fmt: skip
    batched = stack_keys(own)
    assert batched.head == 2 * KEY_BLOCK
    together = attention_kernel.attend(q, keys, values, *batched.tensors())
    assert torch.equal(together, torch.cat(alone))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = attention_kernel.attend(q, keys, values, *batched.tensors())
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, together)


@pytest.mark.skipif(AMX, reason="the AMX build takes bf16 caches through bf16 tiles (test_the_amx_build_...)")
def test_a_bf16_cache_gives_the_bits_of_the_same_numbers_in_fp32() -> None:
    """bf16 entries are widened exactly as they are loaded: a tree pass and a one-row pass over a
    bf16 cache equal the same passes over its values held in fp32, bit for bit."""
    length = 2 * KEY_BLOCK + 5
    keys, values = (tensor.bfloat16() for tensor in cache(11))
    for parents in ([-1], [-1, 0, 0, 1, 2]):
        mask, positions = tree_layout(length, parents)
        q = queries(12, len(parents)).bfloat16().float()
        layout = layout_of(mask, positions, length).tensors()
        half = attention_kernel.attend(q, keys, values, *layout)
        assert torch.equal(half, attention_kernel.attend(q, keys.float(), values.float(), *layout))
        torch.testing.assert_close(half.double(), reference(q, keys.float(), values.float(), mask)[None],
                                   rtol=1e-5, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_padding_rows_see_one_slot(dtype: torch.dtype) -> None:
    """A pass padded past its rows: the padding rows see tail position 0 alone (not the head), and
    the real rows are computed as without padding."""
    length = KEY_BLOCK + 20
    keys, values = cache(15, dtype=dtype)
    mask, positions = tree_layout(length, [-1, 0])
    q = queries(16, 8)
    padded = layout_of(mask, positions, length, rows=8)
    seen = padded.seen[0]
    assert seen[:2, :KEY_BLOCK].all() and not seen[2:, :KEY_BLOCK].any()
    assert seen[2:, KEY_BLOCK].all() and seen[2:].sum() == 6
    out = attention_kernel.attend(q, keys, values, *padded.tensors())
    alone = attention_kernel.attend(q[:, :, :2], keys, values, *layout_of(mask, positions, length).tensors())
    assert torch.equal(out[:, :, :2], alone)
    first_tail = values[0, :, KEY_BLOCK].float().repeat_interleave(HEADS // KV_HEADS, dim=0)  # slot T: tail position 0
    torch.testing.assert_close(out[0, :, 2:], first_tail[:, None].expand(HEADS, 6, HEAD_DIM))


def test_kernel_refuses_mixed_or_other_cache_dtypes() -> None:
    keys, values = cache(13)
    mask, positions = tree_layout(10, [-1, 0])
    layout = layout_of(mask, positions, 10).tensors()
    with pytest.raises(RuntimeError, match="both fp32 or both bf16"):
        attention_kernel.attend(queries(14, 2), keys.bfloat16(), values, *layout)
    with pytest.raises(RuntimeError, match="both fp32 or both bf16"):
        attention_kernel.attend(queries(14, 2), keys.half(), values.half(), *layout)


def test_kernel_refuses_a_layout_that_does_not_fit() -> None:
    keys, values = cache(7)
    mask, positions = tree_layout(10, [-1, 0])
    layout = layout_of(mask, positions, 10)
    with pytest.raises(RuntimeError, match="layout does not fit"):
        attention_kernel.attend(queries(8, 3), keys, values, *layout.tensors())


# Runs the kernel of the build this process picks on the cases in argv[1]; saves its outputs to argv[2].
RUN_CASES = """
import sys, torch
from causaldraft.models import attention_kernel
assert attention_kernel.available()
torch.save([attention_kernel.attend(*case) for case in torch.load(sys.argv[1])], sys.argv[2])
"""


def build_cases() -> list[tuple[torch.Tensor, ...]]:
    """Head sizes 16-128 (48: the AVX2 row code), groups of 1-5 heads (chunks of 4 and a rest), key
    counts that are and are not multiples of 8, one row and trees, fp32 and bf16 caches: 48 cases."""
    generator = torch.Generator().manual_seed(0)
    cases = []
    for hd, kv_heads, heads in ((64, 3, 9), (64, 1, 5), (128, 2, 8), (32, 1, 4), (16, 2, 2), (48, 2, 10)):
        for length, parents in ((1, [-1]), (29, [-1]), (203, [-1, 0, 0, 1, 2]), (64, [-1, 0, 1, 2, 3, 4, 5, 6, 7])):
            mask, positions = tree_layout(length, parents)
            layout = layout_of(mask, positions, length).tensors()
            keys = 3 * torch.randn(1, kv_heads, length + 200, hd, generator=generator)
            values = torch.randn(1, kv_heads, length + 200, hd, generator=generator)
            q = torch.randn(1, heads, len(parents), hd, generator=generator)
            cases.extend((q, keys.to(dtype), values.to(dtype), *layout) for dtype in (torch.float32, torch.bfloat16))
    return cases


def run_build(build: str, cases: Path, tmp_path: Path) -> list[torch.Tensor]:
    """The outputs of the build ``build`` names (``CAUSALDRAFT_ATTENTION_KERNEL``) on ``cases``, in a child process."""
    path = tmp_path / f"{build}.pt"
    environment = {**os.environ, attention_kernel.SWITCH: build}
    command = [sys.executable, "-c", RUN_CASES, str(cases), str(path)]
    root = Path(__file__).parent.parent
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    return torch.load(path)


def has_cpu_flags(flags: tuple[str, ...]) -> bool:
    return all(flag in attention_kernel.cpu_flags() for flag in flags)


@pytest.mark.skipif(not has_cpu_flags(attention_kernel.AVX512_CPU_FLAGS), reason="needs a CPU with AVX-512")
def test_the_avx512_build_gives_the_avx2_builds_bits(tmp_path: Path) -> None:
    """One task per kv head, 16 lanes and eight horizontal sums at once compute the AVX2 build's bits
    (the builds run in two processes: ``CAUSALDRAFT_ATTENTION_KERNEL`` picks each)."""
    cases = tmp_path / "cases.pt"
    torch.save(build_cases(), cases)
    avx2, avx512 = (run_build(build, cases, tmp_path) for build in ("avx2", "avx512"))
    assert len(avx2) == len(avx512) == 48
    for one, other in zip(avx2, avx512, strict=True):
        assert torch.equal(one, other)


@pytest.mark.skipif(not has_cpu_flags(attention_kernel.AMX_CPU_FLAGS), reason="needs a CPU with AMX bf16")
def test_the_amx_build_changes_only_bf16_caches_of_head_size_64(tmp_path: Path) -> None:
    """The AMX build gives the AVX-512 build's bits for every fp32 cache and other head sizes; bf16 caches of
    head size 64 go through bf16 tiles, within bf16 rounding of the AVX-512 build's fp32 arithmetic."""
    built = build_cases()
    cases = tmp_path / "cases.pt"
    torch.save(built, cases)
    avx512, amx = (run_build(build, cases, tmp_path) for build in ("avx512", "amx"))
    tiles = 0
    for case, one, other in zip(built, avx512, amx, strict=True):
        q, keys, values, seen, tail_slots = case
        if keys.dtype == torch.bfloat16 and q.shape[-1] == 64:
            tiles += 1
            assert not torch.equal(one, other)  # the other arithmetic ran
            torch.testing.assert_close(other, one, rtol=3e-2, atol=3e-2)
        else:
            assert torch.equal(one, other)
    assert tiles == 8


def test_a_build_that_fails_gives_way_to_the_next_one_down() -> None:
    """A compiler that cannot build AMX code (GCC before 11) still gets the AVX-512 build, not torch's ops."""
    builds = attention_kernel.BUILDS
    tried: list[tuple[str, ...]] = []

    def load(flags: tuple[str, ...]) -> bool:
        tried.append(flags)
        return flags != attention_kernel.AMX_FLAGS

    assert attention_kernel.first_build(builds, load) == attention_kernel.AVX512_FLAGS
    assert tried == [attention_kernel.AMX_FLAGS, attention_kernel.AVX512_FLAGS]
    assert attention_kernel.first_build(builds, lambda flags: False) is None
