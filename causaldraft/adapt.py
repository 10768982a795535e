"""Cost model and adaptation: how big and how deep a tree pays off, and when to stop speculating.

t_verify(n) is measured on this machine (a short calibration at load, then refreshed from every
step); the expected tokens per step of a tree pruned to n nodes is 1 + c * (sum of its n - 1 best
node scores), where c is the observed calibration (accepted drafts / predicted, capped at 1).
The loop keeps the node budget maximising E[tokens] / (t_verify(n) + t_draft), with t_draft the
drafting time the step actually spent; the root alone (a plain step) is one of the choices.

How deep to draft is decided level by level, while drafting (``DepthGate``): before each level the
gate compares the best expected rate of the tree drafted so far (pruned to its best budget, with
the drafting time already spent) with an optimistic guess of the rate one level deeper (each
frontier node's best children at fixed shares of its score, at the measured cost of that level).
A level that cannot pay for itself is not drafted; when the first one cannot, the step decodes
plainly (a re-probe every ``reprobe_every`` such steps keeps the estimates current).

Replayed on teacher-forced drafting logs of 16 MT-bench prompts (docs/design.md, "Cost model"), this
was worth +18-29 % tokens/s against the previous policy (the next tree sized from the last chosen
budget, a calibration per budget class, and plain stretches after unprofitable steps), for Markov
heads and eagle3 in bf16 and int4: most steps need one or two levels, a few (copied text, confident
runs) need all of them, and drafting every level of a tree pruned to 3 nodes cost up to a third of
the verify pass. Per-budget calibrations and the fallback's plain stretches each cost 4-8 % under
the gate, so a sized policy has neither; the fallback remains for fixed trees (``--no-adapt``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from causaldraft.config import DecodeConfig, TreeConfig
from causaldraft.drafters.base import Draft
from causaldraft.models.base import Backend
from causaldraft.tree import LevelGate

CALIBRATION_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
BUDGETS = (2, 3, 4, 6, 8, 12, 16, 20, 24, 32, 48, 64)
# moving averages: the weight an old value keeps at each step
COST_KEEP = 0.9  # measured verify seconds per node count
TOKENS_KEEP = 0.8  # tokens per speculative step, and drafting seconds
CALIBRATION_KEEP = 0.9  # accepted drafts / predicted
DEPTH_KEEP = 0.9  # hit rate per draft depth
CALIBRATION_FLOOR = 0.05
NARROW_AT_HIT_RATE = 0.8  # depth-1 hit rate above which trees drop one branch per level
PROBES_BEFORE_FALLBACK = 4  # speculative steps measured before speculation may be judged unprofitable
STEPS_TO_FORGIVE = 8  # profitable steps after which past fallbacks are forgotten
MAX_BACKOFF_DOUBLINGS = 4  # plain stretches grow 2x per consecutive fallback, up to 16x
LEVEL_KEEP = 0.8  # measured seconds of drafting one tree level, per level
# A frontier node's best children, guessed as shares of its score before drafting them: an optimistic
# guess (the replayed logs: 0.4..0.7 for the best child changed tokens/s by < 2 %).
CHILD_SHARES = (0.5, 0.25, 0.1)


# A dynamic tree's default depth where verify passes cost about the same over 2 and 16 rows: deep paths are
# then nearly free to verify, and confident runs (lists, code, repeated phrases) accept all of them. bf16 through
# oneDNN on an AMX Xeon (2 / 16 rows 16.4 / 19.6 ms): depth 12 against 8 gave eagle3 142.6 / 138.9 tokens/s against
# ~110-121 and markov and lookup +15-22 %; with `bf16_mm` there (18.2 / 29.1 ms) depth 12 changed nothing, nor in
# int4; on Zen (stop 28, oneDNN without AMX) depths 12 and 16 lost to 8 (docs/results/history.md, stop 36)
FLAT_COST_DEPTH = 12
FLAT_COST_RATIO = 1.3  # cost(16 rows) / cost(2 rows) at or below which passes count as flat


FLAT_COST_LOOKUP_DEPTH = 24  # prompt-lookup paths' depth where passes are flat (``TreeConfig.lookup_depth``)


def flat_costs(cost: VerifyCost) -> bool:
    """Whether the calibrated ``cost`` of a 16-row pass is at most ``FLAT_COST_RATIO`` times a 2-row pass's."""
    return cost(16) <= FLAT_COST_RATIO * cost(2)


