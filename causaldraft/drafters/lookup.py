"""Prompt lookup: propose continuations of earlier occurrences of the latest n-gram.

An index from n-gram to the positions that follow it is extended incrementally as tokens arrive.
Longer n-grams are tried first; the most recent occurrences first. Several distinct
continuations become a tree sharing prefixes (a trie).

Scores (the chance that the target takes a node, which the tree builder and the cost model read)
are running rates per kind of *match*: the size of the n-gram found, and whether at least two of
its earlier occurrences continue with the proposed first token. The kinds differ a lot: on the
greedy int4 answers to `bench/prompts/mt-bench-other16.jsonl` (first turns), the target took the
first proposed token after a 1-token match 27 % of the time, after a 2-token match 65 %, after a
3-token match 89 % (99 % when at least two earlier occurrences agreed on it); the tokens accepted
per proposal were 0.50, 1.85 and 3.16 of up to 4. One rate for all (as until stop 30) drafts too
much after weak matches and too little after strong ones.

A second source, when the drafter has one: an n-gram store of the target's own answers
(``drafters/store.py``), walked from the text so far. Its proposal is a match kind of its own
(``stored``), with its own rates, and takes a context continuation's place when its score is higher.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from causaldraft.drafters.base import Draft, DraftContext, StepResult
from causaldraft.drafters.store import SURE_SHARE, NgramStore
from causaldraft.tree import TreeDraft, merge_paths, prune

AGREEING = 2  # occurrences that make a match "repeated"
SCANNED = 16  # most recent occurrences of an n-gram looked at for agreement


class Match(NamedTuple):
    size: int  # tokens of the n-gram found
    repeated: bool  # in the context: >= 2 earlier occurrences continue with the first token;
    # in the store: the first token's share of the n-gram's followers is >= SURE_SHARE
    stored: bool = False  # found in the n-gram store, not in the text so far


@dataclass(frozen=True)
class Continuation:
    tokens: tuple[int, ...]
    match: Match
    rank: int = 0  # among the continuations of its source, most recent (context) first


def prior_first_rate(match: Match) -> float:
    """A new match kind's first-token rate before any observation: longer and repeated matches are
    surer. The running rates replace it within a few proposals."""
    size, repeated, stored = match
    if stored:
        return min(0.8, 0.1 + 0.08 * size + (0.25 if repeated else 0.0))
    return min(0.9, 0.15 + 0.2 * size + (0.15 if repeated else 0.0))


@dataclass
class LookupRates:
    """Running acceptance rates: of the first proposed token per match kind, and of each further
    token (given the earlier ones were taken) per n-gram size and source."""

    first: dict[Match, float] = field(default_factory=dict)
    further: dict[tuple[int, bool], float] = field(default_factory=dict)

    def score(self, match: Match, offset: int, rank: int) -> float:
        """Estimated chance that the ``rank``-th continuation is taken through token ``offset``."""
        first = self.first.get(match, prior_first_rate(match))
        return first * self.further.get((match.size, match.stored), 0.7) ** offset / (rank + 1)

    def record(self, match: Match, matched: int, observed: int) -> None:
        """Fold in that the target's tokens equal the first ``matched`` of ``observed`` proposed
        tokens that it emitted a token for (``matched <= observed``)."""
        if observed < 1:
            return
        first = 0.9 * self.first.get(match, prior_first_rate(match)) + 0.1 * float(matched >= 1)
        self.first[match] = min(0.98, max(0.02, first))
        key = (match.size, match.stored)
        further = self.further.get(key, 0.7)
        for offset in range(1, min(matched + 1, observed)):  # token offset + 1 given tokens 1 .. offset
            further = 0.95 * further + 0.05 * float(matched > offset)
        self.further[key] = min(0.98, max(0.05, further))


def periodic_continuation(tokens: tuple[int, ...], start: int, depth: int) -> tuple[int, ...]:
    """The ``depth`` tokens that follow the text if it goes on as it did from ``start``. A match that
    reaches the present repeats: with period p = len(tokens) - start, token i is tokens[start + i % p].

    Example: tokens (a, b, c, a, b), start 3: from there the text is (a, b) up to the present, so the
    period is 2 and depth 5 gives (a, b, a, b, a)."""
    period = len(tokens) - start
    if start + depth <= len(tokens):
        return tokens[start : start + depth]
    return tuple(tokens[start + offset % period] for offset in range(depth))


def path_depth(context: DraftContext) -> tuple[int, bool]:
    """How long lookup paths may be this step, and whether they go on around a period: only where they may
    reach past the tree's depth (``--lookup-depth``). Repeating periods at the tree's depth gained nothing
    measurable greedy, and at T = 1 eagle3 accepted 1.27 tokens per pass with them against 1.37 without
    (docs/results/history.md, stop 34)."""
    depth = context.lookup_depth or context.depth
    return depth, depth > context.depth


def emitted_prefix(emitted: tuple[int, ...], proposed: tuple[int, ...]) -> tuple[int, int]:
    """(how many leading proposed tokens the target emitted, how many proposed tokens it emitted a
    token for): the target's own tokens say whether a proposal was right even where the tree was
    cut shorter than it."""
    observed = min(len(emitted), len(proposed))
    matched = 0
    while matched < observed and emitted[matched] == proposed[matched]:
        matched += 1
    return matched, observed


class LookupDrafter:
    name = "lookup"
    feature_layers: tuple[int, ...] = ()

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, store: NgramStore | None = None) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.store = store  # read-only, shared by forks
        self.index: dict[tuple[int, ...], list[int]] = defaultdict(list)
        self.indexed = 0
        self.rates = LookupRates()
        self.recorded: list[Continuation] = []  # of the step being verified: the best of each source

    def fork(self) -> LookupDrafter:
        return LookupDrafter(self.max_ngram, self.min_ngram, self.store)

    def start(self, prompt: tuple[int, ...], features: torch.Tensor | None = None) -> None:
        self.index = defaultdict(list)
        self.indexed = 0
        self.recorded = []

    def update_index(self, tokens: tuple[int, ...]) -> None:
        """Record, for every n-gram ending before position p, that p follows it."""
        for end in range(max(self.indexed, 1), len(tokens)):
            for size in range(self.min_ngram, self.max_ngram + 1):
                if end - size >= 0:
                    self.index[tokens[end - size : end]].append(end)
        self.indexed = max(self.indexed, len(tokens))

    def context_continuations(
        self, tokens: tuple[int, ...], depth: int, limit: int, periodic: bool = False
    ) -> list[Continuation]:
        """Up to ``limit`` distinct continuations (length <= depth) of the latest n-gram, best first;
        ``periodic``: one that reaches the present goes on around its period (``periodic_continuation``)."""
        self.update_index(tokens)
        found: list[Continuation] = []
        for size in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(tokens) < size:
                continue
            followers = self.index.get(tokens[len(tokens) - size :], [])  # positions < len(tokens)
            for start in reversed(followers):
                continuation = (
                    periodic_continuation(tokens, start, depth) if periodic else tokens[start : start + depth]
                )
                if continuation and not any(seen.tokens[: len(continuation)] == continuation for seen in found):
                    agreeing = sum(1 for other in followers[-SCANNED:] if tokens[other] == continuation[0])
                    found.append(Continuation(continuation, Match(size, agreeing >= AGREEING), len(found)))
                if len(found) >= limit:
                    return found
        return found

    def stored_continuation(self, tokens: tuple[int, ...], depth: int) -> Continuation | None:
        walked = self.store.continuation(tokens, depth) if self.store is not None else None
        if walked is None:
            return None
        proposal, guess = walked
        return Continuation(proposal, Match(guess.size, guess.share >= SURE_SHARE, stored=True))

    def continuations(
        self, tokens: tuple[int, ...], depth: int, limit: int, periodic: bool = False
    ) -> list[Continuation]:
        """Up to ``limit`` continuations: the context's, best first, with the store's in place of the
        last when its first token scores higher (or in a free place). The best of each source is
        kept for ``observe`` to score, whether it was proposed or not."""
        found = self.context_continuations(tokens, depth, limit, periodic)
        stored = self.stored_continuation(tokens, depth)
        self.recorded = [path for path in (found[0] if found else None, stored) if path is not None]
        if stored is None or any(path.tokens[: len(stored.tokens)] == stored.tokens for path in found):
            return found
        if len(found) < limit:
            return [*found, stored]
        if self.rates.score(stored.match, 0, 0) > self.rates.score(found[-1].match, 0, found[-1].rank):
            return [*found[:-1], stored]
        return found

    def propose(self, context: DraftContext) -> Draft:
        limit = 1 if context.tree_kind == "chain" else context.width
        depth, periodic = path_depth(context)
        found = self.continuations(context.tokens, depth, limit, periodic)
        draft = TreeDraft(parents=[-1], tokens=[context.tokens[-1]], scores=[1.0])
        self.merge(draft, found, context.max_nodes)
        return Draft.from_tree_draft(draft)

    def merge(self, draft: TreeDraft, found: list[Continuation], max_nodes: int) -> None:
        """Add the continuations to ``draft`` as a trie, each node scored by its match kind's rates."""
        for continuation in found:
            path = continuation.tokens
            for end in range(1, len(path) + 1):
                score = self.rates.score(continuation.match, end - 1, continuation.rank)
                merge_paths(draft, [path[:end]], score, max_nodes)

    def observe(self, result: StepResult) -> None:
        """Score the step's best continuation of each source against the tokens the target emitted."""
        for continuation in self.recorded:
            matched, observed = emitted_prefix(result.acceptance.tokens, continuation.tokens)
            self.rates.record(continuation.match, matched, observed)
        self.recorded = []


