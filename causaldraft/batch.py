"""Continuous batching: the steps of several requests share one target pass.

A ``Batch`` holds up to ``size`` streams (requests being decoded), each with its own drafter
(``Drafter.fork``), adaptation state and pool slot (``cache.CachePool``). One ``step``:

1. every stream drafts its tree, sized by its budget policy with its *share* of the combined pass's
   measured cost (the pass over k streams of R rows each costs ``cost(R)``; each stream is charged
   ``cost(R) / k``), so a big batch leaves less room for speculation per stream and, at some load,
   plain decoding of every stream wins;
2. one target pass verifies all the trees (``NativeLlama.forward_batch``: ragged, each stream with
   its own cache rows, positions and tree mask; no attention across streams); a lone stream, or a
   backend without batch passes, runs its own pass;
3. each stream accepts, commits and emits on its own.

Streams join (``add``) and leave (``remove``) between steps. A joining stream's prompt is read
before its first step, in chunks of ``decode.PROMPT_CHUNK`` rows, at most ``PROMPT_ROWS_PER_STEP``
rows at the start of each step, so a long prompt delays the other streams' steps by a chunk's pass,
not by its whole prefill. Every row of a batch pass is bit for bit the row of the stream's own pass
(docs/exactness.md), so a stream's greedy or Gumbel-sampled output is the same whatever else runs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from causaldraft.adapt import (
    MAX_BACKOFF_DOUBLINGS,
    VerifyCost,
    calibration_name,
    expected_tokens,
    plausible_calibration,
)
from causaldraft.api import (
    Completion,
    Engine,
    Generation,
    Prompt,
    RequestRun,
    StreamPiece,
    as_generation,
    quiet_graph_builds,
)
from causaldraft.cache import CachePool
from causaldraft.decode import PROMPT_CHUNK, StepTiming, TreePass, accept_pass, draft_step, finish_step, tree_pass
from causaldraft.drafters.base import Draft
from causaldraft.errors import CausalDraftError
from causaldraft.models.base import ForwardOutput
from causaldraft.models.compiled import compile_batch
from causaldraft.models.native import NativeLlama, SequencePass
from causaldraft.threads import step_on

Event = StreamPiece | Completion

PROMPT_ROWS_PER_STEP = PROMPT_CHUNK  # prompt rows a step reads for joining streams before its pass


@dataclass
class Stream:
    """One request in a batch: its run, pool slot (None without a pool) and undelivered events."""

    ident: int
    run: RequestRun
    slot: int | None
    events: list[Event] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.run.done


@dataclass(frozen=True)
class StepReport:
    streams: int  # streams in the step's pass
    rows: int  # rows per stream of the pass (the largest tree)
    seconds: float


class Batch:
    """Up to ``size`` concurrent streams of one engine, advanced one step at a time.

    ``context``: the most tokens (prompt + output) a stream may hold; the pool is allocated for
    ``size`` such streams. ``cost``: the measured cost of a batch pass by rows per stream (default:
    measured now, or read from beside the compiled graphs)."""

    def __init__(self, engine: Engine, size: int, context: int, cost: VerifyCost | None = None) -> None:
        if size < 1:
            raise CausalDraftError(f"the batch size must be >= 1, got {size}")
        self.engine = engine
        backend = engine.model.backend
        self.backend = backend if isinstance(backend, NativeLlama) and size > 1 else None
        if self.backend is not None and self.backend.compiled and self.backend.batch_sequences != size:
            with quiet_graph_builds():
                compile_batch(self.backend, size)  # built once per model, dtype, CPU and batch size
        self.context = min(context, backend.shape.max_positions)
        # a pool slot holds the context plus a tree's scratch rows
        slot_length = self.context + engine.decoder.tree.max_nodes + 1
        self.pool: CachePool | None = self.backend.new_pool(size, slot_length) if self.backend else None
        self.size = size
        self.streams: list[Stream] = []
        self.cost = cost or (batch_cost(engine, size) if self.backend else engine.decoder.cost)
        self.baseline = VerifyCost(dict(self.cost.seconds), buckets=self.cost.buckets)  # as measured, for threads
        self.next_ident = 0
        self.last_step: StepReport | None = None
        self.largest_step = 0  # the most streams one pass has served
        self.plain_steps_left = 0  # batch steps to decode plainly (speculation did not pay at this load)
        self.fallbacks = 0  # consecutive

    @property
    def free(self) -> int:
        return self.size - len(self.streams)

    def add(self, prompt: Prompt, **options: Any) -> Stream:
        """Start a stream (checks the request; the steps read its prompt); raises CausalDraftError
        for bad input or a full batch, leaving the batch as it was."""
        if self.free < 1:
            raise CausalDraftError(f"the batch is full ({self.size} streams)")
        engine = self.engine
        decoder = replace(engine.decoder, drafter=engine.decoder.drafter.fork())
        slot = self.pool.take() if self.pool is not None else None
        try:
            cache = self.pool.caches[slot] if self.pool is not None and slot is not None else None
            run = engine.start(prompt, decoder=decoder, cache=cache, read_prompt=False, **options)
        except BaseException:
            if self.pool is not None and slot is not None:
                self.pool.release(slot)
            raise
        stream = Stream(self.next_ident, run, slot)
        self.next_ident += 1
        self.streams.append(stream)
        return stream

    def remove(self, stream: Stream) -> None:
        """Take a stream out (finished or cancelled) and free its slot. Its adaptation state
        becomes the engine's, which the next stream starts from (as one engine's requests do)."""
        if stream in self.streams:
            self.streams.remove(stream)
            if stream.run.policy.state.timed:
                self.engine.adapt = stream.run.policy.state
            if self.pool is not None and stream.slot is not None:
                self.pool.release(stream.slot)

    def step(self) -> list[Stream]:
        """One decoding step of every live stream; returns the streams that finished in it (still
        in the batch until removed, their ``events`` ending with a Completion)."""
        self.last_step = None
        live = [stream for stream in self.streams if not stream.done]
        self.read_prompts([stream for stream in live if stream.run.reading])
        live = [stream for stream in live if not stream.run.reading]
        if not live:
            return []
        # the engine's thread policy, unless a seeded stream needs numbers independent of the load
        timed = all(stream.run.policy.state.timed for stream in live)
        threads = self.engine.threads if timed else None
        with step_on(threads):
            finished = self.advance(live)
        report = self.last_step
        if threads is not None and report is not None:
            shared = self.backend is not None and report.streams > 1
            expected = self.baseline(report.rows) if shared else self.engine.threads.baseline(report.rows)
            threads.observe(report.seconds, expected)
        return finished

    def read_prompts(self, reading: list[Stream]) -> None:
        """Read joining streams' prompts, oldest first, until ``PROMPT_ROWS_PER_STEP`` rows are read
        (a stream's chunks are fixed by its prompt, whatever else runs)."""
        budget = PROMPT_ROWS_PER_STEP
        for stream in reading:
            if budget <= 0:
                return
            budget -= stream.run.read_prompt(budget)

    def advance(self, live: list[Stream]) -> list[Stream]:
        """``step``'s work on the live streams: draft, one verify pass, accept, commit."""
        shared = self.backend is not None and len(live) > 1
        plain = shared and self.plain_steps_left > 0
        self.plain_steps_left -= int(plain)
        drafts, draft_seconds = [], []
        for stream in live:
            started = time.perf_counter()
            drafts.append(Draft.root_only(stream.run.state.tokens[-1]) if plain else self.draft(stream, len(live)))
            draft_seconds.append(time.perf_counter() - started)
        if shared and not plain:
            drafts = self.fit(live, drafts, sum(draft_seconds))
        prefixes = [stream.run.state.cache.length for stream in live]
        inputs = [tree_pass(draft, prefix) for draft, prefix in zip(drafts, prefixes, strict=True)]
        started = time.perf_counter()
        outputs = self.verify(live, inputs, shared)
        # timed with the pass, as decode_steps times verify_step: a screened head answers in accept_pass
        acceptances = [
            accept_pass(stream.run.decoder, stream.run.state, draft, pass_inputs, out, stream.run.sampling)
            for stream, draft, pass_inputs, out in zip(live, drafts, inputs, outputs, strict=True)
        ]
        seconds = time.perf_counter() - started
        rows = max(draft.tree.size for draft in drafts)
        if shared:
            self.cost.update(rows, seconds)
        self.last_step = StepReport(len(live), rows, seconds)
        self.largest_step = max(self.largest_step, len(live) if shared else 1)
        finished = []
        for stream, draft, prefix, acceptance, out, drafted in zip(
            live, drafts, prefixes, acceptances, outputs, draft_seconds, strict=True
        ):
            run = stream.run
            timing = StepTiming(drafted, seconds / len(live))
            emitted = finish_step(run.decoder, run.state, run.policy, draft, prefix, acceptance, out,
                                  run.max_new_tokens, timing)  # fmt: skip
            stream.events.extend(run.absorb(emitted) if emitted else [])
            if run.done:
                stream.events.extend(run.finish())
                finished.append(stream)
        return finished

    def draft(self, stream: Stream, sharing: int) -> Draft:
        """The stream's tree for this step: with its share of a batch pass's cost and no more rows
        than a batch pass takes (beyond them the pass would not be row-invariant)."""
        run = stream.run
        policy = run.policy
        if sharing > 1 and self.backend is not None:
            share = {rows: seconds / sharing for rows, seconds in self.cost.seconds.items()}
            policy.cost = VerifyCost(share, buckets=self.cost.buckets)
            policy.tree = replace(run.decoder.tree, max_nodes=min(run.decoder.tree.max_nodes, self.backend.batch_rows))
        else:
            policy.cost, policy.tree = run.decoder.cost, run.decoder.tree
        draft = draft_step(run.decoder, run.state, policy, run.sampling)
        if draft.tree.size > policy.tree.max_nodes:  # a drafter over its budget: verify the root alone
            return Draft.root_only(run.state.tokens[-1])
        return draft

    def fit(self, live: list[Stream], drafts: list[Draft], draft_seconds: float) -> list[Draft]:
        """One row count for the whole pass: every stream's tree is padded to the largest, so the
        pass's rows R are chosen for the batch, maximising the streams' expected tokens together
        over the pass's measured cost, and the trees are cut to R nodes.

        When even the best R, with this step's drafting time counted, is predicted slower than
        plain decoding of every stream, the batch decodes plainly (no drafting) for a stretch, then
        drafts again to re-probe; consecutive fallbacks double the stretch (as one stream's does)."""
        sizes = sorted({*self.cost.buckets, *(draft.tree.size for draft in drafts)})
        candidates = [size for size in sizes if size <= max(draft.tree.size for draft in drafts)]
        ranked = [sorted(draft.scores[1:], reverse=True) for draft in drafts]

        def rate(rows: int) -> float:
            states = (stream.run.policy.state for stream in live)
            tokens = sum(expected_tokens(scores, state, rows) for scores, state in zip(ranked, states, strict=True))
            return tokens / self.cost(rows)

        rows = max(candidates, key=rate)
        speculative = [size for size in candidates if size > 1]
        plain_rate = len(live) / self.cost(1)
        best = max(
            (rate(size) * self.cost(size) / (self.cost(size) + draft_seconds) for size in speculative), default=0.0
        )
        if best < plain_rate:
            self.fallbacks += 1
            reprobe = self.engine.decoder.decode.reprobe_every
            self.plain_steps_left = reprobe * 2 ** min(self.fallbacks - 1, MAX_BACKOFF_DOUBLINGS)
        else:
            self.fallbacks = 0
        return [draft if draft.tree.size <= rows else cut(draft, rows) for draft in drafts]

    def verify(self, live: list[Stream], inputs: list[TreePass], shared: bool) -> list[ForwardOutput]:
        aux_layers = self.engine.decoder.drafter.feature_layers
        if shared and self.backend is not None and self.pool is not None:
            passes = [SequencePass(stream.slot, i.tokens, i.positions, i.mask)
                      for stream, i in zip(live, inputs, strict=True) if stream.slot is not None]  # fmt: skip
            return self.backend.forward_batch(self.pool, passes, aux_layers)
        target = self.engine.decoder.target
        return [
            target.forward(i.tokens, i.positions, i.mask, stream.run.state.cache, aux_layers=aux_layers)
            for stream, i in zip(live, inputs, strict=True)
        ]


def cut(draft: Draft, nodes: int) -> Draft:
    """The draft pruned to its ``nodes`` best nodes (the root alone where pruning is not lossless:
    sampled children)."""
    if nodes <= 1 or draft.child_mode != "deterministic":
        return Draft.root_only(draft.tree.tokens[0])
    return draft.pruned(nodes)


def batch_cost(engine: Engine, size: int) -> VerifyCost:
    """The measured cost of a batch pass over ``size`` streams by rows per stream, kept beside
    the compiled graphs (measured once) or timed now when eager."""
    backend = engine.model.backend
    assert isinstance(backend, NativeLlama)
    store = backend.calibration
    aux_layers = engine.decoder.drafter.feature_layers
    name = calibration_name(f"batch={size}", aux_layers, backend)
    if store is not None:
        seconds = store.read_calibration(name)
        if seconds and plausible_calibration(seconds):
            return VerifyCost(seconds, buckets=tuple(sorted(backend.batch_graphs)))
    cost = measure_batch_cost(backend, size, aux_layers)
    if store is not None:
        store.write_calibration(name, cost.seconds)
    return cost


def measure_batch_cost(
    backend: NativeLlama, size: int, aux_layers: tuple[int, ...], context: int = 128, repeats: int = 2
) -> VerifyCost:
    """Time batch passes over ``size`` streams of R rows each after a ``context``-token prefix."""
    pool = backend.new_pool(size, context + backend.batch_rows + 1)
    prefix = torch.zeros(context, dtype=torch.long)
    for cache in pool.caches:
        backend.forward(prefix, torch.arange(context), torch.ones(context, context, dtype=torch.bool).tril(), cache)
    buckets = tuple(sorted(backend.batch_graphs)) or (1, 2, 4, 8, 16)
    cost = VerifyCost(buckets=tuple(sorted(backend.batch_graphs)))
    for rows in buckets:
        positions = torch.arange(context, context + rows)
        mask = torch.ones(rows, context + rows, dtype=torch.bool).tril(context)
        passes = [SequencePass(slot, torch.zeros(rows, dtype=torch.long), positions, mask) for slot in range(size)]
        timings = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            backend.forward_batch(pool, passes, aux_layers)
            timings.append(time.perf_counter() - started)
            for cache in pool.caches:
                cache.rollback(context)
        cost.seconds[rows] = min(timings[1:])
    return cost


def generate_batch(
    engine: Engine, prompts: Sequence[Prompt], size: int = 8, batch: Batch | None = None,
    **options: Any,
) -> list[Generation]:  # fmt: skip
    """Generate for every prompt, ``size`` at a time in one batch (new prompts join as others
    finish); returns the generations in the prompts' order. Options: those of ``Engine.start``.
    ``batch``: one to run in (default: a new one with room for the longest prompt)."""
    if batch is None:
        chat = bool(options.get("chat"))
        longest = max((len(engine.encode(prompt, chat)) for prompt in prompts), default=1)
        batch = Batch(engine, size, longest + int(options.get("max_new_tokens", 256)))
    waiting = list(enumerate(prompts))
    results: dict[int, Generation] = {}
    owner: dict[int, int] = {}  # stream ident -> prompt index
    while waiting or batch.streams:
        while waiting and batch.free:
            index, prompt = waiting.pop(0)
            owner[batch.add(prompt, **options).ident] = index
        for stream in batch.step():
            results[owner[stream.ident]] = as_generation(stream.events, options.get("logprobs") is not None)
            batch.remove(stream)
    return [results[index] for index in range(len(prompts))]
