"""Row-invariant attention: each row of a pass computes exactly what a one-row pass at its position
would, whatever the other rows, the tree mask or the padding (docs/exactness.md).

Keys are split by absolute position into a **head**, the whole blocks of ``KEY_BLOCK`` positions
before the block of the pass's first position (always committed, at slot == position, seen by
every row), and a **tail**, the rest of that block. A pass may only reach positions inside that
one block (``pass_room``), so a row's split point depends on its own position alone, not on the
pass. Then, for every row:

- scores: one matmul over the head and tail slots (a product over ``head_dim``, the same for any
  number of rows), the tail's then read in position order (``tail_slots``);
- softmax over [head scores, tail scores by position]: the row sees exactly the layout a one-row
  pass at its position sees (T head columns, then ``KEY_BLOCK`` tail columns, the unseen ones
  masked at the end), so the vectorised reductions add the same numbers in the same lanes. It is
  written in parts (one max over both, then the head's and the tail's exponentials and sums
  separately): the gather stays out of the big head kernel, which graphs then vectorise (a
  16-row bf16 pass: that kernel 146 -> 70 us per layer, measured);
- output: the head's weights times the head's values (one matmul, as above), plus the tail's
  weights times the tail's values gathered in position order (one small product per row over
  ``KEY_BLOCK`` positions, unseen ones adding exact zeros at the end), so a tree's siblings change
  nothing.

Worked example (KEY_BLOCK = 4 for brevity): committed length L = 6, so T = 4 and the tail block is
positions 4..7. Tree nodes at slots 6, 7, 8: root (position 6), two children (position 7). Row 2
(the second child) sees slots 4, 5, 6 and 8: ``seen`` = [1, 1, 1, 1 | 1, 1, 1, 1] (head | tail
positions) and ``tail_slots`` = [0, 1, 2, 4] (slot - T of each tail position). A one-row pass at
position 7, after that child is committed at slot 7, sees ``seen`` the same and ``tail_slots`` =
[0, 1, 2, 3]: the same keys in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

KEY_BLOCK = 64  # positions per key block; a multiple of every vector width the reductions use


@dataclass(frozen=True)
class BlockedKeys:
    """The key layout of one pass of n rows.

    seen: [n, T + KEY_BLOCK] bool, by position: which of positions [0, T + KEY_BLOCK) each row
    sees (the head all; its width carries T into compiled graphs). tail_slots: [n, KEY_BLOCK]
    long, the cache slot (minus T) holding each tail position on the row's path (0 where unseen).
    """

    seen: torch.Tensor
    tail_slots: torch.Tensor

    @property
    def head(self) -> int:
        return self.seen.shape[1] - KEY_BLOCK

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.seen, self.tail_slots


def head_length(length: int) -> int:
    """T: the positions in whole key blocks before the block holding position ``length``."""
    return length // KEY_BLOCK * KEY_BLOCK


def pass_room(length: int) -> int:
    """How many positions (length, length + 1, ...) a pass over a cache of ``length`` committed
    entries may reach and stay row-invariant: up to the end of the block."""
    return KEY_BLOCK - length % KEY_BLOCK


def blocked_keys(mask: torch.Tensor, positions: torch.Tensor, length: int, rows: int) -> BlockedKeys | None:
    """The layout of a pass over ``length`` committed slots, or None when it has none (a row sees
    a gap in the committed prefix, or reaches past the block: a long prefill).

    mask: [n, length + n] bool (the backend's mask), positions: [n] long; ``rows`` >= n pads the
    pass to that many rows (padding rows see tail position 0 only; their output is discarded).
    A row's visible tail slots, in slot order, are its positions T, T + 1, ... in order
    (ancestors precede descendants), which the count check confirms.
    """
    n, span = mask.shape
    head = head_length(length)
    visible = mask.numpy()  # host arrays: a pass's layout costs a few numpy calls, not torch kernels
    if span != length + n or not visible[:, :length].all():
        return None
    tail = np.zeros((rows, KEY_BLOCK + rows), dtype=bool)  # [rows, slots T..]
    tail[:n, : span - head] = visible[:, head:]
    tail[n:, 0] = True
    counts = tail.sum(axis=1)  # [rows] positions each row sees in the tail
    expected = np.ones(rows, dtype=np.int64)
    expected[:n] = positions.numpy() - head + 1
    if (counts > KEY_BLOCK).any() or not np.array_equal(counts, expected):
        return None
    tail_slots = np.zeros((rows, KEY_BLOCK), dtype=np.int64)
    row_index, slot_index = tail.nonzero()  # row-major: each row's slots in order
    tail_slots[row_index, tail.cumsum(axis=1)[row_index, slot_index] - 1] = slot_index
    seen = np.ones((rows, head + KEY_BLOCK), dtype=bool)
    seen[:, head:] = np.arange(KEY_BLOCK)[None, :] < counts[:, None]
    return BlockedKeys(torch.from_numpy(seen), torch.from_numpy(tail_slots))


def attend_blocked(
    q: torch.Tensor,  # [nh, n, hd]
    keys: torch.Tensor,  # [kvh, capacity, hd] (capacity >= T + KEY_BLOCK + n)
    values: torch.Tensor,  # [kvh, capacity, hd]
    layout: BlockedKeys,
) -> torch.Tensor:
    """Grouped-query attention of n rows in the blocked layout: [nh, n, hd] (scores fp32)."""
    heads, n, hd = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    head = layout.head
    width = KEY_BLOCK + n  # tail slots [T, T + width) hold every tail position of every row
    grouped = at_least_two_rows(q.reshape(kv_heads, group * n, hd))  # [kvh, max(2, g*n), hd]
    # the cache slices are copied to dense tensors first: the batched product copies a strided
    # operand itself, at twice the cost (measured: a third of a 1-row int4 pass's attention time)
    by_slot = torch.matmul(grouped, keys[:, : head + width].contiguous().transpose(1, 2))[:, : group * n].float()
    by_slot = by_slot.view(kv_heads, group, n, head + width)  # [kvh, g, n, T + W] over slots [0, T + W)
    to_slot = layout.tail_slots.view(1, 1, n, KEY_BLOCK).expand(kv_heads, group, n, KEY_BLOCK)
    scale = hd**-0.5
    head_scores = by_slot[..., :head] * scale  # [kvh, g, n, T]
    tail_scores = by_slot[..., head:].gather(3, to_slot) * scale  # [kvh, g, n, B] by position
    tail_scores = tail_scores.masked_fill(~layout.seen[:, head:], float("-inf"))
    top = torch.cat((head_scores, tail_scores), dim=-1).amax(dim=-1, keepdim=True)  # [kvh, g, n, 1]
    head_exp, tail_exp = (head_scores - top).exp(), (tail_scores - top).exp()
    total = head_exp.sum(dim=-1, keepdim=True) + tail_exp.sum(dim=-1, keepdim=True)
    tail_values = values[:, head + layout.tail_slots]  # [kvh, n, B, hd] by position
    tail_weights = at_least_two_rows((tail_exp / total).transpose(1, 2).to(values.dtype))  # [kvh, n, max(2, g), B]
    tail_out = torch.matmul(tail_weights, tail_values)[:, :, :group].transpose(1, 2)  # [kvh, g, n, hd]
    head_weights = at_least_two_rows((head_exp / total).to(values.dtype).reshape(kv_heads, group * n, head))
    head_out = torch.matmul(head_weights, values[:, :head].contiguous())[:, : group * n]  # [kvh, g*n, hd]
    out = tail_out.float() + head_out.view(kv_heads, group, n, hd).float()
    return out.to(q.dtype).reshape(heads, n, hd)


def at_least_two_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., m, k] with m >= 2: a product's one-row kernel rounds differently from the kernels of
    two or more rows (measured, bf16 and fp32), so one row is computed as two."""
    return x if x.shape[-2] >= 2 else torch.cat((x, x), dim=-2)
