"""Preallocated KV cache with host-side length and exactly three operations.

append: a forward writes n new entries at slots [length, length + n) (``write_layer`` per layer,
then ``append(n)``); commit: gather accepted tree slots into contiguous positions; rollback: set
the length. A rejected slot is never cleared, it is simply overwritten by the next append.
"""

from __future__ import annotations

import torch

from causaldraft.errors import CausalDraftError


class KVCache:
    """One K and one V buffer per layer (separate tensors, which torch.compile prefers).

    keys[layer], values[layer]: [kv_heads, max_len, head_dim]
    """

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        capacity: int | None = None,
    ) -> None:
        """``max_len`` entries may be committed; buffers hold ``capacity`` >= max_len slots (the
        compiled backend writes padding rows past the real ones)."""
        self.max_len = max_len
        self.length = 0
        size = max(capacity or max_len, max_len)
        self.keys = [torch.zeros(kv_heads, size, head_dim, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.zeros(kv_heads, size, head_dim, dtype=dtype) for _ in range(num_layers)]

    @staticmethod
    def over(keys: list[torch.Tensor], values: list[torch.Tensor], max_len: int) -> KVCache:
        """A cache over given buffers (views of a ``CachePool``'s rows): [kv_heads, capacity, head_dim]."""
        cache = KVCache.__new__(KVCache)
        cache.max_len, cache.length, cache.keys, cache.values = max_len, 0, keys, values
        return cache

    def check_room(self, new_tokens: int) -> None:
        if self.length + new_tokens > self.max_len:
            raise CausalDraftError(
                f"context overflow: {self.length} cached + {new_tokens} new tokens exceed the "
                f"context of {self.max_len} tokens"
            )

    def write_layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new entries at [length, length + n) and return views over [0, length + n).

        keys, values: [kv_heads, n, head_dim] -> returned views [kv_heads, length + n, head_dim]
        (the native backend writes the same slots with index_copy_ inside its forward)
        """
        end = self.length + keys.shape[1]
        self.keys[layer][:, self.length : end] = keys
        self.values[layer][:, self.length : end] = values
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def append(self, new_tokens: int) -> None:
        """Advance the length past entries written by ``write_layer`` for every layer."""
        self.check_room(new_tokens)
        self.length += new_tokens

    def commit(self, slots: list[int], start: int) -> None:
        """Gather cache slots into contiguous positions start, start+1, ... and set the length.

        Example: prefix length P=10, tree nodes written at slots 10..13, the accepted path is
        nodes [0, 1] -> commit([10, 11], 10) is a no-op gather and length becomes 12; accepted
        nodes [0, 2] -> commit([10, 12], 10) copies slot 12 into position 11, length 12.
        """
        if start > self.length or any(s < start or s >= self.length for s in slots):
            raise ValueError(f"commit slots {slots} outside [{start}, {self.length})")
        index = torch.tensor(slots, dtype=torch.long)
        end = start + len(slots)
        contiguous = slots == list(range(start, end))
        if not contiguous:
            for layer in range(len(self.keys)):
                self.keys[layer][:, start:end] = self.keys[layer].index_select(1, index)
                self.values[layer][:, start:end] = self.values[layer].index_select(1, index)
        self.length = end

    def rollback(self, length: int) -> None:
        if length < 0 or length > self.length:
            raise ValueError(f"cannot roll back to {length} from {self.length}")
        self.length = length


class CachePool:
    """The caches of up to ``size`` concurrent sequences in one tensor per layer, so one target
    pass can read and write all of them (``NativeLlama.forward_batch``).

    keys[layer], values[layer]: [size, kv_heads, capacity, head_dim]; ``caches[i]`` is sequence
    slot i's ``KVCache``, whose buffers are views of row i (so single-sequence passes, such as a
    prompt's prefill, write the same memory). A slot is taken for a sequence and released after it.
    """

    def __init__(
        self, size: int, num_layers: int, kv_heads: int, head_dim: int, max_len: int, capacity: int,
        dtype: torch.dtype,
    ) -> None:  # fmt: skip
        shape = (size, kv_heads, max(capacity, max_len), head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.caches = [
            KVCache.over([k[i] for k in self.keys], [v[i] for v in self.values], max_len) for i in range(size)
        ]
        self.free = list(range(size))

    @property
    def size(self) -> int:
        return len(self.caches)

    def take(self) -> int:
        """A free slot, its cache emptied; raises when every slot is taken."""
        if not self.free:
            raise CausalDraftError(f"all {self.size} sequence slots are taken")
        slot = self.free.pop(0)
        self.caches[slot].rollback(0)
        return slot

    def release(self, slot: int) -> None:
        if slot in self.free or not 0 <= slot < self.size:
            raise ValueError(f"slot {slot} is not taken")
        self.caches[slot].rollback(0)
        self.free.append(slot)
        self.free.sort()
