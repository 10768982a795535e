"""Prompt lookup's continuations and their scores (drafters/lookup.py); its output is covered with
every other drafter by the equivalence tests (test_decode, test_exact, test_default_model)."""

from __future__ import annotations

from causaldraft.config import SamplingConfig
from causaldraft.drafters.base import Draft, DraftContext, StepResult
from causaldraft.drafters.lookup import (
    Continuation,
    LookupDrafter,
    LookupMerge,
    LookupRates,
    Match,
    emitted_prefix,
    periodic_continuation,
    prior_first_rate,
)
from causaldraft.tree import TreeDraft
from causaldraft.verify import Acceptance


def context(tokens: tuple[int, ...], width: int = 1, lookup_depth: int = 0) -> DraftContext:
    kind = "chain" if width == 1 else "dynamic"
    return DraftContext(tokens, None, kind, 4, width, 16, SamplingConfig(), None, lookup_depth=lookup_depth)


def test_continuations_say_how_strong_their_match_is() -> None:
    drafter = LookupDrafter()
    # "1 2 3" was followed by 4 twice: a repeated 3-token match
    assert drafter.continuations((1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3), 4, 1) == [
        Continuation((4, 6, 1, 2), Match(3, True))
    ]
    drafter = LookupDrafter()
    # only the token 7 occurred before, once: a single 1-token match
    assert drafter.continuations((7, 8, 9, 10, 7), 2, 1) == [Continuation((8, 9), Match(1, False))]
    drafter = LookupDrafter()
    found = drafter.continuations((5, 1, 2, 9, 3, 1, 2, 8, 1, 2), 2, 3)  # "1 2" followed by 9, then 8
    assert [c.tokens for c in found] == [(8, 1), (9, 3)] and all(c.match == Match(2, False) for c in found)
    assert LookupDrafter().continuations((1, 2, 3), 4, 2) == []


def test_each_match_kind_learns_its_own_rate() -> None:
    rates = LookupRates()
    strong, weak = Match(3, True), Match(1, False)
    assert rates.score(strong, 0, 0) == prior_first_rate(strong) > prior_first_rate(weak) == rates.score(weak, 0, 0)
    for _ in range(60):
        rates.record(strong, 4, 4)
        rates.record(weak, 0, 4)
    assert rates.score(strong, 0, 0) > 0.95 and rates.score(weak, 0, 0) < 0.05
    assert rates.score(strong, 2, 0) > 0.9  # tokens after the first, given it: size 3 kept them all
    assert rates.score(strong, 0, 1) == rates.score(strong, 0, 0) / 2  # a second continuation counts half
    before = dict(rates.further)
    rates.record(Match(1, True), 1, 1)  # one observed token: nothing learnt about further tokens
    assert rates.further == before


def test_the_target_s_own_tokens_score_a_proposal_even_where_the_tree_was_cut() -> None:
    assert emitted_prefix((4, 6, 9), (4, 6, 1, 2)) == (2, 3)
    assert emitted_prefix((4,), (4, 6)) == (1, 1)
    assert emitted_prefix((5, 6, 1, 2, 3), (4, 6, 1, 2)) == (0, 4)


def test_observe_records_the_proposed_continuation_once() -> None:
    drafter = LookupDrafter()
    tokens = (1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3)
    draft = drafter.propose(context(tokens))
    assert draft.tree.tokens == (3, 4, 6, 1, 2)
    assert draft.scores[1] == prior_first_rate(Match(3, True))
    root_only = Draft.root_only(3)  # e.g. the gate kept the step plain: the target's token still counts
    drafter.observe(StepResult(root_only, Acceptance((0,), (4,), True), (*tokens, 4)))
    assert drafter.rates.first[Match(3, True)] > prior_first_rate(Match(3, True))
    first = dict(drafter.rates.first)
    drafter.observe(StepResult(root_only, Acceptance((0,), (9,), True), (*tokens, 4, 9)))  # nothing proposed
    assert drafter.rates.first == first


def test_a_match_that_reaches_the_present_repeats_its_period() -> None:
    # the text repeats "3 1 2": the latest earlier "3 1 2" is followed from position 5, 3 tokens back
    tokens = (9, 1, 2, 3, 1, 2, 3, 1, 2)
    assert periodic_continuation(tokens, 6, 7) == (3, 1, 2, 3, 1, 2, 3)
    assert periodic_continuation(tokens, 2, 4) == (2, 3, 1, 2)  # within the text: a plain slice
    assert LookupDrafter().continuations(tokens, 7, 1, periodic=True) == [
        Continuation((3, 1, 2, 3, 1, 2, 3), Match(3, False))
    ]
    assert LookupDrafter().continuations(tokens, 7, 1) == [Continuation((3, 1, 2), Match(3, False))]


def test_lookup_paths_reach_lookup_depth_beyond_the_tree_depth() -> None:
    tokens = (9, 1, 2, 3, 1, 2, 3, 1, 2)
    # depth 4, lookup_depth unset: paths of the tree's depth, which stop at the present (3 tokens here)
    assert LookupDrafter().propose(context(tokens)).tree.tokens == (2, 3, 1, 2)
    draft = LookupDrafter().propose(context(tokens, lookup_depth=12))
    assert draft.tree.tokens == (2, *(3, 1, 2) * 4)
    assert max(draft.tree.depths) == 12


def test_merged_candidates_and_drafted_nodes_compete_for_one_budget() -> None:
    """A long path of a weak match no longer crowds a drafter's sure nodes out of the tree."""
    weak = Continuation(tuple(range(20, 36)), Match(1, False))  # 16 tokens; scores 0.35, 0.245, 0.17, ...
    drafted = TreeDraft(parents=[-1, 0, 1], tokens=[5, 6, 7], scores=[1.0, 0.9, 0.8])
    merged = LookupMerge().merge(drafted, [weak], max_nodes=6)
    assert merged.tokens == [5, 6, 7, 20, 21, 22] and merged.parents == [-1, 0, 1, 0, 3, 4]
    strong = Continuation(tuple(range(20, 36)), Match(3, True))  # scores 0.9, 0.63, 0.44, ...
    drafted = TreeDraft(parents=[-1, 0, 1, 1], tokens=[5, 6, 7, 8], scores=[1.0, 0.9, 0.8, 0.3])
    merged = LookupMerge().merge(drafted, [strong], max_nodes=6)
    assert merged.tokens == [5, 6, 7, 20, 21, 22]  # the drafter's 0.3 node gives way to the path's 0.44