def dynamic_depth(cost: VerifyCost, depth: int) -> int:
    """The depth ceiling of a dynamic tree left at its default ``depth``: ``FLAT_COST_DEPTH`` where passes are
    flat (``flat_costs``), else ``depth``."""
    return max(depth, FLAT_COST_DEPTH) if flat_costs(cost) else depth


def flat_cost_tree(tree: TreeConfig, cost: VerifyCost, depth_set: bool, lookup_depth_set: bool) -> TreeConfig:
    """A dynamic ``tree`` for measured costs: where passes are flat, a default depth goes to ``FLAT_COST_DEPTH``
    and a default lookup depth to ``FLAT_COST_LOOKUP_DEPTH`` (copied paths cost no drafting, and their extra rows
    almost nothing there: eagle3 accepted 3.47-3.50 tokens per pass against 3.37-3.40 with lookup paths held to the
    tree's depth, at the same tokens/s, stop 37). Other kinds, and what the user set, are kept.

    Example: flat costs, nothing set: depth 8 -> 12, lookup depth None -> 24."""
    if tree.kind != "dynamic" or not flat_costs(cost):
        return tree
    depth = tree.depth if depth_set else dynamic_depth(cost, tree.depth)
    lookup_depth = tree.lookup_depth if lookup_depth_set else max(depth, FLAT_COST_LOOKUP_DEPTH)
    return replace(tree, depth=depth, lookup_depth=lookup_depth)


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
# compiled graphs (whose key changes with their code), or how it is measured: 2, the LM head through
# oneDNN (models/packed.py); 3, medians of interleaved rounds (``measure_verify_cost``).
CALIBRATION_VERSION = 3


def calibration_name(kind: str, aux_layers: tuple[int, ...], backend: object) -> str:
    """The name a calibration is kept under, e.g. ``v3 max_nodes=16 aux_layers=[] head=Q8_0Head/amx``: the LM
    head runs outside the compiled graphs, and which one a model has (models/q8_0_head.py, packed.py)
    depends on the CPU and on a switch, so its kind is part of the name."""
    head = getattr(backend, "lm_head", None)
    build = getattr(head, "build", None)  # a Q8_0 head's kernel build: its passes cost another time
    name = type(head).__name__ if build is None else f"{type(head).__name__}/{build}"
    return f"v{CALIBRATION_VERSION} {kind} aux_layers={list(aux_layers)} head={name}"


def plausible_calibration(seconds: dict[int, float]) -> bool:
    """Whether kept verify timings can be trusted: a pass over more rows never costs much less than
    one over fewer. A calibration timed while another process ran breaks that (seen: 2 rows at
    139 ms, 4 rows at 34 ms), and it would starve every later run of draft trees.

    Example: {1: 0.010, 2: 0.012, 4: 0.011} is plausible (0.011 >= 0.8 * 0.012); {2: 0.139, 4: 0.034}
    is not."""
    sizes = sorted(seconds)
    pairs = zip(sizes, sizes[1:], strict=False)
    return all(seconds[larger] >= CALIBRATION_SLACK * seconds[smaller] for smaller, larger in pairs)


STALE_CALIBRATION = 1.5  # a kept calibration whose smallest pass now takes this factor more or less is timed again


def calibration_holds(kept: dict[int, float], now: VerifyCost) -> bool:
    """Whether a kept calibration still describes this machine: each size timed again ``now`` (its smallest and
    its largest pass: ``measure_verify_cost`` with ``sizes``) within ``STALE_CALIBRATION`` of the kept time either
    way. The decode loop refines only the sizes it runs, so a calibration timed while the machine was busy kept
    bigger trees looking dear for good: int4, kept {1: 19.9, 2: 20.3, 4: 21.7, 8: 29.3} ms against 5.6 for one
    row, and lookup verified trees of at most 2 nodes for a whole run (stop 36). The largest is checked as well,
    for a slowdown that hit only bigger passes.

    Example: kept {1: 0.0199, 8: 0.0293} with {1: 0.0056, 8: 0.0100} now does not hold; with {1: 0.0170, 8: 0.0250}
    it does, and with {1: 0.0199, 8: 0.0100} it does not."""
    if not now.seconds or any(size not in kept for size in now.seconds):
        return False
    return all(1 / STALE_CALIBRATION <= now.seconds[size] / kept[size] <= STALE_CALIBRATION for size in now.seconds)


