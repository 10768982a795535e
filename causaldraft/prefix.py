"""Prompt prefixes kept between requests (``PrefixStore``): the target's cache entries, and a drafter's
features, of every whole chunk of the prompts an engine reads, so a later prompt that starts with the
same tokens copies them instead of reading them again (a shared system prompt, or a chat whose history
comes back in every request).

Lossless by construction: a prompt is read in chunks of ``PROMPT_CHUNK`` rows whose bounds depend on
the prompt alone (``decode.PromptRead``), on all threads (``threads.ThreadPolicy.prompt``), and a
chunk's entries depend only on its tokens, its positions and the entries before it. So a whole chunk
that two prompts share, together with every token before it, is computed by the same operations on
the same values in both: the same bits, and copying it is reading it. Only whole chunks are kept:
a prompt's last chunk is partial (a pass of other rows, which may round differently), and the last
prompt token is always left to be read, since its pass gives the first step's hidden state.

Example (chunks of 256): prompt A of 700 tokens caches 699 rows in passes of 256, 256 and 187; its
chunks 0 and 1 are kept as they are read. Prompt B of 900 tokens whose first 600 are A's copies those
512 rows and reads 512..898 in passes of 256 and 131, what it would have read anyway; its chunk 2 is
kept after A's two, which both prompts share and the store holds once.

The kept chunks form a tree: a chunk is named by a digest chained over every chunk up to it
(``chunk_digests``), so two prompts that part after chunk j share chunks 0..j and keep their own
children of it. The store holds at most ``max_bytes`` and drops the least recently used chunk that no
other kept chunk continues. It belongs to one engine (one target, one prompt reader); the digests also
cover the drafter's feature layers and the thread count the prompt was read on, so chunks made under
other conditions are never used. Chunks are kept as soon as they are read, so a request that joins a
batch while another reads the same prefix copies what the other has read so far.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from causaldraft.cache import KVCache


@dataclass
class Chunk:
    """One kept chunk of ``rows`` positions. keys[layer], values[layer]: [kv_heads, rows, head_dim];
    features: [rows, F] or None."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    features: torch.Tensor | None
    parent: bytes | None  # the digest of the chunk before it (None: the prompt's first)
    children: int = 0  # kept chunks that continue it (a chunk is dropped only when it has none)

    @property
    def rows(self) -> int:
        return self.keys[0].shape[1]

    @property
    def nbytes(self) -> int:
        tensors = [*self.keys, *self.values, *([] if self.features is None else [self.features])]
        return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def chunk_digests(tokens: list[int], chunks: int, chunk: int, conditions: tuple[int, ...]) -> list[bytes]:
    """digests[j] names ``tokens[: (j + 1) * chunk]`` read under ``conditions``, for j = 0..chunks - 1:
    each digest hashes the one before it and its chunk's ids, so equal digests mean equal prefixes (up
    to blake2b collisions).

    Example: chunk 2, tokens [5, 6, 7, 8, 9], chunks 2 -> [h(c, [5, 6]), h(h(c, [5, 6]), [7, 8])]."""
    digest = hashlib.blake2b(repr(conditions).encode(), digest_size=16).digest()
    digests = []
    for index in range(chunks):
        ids = torch.tensor(tokens[index * chunk : (index + 1) * chunk], dtype=torch.int64)
        digest = hashlib.blake2b(digest + ids.numpy().tobytes(), digest_size=16).digest()
        digests.append(digest)
    return digests


class PrefixStore:
    """The engine's kept prompt chunks (see the module docstring), least recently used first out."""

    def __init__(self, max_bytes: int, chunk: int) -> None:
        if max_bytes < 0 or chunk < 1:
            raise ValueError(f"a prefix store needs max_bytes >= 0 and chunk >= 1, got {max_bytes}, {chunk}")
        self.max_bytes = max_bytes
        self.chunk = chunk
        self.chunks: OrderedDict[bytes, Chunk] = OrderedDict()  # by digest, least recently used first
        self.nbytes = 0

    def find(self, tokens: list[int], start: int, conditions: tuple[int, ...]) -> list[Chunk]:
        """The kept chunks ``start``, ``start + 1``, ... of ``tokens``, as far as they go, leaving at
        least the last token to be read (marked used)."""
        usable = (len(tokens) - 2) // self.chunk  # rows copied <= len(tokens) - 2: a row is left to read
        if usable <= start or not self.chunks:
            return []
        found = []
        for digest in chunk_digests(tokens, usable, self.chunk, conditions)[start:]:
            kept = self.chunks.get(digest)
            if kept is None:
                break
            self.chunks.move_to_end(digest)
            found.append(kept)
        return found

    def keep(
        self, tokens: list[int], index: int, cache: KVCache, features: torch.Tensor | None,
        conditions: tuple[int, ...],
    ) -> None:  # fmt: skip
        """Keep chunk ``index`` of a prompt just read into ``cache`` (its rows [index * chunk, (index + 1) *
        chunk)) with its features ([chunk, F] or None). Not kept: a chunk kept already, one whose parent
        is not kept (it could never be reached), one larger than the store."""
        digests = chunk_digests(tokens, index + 1, self.chunk, conditions)
        digest, parent = digests[index], digests[index - 1] if index else None
        if digest in self.chunks or (parent is not None and parent not in self.chunks):
            return
        begin, end = index * self.chunk, (index + 1) * self.chunk
        if cache.length < end:
            raise ValueError(f"chunk {index} is not cached yet ({cache.length} entries)")
        row_bytes = sum(buffer.shape[0] * buffer.shape[2] * buffer.element_size() for buffer in cache.keys)
        row_bytes += sum(buffer.shape[0] * buffer.shape[2] * buffer.element_size() for buffer in cache.values)
        if features is not None:
            row_bytes += features.shape[1] * features.element_size()
        if self.chunk * row_bytes > self.max_bytes:
            return
        while self.nbytes + self.chunk * row_bytes > self.max_bytes and self.drop_oldest_leaf(keep=parent):
            pass
        if self.nbytes + self.chunk * row_bytes > self.max_bytes:
            return
        kept = Chunk(
            tuple(keys[:, begin:end].clone() for keys in cache.keys),
            tuple(values[:, begin:end].clone() for values in cache.values),
            None if features is None else features.clone(),
            parent,
        )
        if parent is not None:
            self.chunks[parent].children += 1
        self.chunks[digest] = kept
        self.nbytes += kept.nbytes

    def drop_oldest_leaf(self, keep: bytes | None = None) -> bool:
        """Drop the least recently used chunk that no kept chunk continues (never ``keep``); False when
        there is none."""
        digest = next((name for name, kept in self.chunks.items() if not kept.children and name != keep), None)
        if digest is None:
            return False
        dropped = self.chunks.pop(digest)
        if dropped.parent is not None:
            self.chunks[dropped.parent].children -= 1
        self.nbytes -= dropped.nbytes
        return True

    def clear(self) -> None:
        """Forget every kept chunk (``engine.prefixes.clear()``)."""
        self.chunks.clear()
        self.nbytes = 0


def copy_chunks(chunks: list[Chunk], cache: KVCache) -> None:
    """Append the chunks' entries to ``cache`` at positions [length, length + rows), as prompt passes
    would have written them."""
    for kept in chunks:
        for layer, (keys, values) in enumerate(zip(kept.keys, kept.values, strict=True)):
            cache.write_layer(layer, keys, values)
        cache.append(kept.rows)
