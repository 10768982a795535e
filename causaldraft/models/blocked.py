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

Several sequences (continuous batching) share one pass: every tensor gets a leading sequence
dimension, each sequence reads and writes its own cache row, and its rows attend to its own keys
only. Their heads differ in length, so the pass uses the longest, T, and a sequence with a shorter
head T_s sees head columns [0, T_s) and not [T_s, T): the masked columns add exact zeros at the end
of the head's sum and of the head's product, which leaves every lane's partial sums as they are
(measured: bit-identical to the sequence's own pass, eager and compiled, bf16, int8 and int4). Its
tail slots are absolute (T_s + offset), so its tail is read where its own cache holds it.

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

from causaldraft.models import attention_kernel
from causaldraft.models.products import at_least_rows, product_dtype, product_rows

KEY_BLOCK = 64  # positions per key block; a multiple of every vector width the reductions use


@dataclass(frozen=True)
class BlockedKeys:
    """The key layout of one pass over S sequences of n rows each (S = 1 for a single sequence).

    seen: [S, n, T + KEY_BLOCK] bool, by position: which of positions [0, T + KEY_BLOCK) each row
    sees. T, the head width, is the largest of the sequences' own heads (its width carries T into
    compiled graphs); a sequence with a shorter head sees its own head columns and not the rest
    (masked columns add exact zeros at the end of the head's sum and product: docs/exactness.md).
    tail_slots: [S, n, KEY_BLOCK] long, the cache slot holding each tail position on the row's path
    (the sequence's own head slot where unseen).
    """

    seen: torch.Tensor
    tail_slots: torch.Tensor

    @property
    def head(self) -> int:
        return self.seen.shape[-1] - KEY_BLOCK

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.seen, self.tail_slots


@dataclass(frozen=True)
class SequenceKeys:
    """One sequence's layout on the host, before sequences are stacked: its own head ``head``,
    ``tail_seen`` [rows, KEY_BLOCK] bool by tail position, ``tail_slots`` [rows, KEY_BLOCK] absolute;
    the first ``real`` rows are the pass's, the rest padding (they see tail position 0 alone, not
    the head: their output is discarded, and the attention kernel then spends nothing on them)."""

    head: int
    tail_seen: np.ndarray
    tail_slots: np.ndarray
    real: int

    @staticmethod
    def padding(rows: int) -> SequenceKeys:
        """A sequence slot with nothing to compute: each row sees slot 0 only (no empty softmax)."""
        seen = np.zeros((rows, KEY_BLOCK), dtype=bool)
        seen[:, 0] = True
        return SequenceKeys(0, seen, np.zeros((rows, KEY_BLOCK), dtype=np.int64), 0)


def head_length(length: int) -> int:
    """T: the positions in whole key blocks before the block holding position ``length``."""
    return length // KEY_BLOCK * KEY_BLOCK


def pass_room(length: int) -> int:
    """How many positions (length, length + 1, ...) a pass over a cache of ``length`` committed
    entries may reach and stay row-invariant: up to the end of the block."""
    return KEY_BLOCK - length % KEY_BLOCK


def sequence_keys(mask: torch.Tensor, positions: torch.Tensor, length: int, rows: int) -> SequenceKeys | None:
    """One sequence's layout for a pass over ``length`` committed slots, or None when it has none
    (a row sees a gap in the committed prefix, or reaches past the block: a long prefill).

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
    tail_slots = np.full((rows, KEY_BLOCK), head, dtype=np.int64)
    row_index, slot_index = tail.nonzero()  # row-major: each row's slots in order
    tail_slots[row_index, tail.cumsum(axis=1)[row_index, slot_index] - 1] = head + slot_index
    tail_seen = np.arange(KEY_BLOCK)[None, :] < counts[:, None]
    return SequenceKeys(head, tail_seen, tail_slots, n)


def stack_keys(sequences: list[SequenceKeys]) -> BlockedKeys:
    """The layout of one pass over these sequences (equal row counts), heads padded to the longest."""
    head = max(sequence.head for sequence in sequences)
    rows = sequences[0].tail_seen.shape[0]
    seen = np.zeros((len(sequences), rows, head + KEY_BLOCK), dtype=bool)
    for index, sequence in enumerate(sequences):
        seen[index, : sequence.real, : sequence.head] = True
        seen[index, :, head:] = sequence.tail_seen
    tail_slots = np.stack([sequence.tail_slots for sequence in sequences])
    return BlockedKeys(torch.from_numpy(seen), torch.from_numpy(tail_slots))


def blocked_keys(mask: torch.Tensor, positions: torch.Tensor, length: int, rows: int) -> BlockedKeys | None:
    """The layout of a one-sequence pass (``sequence_keys``, stacked), or None when it has none."""
    keys = sequence_keys(mask, positions, length, rows)
    return None if keys is None else stack_keys([keys])


def attend_blocked(
    q: torch.Tensor,  # [S, nh, n, hd]
    keys: torch.Tensor,  # [S, kvh, capacity, hd] (capacity >= T + KEY_BLOCK + n)
    values: torch.Tensor,  # [S, kvh, capacity, hd]
    layout: BlockedKeys,
) -> torch.Tensor:
    """Grouped-query attention of n rows per sequence in the blocked layout: [S, nh, n, hd]
    (scores fp32). Sequences never see each other's keys. Attention over an fp32 or bf16 cache runs in
    ``attention_kernel`` where it is built (each row's arithmetic the same for any row count: fp32, or AMX tiles
    for bf16 caches of head size 64); the rest of this function is the torch ops' version."""
    if attention_kernel.takes(keys):
        return attention_kernel.attend(q, keys, values, *layout.tensors()).to(q.dtype)
    sequences, heads, n, hd = q.shape
    kv_heads, capacity = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    head = layout.head
    width = KEY_BLOCK + n  # slots [0, T + width) hold every head and tail position of every row
    # bf16 products run in fp32 where bf16 is not native (the cache is then fp32: NativeLlama.cache_dtype),
    # each result rounded back to the model's dtype as a bf16 product rounds
    work = product_dtype(keys.dtype)
    least = product_rows(work)
    grouped = at_least_rows(q.reshape(sequences, kv_heads, group * n, hd).to(work), least)  # [S, kvh, >= g*n, hd]
    # bf16 cache slices are copied to dense tensors first: the batched product copies a strided
    # operand itself, at twice the cost (measured: a third of a 1-row int4 pass's attention time)
    head_keys = dense(keys[:, :, : head + width], work).transpose(2, 3)
    by_slot = torch.matmul(grouped, head_keys)[:, :, : group * n].to(q.dtype)
    by_slot = by_slot.float().view(sequences, kv_heads, group, n, head + width)  # over slots [0, T + W)
    seen = layout.seen.view(sequences, 1, 1, n, head + KEY_BLOCK)
    to_slot = layout.tail_slots.view(sequences, 1, 1, n, KEY_BLOCK).expand(sequences, kv_heads, group, n, KEY_BLOCK)
    scale = hd**-0.5
    head_scores = (by_slot[..., :head] * scale).masked_fill(~seen[..., :head], float("-inf"))  # [S, kvh, g, n, T]
    tail_scores = by_slot.gather(4, to_slot) * scale  # [S, kvh, g, n, B] by position
    tail_scores = tail_scores.masked_fill(~seen[..., head:], float("-inf"))
    top = torch.cat((head_scores, tail_scores), dim=-1).amax(dim=-1, keepdim=True)  # [S, kvh, g, n, 1]
    head_exp, tail_exp = (head_scores - top).exp(), (tail_scores - top).exp()
    total = head_exp.sum(dim=-1, keepdim=True) + tail_exp.sum(dim=-1, keepdim=True)
    # tail values gathered in position order from a flat view: [S, kvh, n, B, hd]
    base = (torch.arange(sequences * kv_heads) * capacity).view(sequences, kv_heads, 1, 1)
    flat = (base + layout.tail_slots.view(sequences, 1, n, KEY_BLOCK)).reshape(-1)
    tail_values = values.reshape(-1, hd).index_select(0, flat).view(sequences, kv_heads, n, KEY_BLOCK, hd)
    tail_weights = (tail_exp / total).transpose(2, 3)  # [S, kvh, n, g, B] fp32
    # one [g, B] x [B, hd] product per row, in fp32: every call has the same matrix shape whatever
    # n (only the batch count grows), and fp32's small products cost a third of bf16's per call
    tail_out = torch.matmul(at_least_rows(tail_weights, 2), tail_values.float())[:, :, :, :group].transpose(2, 3)
    head_weights = (head_exp / total).to(q.dtype).reshape(sequences, kv_heads, group * n, head)
    head_values = dense(values[:, :, :head], work)
    head_out = torch.matmul(at_least_rows(head_weights.to(work), least), head_values)[:, :, : group * n]
    head_out = head_out.to(q.dtype)
    out = tail_out + head_out.view(sequences, kv_heads, group, n, hd).float()  # [S, kvh, g, n, hd]
    return out.to(q.dtype).reshape(sequences, heads, n, hd)


def dense(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype`` as a product's operand: a slice of an fp32 cache as it is (fp32 batched
    products read the strided slice at two thirds of the cost of a copy and its product, same
    bits: measured), anything else as a contiguous copy (a bf16 product copies a strided operand
    itself, at twice the cost)."""
    return x if x.dtype == dtype == torch.float32 else x.to(dtype).contiguous()
