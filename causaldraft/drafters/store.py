"""An n-gram store of a model's own answers: prompt lookup's second source of continuations.

Prompt lookup finds continuations in the text so far. Many of a model's phrases recur across its
answers ("Here are some", "I hope this helps"), and an answer's first tokens have no earlier text
to match at all. The store keeps, for every 2- to 6-gram of a corpus of the target's own greedy
answers (self-distilled, like the draft heads' training data), the token that most often followed
it, how often, and out of how many. A continuation walks it: the longest n-gram of the text so far
that the store saw at least ``MIN_COUNT`` times proposes its commonest follower, which extends the
text, until the product of the followers' shares drops below ``MIN_SHARE`` (the idea of REST and
SuffixDecoding, with the model's own answers as the store). Drafts never change what the target
emits, so a poor store costs speed, never output.

Worked example, corpus "a b c d", "a b c e", "a b c d" (``MIN_COUNT`` 2): the 3-gram "a b c" was
followed by d twice of 3 times, so after "x a b c" the store proposes d (share 2/3); "b c d" was
seen twice, never followed, so the walk stops: continuation (d,), match size 3.

On disk a store is the corpus itself (``store.safetensors``: token ids and sequence starts) and
``store_config.json`` (the base model's fingerprint, sizes, how it was built), so the format does not
depend on the index. The index is built the first time a corpus loads (~0.5-1 s for 450k tokens) and kept
under ``$CAUSALDRAFT_HOME/store-index``, keyed by the corpus, the n-gram sizes and this module's code
(``cached_index``): later loads read it in milliseconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.numpy import load_file as load_arrays
from safetensors.numpy import save_file as save_arrays
from safetensors.torch import load_file, save_file

from causaldraft.errors import CausalDraftError
from causaldraft.models.identity import OLD_FINGERPRINTS
from causaldraft.paths import causaldraft_home

STORE_FILE = "store.safetensors"
CONFIG_FILE = "store_config.json"
INDEX_DIR = "store-index"  # under causaldraft_home(): built indexes (cached_index)
MIN_NGRAM, MAX_NGRAM = 2, 6
MIN_COUNT = 2  # an n-gram seen fewer times proposes nothing
MIN_SHARE = 0.3  # a continuation stops where the product of its followers' shares falls below this
SURE_SHARE = 0.6  # a proposal whose first follower has at least this share is a "sure" match kind
REPEAT_PREFIX = 32  # answers that begin with the same this many tokens are one answer twice (add_answers)
HASH_MULTIPLIER = 0x9E3779B97F4A7C15  # odd 64-bit constant of the polynomial n-gram hash
MASK = (1 << 64) - 1


@dataclass(frozen=True)
class StoreConfig:
    fingerprint: str  # LoadedModel.base_fingerprint of the model whose answers fill the store
    vocab_size: int
    tokens: int  # corpus size, response tokens
    sequences: int
    min_ngram: int = MIN_NGRAM
    max_ngram: int = MAX_NGRAM
    record: dict[str, object] = field(default_factory=dict)  # how it was built (command, data)

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram or self.vocab_size < 1:
            raise CausalDraftError(f"invalid n-gram store sizes: {self}")


@dataclass(frozen=True)
class StoreGuess:
    token: int
    size: int  # tokens of the n-gram that proposed it
    share: float  # of that n-gram's occurrences, the fraction this token followed


def ngram_hash(tokens: Sequence[int]) -> int:
    """Hash of an n-gram read from its last token backwards: h = (...((t[-1]+1)*M + t[-2]+1)*M ...)
    mod 2**64, so the hashes of the suffixes of growing size come one multiply-add apart."""
    value = 0
    for token in reversed(tokens):
        value = (value * HASH_MULTIPLIER + token + 1) & MASK
    return value


class NgramStore:
    """The index: sorted n-gram hashes (all sizes together), each with its commonest follower, that
    follower's count and the n-gram's count. A hash collision can only cost a wrong guess."""

    def __init__(self, config: StoreConfig, tokens: np.ndarray, starts: np.ndarray, cache: bool = False) -> None:
        """The index of ``tokens`` (sequences at ``starts``); with ``cache``, read from and kept in the
        index cache (``cached_index``) rather than built each time."""
        self.config = config
        index = cached_index if cache else build_index
        self.keys, self.followers, self.shares = index(tokens, starts, config.min_ngram, config.max_ngram)

    def __len__(self) -> int:
        return len(self.keys)

    def guess(self, context: Sequence[int]) -> StoreGuess | None:
        """The follower of the longest n-gram ending ``context`` that the store saw ``MIN_COUNT`` times."""
        sizes = range(self.config.min_ngram, min(self.config.max_ngram, len(context)) + 1)
        if not sizes or not len(self.keys):
            return None
        wanted, value = [], 0
        for size in range(1, sizes[-1] + 1):
            value = (value * HASH_MULTIPLIER + context[-size] + 1) & MASK
            if size >= sizes[0]:
                wanted.append(value)
        hashes = np.array(wanted, dtype=np.uint64)  # [sizes], shortest first
        found = np.minimum(np.searchsorted(self.keys, hashes), len(self.keys) - 1)
        hits = np.flatnonzero(self.keys[found] == hashes)
        if not len(hits):
            return None
        longest = int(hits[-1])
        row = int(found[longest])
        return StoreGuess(int(self.followers[row]), sizes[0] + longest, float(self.shares[row]))

    def continuation(self, context: Sequence[int], depth: int) -> tuple[tuple[int, ...], StoreGuess] | None:
        """Up to ``depth`` tokens walked from ``context``, and the first token's guess."""
        history = list(context[-self.config.max_ngram :])
        tokens: list[int] = []
        first: StoreGuess | None = None
        chance = 1.0
        while len(tokens) < depth:
            guess = self.guess(history)
            if guess is None or chance * guess.share < MIN_SHARE:
                break
            chance *= guess.share
            first = first or guess
            tokens.append(guess.token)
            history = [*history[1:], guess.token] if len(history) >= self.config.max_ngram else [*history, guess.token]
        return (tuple(tokens), first) if first is not None else None


