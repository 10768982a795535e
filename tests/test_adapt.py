"""The cost model: verify cost by node count (eager and compiled buckets) and the budget choice."""

import time
from dataclasses import replace
from pathlib import Path

import pytest

from causaldraft.adapt import (
    FLAT_COST_DEPTH,
    FLAT_COST_LOOKUP_DEPTH,
    BudgetPolicy,
    DepthGate,
    VerifyCost,
    choose_budget,
    dynamic_depth,
    flat_cost_tree,
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


def test_fixed_trees_fall_back_to_plain_decoding_when_speculation_does_not_pay() -> None:
    tree, decode = TreeConfig(), DecodeConfig(adapt=False)
    state = initial_adapt_state(tree)
    cost = VerifyCost({1: 0.020, 32: 0.080})
    for _ in range(4):
        update_after_step(state, tree, decode, cost, 31, 3.0, 0, 0.005, 32)
    assert not state.speculating and state.plain_steps_left == decode.reprobe_every
    for _ in range(decode.reprobe_every):
        update_after_step(state, tree, decode, cost, 0, 0.0, 0, 0.0, 1)
    assert state.speculating  # re-probes after the plain stretch


def chain_draft(scores: list[float]) -> Draft:
    """A chain of len(scores) draft nodes under a root, with those cumulative scores."""
    size = len(scores) + 1
    return Draft(Tree(tuple(range(-1, size - 1)), tuple(range(size))), (1.0, *scores), "deterministic")


def test_the_depth_gate_drafts_a_level_only_when_it_pays() -> None:
    """The example of DepthGate's docstring: verify 25 ms up to 8 nodes, calibration 1."""
    state = initial_adapt_state(TreeConfig())
    cost = VerifyCost({1: 0.025, 8: 0.025, 16: 0.050})
    state.level_seconds = [0.002, 0.002]
    gate = DepthGate(state, cost, 32, reprobe_every=16, started=time.perf_counter())
    assert gate([0.9, 0.3], [0.9], 1) and gate.allowed == 2  # 2.97 / 27 ms beats 2.2 / 25 ms
    state.level_seconds = [0.020, 0.020]
    assert not DepthGate(state, cost, 32, reprobe_every=16, started=time.perf_counter())([0.9, 0.3], [0.9], 1)
    # a first level whose best guesses cannot pay for its 30 ms: the step decodes plainly
    state.level_seconds = [0.030]
    assert not DepthGate(state, cost, 32, reprobe_every=16, started=time.perf_counter())([], [1.0], 0)
    # ... unless told never to fall back
    assert DepthGate(state, cost, 32, reprobe_every=16, started=time.perf_counter(), always_first=True)([], [1.0], 0)


def test_the_depth_gate_times_each_level_it_allowed() -> None:
    gate = DepthGate(initial_adapt_state(TreeConfig()), VerifyCost({1: 0.02}), 32, reprobe_every=16, started=100.0)
    gate.stamps, gate.allowed = [100.001, 100.003, 100.004], 2  # the third call declined level 2
    assert gate.level_times(0.006) == pytest.approx([0.002, 0.001])
    gate.allowed = 3  # allowed: the last level ran until drafting ended
    assert gate.level_times(0.006) == pytest.approx([0.002, 0.001, 0.002])


def test_the_sized_policy_gates_prunes_learns_level_costs_and_reprobes() -> None:
    tree, decode = TreeConfig(kind="chain", depth=8, width=1, max_nodes=32), DecodeConfig()
    cost = VerifyCost({1: 0.020, 2: 0.021, 4: 0.022, 8: 0.040, 16: 0.080})
    policy = BudgetPolicy(tree, decode, cost, initial_adapt_state(tree))
    limits = policy.limits()
    assert limits is not None and (limits.depth, limits.width, limits.max_nodes) == (8, 1, 32)
    assert limits.gate is policy.gate is not None
    assert limits.gate([], [1.0], 0)  # no level cost known yet: drafting looks free
    pruned = policy.prune(chain_draft([0.9, 0.8, 0.7, 0.2, 0.1, 0.05, 0.02, 0.01]))
    assert pruned.tree.size == 4  # 8 nodes cost twice as much for ~0.3 tokens
    policy.observe(pruned, accepted=3, draft_seconds=0.004, verify_seconds=0.030)
    assert cost.seconds[4] == pytest.approx(0.9 * 0.022 + 0.1 * 0.030)  # the measured cost is refined
    assert policy.state.level_seconds and policy.gate is None
    policy.limits()
    assert policy.prune(chain_draft([0.01, 0.001])).tree.size == 1  # nothing worth verifying: the root alone
    policy.observe(chain_draft([]), accepted=0, draft_seconds=0.0, verify_seconds=0.020)
    # levels that cost more than they can bring are declined; every reprobe_every-th step probes
    policy.state.level_seconds = [0.050]
    declined = 0
    while True:
        limits = policy.limits()
        assert limits is not None  # no plain stretches under a gate
        assert limits.gate is not None
        if limits.gate([], [1.0], 0):
            break
        declined += 1
        policy.observe(chain_draft([]), accepted=0, draft_seconds=0.0, verify_seconds=0.020)
    assert declined == decode.reprobe_every - 1  # the root-alone step above counts too
    assert policy.prune(chain_draft([0.01, 0.001])).tree.size == 2  # a probe verifies a draft node, however unsure
    policy.observe(chain_draft([0.01]), accepted=0, draft_seconds=0.0, verify_seconds=0.020)
    assert policy.state.declined == 0
    # reproducible runs never size drafts from the clock: their scores alone decide
    untimed = BudgetPolicy(tree, decode, cost, initial_adapt_state(tree, timed=False))
    limits = untimed.limits()
    assert limits is not None and limits.gate is not None and untimed.gate is None
    assert limits.gate([], [1.0], 0) and limits.gate([0.9], [0.5, 0.1], 1) and not limits.gate([0.9], [0.19], 1)
    draft = chain_draft([0.9, 0.8, 0.7, 0.2, 0.1, 0.05, 0.02, 0.01])
    assert untimed.prune(draft).tree.tokens == (0, 1, 2, 3, 4)  # the nodes scoring >= untimed_min_score (0.2)
    assert untimed.prune(chain_draft([0.1])).tree.size == 1  # nothing sure enough: a plain step
    fixed = BudgetPolicy(tree, replace(decode, adapt=False), cost, initial_adapt_state(tree, timed=False))
    fixed_limits = fixed.limits()
    assert fixed_limits is not None and fixed_limits.gate is None and fixed.prune(draft) is draft  # --no-adapt


def test_lookup_paths_reach_lookup_depth_only_where_the_policy_prunes() -> None:
    """Lookup paths cost no drafting, so adaptive policies (which prune by score) let them reach
    ``lookup_depth``; fixed trees verify what they draft, so theirs stay within the tree's depth."""
    tree, cost = TreeConfig(depth=8, lookup_depth=20), VerifyCost({1: 0.020, 32: 0.030})
    for timed in (True, False):
        limits = BudgetPolicy(tree, DecodeConfig(), cost, initial_adapt_state(tree, timed=timed)).limits()
        assert limits is not None and (limits.depth, limits.lookup_depth) == (8, 20)
    fixed = BudgetPolicy(tree, DecodeConfig(adapt=False), cost, initial_adapt_state(tree, timed=False)).limits()
    assert fixed is not None and fixed.lookup_depth == 8
    default = BudgetPolicy(TreeConfig(depth=8), DecodeConfig(), cost, initial_adapt_state(TreeConfig(depth=8))).limits()
    assert default is not None and default.lookup_depth == 8  # off unless asked for: the tree's depth


def test_a_level_declined_for_an_old_slow_time_is_timed_again() -> None:
    """One slow measurement of the second level (a kernel built at its first call) made the gate
    decline it for good, since a declined level is never timed. After reprobe_every gated steps
    without a time it is drafted once and its new time replaces the old one."""
    tree, decode = TreeConfig(kind="chain", depth=4, width=1, max_nodes=32), DecodeConfig()
    cost = VerifyCost({1: 0.020, 2: 0.020, 4: 0.021, 8: 0.040})
    policy = BudgetPolicy(tree, decode, cost, initial_adapt_state(tree))
    policy.state.level_seconds, policy.state.level_age = [0.001, 0.050], [0, 0]

    def step(second_level_seconds: float) -> bool:
        """One step whose first level is drafted; whether the gate allowed the second."""
        limits = policy.limits()
        assert limits is not None and limits.gate is not None
        gate = limits.gate
        assert gate([], [1.0], 0)
        allowed = gate([0.6], [0.6], 1)
        gate.stamps[0] = gate.started  # the first level took 1 ms, the second (when drafted) as given
        gate.stamps[1] = gate.started + 0.001
        drafted = chain_draft([0.6, 0.3] if allowed else [0.6])
        policy.observe(drafted, accepted=1, draft_seconds=0.001 + (second_level_seconds if allowed else 0.0),
                       verify_seconds=0.020)  # fmt: skip
        return allowed

    declined = 0
    while not step(0.0012):
        declined += 1
        assert declined <= decode.reprobe_every
    assert declined == decode.reprobe_every
    assert policy.state.level_seconds[1] == pytest.approx(0.0012)  # replaced, not averaged with 50 ms
    assert policy.state.level_age == [0, 0]
    assert step(0.0012)  # now it pays: drafted on its merits


def test_kept_calibrations_that_fall_with_more_rows_are_not_trusted() -> None:
    from causaldraft.adapt import plausible_calibration

    assert plausible_calibration({1: 0.010, 2: 0.012, 4: 0.011, 8: 0.020})
    assert not plausible_calibration({1: 0.025, 2: 0.139, 4: 0.034, 8: 0.062})
    assert plausible_calibration({})


def test_dynamic_trees_go_deeper_where_verify_passes_cost_about_the_same_over_2_and_16_rows() -> None:
    onednn_amx = VerifyCost({2: 0.0164, 8: 0.0177, 16: 0.0196, 32: 0.0250}, buckets=(2, 4, 8, 16, 32))
    kernel = VerifyCost({1: 0.0147, 2: 0.0155, 8: 0.0196, 16: 0.0291, 32: 0.0498}, buckets=(1, 2, 4, 8, 16, 32))
    assert dynamic_depth(onednn_amx, 8) == FLAT_COST_DEPTH == 12
    assert dynamic_depth(kernel, 8) == 8
    assert dynamic_depth(onednn_amx, 16) == 16  # never shallower than asked
    dynamic = TreeConfig(kind="dynamic", depth=8)
    assert flat_cost_tree(dynamic, onednn_amx, False, False) == replace(dynamic, depth=12, lookup_depth=24)
    assert flat_cost_tree(dynamic, kernel, False, False) == dynamic
    assert flat_cost_tree(replace(dynamic, depth=30), onednn_amx, True, False).lookup_depth == 30  # never below depth
    assert flat_cost_tree(replace(dynamic, lookup_depth=10), onednn_amx, False, True).lookup_depth == 10  # as set
    static = TreeConfig(kind="static", depth=5)
    assert flat_cost_tree(static, onednn_amx, False, False) == static


def test_the_engine_deepens_only_a_default_dynamic_tree_and_only_from_measured_costs(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import causaldraft
    from causaldraft import api

    flat = VerifyCost({1: 0.010, 2: 0.010, 16: 0.011, 64: 0.012})
    monkeypatch.setattr(api, "verify_cost", lambda *args, **kwargs: VerifyCost(dict(flat.seconds)))
    directory = str(tiny_llama_dir)
    deep = causaldraft.load(directory, dtype="float32", drafter="lookup", compile=False)
    assert deep.decoder.tree.depth == FLAT_COST_DEPTH and deep.adapt.depth == FLAT_COST_DEPTH
    assert deep.decoder.tree.lookup_depth == FLAT_COST_LOOKUP_DEPTH
    assert (
        causaldraft.load(
            directory, dtype="float32", drafter="lookup", lookup_depth=9, compile=False
        ).decoder.tree.lookup_depth
        == 9
    )
    assert (
        causaldraft.load(directory, dtype="float32", drafter="lookup", depth=6, compile=False).decoder.tree.depth == 6
    )
    assert (
        causaldraft.load(directory, dtype="float32", drafter="lookup", tree="static", compile=False).decoder.tree.depth
        == 5
    )
    uncalibrated = causaldraft.load(directory, dtype="float32", drafter="lookup", calibrate=False, compile=False)
    assert uncalibrated.decoder.tree.depth == 8  # no measured costs: the kind's default
    assert uncalibrated.decoder.tree.lookup_depth is None
    monkeypatch.setattr(api, "verify_cost", lambda *args, **kwargs: VerifyCost({1: 0.010, 2: 0.011, 16: 0.030}))
    assert causaldraft.load(directory, dtype="float32", drafter="lookup", compile=False).decoder.tree.depth == 8


def test_a_kept_calibration_holds_while_its_smallest_and_largest_passes_take_about_what_it_kept() -> None:
    from causaldraft.adapt import calibration_holds

    kept = {1: 0.0199, 2: 0.0203, 8: 0.0293}  # int4, timed while the machine was busy (stop 36)
    assert not calibration_holds(kept, VerifyCost({1: 0.0056, 8: 0.0100}))
    assert calibration_holds(kept, VerifyCost({1: 0.0170, 8: 0.0250}))
    assert not calibration_holds(kept, VerifyCost({1: 0.0400, 8: 0.0500}))  # now much slower: timed again too
    assert not calibration_holds(kept, VerifyCost({1: 0.0199, 8: 0.0100}))  # only the big passes were slow then
    assert not calibration_holds({2: 0.010}, VerifyCost({1: 0.010}))  # other sizes: no comparison
    assert not calibration_holds(kept, VerifyCost({}))
