"""Prompt lookup's continuations and their scores (drafters/lookup.py); its output is covered with
every other drafter by the equivalence tests (test_decode, test_exact, test_default_model)."""

from __future__ import annotations

from causaldraft.config import SamplingConfig
from causaldraft.drafters.base import Draft, DraftContext, StepResult
from causaldraft.drafters.lookup import (
    Continuation,
    LookupDrafter,
    LookupRates,
    Match,
    emitted_prefix,
    prior_first_rate,
)
from causaldraft.verify import Acceptance


def context(tokens: tuple[int, ...], width: int = 1) -> DraftContext:
    return DraftContext(tokens, None, "chain" if width == 1 else "dynamic", 4, width, 16, SamplingConfig(), None)


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