def measure_verify_cost(
    backend: Backend,
    max_nodes: int,
    context: int = 128,
    repeats: int = 5,
    aux_layers: tuple[int, ...] = (),
    sizes: tuple[int, ...] | None = None,
) -> VerifyCost:
    """Time target passes over n new tokens after a ``context``-token prefix (returning the
    drafter's ``aux_layers`` features, as the decode loop's passes do): a warm-up round, then
    ``repeats`` rounds over every size in turn, and each size's median. Rounds over all sizes, not
    one size after another: the tree policy compares sizes, so what slows the machine for a while
    (another process, a busy memory bus) must weigh on all of them alike. Stop 27's calibrations
    (2 timings per size, one size at a time, the minimum) put a one-row int4 pass with eagle3's
    features at 4.0 ms and one without them at 4.5 ms, the same graph's cost. ``sizes``: time only these
    (``calibration_holds`` checks a kept calibration's smallest and largest)."""
    buckets = backend.buckets
    cost = VerifyCost(buckets=buckets)
    chosen = sizes if sizes is not None else tuple(size for size in CALIBRATION_SIZES if size <= max(max_nodes, 1))
    sizes = tuple(sorted({cost.padded(size) for size in chosen}))
    cache = backend.new_cache(context + max(*CALIBRATION_SIZES, *sizes) + 1)
    prefix = torch.zeros(context, dtype=torch.long)
    backend.forward(prefix, torch.arange(context), torch.ones(context, context, dtype=torch.bool).tril(), cache)
    timings: dict[int, list[float]] = {size: [] for size in sizes}
    inputs = {
        size: (torch.zeros(size, dtype=torch.long), torch.arange(context, context + size),
               torch.ones(size, context + size, dtype=torch.bool).tril(context))
        for size in sizes
    }  # fmt: skip
    for _ in range(repeats + 1):
        for size in sizes:
            tokens, positions, mask = inputs[size]
            started = time.perf_counter()
            # with the head's answer a greedy step reads (logits are computed when read, models/base.Scores)
            backend.forward(tokens, positions, mask, cache, aux_layers=aux_layers).scores.first_maxima()
            timings[size].append(time.perf_counter() - started)
            cache.rollback(context)
    for size in sizes:
        cost.seconds[size] = statistics.median(timings[size][1:])
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
    level_seconds: list[float] = field(default_factory=list)  # drafting one tree level, by level
    level_age: list[int] = field(default_factory=list)  # gated steps since each level was last timed
    declined: int = 0  # consecutive sized steps that verified the root alone (drafted nothing worth it)
    timed: bool = True  # False: no decision depends on measured times (seeded, reproducible runs)


def score_gate(min_score: float) -> LevelGate:
    """The untimed depth gate: draft a level iff a frontier node scores at least ``min_score``
    (scores alone decide, never the clock). Example at 0.2: frontier [0.5, 0.1] drafts; [0.15] stops."""

    def gate(scores: list[float], frontier: list[float], level: int) -> bool:
        return max(frontier, default=0.0) >= min_score

    return gate


def initial_adapt_state(tree: TreeConfig, timed: bool = True) -> AdaptState:
    return AdaptState(depth=tree.depth, width=tree.width, depth_hits=[0.5] * tree.depth, timed=timed)


def expected_tokens(scores: list[float], state: AdaptState, budget: int) -> float:
    """Tokens a step emits, expected, from a tree pruned to ``budget`` nodes (scores sorted high to low)."""
    return 1.0 + state.score_calibration * sum(scores[: budget - 1]) if budget > 1 else 1.0


def best_budget(scores: list[float], state: AdaptState, cost: VerifyCost, max_nodes: int,
                spent: float) -> tuple[int, float]:  # fmt: skip
    """(node count, expected tokens per second) maximising E[tokens] / (t_verify(n) + spent),
    given scores sorted high to low and ``spent`` seconds of drafting."""
    best_nodes, best_rate = 1, 1.0 / (cost(1) + spent)
    for budget in (b for b in BUDGETS if b <= min(max_nodes, len(scores) + 1)):
        rate = expected_tokens(scores, state, budget) / (cost(budget) + spent)
        if rate > best_rate:
            best_nodes, best_rate = budget, rate
    return best_nodes, best_rate