def build_index(
    tokens: np.ndarray, starts: np.ndarray, min_ngram: int, max_ngram: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sorted hashes [K] uint64, commonest follower [K] int32, its share [K] float32) over every
    n-gram of ``min_ngram..max_ngram`` tokens inside one sequence that is followed by a token of
    it and was seen at least ``MIN_COUNT`` times.

    ``tokens`` [N] holds the sequences back to back; ``starts`` [S + 1] their offsets, ending with N.
    E.g. starts (0, 4, 7): sequences tokens[0:4] and tokens[4:7]; the follower at index 5 has one
    earlier token in its sequence, so no 2-gram precedes it.
    """
    lengths = np.diff(starts)  # [S]
    offset = np.arange(len(tokens)) - np.repeat(starts[:-1], lengths)  # [N] index within its sequence
    values = tokens.astype(np.uint64) + np.uint64(1)
    multiplier = np.uint64(HASH_MULTIPLIER)
    hashes, followers = [], []
    rolling = np.zeros(len(tokens), dtype=np.uint64)  # rolling[i]: hash of the size-n gram ending at i - 1
    with np.errstate(over="ignore"):
        for size in range(1, max_ngram + 1):
            rolling[size:] = rolling[size:] * multiplier + values[: max(0, len(tokens) - size)]
            if size >= min_ngram:
                valid = np.flatnonzero(offset >= size)
                hashes.append(rolling[valid])
                followers.append(tokens[valid])
    if not hashes or not sum(len(h) for h in hashes):
        empty = np.zeros(0, dtype=np.uint64)
        return empty, np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.float32)
    return commonest(np.concatenate(hashes), np.concatenate(followers).astype(np.int32))


def commonest(hashes: np.ndarray, followers: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per distinct hash (sorted): its commonest follower and that follower's share, keeping hashes
    seen at least ``MIN_COUNT`` times. Ties go to the smaller token id."""
    order = np.lexsort((followers, hashes))
    hashes, followers = hashes[order], followers[order]
    new_pair = np.ones(len(hashes), dtype=bool)
    new_pair[1:] = (hashes[1:] != hashes[:-1]) | (followers[1:] != followers[:-1])
    pair_starts = np.flatnonzero(new_pair)
    pair_counts = np.diff(np.append(pair_starts, len(hashes)))
    pair_hashes, pair_followers = hashes[pair_starts], followers[pair_starts]
    best_first = np.lexsort((-pair_counts, pair_hashes))  # per hash, the largest count first
    pair_hashes, pair_followers = pair_hashes[best_first], pair_followers[best_first]
    pair_counts = pair_counts[best_first]
    new_key = np.ones(len(pair_hashes), dtype=bool)
    new_key[1:] = pair_hashes[1:] != pair_hashes[:-1]
    key_starts = np.flatnonzero(new_key)
    totals = np.add.reduceat(pair_counts, key_starts)
    keep = totals >= MIN_COUNT
    rows = key_starts[keep]
    return (
        pair_hashes[rows],
        pair_followers[rows].astype(np.int32),
        (pair_counts[rows] / totals[keep]).astype(np.float32),
    )


