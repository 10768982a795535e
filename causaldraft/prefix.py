"""Prompt prefixes kept between requests (``PrefixStore``): the target's cache entries, and a drafter's
features, of a prompt's first whole chunks, so a later prompt that starts with the same tokens copies
them instead of reading them again (a shared system prompt, or a chat whose history grows turn by turn).

Lossless by construction: a prompt is read in chunks of ``PROMPT_CHUNK`` rows whose bounds depend on
the prompt alone (``decode.PromptRead``), on all threads (``threads.ThreadPolicy.prompt``), and a
chunk's entries depend only on its tokens, its positions and the entries before it. So a whole chunk
that two prompts share, together with every token before it, is computed by the same operations on
the same values in both: the same bits, and copying it is reading it. Only whole chunks are kept:
a prompt's last chunk is partial (a pass of other rows, which may round differently), and the last
prompt token is always left to be read, since its pass gives the first step's hidden state.

Example (chunks of 256): prompt A of 700 tokens caches 699 rows in passes of 256, 256 and 187; its
first 512 rows (two whole chunks) are kept. Prompt B of 900 tokens whose first 600 are A's copies
those 512 rows and reads 512..898 in passes of 256 and 131, what it would have read anyway; B's first
768 rows are kept in turn, and replace A's entry (B's serves every prompt A's would).

Entries are found by a chained digest of their chunks (``chunk_digests``), and a kept prefix of k
chunks serves any prompt sharing its first j <= k. The store holds at most ``max_bytes`` (entries,
features included) and drops the least recently used first. It belongs to one engine: one target, one
prompt reader; the digest also covers the drafter's feature layers and the thread count the prompt
was read on, so entries made under other conditions are never used.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from causaldraft.cache import KVCache


@dataclass(frozen=True)
class Prefix:
    """A kept prompt prefix of ``rows`` positions (a whole number of chunks).

    keys[layer], values[layer]: [kv_heads, rows, head_dim]; features: [rows, F] or None."""

    rows: int
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    features: torch.Tensor | None
    digests: tuple[bytes, ...]  # one per chunk boundary: digests[j - 1] names the first j chunks

    @property
    def nbytes(self) -> int:
        tensors = [*self.keys, *self.values, *([] if self.features is None else [self.features])]
        return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


@dataclass(frozen=True)
class PrefixHit:
    prefix: Prefix
    rows: int  # rows to copy: the first ``rows`` of the prefix (a whole number of chunks)


def chunk_digests(tokens: list[int], chunks: int, chunk: int, conditions: tuple[int, ...]) -> list[bytes]:
    """digests[j - 1] names ``tokens[: j * chunk]`` read under ``conditions``, for j = 1..chunks: each
    digest hashes the one before it and its chunk's ids, so equal digests mean equal prefixes (up to
    blake2b collisions).

    Example: chunk 2, tokens [5, 6, 7, 8, 9], chunks 2 -> [h(c, [5, 6]), h(h(c, [5, 6]), [7, 8])]."""
    digest = hashlib.blake2b(repr(conditions).encode(), digest_size=16).digest()
    digests = []
    for index in range(chunks):
        ids = torch.tensor(tokens[index * chunk : (index + 1) * chunk], dtype=torch.int64)
        digest = hashlib.blake2b(digest + ids.numpy().tobytes(), digest_size=16).digest()
        digests.append(digest)
    return digests


class PrefixStore:
    """The engine's kept prompt prefixes (see the module docstring), least recently used first out."""

    def __init__(self, max_bytes: int, chunk: int) -> None:
        if max_bytes < 0 or chunk < 1:
            raise ValueError(f"a prefix store needs max_bytes >= 0 and chunk >= 1, got {max_bytes}, {chunk}")
        self.max_bytes = max_bytes
        self.chunk = chunk
        self.entries: OrderedDict[bytes, Prefix] = OrderedDict()  # by the digest of all their chunks; LRU order
        self.by_digest: dict[bytes, Prefix] = {}  # every chunk boundary's digest -> the entry holding it
        self.nbytes = 0

    def find(self, tokens: list[int], conditions: tuple[int, ...]) -> PrefixHit | None:
        """The longest kept prefix of ``tokens`` that leaves at least the last token to be read."""
        usable = (len(tokens) - 2) // self.chunk  # rows copied <= len(tokens) - 2: a row is left to read
        if usable < 1 or not self.entries:
            return None
        digests = chunk_digests(tokens, usable, self.chunk, conditions)
        for chunks in range(usable, 0, -1):
            prefix = self.by_digest.get(digests[chunks - 1])
            if prefix is not None:
                self.entries.move_to_end(prefix.digests[-1])
                return PrefixHit(prefix, chunks * self.chunk)
        return None

    def keep(
        self, tokens: list[int], cache: KVCache, features: torch.Tensor | None, conditions: tuple[int, ...]
    ) -> None:
        """Keep the whole chunks of a prompt just read into ``cache`` (rows [0, cache.length)) with its
        features ([cache.length, F] or None). An entry it extends is replaced; one too large for the
        store is not kept."""
        chunks = cache.length // self.chunk
        if chunks < 1 or self.max_bytes == 0:
            return
        digests = chunk_digests(tokens, chunks, self.chunk, conditions)
        if digests[-1] in self.by_digest:
            self.entries.move_to_end(self.by_digest[digests[-1]].digests[-1])
            return
        rows = chunks * self.chunk
        row_bytes = sum(buffer.shape[0] * buffer.shape[2] * buffer.element_size() for buffer in cache.keys)
        row_bytes += sum(buffer.shape[0] * buffer.shape[2] * buffer.element_size() for buffer in cache.values)
        if features is not None:
            row_bytes += features.shape[1] * features.element_size()
        if rows * row_bytes > self.max_bytes:  # larger than the whole store: not copied at all
            return
        prefix = Prefix(
            rows,
            tuple(keys[:, :rows].clone() for keys in cache.keys),
            tuple(values[:, :rows].clone() for values in cache.values),
            None if features is None else features[:rows].clone(),
            tuple(digests),
        )
        for digest in digests:  # entries this one extends: it serves all their prompts
            older = self.by_digest.get(digest)
            if older is not None and older.digests == tuple(digests[: len(older.digests)]):
                self.drop(older)
        while self.entries and self.nbytes + prefix.nbytes > self.max_bytes:
            self.drop(next(iter(self.entries.values())))
        self.entries[digests[-1]] = prefix
        for digest in digests:
            self.by_digest[digest] = prefix
        self.nbytes += prefix.nbytes

    def clear(self) -> None:
        """Forget every kept prefix (``engine.prefixes.clear()``)."""
        self.entries.clear()
        self.by_digest.clear()
        self.nbytes = 0

    def drop(self, prefix: Prefix) -> None:
        """Forget an entry; a chunk boundary it shares with another entry (two prompts that part after
        it) is then found through that one."""
        del self.entries[prefix.digests[-1]]
        for digest in prefix.digests:
            if self.by_digest.get(digest) is prefix:
                holder = next((entry for entry in self.entries.values() if digest in entry.digests), None)
                if holder is None:
                    del self.by_digest[digest]
                else:
                    self.by_digest[digest] = holder
        self.nbytes -= prefix.nbytes


def copy_prefix(hit: PrefixHit, cache: KVCache) -> None:
    """Write the hit's rows into an empty ``cache`` at positions [0, rows), as a prompt pass would."""
    if cache.length:
        raise ValueError(f"a prefix is copied into an empty cache, this one holds {cache.length} entries")
    for layer, (keys, values) in enumerate(zip(hit.prefix.keys, hit.prefix.values, strict=True)):
        cache.write_layer(layer, keys[:, : hit.rows], values[:, : hit.rows])
    cache.append(hit.rows)
