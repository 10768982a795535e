"""Cost model and adaptation: how big a tree pays off, and when to stop speculating.

t_verify(n) is measured on this machine (a short calibration at load, then refreshed from every
step); the expected tokens per step of a tree pruned to n nodes is 1 + c_n * (sum of its node
scores), where c_n is the observed calibration (accepted drafts / predicted) of the steps that ran
at that budget class, or the global calibration c while a class is untried. A calibration per
budget matters because drafters are over-confident in the tail: on MT-bench the 16 weakest nodes
of a 32-node Markov tree added ~0.1 tokens per step while costing a third more verify time, which
one global factor cannot see. The loop keeps the node budget maximising
E[tokens] / (t_verify(n) + t_draft) and falls back to plain decoding when even the best budget is
predicted slower than one token per t_verify(1), re-probing periodically.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from causaldraft.config import DecodeConfig, TreeConfig
from causaldraft.drafters.base import Draft
from causaldraft.models.base import Backend

CALIBRATION_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
BUDGETS = (2, 3, 4, 6, 8, 12, 16, 20, 24, 32, 48, 64)
# moving averages: the weight an old value keeps at each step
COST_KEEP = 0.9  # measured verify seconds per node count
TOKENS_KEEP = 0.8  # tokens per speculative step, and drafting seconds
CALIBRATION_KEEP = 0.9  # accepted drafts / predicted, globally and per budget class
DEPTH_KEEP = 0.9  # hit rate per draft depth
CALIBRATION_FLOOR = 0.05
BUDGET_CALIBRATION_CEILING = 2.0  # a budget class may earn more than its scores predict, up to this
NARROW_AT_HIT_RATE = 0.8  # depth-1 hit rate above which trees drop one branch per level
PROBES_BEFORE_FALLBACK = 4  # speculative steps measured before speculation may be judged unprofitable
STEPS_TO_FORGIVE = 8  # profitable steps after which past fallbacks are forgotten
MAX_BACKOFF_DOUBLINGS = 4  # plain stretches grow 2x per consecutive fallback, up to 16x


def round_up(sizes: tuple[int, ...], n: int) -> int:
    """The smallest of ``sizes`` (ascending) that is >= n, or n itself past the largest."""
    return next((size for size in sizes if size >= n), n)


@dataclass
class VerifyCost:
    """Seconds of one target pass by number of new tokens, interpolated between measured sizes.

    ``buckets``: a compiled backend pads n new tokens up to the next bucket, so a pass costs what
    its bucket costs (12 nodes cost a 16-row pass); sizes past the largest bucket run eagerly.
    """

    seconds: dict[int, float] = field(default_factory=dict)
    buckets: tuple[int, ...] = ()

    def padded(self, nodes: int) -> int:
        return round_up(self.buckets, nodes)

    def __call__(self, nodes: int) -> float:
        nodes = self.padded(nodes)
        sizes = sorted(self.seconds)
        if not sizes:
            return 1.0
        if nodes <= sizes[0]:
            return self.seconds[sizes[0]]
        for low, high in zip(sizes, sizes[1:], strict=False):
            if nodes <= high:
                share = (nodes - low) / (high - low)
                return self.seconds[low] * (1 - share) + self.seconds[high] * share
        return self.seconds[sizes[-1]] * nodes / sizes[-1]

    def update(self, nodes: int, seconds: float) -> None:
        nodes = self.padded(nodes)
        key = min(self.seconds, key=lambda size: abs(size - nodes)) if self.seconds else nodes
        if key != nodes and abs(key - nodes) > max(1, nodes // 4):
            key = nodes
        previous = self.seconds.get(key, seconds)
        self.seconds[key] = COST_KEEP * previous + (1 - COST_KEEP) * seconds


CALIBRATION_SLACK = 0.8  # a kept pass over more rows may cost no less than this share of one over fewer


# Kept calibrations carry this in their names; raise it when what a pass costs changes outside the
# compiled graphs (whose key changes with their code): 2, the LM head through oneDNN (models/packed.py).
CALIBRATION_VERSION = 2


def calibration_name(kind: str, aux_layers: tuple[int, ...]) -> str:
    """The name a calibration is kept under, e.g. ``v2 max_nodes=16 aux_layers=[]``."""
    return f"v{CALIBRATION_VERSION} {kind} aux_layers={list(aux_layers)}"


def plausible_calibration(seconds: dict[int, float]) -> bool:
    """Whether kept verify timings can be trusted: a pass over more rows never costs much less than
    one over fewer. A calibration timed while another process ran breaks that (seen: 2 rows at
    139 ms, 4 rows at 34 ms), and it would starve every later run of draft trees.

    Example: {1: 0.010, 2: 0.012, 4: 0.011} is plausible (0.011 >= 0.8 * 0.012); {2: 0.139, 4: 0.034}
    is not."""
    sizes = sorted(seconds)
    pairs = zip(sizes, sizes[1:], strict=False)
    return all(seconds[larger] >= CALIBRATION_SLACK * seconds[smaller] for smaller, larger in pairs)


def measure_verify_cost(
    backend: Backend, max_nodes: int, context: int = 128, repeats: int = 2, aux_layers: tuple[int, ...] = ()
) -> VerifyCost:
    """Time target passes over n new tokens after a ``context``-token prefix (returning the
    drafter's ``aux_layers`` features, as the decode loop's passes do)."""
    cache = backend.new_cache(context + max(CALIBRATION_SIZES) + 1)
    prefix = torch.zeros(context, dtype=torch.long)
    backend.forward(prefix, torch.arange(context), torch.ones(context, context, dtype=torch.bool).tril(), cache)
    buckets = backend.buckets
    cost = VerifyCost(buckets=buckets)
    sizes = sorted({cost.padded(size) for size in CALIBRATION_SIZES if size <= max(max_nodes, 1)})
    for size in sizes:
        tokens = torch.zeros(size, dtype=torch.long)
        positions = torch.arange(context, context + size)
        mask = torch.ones(size, context + size, dtype=torch.bool).tril(context)
        timings = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            backend.forward(tokens, positions, mask, cache, aux_layers=aux_layers)
            timings.append(time.perf_counter() - started)
            cache.rollback(context)
        cost.seconds[size] = min(timings[1:])
    return cost


@dataclass
class AdaptState:
    """Explicit adaptation state carried across steps (and across requests of one engine)."""

    depth: int
    width: int
    tokens_per_step: float = 2.0  # EMA of tokens emitted per speculative step
    score_calibration: float = 1.0  # EMA of accepted drafts / predicted (sum of scores)
    draft_seconds: float = 0.0
    speculating: bool = True
    plain_steps_left: int = 0
    failures: int = 0
    probe_steps: int = 0
    depth_hits: list[float] = field(default_factory=list)
    budget_calibration: dict[int, float] = field(default_factory=dict)  # budget class -> its own calibration
    chosen_budget: int = 0  # the node budget of the last pruned draft (0: none yet)
    timed: bool = True  # False: no decision depends on measured times (seeded, reproducible runs)


def initial_adapt_state(tree: TreeConfig, timed: bool = True) -> AdaptState:
    return AdaptState(depth=tree.depth, width=tree.width, depth_hits=[0.5] * tree.depth, timed=timed)


def budget_class(nodes: int) -> int:
    """The candidate budget a tree of ``nodes`` nodes counts under."""
    return round_up(BUDGETS, nodes)


def budget_calibration(state: AdaptState, budget: int) -> float:
    return state.budget_calibration.get(budget_class(budget), state.score_calibration)


def expected_tokens(scores: list[float], state: AdaptState, budget: int) -> float:
    """Tokens a step emits, expected, from a tree pruned to ``budget`` nodes (scores sorted high to low)."""
    return 1.0 + budget_calibration(state, budget) * sum(scores[: budget - 1]) if budget > 1 else 1.0


def choose_budget(scores: list[float], state: AdaptState, cost: VerifyCost, max_nodes: int) -> int:
    """The node count maximising expected tokens per second, given scores sorted high to low."""
    best_nodes, best_rate = 1, 1.0 / cost(1)
    for budget in (b for b in BUDGETS if b <= min(max_nodes, len(scores) + 1)):
        expected = expected_tokens(scores, state, budget)
        rate = expected / (cost(budget) + state.draft_seconds)
        if rate > best_rate:
            best_nodes, best_rate = budget, rate
    return best_nodes


def draft_limits(state: AdaptState, tree: TreeConfig) -> tuple[int, int]:
    """(depth, max_nodes) to draft for: the tree's, or, once budgets are chosen from measured
    costs, twice the last chosen budget (rounded up to a budget class), no deeper than that many
    nodes allow (e.g. budget 2: 4 nodes, 3 levels; budget 8: 8 -> 16 nodes).

    Drafting what will be pruned is pure cost (Markov heads: one vocabulary projection per level,
    ~1.5 ms on this CPU): with a 2-node budget a full 4-level 32-node tree cost 5-9 ms to draft,
    as much as the int4 verify pass itself. Room to double keeps budgets free to climb: allowing
    only one class of growth per step starved bf16 Markov trees at 3 nodes (MT-bench: mean
    accepted 1.74 instead of 2.48, 64 instead of 72 tokens/s).
    """
    if not state.chosen_budget:
        return state.depth, tree.max_nodes
    max_nodes = min(tree.max_nodes, round_up(BUDGETS, 2 * state.chosen_budget))
    return min(state.depth, max_nodes - 1), max_nodes


def update_after_step(
    state: AdaptState,
    tree: TreeConfig,
    decode: DecodeConfig,
    cost: VerifyCost,
    drafted: int,
    predicted: float,
    accepted: int,
    draft_seconds: float,
    nodes: int,
) -> None:
    """Fold one speculative step's outcome into the state; maybe switch to plain decoding."""
    if not state.speculating:
        state.plain_steps_left -= 1
        if state.plain_steps_left <= 0:
            state.speculating, state.probe_steps = True, 0
        return
    if drafted == 0:
        return
    state.probe_steps += 1
    state.tokens_per_step = ema(state.tokens_per_step, accepted + 1, TOKENS_KEEP)
    state.draft_seconds = (
        ema(state.draft_seconds, draft_seconds, TOKENS_KEEP) if state.probe_steps > 1 else draft_seconds
    )
    if predicted > 0:
        # Capped at 1: one global factor cannot tell strong nodes from the weak tail, and inflating
        # every score (e.g. when merged lookup paths outperform the heads) buys oversized trees.
        ratio = min(1.0, max(CALIBRATION_FLOOR, accepted / predicted))
        state.score_calibration = ema(state.score_calibration, ratio, CALIBRATION_KEEP)
        key = budget_class(nodes)
        own = max(CALIBRATION_FLOOR, min(BUDGET_CALIBRATION_CEILING, accepted / predicted))
        state.budget_calibration[key] = ema(state.budget_calibration.get(key, state.score_calibration), own,
                                            CALIBRATION_KEEP)  # fmt: skip
    for depth in range(min(len(state.depth_hits), accepted + 1)):
        state.depth_hits[depth] = ema(state.depth_hits[depth], float(depth < accepted), DEPTH_KEEP)
    if decode.adapt and tree.kind == "chain":
        state.depth = max(1, min(tree.depth, round(state.tokens_per_step) + 1))
    if decode.adapt and tree.kind != "chain":
        state.width = tree.width if state.depth_hits[0] < NARROW_AT_HIT_RATE else max(1, tree.width - 1)
    speedup = state.tokens_per_step * cost(1) / (cost(nodes) + state.draft_seconds)
    if decode.fallback and state.timed and state.probe_steps >= PROBES_BEFORE_FALLBACK and speedup < 1.0:
        state.failures += 1
        state.speculating = False
        state.plain_steps_left = decode.reprobe_every * 2 ** min(state.failures - 1, MAX_BACKOFF_DOUBLINGS)
        state.tokens_per_step = AdaptState.tokens_per_step
    elif speedup >= 1.0 and state.probe_steps >= STEPS_TO_FORGIVE:
        state.failures = 0


