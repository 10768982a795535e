"""Prompt lookup: propose continuations of earlier occurrences of the latest n-gram.

An index from n-gram to the positions that follow it is extended incrementally as tokens arrive.
Longer n-grams are tried first; the most recent occurrences first. Several distinct
continuations become a tree sharing prefixes (a trie).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from causaldraft.drafters.base import Draft, DraftContext, StepResult
from causaldraft.tree import TreeDraft, merge_paths


class LookupDrafter:
    name = "lookup"
    feature_layers: tuple[int, ...] = ()

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.index: dict[tuple[int, ...], list[int]] = defaultdict(list)
        self.indexed = 0
        # Scores: a copied continuation is either wrong at once or right for a while, so the first
        # token and each further token (given the previous ones matched) get separate running rates.
        self.first_rate = 0.5  # P(first proposed token accepted)
        self.continue_rate = 0.7  # P(token k+1 accepted | tokens 1..k accepted)

    def fork(self) -> LookupDrafter:
        return LookupDrafter(self.max_ngram, self.min_ngram)

    def start(self, prompt: tuple[int, ...], features: torch.Tensor | None = None) -> None:
        self.index = defaultdict(list)
        self.indexed = 0

    def update_index(self, tokens: tuple[int, ...]) -> None:
        """Record, for every n-gram ending before position p, that p follows it."""
        for end in range(max(self.indexed, 1), len(tokens)):
            for size in range(self.min_ngram, self.max_ngram + 1):
                if end - size >= 0:
                    self.index[tokens[end - size : end]].append(end)
        self.indexed = max(self.indexed, len(tokens))

    def continuations(self, tokens: tuple[int, ...], depth: int, limit: int) -> list[tuple[int, ...]]:
        """Up to ``limit`` distinct continuations (length <= depth) of the latest n-gram."""
        self.update_index(tokens)
        found: list[tuple[int, ...]] = []
        for size in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(tokens) < size:
                continue
            followers = self.index.get(tokens[len(tokens) - size :], [])
            for start in reversed(followers):
                if start >= len(tokens):
                    continue
                continuation = tokens[start : start + depth]
                if continuation and not any(seen[: len(continuation)] == continuation for seen in found):
                    found.append(continuation)
                if len(found) >= limit:
                    return found
        return found

    def propose(self, context: DraftContext) -> Draft:
        limit = 1 if context.tree_kind == "chain" else context.width
        paths = self.continuations(context.tokens, context.depth, limit)
        draft = TreeDraft(parents=[-1], tokens=[context.tokens[-1]], scores=[1.0])
        for rank, path in enumerate(paths):
            for offset in range(len(path)):
                merge_paths(draft, [path[: offset + 1]], self.score(offset, rank), context.max_nodes)
        return Draft.from_tree_draft(draft)

    def score(self, offset: int, rank: int) -> float:
        """Estimated probability that the ``rank``-th continuation is accepted through ``offset``."""
        return self.first_rate * self.continue_rate**offset / (rank + 1)

    def record(self, matched: int, proposed: int) -> None:
        """Fold in that the first ``matched`` of ``proposed`` continuation tokens were accepted."""
        if proposed < 1:
            return
        self.first_rate = 0.9 * self.first_rate + 0.1 * float(matched >= 1)
        for offset in range(1, min(matched + 1, proposed)):  # token offset+1 given tokens 1..offset
            self.continue_rate = 0.95 * self.continue_rate + 0.05 * float(matched > offset)
        self.first_rate = min(0.95, max(0.05, self.first_rate))
        self.continue_rate = min(0.98, max(0.05, self.continue_rate))

    def observe(self, result: StepResult) -> None:
        tree = result.draft.tree
        if tree.size > 1:
            depth = [0] * tree.size
            for node in range(1, tree.size):
                depth[node] = depth[tree.parents[node]] + 1
            self.record(len(result.acceptance.path) - 1, max(depth))


class LookupMerge:
    """Prompt-lookup paths merged into a model drafter's tree (heads, eagle3), with their own
    acceptance rates: ``paths`` before drafting, ``merge`` after, ``observe`` after verifying."""

    def __init__(self) -> None:
        self.lookup = LookupDrafter()
        self.last: tuple[int, ...] = ()  # the first path proposed, whose acceptance is recorded

    def start(self, prompt: tuple[int, ...]) -> None:
        self.lookup.start(prompt)
        self.last = ()

    def paths(self, context: DraftContext) -> list[tuple[int, ...]]:
        limit = 1 if context.tree_kind == "chain" else 2
        paths = self.lookup.continuations(context.tokens, context.depth, limit)
        self.last = paths[0] if paths else ()
        return paths

    @staticmethod
    def reserve(paths: list[tuple[int, ...]]) -> int:
        """Tree nodes the paths may add (distinct prefixes)."""
        return len({path[:end] for path in paths for end in range(1, len(path) + 1)})

    def scores(self, paths: list[tuple[int, ...]]) -> list[float]:
        """The scores ``merge`` gives the paths' nodes (a shared prefix once, at its best score)."""
        best: dict[tuple[int, ...], float] = {}
        for rank, path in enumerate(paths):
            for end in range(1, len(path) + 1):
                best[path[:end]] = max(best.get(path[:end], 0.0), self.lookup.score(end - 1, rank))
        return list(best.values())

    def merge(self, draft: TreeDraft, paths: list[tuple[int, ...]], max_nodes: int) -> None:
        for rank, path in enumerate(paths):
            for end in range(1, len(path) + 1):
                merge_paths(draft, [path[:end]], self.lookup.score(end - 1, rank), max_nodes)

    def observe(self, result: StepResult) -> None:
        if not self.last:
            return
        emitted = result.acceptance.tokens
        matched = 0
        while matched < min(len(emitted), len(self.last)) and emitted[matched] == self.last[matched]:
            matched += 1
        self.lookup.record(matched, len(self.last))
