"""What this CPU's matrix products do, for the choices that depend on it (kept in one place): which
dtypes it multiplies natively, and from how many rows a product rounds each row alike."""

from __future__ import annotations

from functools import cache

import torch

CHECK_SEED = 0
CHECKED_HEADS = ((3, 64), (4, 64), (8, 128))  # (query heads per kv head, head_dim) of common models
CHECKED_HEAD_LENGTHS = (0, 64, 320)  # T: committed positions in whole key blocks
CHECKED_ROWS = (2, 3, 4, 8, 16)  # rows of the checked passes
KV_HEADS = 3  # the batch of the checked products
TAIL = 64  # the key block (blocked.KEY_BLOCK; a constant here, as this module sits below it)


@cache
def native_bf16_products() -> bool:
    """Whether oneDNN takes bf16 matrices on this CPU: it needs AVX-512 (bw, vl, dq) or
    AVX-NE-CONVERT. Elsewhere (an AVX2-only CPU such as AMD Zen 3) torch's bf16 products fall back
    to a generic kernel, 4-7x slower than fp32 ones (a [3, 64] x [64, 512] product: 170 against 42
    us, measured), and oneDNN refuses to reorder a bf16 weight."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def product_rows(dtype: torch.dtype) -> int:
    """The fewest rows attention's products are computed with, so that a row rounds alike in every
    pass: bf16 products of one row round differently from those of two or more (AVX-512, measured),
    fp32 ones of 1-3 rows differently from those of four or more (AVX2 Zen 3: a [3, 64] x [64, 400]
    product against the same rows among 4 to 48, measured)."""
    return 4 if dtype == torch.float32 else 2


def at_least_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """[..., m, k] repeated along m until it has at least ``rows`` rows (the first m are x)."""
    m = x.shape[-2]
    return x if m >= rows else torch.cat((x,) * -(-rows // m), dim=-2)


def product_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype attention's products of ``dtype`` operands run in: bf16 ones in fp32 where bf16
    products are not native and fp32 ones are row-invariant. bf16 operands are exact in fp32, and
    the product is rounded back to bf16, as a bf16 product rounds its fp32 sums."""
    if dtype != torch.bfloat16 or native_bf16_products():
        return dtype
    return torch.float32 if fp32_products_row_invariant() else dtype


@cache
def fp32_products_row_invariant() -> bool:
    """Whether fp32 batched products here give each block of rows the same bits whatever the other
    rows: attention's head products over n rows (``blocked.attend_blocked``), [g n, hd] x [hd, T + 64
    + n] and [g n, T] x [T, hd], against the same block computed alone as a one-row pass computes
    it (``product_rows``). Checked once per process on seeded random operands, on one thread and on
    torch's count: true on an AVX2 Zen 3, false for some shapes on the AVX-512 machine of
    docs/exactness.md (where bf16 products are native and this is not asked)."""
    generator = torch.Generator().manual_seed(CHECK_SEED)
    least = product_rows(torch.float32)

    def operand(*shape: int) -> torch.Tensor:
        return torch.randn(KV_HEADS, *shape, generator=generator).to(torch.bfloat16).float()

    threads = torch.get_num_threads()
    try:
        for count in sorted({1, threads}):
            torch.set_num_threads(count)
            for group, head_dim in CHECKED_HEADS:
                for head in CHECKED_HEAD_LENGTHS:
                    rows = group * max(CHECKED_ROWS)
                    q, keys = operand(rows, head_dim), operand(head + TAIL + max(CHECKED_ROWS), head_dim)
                    weights, values = operand(rows, head), operand(head, head_dim)
                    for n in CHECKED_ROWS:
                        scores = torch.matmul(at_least_rows(q[:, : group * n], least),
                                              keys[:, : head + TAIL + n].transpose(1, 2))  # fmt: skip
                        mixed = torch.matmul(at_least_rows(weights[:, : group * n], least), values)
                        for start in range(0, group * n, group):
                            block = slice(start, start + group)
                            one_keys = keys[:, : head + TAIL + 1].transpose(1, 2)
                            own = torch.matmul(at_least_rows(q[:, block], least), one_keys)[:, :group]
                            if not torch.equal(scores[:, block, : head + TAIL + 1], own):
                                return False
                            own = torch.matmul(at_least_rows(weights[:, block], least), values)[:, :group]
                            if not torch.equal(mixed[:, block], own):
                                return False
    finally:
        torch.set_num_threads(threads)
    return True