def choose_budget(scores: list[float], state: AdaptState, cost: VerifyCost, max_nodes: int,
                  spent: float | None = None) -> int:  # fmt: skip
    """The node count maximising expected tokens per second, given scores sorted high to low (and the
    drafting seconds spent on them; default: the running average)."""
    return best_budget(scores, state, cost, max_nodes, state.draft_seconds if spent is None else spent)[0]


@dataclass
class DepthGate:
    """Whether to draft one more level of a tree: called by the tree builder before each level with
    the scores drafted so far (and of merged candidates, e.g. prompt lookup's), the scores of the
    frontier nodes it would expand, and the level's index (0: the root's children).

    It drafts the level when the best expected rate one level deeper (the frontier's children guessed
    at CHILD_SHARES of their parents' scores, plus the level's measured cost) beats the best rate of
    what is drafted now; time already spent counts for both. It keeps the time of each call, so the
    policy learns what each level costs. After ``reprobe_every`` steps that verified the root alone
    it drafts a first level anyway (and ``prune`` keeps a draft node), and a deeper level whose time
    is ``reprobe_every`` gated steps old is drafted once, to keep the estimates current: a level
    declined for its cost is otherwise never timed again, so one slow first measurement (seen: a
    second eagle3 level at 6.6 ms, ~1 ms in truth, while oneDNN built its kernels) kept trees one
    level deep for a whole run.

    Example (verify 25 ms for 1..8 nodes, a level 2 ms, calibration 1, no time spent yet): with
    drafted scores [0.9, 0.3], the best is 3 nodes, (1 + 1.2) / 25 ms = 0.088 tokens/ms; the frontier
    [0.9] guesses children [0.45, 0.225, 0.09], and 6 nodes would give (1 + 1.965) / 27 ms = 0.110
    tokens/ms: deeper pays, so it drafts. With a level costing 20 ms it would not (0.066)."""

    state: AdaptState
    cost: VerifyCost
    max_nodes: int
    reprobe_every: int
    started: float  # perf_counter when drafting began
    always_first: bool = False  # never decline the first level (``--no-fallback``)
    stamps: list[float] = field(default_factory=list)  # perf_counter at each call
    allowed: int = 0  # levels it let the drafter draft

    def level_cost(self, level: int) -> float:
        known = self.state.level_seconds
        return known[level] if level < len(known) else (known[-1] if known else 0.0)

    def __call__(self, scores: Sequence[float], frontier: Sequence[float], level: int) -> bool:
        now = time.perf_counter()
        self.stamps.append(now)
        spent = now - self.started
        drafted = sorted(scores, reverse=True)
        rate = best_budget(drafted, self.state, self.cost, self.max_nodes, spent)[1]
        guesses = [score * share for score in frontier for share in CHILD_SHARES]
        deeper = sorted([*drafted, *guesses], reverse=True)
        deeper_rate = best_budget(deeper, self.state, self.cost, self.max_nodes, spent + self.level_cost(level))[1]
        probe = level == 0 and (self.always_first or self.state.declined >= self.reprobe_every)
        stale = 0 < level < len(self.state.level_age) and self.state.level_age[level] >= self.reprobe_every
        if deeper_rate > rate or probe or stale:
            self.allowed = level + 1
            return True
        return False

    def restart_level(self) -> None:
        """The level just allowed starts now: what the drafter did since the question (its own
        bookkeeping, e.g. eagle3's queued prefix rows) is not that level's drafting time."""
        self.stamps[-1] = time.perf_counter()

    def level_times(self, draft_seconds: float) -> list[float]:
        """Seconds each allowed level took (the last one until drafting ended)."""
        ends = [*self.stamps[1:], self.started + draft_seconds]
        return [end - start for start, end in zip(self.stamps[: self.allowed], ends, strict=False)]


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
    """Fold one speculative step's outcome into the state; maybe switch to plain decoding (fixed
    trees only: a sized policy's DepthGate and budget choice decode plainly step by step instead)."""
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
    for depth in range(min(len(state.depth_hits), accepted + 1)):
        state.depth_hits[depth] = ema(state.depth_hits[depth], float(depth < accepted), DEPTH_KEEP)
    if decode.adapt and tree.kind == "chain":
        state.depth = max(1, min(tree.depth, round(state.tokens_per_step) + 1))
    if decode.adapt and tree.kind != "chain":
        state.width = tree.width if state.depth_hits[0] < NARROW_AT_HIT_RATE else max(1, tree.width - 1)
    speedup = state.tokens_per_step * cost(1) / (cost(nodes) + state.draft_seconds)
    stretches = decode.fallback and state.timed and not decode.adapt
    if stretches and state.probe_steps >= PROBES_BEFORE_FALLBACK and speedup < 1.0:
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
    gate: DepthGate | None = None  # the current step's, while sized

    @property
    def sized(self) -> bool:
        return self.decode.adapt and self.state.timed

    @property
    def scored(self) -> bool:
        """Adaptive but untimed: trees are sized by their scores alone (``DecodeConfig.untimed_min_score``)."""
        return self.decode.adapt and not self.state.timed

    def limits(self) -> DraftLimits | None:
        """What to draft this step; None: decode plainly (after a fallback). Sized: with a fresh
        ``DepthGate`` that decides, level by level, how deep the tree grows."""
        if not self.state.speculating:
            return None
        self.gate = None
        if self.sized:
            decode = self.decode
            self.gate = DepthGate(self.state, self.cost, self.tree.max_nodes, decode.reprobe_every,
                                  time.perf_counter(), always_first=not decode.fallback)  # fmt: skip
        gate: LevelGate | None = score_gate(self.decode.untimed_min_score) if self.scored else self.gate
        lookup_depth = self.tree.lookup_depth if self.decode.adapt and self.tree.lookup_depth else self.state.depth
        return DraftLimits(self.state.depth, self.state.width, self.tree.max_nodes, lookup_depth, gate)

    def prune(self, draft: Draft) -> Draft:
        """Keep the node budget that maximises expected tokens per second, for the drafting time
        this step spent (measured from ``limits()``; the running average if it was not asked). The
        root alone may win (candidates too unsure to verify), except when probing or with
        ``--no-fallback``. Untimed (``scored``): the nodes scoring at least ``untimed_min_score``.
        Fixed trees (``--no-adapt``) and sampled children are kept whole."""
        if draft.tree.size <= 1 or draft.child_mode != "deterministic":
            return draft
        if self.scored:
            sure = sum(score >= self.decode.untimed_min_score for score in draft.scores[1:])
            return draft if sure + 1 >= draft.tree.size else draft.pruned(sure + 1)
        if not self.sized:
            return draft
        ranked = sorted(draft.scores[1:], reverse=True)
        spent = time.perf_counter() - self.gate.started if self.gate is not None else self.state.draft_seconds
        budget = choose_budget(ranked, self.state, self.cost, self.tree.max_nodes, spent)
        probe = not self.decode.fallback or self.state.declined >= self.decode.reprobe_every
        budget = max(2, budget) if probe else budget
        return draft if budget >= draft.tree.size else draft.pruned(budget)

    def observe(self, draft: Draft, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        nodes = draft.tree.size
        self.cost.update(nodes, verify_seconds)
        predicted = sum(draft.scores[1:]) if nodes > 1 else 0.0
        if self.gate is not None:
            self.observe_levels(self.gate, draft_seconds)
            self.state.declined = 0 if nodes > 1 else self.state.declined + 1
            self.gate = None
        update_after_step(self.state, self.tree, self.decode, self.cost, nodes - 1, predicted, accepted,
                          draft_seconds, nodes)  # fmt: skip

    def observe_levels(self, gate: DepthGate, draft_seconds: float) -> None:
        """Fold the gated step's level times in. A level timed after ``reprobe_every`` steps without
        a time takes the new time as it is: its old one may be an outlier that kept it undrafted."""
        known, age = self.state.level_seconds, self.state.level_age
        age.extend([0] * (len(known) - len(age)))
        times = gate.level_times(draft_seconds)
        for level, seconds in enumerate(times):
            if level < len(known):
                stale = age[level] >= self.decode.reprobe_every
                known[level] = seconds if stale else ema(known[level], seconds, LEVEL_KEEP)
                age[level] = 0
            else:
                known.append(seconds)
                age.append(0)
        for level in range(len(times), len(age)):
            age[level] += 1


@dataclass(frozen=True)
class DraftLimits:
    depth: int
    width: int
    max_nodes: int
    lookup_depth: int  # longest prompt-lookup path
    gate: LevelGate | None = None