def index_path(tokens: np.ndarray, starts: np.ndarray, min_ngram: int, max_ngram: int) -> Path:
    """Where ``cached_index`` keeps the index of this corpus: named by a digest of the corpus, the n-gram
    sizes, ``MIN_COUNT`` and this module's source (a change to how the index is built is a new name)."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(f"{min_ngram}:{max_ngram}:{MIN_COUNT}:{len(tokens)}:{len(starts)}:".encode())
    digest.update(np.ascontiguousarray(tokens, dtype="<i4").tobytes())
    digest.update(np.ascontiguousarray(starts, dtype="<i8").tobytes())
    return causaldraft_home() / INDEX_DIR / f"{digest.hexdigest()[:24]}.safetensors"


def cached_index(
    tokens: np.ndarray, starts: np.ndarray, min_ngram: int, max_ngram: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``build_index``'s result, read from the index cache when this corpus was indexed before; built and
    written there (atomically) otherwise. An unreadable or malformed cached file is rebuilt; a cache that
    cannot be written only costs the next load the build."""
    path = index_path(tokens, starts, min_ngram, max_ngram)
    try:
        arrays = load_arrays(str(path))
        keys, followers, shares = arrays["keys"], arrays["followers"], arrays["shares"]
        if (
            keys.dtype == np.uint64
            and followers.dtype == np.int32
            and shares.dtype == np.float32
            and keys.ndim == followers.ndim == shares.ndim == 1
            and len(keys) == len(followers) == len(shares)
            and bool(np.all(keys[1:] > keys[:-1]))
        ):
            return keys, followers, shares
    except (OSError, SafetensorError, KeyError):
        pass
    keys, followers, shares = build_index(tokens, starts, min_ngram, max_ngram)
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_arrays({"keys": keys, "followers": followers, "shares": shares}, str(partial))
        os.replace(partial, path)
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
    return keys, followers, shares


def default_store_dir() -> Path:
    """The store shipped for the default model."""
    return Path(__file__).resolve().parent.parent / "heads" / "default" / "store"


def corpus_arrays(sequences: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """The sequences back to back, tokens [N] int32, and their starts [S + 1] int64 (ending with N)."""
    tokens = np.array([token for sequence in sequences for token in sequence], dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum([len(sequence) for sequence in sequences], dtype=np.int64)])
    return tokens, starts.astype(np.int64)


