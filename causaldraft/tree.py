"""The draft tree: one representation (parent index + token per node), one compiler, builders.

Node 0 is the root: the last token already chosen by the target (not yet in the KV cache). Every
other node is a draft token whose parent index is smaller than its own index. A chain is a tree in
which node i's parent is i - 1.

Worked example (committed prefix length P): nodes 0:"the"(parent -1), 1:"cat"(0), 2:"dog"(0),
3:"sat"(1). depths = [0, 1, 1, 2] so positions = [P, P+1, P+1, P+2]. The tree part of the mask has
row i true at i and its ancestors: row 3 = {0, 1, 3}, row 2 = {0, 2}. Root-to-leaf paths are
[0, 1, 3] and [0, 2]. The full mask prepends P true columns (the prefix) to every row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Tree:
    parents: tuple[int, ...]  # parents[0] == -1, parents[i] < i
    tokens: tuple[int, ...]
    depths: tuple[int, ...] = field(init=False, repr=False, compare=False)  # root 0; the one place it is computed

    def __post_init__(self) -> None:
        if len(self.parents) != len(self.tokens) or not self.parents or self.parents[0] != -1:
            raise ValueError("a tree needs a root (parent -1) and one parent per token")
        depths = [0]
        for index, parent in enumerate(self.parents[1:], start=1):
            if not 0 <= parent < index:
                raise ValueError(f"node {index} has parent {parent}; parents must precede children")
            depths.append(depths[parent] + 1)
        object.__setattr__(self, "depths", tuple(depths))

    @property
    def size(self) -> int:
        return len(self.tokens)

    def children(self, node: int) -> list[int]:
        return [index for index, parent in enumerate(self.parents) if parent == node]

    @staticmethod
    def chain(tokens: Sequence[int]) -> Tree:
        return Tree(tuple(range(-1, len(tokens) - 1)), tuple(tokens))


@dataclass(frozen=True)
class CompiledTree:
    mask: torch.Tensor  # [n, n] bool, True where row may attend to column
    depths: torch.Tensor  # [n] long
    paths: tuple[tuple[int, ...], ...]  # root-to-leaf node indices


def compile_tree(tree: Tree) -> CompiledTree:
    n = tree.size
    mask = torch.zeros(n, n, dtype=torch.bool)
    for node in range(n):
        parent = tree.parents[node]
        if parent >= 0:
            mask[node] = mask[parent]
        mask[node, node] = True
    has_child = set(tree.parents[1:])
    paths = []
    for leaf in (node for node in range(n) if node not in has_child):
        path = [leaf]
        while tree.parents[path[-1]] >= 0:
            path.append(tree.parents[path[-1]])
        paths.append(tuple(reversed(path)))
    return CompiledTree(mask=mask, depths=torch.tensor(tree.depths, dtype=torch.long), paths=tuple(paths))


def full_mask(compiled: CompiledTree, prefix_length: int) -> torch.Tensor:
    """[n, prefix_length + n] bool: every node sees the whole prefix, itself and its ancestors."""
    n = compiled.mask.shape[0]
    return torch.cat((torch.ones(n, prefix_length, dtype=torch.bool), compiled.mask), dim=1)


# ---- builders -------------------------------------------------------------------------------

Candidates = list[tuple[int, float]]  # (token, score: the drafter's chance that the target takes it), best first
Expander = Callable[[Tree, list[int]], list[Candidates]]
"""Given the tree built so far and some of its nodes, return each node's candidate children."""
LevelGate = Callable[[list[float], list[float], int], bool]
"""Before each level: (scores of the nodes so far, scores of the frontier to expand, level index)
-> whether to draft that level (``adapt.DepthGate``)."""


@dataclass
class TreeDraft:
    """A tree under construction, with each node's cumulative draft probability (its score)."""

    parents: list[int]
    tokens: list[int]
    scores: list[float]

    def add(self, parent: int, token: int, prob: float) -> int:
        self.parents.append(parent)
        self.tokens.append(token)
        self.scores.append(self.scores[parent] * prob)
        return len(self.tokens) - 1

    def freeze(self) -> Tree:
        return Tree(tuple(self.parents), tuple(self.tokens))

    def child_with_token(self, node: int, token: int) -> int | None:
        for index, parent in enumerate(self.parents):
            if parent == node and self.tokens[index] == token:
                return index
        return None


def static_branching(depth: int, width: int) -> list[int]:
    """Children per node at each depth of a static tree: [width, width - 1, 1, 1, ...]."""
    return [width, max(1, width - 1)][:depth] + [1] * max(0, depth - 2)