class LookupMerge:
    """Prompt-lookup paths merged into a model drafter's tree (heads, eagle3), with their own
    acceptance rates: ``paths`` before drafting, ``merge`` after, ``observe`` after verifying."""

    def __init__(self, store: NgramStore | None = None) -> None:
        self.lookup = LookupDrafter(store=store)

    def start(self, prompt: tuple[int, ...]) -> None:
        self.lookup.start(prompt)

    def paths(self, context: DraftContext) -> list[Continuation]:
        limit = 1 if context.tree_kind == "chain" else 2
        depth, periodic = path_depth(context)
        return self.lookup.continuations(context.tokens, depth, limit, periodic)

    @staticmethod
    def reserve(paths: list[Continuation]) -> int:
        """Tree nodes the paths may add (distinct prefixes)."""
        return len({path.tokens[:end] for path in paths for end in range(1, len(path.tokens) + 1)})

    def scores(self, paths: list[Continuation]) -> dict[tuple[int, ...], float]:
        """The score ``merge`` gives each of the paths' nodes, by its tokens after the root (a shared
        prefix once, at its best score)."""
        best: dict[tuple[int, ...], float] = {}
        for path in paths:
            for end in range(1, len(path.tokens) + 1):
                score = self.lookup.rates.score(path.match, end - 1, path.rank)
                best[path.tokens[:end]] = max(best.get(path.tokens[:end], 0.0), score)
        return best

    def merge(self, draft: TreeDraft, paths: list[Continuation], max_nodes: int) -> TreeDraft:
        """The drafted tree with the paths merged in, cut to its ``max_nodes`` best nodes by score (each
        with its ancestors): the drafter's nodes and the candidates compete for one budget. (Until stop 34
        the candidates' nodes were reserved first, which, once paths reached ``lookup_depth``, left a
        drafter two nodes beside a weak match's long path.)"""
        self.lookup.merge(draft, paths, len(draft.tokens) + self.reserve(paths))
        return prune(draft, max_nodes)

    def observe(self, result: StepResult) -> None:
        self.lookup.observe(result)
