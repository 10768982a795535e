"""Verifier tests: literal greedy cases, and statistical tests that the sampling rules reproduce
the target's exact law of the first two tokens (and that biased rules fail the same test)."""

from __future__ import annotations

import functools
import hashlib
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from scipy.stats import chisquare

from causaldraft.sampling import sample
from causaldraft.tree import Tree
from causaldraft.verify import Acceptance, row_argmax, verify_greedy, verify_naive, verify_sampled

VOCAB = 4
TRIALS = 12000
P_VALUE_FLOOR = 1e-4  # a lossless sampler fails this with probability 1e-4 per test


@functools.cache
def distribution(prefix: tuple[int, ...], salt: str, sharpness: float = 1.5) -> torch.Tensor:
    """A fixed pseudo-random next-token distribution [VOCAB] for each prefix."""
    seed = int(hashlib.sha256(f"{salt}:{prefix}".encode()).hexdigest()[:8], 16)
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * sharpness
    return torch.softmax(logits, -1)


def target(prefix: tuple[int, ...]) -> torch.Tensor:
    return distribution(prefix, "target")


def drafter(prefix: tuple[int, ...]) -> torch.Tensor:
    return distribution(prefix, "draft", sharpness=2.5)


def exact_two_token_law() -> dict[tuple[int, int], float]:
    first = target(())
    return {(a, b): float(first[a] * target((a,))[b]) for a in range(VOCAB) for b in range(VOCAB)}


Verifier = Callable[[Tree, torch.Tensor, torch.Tensor, torch.Generator], Acceptance]


def draw_tree(mode: str, generator: torch.Generator) -> tuple[Tree, torch.Tensor]:
    """Root with two children per node down to depth 2, children drawn from the drafter."""
    parents, tokens, prefixes = [-1], [0], [()]
    for node in range(3):  # root, then its first two children get children
        if node >= len(tokens):
            break
        if node > 0 and parents[node] != 0:
            continue
        probs = drafter(prefixes[node])
        if mode == "deterministic":
            children = torch.topk(probs, 2).indices.tolist()
        elif mode == "sampled":
            children = torch.multinomial(probs, 2, replacement=True, generator=generator).tolist()
        else:
            children = torch.multinomial(probs, 2, replacement=False, generator=generator).tolist()
        for token in children:
            parents.append(node)
            tokens.append(token)
            prefixes.append((*prefixes[node], token))
    tree = Tree(tuple(parents), tuple(tokens))
    target_probs = torch.stack([target(prefix) for prefix in prefixes])
    draft_probs = torch.stack([drafter(prefix) for prefix in prefixes])
    return tree, torch.stack([target_probs, draft_probs])


def two_tokens(verifier: Verifier, mode: str, seed: int) -> Counter[tuple[int, int]]:
    generator = torch.Generator().manual_seed(seed)
    counts: Counter[tuple[int, int]] = Counter()
    for _ in range(TRIALS):
        tree, probs = draw_tree(mode, generator)
        acceptance = verifier(tree, probs[0], probs[1], generator)
        emitted = list(acceptance.tokens)
        if len(emitted) < 2:  # the next step starts from the emitted token
            emitted.append(sample(target((emitted[0],)), generator))
        counts[(emitted[0], emitted[1])] += 1
    return counts


def p_value(counts: Counter[tuple[int, int]]) -> float:
    law = exact_two_token_law()
    keys = sorted(law)
    observed = [counts[key] for key in keys]
    total = sum(law.values())
    expected = [law[key] / total * sum(observed) for key in keys]
    return float(chisquare(observed, expected).pvalue)


def lossless(mode: str) -> Verifier:
    def run(
        tree: Tree, target_probs: torch.Tensor, draft_probs: torch.Tensor, generator: torch.Generator
    ) -> Acceptance:
        return verify_sampled(tree, target_probs, None if mode == "deterministic" else draft_probs, mode, generator)

    return run


@pytest.mark.parametrize("mode", ["deterministic", "sampled", "without_replacement"])
def test_tree_sampling_matches_the_exact_target_law(mode: str) -> None:
    assert p_value(two_tokens(lossless(mode), mode, seed=1)) > P_VALUE_FLOOR


