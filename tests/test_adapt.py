"""The cost model: verify cost by node count (eager and compiled buckets) and the budget choice."""

import pytest

from causaldraft.adapt import (
    PROBES_BEFORE_FALLBACK,
    BudgetPolicy,
    DraftLimits,
    VerifyCost,
    choose_budget,
    draft_limits,
    initial_adapt_state,
    update_after_step,
)
from causaldraft.config import DecodeConfig, TreeConfig
from causaldraft.drafters.base import Draft
from causaldraft.tree import Tree


def test_verify_cost_interpolates_between_measured_sizes() -> None:
    cost = VerifyCost({1: 0.010, 9: 0.018, 17: 0.034})
    assert cost(1) == pytest.approx(0.010)
    assert cost(5) == pytest.approx(0.014)
    assert cost(13) == pytest.approx(0.026)
    assert cost(34) == pytest.approx(0.068)  # past the last size: linear in n


def test_compiled_buckets_cost_what_their_padded_pass_costs() -> None:
    cost = VerifyCost({1: 0.020, 4: 0.021, 8: 0.025, 16: 0.031, 32: 0.042}, buckets=(1, 4, 8, 16, 32))
    assert cost(12) == cost(16) == pytest.approx(0.031)
    assert cost(2) == pytest.approx(0.021)
    cost.update(12, 0.041)  # a 12-node pass ran as the 16 bucket
    assert 12 not in cost.seconds and cost.seconds[16] == pytest.approx(0.9 * 0.031 + 0.1 * 0.041)


def test_budget_grows_with_draft_confidence_and_shrinks_with_verify_cost() -> None:
    state = initial_adapt_state(TreeConfig())
    cheap = VerifyCost({1: 0.020, 8: 0.022, 16: 0.024, 32: 0.028})
    steep = VerifyCost({1: 0.013, 8: 0.026, 16: 0.044, 32: 0.077})
    confident = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.3, 0.2, 0.2, 0.2, 0.2, 0.1, 0.1, 0.1, 0.1] + [0.05] * 15
    assert choose_budget(confident, state, cheap, 32) == 16  # 1 + 6.4 tokens / 24 ms beats 32 nodes' 8.25 / 28 ms
    assert choose_budget(confident, state, steep, 32) <= 8
    assert choose_budget([0.01] * 31, state, steep, 32) == 1  # nothing worth verifying


def test_fallback_to_plain_decoding_when_speculation_does_not_pay() -> None:
    tree, decode = TreeConfig(), DecodeConfig()
    state = initial_adapt_state(tree)
    cost = VerifyCost({1: 0.020, 32: 0.080})
    for _ in range(4):
        update_after_step(state, tree, decode, cost, 31, 3.0, 0, 0.005, 32)
    assert not state.speculating and state.plain_steps_left == decode.reprobe_every
    for _ in range(decode.reprobe_every):
        update_after_step(state, tree, decode, cost, 0, 0.0, 0, 0.0, 1)
    assert state.speculating  # re-probes after the plain stretch


def test_a_budget_whose_trees_underdeliver_gets_its_own_lower_calibration() -> None:
    tree, decode = TreeConfig(), DecodeConfig()
    state = initial_adapt_state(tree)
    cost = VerifyCost({1: 0.020, 16: 0.030, 32: 0.040})
    scores = [0.9, 0.9] + [0.1] * 29  # 16 nodes predict 3.1 drafts, 32 nodes 4.7
    for _ in range(30):  # 16-node trees deliver what they predict
        update_after_step(state, tree, decode, cost, 15, sum(scores[:15]), 3, 0.0, 16)
    for _ in range(30):  # 32-node trees deliver nothing more: their tail is over-confident
        update_after_step(state, tree, decode, cost, 31, sum(scores), 3, 0.0, 32)
    assert state.budget_calibration[32] < 0.7 < 0.9 < state.budget_calibration[16]
    # one global factor (~0.66 now) would rate 32 nodes (4.1 tokens / 40 ms) above 16 (3.0 / 30 ms)
    assert choose_budget(scores, state, cost, 32) == 16


def test_draft_limits_follow_the_chosen_budget_with_room_to_double() -> None:
    tree = TreeConfig(depth=5, max_nodes=32)
    state = initial_adapt_state(tree)
    assert draft_limits(state, tree) == (5, 32)  # nothing chosen yet: the whole tree
    state.chosen_budget = 2
    assert draft_limits(state, tree) == (3, 4)  # a 2-node budget drafts 4 nodes, up to 3 levels deep
    state.chosen_budget = 3
    assert draft_limits(state, tree) == (5, 6)
    state.chosen_budget = 8
    assert draft_limits(state, tree) == (5, 16)
    state.chosen_budget = 32
    assert draft_limits(state, tree) == (5, 32)  # never past the configured ceiling


def chain_draft(scores: list[float]) -> Draft:
    """A chain of len(scores) draft nodes under a root, with those cumulative scores."""
    size = len(scores) + 1
    return Draft(Tree(tuple(range(-1, size - 1)), tuple(range(size))), (1.0, *scores), "deterministic")


def test_the_budget_policy_sizes_prunes_observes_and_falls_back_on_its_own() -> None:
    tree, decode = TreeConfig(kind="chain", depth=8, width=1, max_nodes=32), DecodeConfig()
    cost = VerifyCost({1: 0.020, 2: 0.021, 4: 0.022, 8: 0.040, 16: 0.080})
    policy = BudgetPolicy(tree, decode, cost, initial_adapt_state(tree))
    assert policy.limits() == DraftLimits(8, 1, 32)  # nothing chosen yet: the whole tree
    pruned = policy.prune(chain_draft([0.9, 0.8, 0.7, 0.2, 0.1, 0.05, 0.02, 0.01]))
    assert pruned.tree.size == 4 and policy.state.chosen_budget == 4  # 8 nodes cost twice as much for ~0.3 tokens
    assert policy.limits() == DraftLimits(7, 1, 8)  # room to double
    policy.observe(pruned, accepted=3, draft_seconds=0.001, verify_seconds=0.030)
    assert cost.seconds[4] == pytest.approx(0.9 * 0.022 + 0.1 * 0.030)  # the measured cost is refined
    steps = 0
    while policy.limits() is not None and steps < 20:  # nothing accepted: plain decoding pays better
        policy.observe(pruned, accepted=0, draft_seconds=0.001, verify_seconds=0.030)
        steps += 1
    assert PROBES_BEFORE_FALLBACK <= steps < 20 and policy.state.plain_steps_left == decode.reprobe_every
    untimed = BudgetPolicy(tree, decode, cost, initial_adapt_state(tree, timed=False))
    draft = chain_draft([0.9, 0.8, 0.7, 0.2, 0.1, 0.05, 0.02, 0.01])
    assert untimed.prune(draft) is draft  # reproducible runs never size drafts from the clock


def test_kept_calibrations_that_fall_with_more_rows_are_not_trusted() -> None:
    from causaldraft.adapt import plausible_calibration

    assert plausible_calibration({1: 0.010, 2: 0.012, 4: 0.011, 8: 0.020})
    assert not plausible_calibration({1: 0.025, 2: 0.139, 4: 0.034, 8: 0.062})
    assert plausible_calibration({})