def ema(previous: float, value: float, keep: float) -> float:
    return keep * previous + (1 - keep) * value


@dataclass
class BudgetPolicy:
    """How big a draft may be, which of its nodes are verified, and when to stop speculating.

    It owns the measured verify cost (shared by an engine's requests) and the adaptation state;
    the decode loop asks ``limits()`` before drafting, ``prune()`` after, and ``observe()`` after
    each verify pass. Sizing from measured times is off when adaptation is off or the run must
    not depend on the clock (``state.timed`` False)."""

    tree: TreeConfig
    decode: DecodeConfig
    cost: VerifyCost
    state: AdaptState

    @property
    def sized(self) -> bool:
        return self.decode.adapt and self.state.timed

    def limits(self) -> DraftLimits | None:
        """What to draft this step; None: decode plainly (after a fallback)."""
        if not self.state.speculating:
            return None
        depth, max_nodes = (
            draft_limits(self.state, self.tree) if self.sized else (self.state.depth, self.tree.max_nodes)
        )
        return DraftLimits(depth, self.state.width, max_nodes)

    def prune(self, draft: Draft) -> Draft:
        """Keep the node budget that maximises expected tokens per second (at least one draft
        node: whether speculating pays at all is the fallback's call, from real acceptance)."""
        if draft.tree.size <= 2 or not self.sized or draft.child_mode != "deterministic":
            return draft
        ranked = sorted(draft.scores[1:], reverse=True)
        budget = max(2, choose_budget(ranked, self.state, self.cost, self.tree.max_nodes))
        self.state.chosen_budget = budget
        if budget >= draft.tree.size:
            return draft
        return draft.pruned(budget)

    def observe(self, draft: Draft, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        nodes = draft.tree.size
        self.cost.update(nodes, verify_seconds)
        predicted = sum(draft.scores[1:]) if nodes > 1 else 0.0
        update_after_step(self.state, self.tree, self.decode, self.cost, nodes - 1, predicted, accepted,
                          draft_seconds, nodes)  # fmt: skip


@dataclass(frozen=True)
class DraftLimits:
    depth: int
    width: int
    max_nodes: int