def save_store(directory: Path, sequences: Sequence[Sequence[int]], config: StoreConfig) -> NgramStore:
    """Write the store's files; returns the store they load as."""
    directory.mkdir(parents=True, exist_ok=True)
    tokens, starts = corpus_arrays(sequences)
    save_file({"tokens": torch.from_numpy(tokens), "starts": torch.from_numpy(starts)}, str(directory / STORE_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps(asdict(config), indent=2) + "\n")
    return NgramStore(config, tokens, starts)


def read_store_config(directory: Path) -> StoreConfig:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise CausalDraftError(f"no n-gram store in {directory}: {CONFIG_FILE} is missing (causaldraft build-store)")
    try:
        return StoreConfig(**json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError) as error:
        raise CausalDraftError(f"{path} is not an n-gram store config: {error}") from None


def load_corpus(directory: Path, fingerprint: str, vocab_size: int) -> tuple[StoreConfig, np.ndarray, np.ndarray]:
    """The config, tokens [N] and sequence starts [S + 1] of the store in ``directory``, for the model with this
    base fingerprint; a store built from another model's answers, or a missing or corrupt file, is refused."""
    config = read_store_config(directory)
    if config.fingerprint != fingerprint or config.vocab_size != vocab_size:
        raise CausalDraftError(
            f"the n-gram store in {directory} holds another model's answers (fingerprint {config.fingerprint}, "
            f"this model {fingerprint}); build one with causaldraft build-store ({OLD_FINGERPRINTS})"
        )
    try:
        tensors = load_file(str(directory / STORE_FILE))
    except (SafetensorError, OSError) as error:
        raise CausalDraftError(f"cannot read {directory / STORE_FILE}: {error}") from None
    tokens, starts = tensors.get("tokens"), tensors.get("starts")
    if tokens is None or starts is None or tokens.dim() != 1 or starts.dim() != 1 or len(starts) < 1:
        raise CausalDraftError(f"{directory / STORE_FILE} lacks its tokens or sequence starts")
    token_array, start_array = tokens.numpy(), starts.numpy()
    if start_array[0] != 0 or start_array[-1] != len(token_array) or np.any(np.diff(start_array) < 0):
        raise CausalDraftError(f"{directory / STORE_FILE}: sequence starts do not cover its tokens")
    if len(token_array) and (token_array.min() < 0 or token_array.max() >= vocab_size):
        raise CausalDraftError(f"{directory / STORE_FILE} holds token ids outside the vocabulary of {vocab_size}")
    return config, token_array, start_array


def load_store(directory: Path, fingerprint: str, vocab_size: int) -> NgramStore:
    """The store in ``directory`` for the model with this base fingerprint (``load_corpus``'s checks)."""
    return NgramStore(*load_corpus(directory, fingerprint, vocab_size), cache=True)


def corpus_sequences(tokens: np.ndarray, starts: np.ndarray) -> list[list[int]]:
    """The corpus's answers, one list of ids each (``corpus_arrays`` undone)."""
    return [tokens[begin:end].tolist() for begin, end in zip(starts[:-1], starts[1:], strict=True)]


def add_answers(
    corpus: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], prefix: int = REPEAT_PREFIX
) -> tuple[list[list[int]], int]:
    """``corpus`` followed by the ``answers`` that repeat none before them, and how many did. An answer repeats
    an earlier one when their first ``prefix`` tokens agree, or when it is shorter than ``prefix`` and all of it is
    the earlier one's start: as two greedy answers to one prompt do (two prompt orders share prompts; an answer cut
    shorter by a smaller --max-new-tokens, found by an audit), so no answer's n-grams count twice. A longer answer
    whose start is an earlier short one is kept: it holds n-grams the short one lacks.
    Example, prefix 2: corpus [[1, 2, 3]] and answers [[1, 2, 4], [5], [5], [1], [5, 6]] give
    [[1, 2, 3], [5], [5, 6]] and 3 repeats."""
    starts: set[tuple[int, ...]] = set()  # every start, up to ``prefix`` tokens, of the answers kept
    kept, repeats = [], 0
    for index, answer in enumerate([*corpus, *answers]):
        key = tuple(answer[:prefix])
        if index >= len(corpus) and key in starts:
            repeats += 1
            continue
        starts.update(key[:length] for length in range(1, len(key) + 1))
        kept.append(list(answer))
    return kept, repeats
