"""Prompt lookup's proposals and scores (causaldraft/drafters/lookup.py): continuations carry the size of
the n-gram that matched, and the first token's acceptance rate is learned per size."""

from __future__ import annotations

from causaldraft.drafters.lookup import FIRST_RATE, Continuation, LookupDrafter, LookupMerge


def test_continuations_prefer_the_longest_matching_ngram_and_say_its_size() -> None:
    #          0  1  2  3  4  5  6  7  8  9 10
    tokens = (5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7)
    drafter = LookupDrafter()
    found = drafter.continuations(tokens, depth=3, limit=3)
    # (6, 7) matched twice (2-grams, most recent first), then 7 alone adds nothing new; (5, 6, 7) is not
    # the latest 3-gram, so no 3-gram matches
    assert found == [Continuation((9, 2, 6), 2), Continuation((8, 1, 6), 2)]
    drafter.start((1, 2, 3, 4, 9, 1, 2, 3))  # a new request: a new index
    assert drafter.continuations((1, 2, 3, 4, 9, 1, 2, 3), depth=2, limit=1) == [Continuation((4, 9), 3)]
    drafter.start((4, 4, 4, 8))
    assert drafter.continuations((4, 4, 4, 8), depth=2, limit=2) == []  # 8 never occurred before


def test_first_token_rates_are_kept_per_ngram_size() -> None:
    drafter = LookupDrafter()
    for _ in range(20):
        drafter.record(matched=3, proposed=3, ngram=3)  # 3-gram continuations right throughout
        drafter.record(matched=0, proposed=3, ngram=1)  # 1-gram ones wrong at once
    assert drafter.first_rate[3] > 0.85 and drafter.first_rate[1] < 0.15
    assert drafter.first_rate[2] == FIRST_RATE  # untouched
    assert drafter.score(0, 0, 3) > 5 * drafter.score(0, 0, 1)
    assert drafter.score(1, 0, 3) < drafter.score(0, 0, 3)  # deeper tokens are less sure
    assert drafter.score(0, 1, 3) == drafter.score(0, 0, 3) / 2  # a second continuation, half


def test_merged_paths_are_scored_by_their_own_ngram() -> None:
    merge = LookupMerge()
    merge.lookup.first_rate.update({3: 0.9, 2: 0.5, 1: 0.1})
    paths = [Continuation((4, 5), 3), Continuation((7,), 1)]
    assert LookupMerge.reserve(paths) == 3
    rate = merge.lookup.continue_rate
    assert merge.scores(paths) == [0.9, 0.9 * rate, 0.1 / 2]