def build_tree(
    kind: str, root: int, expand: Expander, depth: int, width: int, max_nodes: int,
    gate: LevelGate | None = None, merged: Mapping[tuple[int, ...], float] | None = None,
) -> TreeDraft:  # fmt: skip
    """Grow a chain, static or dynamic tree with a drafter's expander.

    chain: the top candidate at each depth. static: a fixed branching (static_branching).
    dynamic: at each depth the ``width`` best frontier nodes by cumulative probability are expanded
    together (one expander call) into ``width`` children each; at the end the ``max_nodes`` best
    nodes are kept (a child never outscores its parent, so kept nodes form a tree).
    ``gate``: asked before each level whether to draft it; a no ends the tree. It sees the scores of
    the drafted nodes and of ``merged``: candidates the drafter will merge in afterwards (e.g. prompt
    lookup's), by their tokens after the root, a candidate the tree already holds counted once.
    """
    draft = TreeDraft(parents=[-1], tokens=[root], scores=[1.0])
    frontier = [0]
    branching = [1] * depth if kind == "chain" else static_branching(depth, width)
    for level in range(depth):
        if not frontier or len(draft.tokens) >= (max_nodes if kind != "dynamic" else 4 * max_nodes):
            break
        if kind == "dynamic":
            frontier = sorted(frontier, key=lambda node: -draft.scores[node])[:width]
        if gate is not None:
            frontier_scores = [draft.scores[node] for node in frontier]
            if not gate(gate_scores(draft, merged or {}), frontier_scores, level):
                break
        candidates = expand(draft.freeze(), frontier)
        next_frontier = []
        keep = width if kind == "dynamic" else branching[level]
        for node, options in zip(frontier, candidates, strict=True):
            for token, prob in options[:keep]:
                if kind != "dynamic" and len(draft.tokens) >= max_nodes:
                    break
                next_frontier.append(draft.add(node, token, prob))
        frontier = next_frontier
    if kind == "dynamic":
        draft = prune(draft, max_nodes)
    return draft


def gate_scores(draft: TreeDraft, merged: Mapping[tuple[int, ...], float]) -> list[float]:
    """Scores of the merged candidates and of the drafted nodes, a node whose path equals a merged
    candidate's counted once, at the higher score (the merge will keep one node for both).
    E.g. drafted root -> 7 (0.6) -> 8 (0.3), merged {(7,): 0.5, (9,): 0.4}: [0.6, 0.4, 0.3]."""
    if not merged:
        return draft.scores[1:]
    best = dict(merged)
    drafted: list[float] = []
    paths: list[tuple[int, ...]] = [()]  # tokens after the root, per node (a parent precedes its children)
    for node in range(1, len(draft.tokens)):
        path = (*paths[draft.parents[node]], draft.tokens[node])
        paths.append(path)
        if path in best:
            best[path] = max(best[path], draft.scores[node])
        else:
            drafted.append(draft.scores[node])
    return [*best.values(), *drafted]


def prune(draft: TreeDraft, max_nodes: int) -> TreeDraft:
    """Keep the root and the best nodes by score, each with its ancestors, up to max_nodes."""
    order = sorted(range(1, len(draft.tokens)), key=lambda node: (-draft.scores[node], node))
    kept_set = {0}
    for node in order:
        lineage = []
        while node not in kept_set:
            lineage.append(node)
            node = draft.parents[node]
        if len(kept_set) + len(lineage) > max_nodes:
            continue
        kept_set.update(lineage)
        if len(kept_set) >= max_nodes:
            break
    kept = sorted(kept_set)
    new_index = {old: new for new, old in enumerate(kept)}
    return TreeDraft(
        parents=[-1] + [new_index[draft.parents[old]] for old in kept[1:]],
        tokens=[draft.tokens[old] for old in kept],
        scores=[draft.scores[old] for old in kept],
    )


def merge_paths(draft: TreeDraft, paths: Sequence[Sequence[int]], score: float, max_nodes: int) -> None:
    """Add token paths (continuations of the root) into the tree as a trie, sharing prefixes."""
    for path in paths:
        node = 0
        for token in path:
            child = draft.child_with_token(node, token)
            if child is None:
                if len(draft.tokens) >= max_nodes:
                    return
                draft.parents.append(node)
                draft.tokens.append(token)
                draft.scores.append(score)
                child = len(draft.tokens) - 1
            else:
                draft.scores[child] = max(draft.scores[child], score)
            node = child