def test_chain_sampling_matches_the_exact_target_law() -> None:
    def chain_run(
        tree: Tree, target_probs: torch.Tensor, draft_probs: torch.Tensor, generator: torch.Generator
    ) -> Acceptance:
        # keep only the first child at each level: a chain drawn from the drafter
        first = [0, 1, 3] if tree.parents[3] == 1 else [0, 1]
        chain = Tree.chain([tree.tokens[i] for i in first])
        return verify_sampled(chain, target_probs[first], draft_probs[first], "sampled", generator)

    assert p_value(two_tokens(chain_run, "sampled", seed=2)) > P_VALUE_FLOOR


def test_naive_rule_is_biased() -> None:
    def naive(
        tree: Tree, target_probs: torch.Tensor, draft_probs: torch.Tensor, generator: torch.Generator
    ) -> Acceptance:
        return verify_naive(tree, target_probs, generator)

    assert p_value(two_tokens(naive, "deterministic", seed=3)) < P_VALUE_FLOOR


def test_ignoring_the_residual_update_across_siblings_is_biased() -> None:
    """Trying the next sibling against the unchanged target probabilities (DESIGN.md) is caught."""

    def no_residual(
        tree: Tree, target_probs: torch.Tensor, draft_probs: torch.Tensor, generator: torch.Generator
    ) -> Acceptance:
        node, path = 0, [0]
        while True:
            children = [c for c in range(tree.size) if tree.parents[c] == node]
            chosen = None
            for child in children:
                token = tree.tokens[child]
                ratio = float(target_probs[node, token] / draft_probs[node, token])
                if float(torch.rand((), generator=generator)) < ratio:
                    chosen = child
                    break
            if chosen is None:
                residual = (target_probs[node] - draft_probs[node]).clamp_min(0)
                residual = residual / residual.sum() if residual.sum() > 0 else target_probs[node]
                final = sample(residual, generator)
                return Acceptance(tuple(path), (*[tree.tokens[i] for i in path[1:]], final), False)
            node = chosen
            path.append(node)

    assert p_value(two_tokens(no_residual, "sampled", seed=4)) < P_VALUE_FLOOR


def test_greedy_descends_along_argmax_and_emits_bonus() -> None:
    tree = Tree(parents=(-1, 0, 0, 2), tokens=(9, 1, 2, 3))
    logits = torch.full((4, 5), -1.0)
    logits[0, 2] = 5.0  # root -> 2 (node 2)
    logits[2, 3] = 5.0  # node 2 -> 3 (node 3)
    logits[3, 4] = 5.0  # leaf -> bonus 4
    logits[1, 0] = 5.0
    assert verify_greedy(tree, row_argmax(logits)) == Acceptance((0, 2, 3), (2, 3, 4), True)
    logits[2, 3], logits[2, 1] = -1.0, 5.0  # node 2 now wants 1: recovered token 1 at node 2
    assert verify_greedy(tree, row_argmax(logits)) == Acceptance((0, 2), (2, 1), False)


def test_row_argmax_is_torch_argmax_ties_nans_and_infinities_included() -> None:
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(9, 49152, generator=generator)
    scores[1, 7] = scores[1, 40000] = 99.0  # a tie: the first index
    scores[2, 123] = scores[2, 5] = float("nan")  # a NaN counts as the maximum, the first one
    scores[3] = float("-inf")
    scores[4, 300] = scores[4, 301] = float("inf")
    scores[5] = 0.0
    expected = scores.argmax(-1).tolist()
    assert expected[1:6] == [7, 5, 0, 300, 0]
    assert row_argmax(scores) == expected
    assert row_argmax(scores[:, ::2]) == scores[:, ::2].argmax(-1).tolist()  # not contiguous
    assert row_argmax(scores.bfloat16()) == scores.bfloat16().argmax(-1).tolist()  # torch's path
    with torch.inference_mode():
        assert row_argmax(scores.clone()) == expected


def test_deterministic_rule_with_one_hot_target_accepts_exactly_the_argmax() -> None:
    tree = Tree(parents=(-1, 0, 0), tokens=(0, 3, 1))
    target_probs = torch.zeros(3, 4)
    target_probs[:, 1] = 1.0
    acceptance = verify_sampled(tree, target_probs, None, "deterministic", torch.Generator().manual_seed(0))
    assert acceptance.path == (0, 2) and acceptance.tokens == (1, 1)
