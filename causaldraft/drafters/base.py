"""The drafter protocol and the frozen records passed between decode-loop stages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from causaldraft.config import SamplingConfig
from causaldraft.tree import LevelGate, Tree, TreeDraft, prune
from causaldraft.verify import Acceptance


@dataclass(frozen=True)
class DraftContext:
    tokens: tuple[int, ...]  # prompt + output so far; the last one is the root (not yet cached)
    hidden: torch.Tensor | None  # [hidden] target hidden state that predicted the root, if any
    tree_kind: str
    depth: int
    width: int
    max_nodes: int
    sampling: SamplingConfig
    generator: torch.Generator | None
    # Gumbel sampling: the seed of the target's noise (sampling.gumbel_noise(seed, position, vocab));
    # a drafter ranks its guesses by the same perturbed scores. None: greedy or rejection sampling.
    noise_seed: int | None = None
    # asked before each tree level whether to draft it (the budget policy's DepthGate); None: every level
    gate: LevelGate | None = None
    # longest prompt-lookup path (its tokens cost no drafting, so it may exceed ``depth``); 0: ``depth``
    lookup_depth: int = 0


@dataclass(frozen=True)
class Draft:
    tree: Tree
    scores: tuple[float, ...]  # cumulative draft probability per node (root 1.0)
    child_mode: str  # "deterministic" | "sampled" | "without_replacement"
    draft_probs: torch.Tensor | None = None  # [n, vocab] distribution each node's children came from

    @staticmethod
    def root_only(root: int) -> Draft:
        return Draft(Tree((-1,), (root,)), (1.0,), "deterministic")

    @staticmethod
    def from_tree_draft(draft: TreeDraft, child_mode: str = "deterministic") -> Draft:
        return Draft(draft.freeze(), tuple(draft.scores), child_mode)

    def pruned(self, nodes: int) -> Draft:
        """Its ``nodes`` best-scored nodes, ancestors kept (lossless for deterministic children)."""
        kept = prune(TreeDraft(list(self.tree.parents), list(self.tree.tokens), list(self.scores)), nodes)
        return Draft.from_tree_draft(kept)

    def within_depth(self, depth: int) -> Draft:
        """The nodes at most ``depth`` below the root (a node's ancestors are shallower, so this
        is a tree). Lossless for every acceptance rule: what is cut depends on positions alone.

        Example: parents (-1, 0, 1, 0), depths (0, 1, 2, 1); within_depth(1) keeps nodes 0, 1, 3
        as parents (-1, 0, 0).
        """
        depths = self.tree.depths
        if max(depths) <= depth:
            return self
        kept = [node for node, node_depth in enumerate(depths) if node_depth <= depth]
        new_index = {old: new for new, old in enumerate(kept)}
        parents = tuple(-1 if node == 0 else new_index[self.tree.parents[node]] for node in kept)
        tokens = tuple(self.tree.tokens[node] for node in kept)
        probs = None if self.draft_probs is None else self.draft_probs[kept]
        return Draft(Tree(parents, tokens), tuple(self.scores[node] for node in kept), self.child_mode, probs)


@dataclass(frozen=True)
class StepResult:
    draft: Draft
    acceptance: Acceptance
    tokens: tuple[int, ...]  # the whole sequence after the step; the last one is the new root
    # [len(acceptance.path), F] target features (inputs of ``feature_layers``) of the accepted
    # path's nodes, root first; None unless the drafter asked for features
    features: torch.Tensor | None = None


class Drafter(Protocol):
    name: str
    feature_layers: tuple[int, ...]  # target layers whose inputs the drafter reads; () = none

    def start(self, prompt: tuple[int, ...], features: torch.Tensor | None) -> None:
        """A new sequence begins; reset any per-sequence state. ``features``: [len(prompt) - 1, F]
        of the cached prompt positions when ``feature_layers`` is set (None for a 1-token prompt)."""

    def propose(self, context: DraftContext) -> Draft: ...

    def observe(self, result: StepResult) -> None: ...

    def fork(self) -> Drafter:
        """A drafter for another concurrent sequence: the same weights, its own per-sequence state
        (continuous batching runs one per sequence)."""
        ...


class NoDrafter:
    """Plain decoding: every step verifies only the root."""

    name = "none"
    feature_layers: tuple[int, ...] = ()

    def start(self, prompt: tuple[int, ...], features: torch.Tensor | None) -> None:
        return None

    def propose(self, context: DraftContext) -> Draft:
        return Draft.root_only(context.tokens[-1])

    def observe(self, result: StepResult) -> None:
        return None

    def fork(self) -> NoDrafter:
        return NoDrafter()
