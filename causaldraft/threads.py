"""Torch's thread count under load: ``ThreadPolicy`` drops to one thread while other processes hold
the cores, and returns when they leave.

Why: each parallel region of a pass (the int4 kernel's products make ~120 per pass) ends at a barrier
that waits for its slowest thread. With as many threads as cores, a thread whose core another
process holds waits for the scheduler at every barrier. Measured on a 2-core AVX2 machine, plain
int4 decoding: 60-65 tokens/s on 2 threads when quiet; with one busy process beside it 17-20 tokens/s
on 2 threads and 42-48 on one (``docs/threads.md``). One thread waits for no other.

How: the policy keeps, per thread count, a moving average of the *slowdown* of verify passes: their
measured seconds over what the calibration (timed at load, on all threads) predicts for their size.
It runs the count with the lower slowdown. It probes the other count for ``PROBE_STEPS`` steps (the
first, which may wake sleeping threads, is not counted) every ``interval`` steps (doubling while
probes confirm the choice, from ``FIRST_INTERVAL`` up to ``MAX_INTERVAL``), and sooner when the
current count's slowdown passes the other's last known one, or ``ALARM`` while the other is unknown.

Example: all threads, slowdown 1.0; at step 64 a probe of one thread measures 1.4: confirmed, the
next probe comes 128 steps later. Another process starts; two-thread passes slow to 3.5x, which
passes the one-thread 1.4 within a few steps: a probe measures 1.4 again and the policy switches.
Probes of all threads then come every 64, 128, ... steps until the machine is quiet again.

Exactness: the steps' passes must not depend on the thread count. The int4 and int8 kernels
split output blocks between threads and compute each the same way, and attention's products were
checked to agree across thread counts (docs/exactness.md); ``threads_agree`` checks a real pass
once per set of compiled graphs (``thread_invariant``), and the policy stays off where the logits
differ in any bit. Prompts are always read on all threads (``ThreadPolicy.prompt``): a pass over
hundreds of prompt rows need not be thread-invariant (oneDNN's products on AMX machines are not).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field

import torch

from causaldraft.adapt import VerifyCost
from causaldraft.models.base import Backend

SLOWDOWN_KEEP = 0.8  # the weight an old slowdown keeps at each measured step
PROBE_STEPS = 3  # steps of a probe; its first is not measured
FIRST_INTERVAL = 64  # steps between probes after a switch (and before the first)
MAX_INTERVAL = 256  # ~4 s of decoding: how long a fallback may outlast the load
ALARM = 2.0  # a slowdown that asks for a probe when the other count is not yet measured
SWITCH_MARGIN = 0.95  # the other count must be this much faster (in slowdown) to take over
MIN_GAP = 8  # measured steps on a count before its slowdown can ask for an early probe


@dataclass
class ThreadPolicy:
    """Which thread count runs the next step (``step()``), learned from every step's verify time
    (``observe``). One per engine: its state carries over from request to request."""

    full: int  # torch's thread count at load
    baseline: VerifyCost = field(default_factory=VerifyCost)  # verify seconds on ``full`` threads, quiet
    enabled: bool = True
    current: int = 0  # the chosen count (0: not yet set, ``full``)
    slowdown: dict[int, float] = field(default_factory=dict)  # moving average per count
    probe_left: int = 0  # steps of the probe under way (0: none)
    steps_to_probe: int = FIRST_INTERVAL
    interval: int = FIRST_INTERVAL
    measured: int = 0  # steps measured on the current count since it last ran
    switches: int = 0

    def __post_init__(self) -> None:
        self.current = self.current or self.full
        self.enabled = self.enabled and self.full > 1

    @property
    def other(self) -> int:
        return 1 if self.current == self.full else self.full

    @property
    def running(self) -> int:
        """The count this step runs on: the other one while probing."""
        return self.other if self.probe_left > 0 else self.current

    def step(self) -> AbstractContextManager[None]:
        """Run one step on the count the policy chose; torch's count is restored afterwards, so nothing
        outside a step (a seeded request, the caller's own work) sees a change. Setting the count
        costs ~2 us and wakes no thread."""
        return on_threads(self.running if self.enabled else None)

    def prompt(self) -> AbstractContextManager[None]:
        """Read a prompt on all threads (``full``), whatever the policy chose for the steps: a prompt pass's
        bits may depend on the thread count. On an AVX-512 machine with AMX (stop 35), the int4 model's
        prompt twin (bf16 products through oneDNN) wrote other keys on one thread than on two for prompts of
        257 tokens and more (``threads_agree`` reads 96); a second turn prefilled during a one-thread stretch
        then decoded other tokens than plain decoding on two threads. Decoding steps are thread-invariant
        (checked at load), so only the prompt must stay on one count."""
        return on_threads(self.full if self.enabled else None)

    def observe_pass(self, nodes: int, seconds: float) -> None:
        """``observe`` a verify pass over ``nodes`` new tokens of one sequence."""
        self.observe(seconds, self.baseline(nodes))

    def observe(self, seconds: float, expected: float) -> None:
        """Fold one step's verify ``seconds`` in, against the ``expected`` seconds of a pass of its
        size on all threads of a quiet machine; decide the next step's count."""
        if not self.enabled or expected <= 0:
            return
        slowdown = seconds / expected
        if self.probe_left > 0:
            self.observe_probe(slowdown)
            return
        if self.measured > 0:  # the first step after a change may wake threads: not counted
            known = self.slowdown.get(self.current)
            self.slowdown[self.current] = slowdown if known is None else ema(known, slowdown, SLOWDOWN_KEEP)
        self.measured += 1
        self.steps_to_probe -= 1
        if self.steps_to_probe <= 0 or self.alarmed():
            self.probe_left = PROBE_STEPS

    def alarmed(self) -> bool:
        """Whether the current count is slower than the other was when last measured, by the margin
        that would switch (an early probe)."""
        mine = self.slowdown.get(self.current)
        if mine is None or self.measured < MIN_GAP:
            return False
        theirs = self.slowdown.get(self.other)
        return mine > ALARM if theirs is None else theirs < SWITCH_MARGIN * mine

    def observe_probe(self, slowdown: float) -> None:
        other = self.other
        if self.probe_left < PROBE_STEPS:  # past the probe's first step
            fresh = self.probe_left == PROBE_STEPS - 1  # the first measured one replaces an old value
            known = self.slowdown.get(other)
            self.slowdown[other] = slowdown if fresh or known is None else (known + slowdown) / 2
        self.probe_left -= 1
        if self.probe_left > 0:
            return
        mine = self.slowdown.get(self.current, float("inf"))
        if self.slowdown[other] < SWITCH_MARGIN * mine:
            self.current, self.interval, self.switches = other, FIRST_INTERVAL, self.switches + 1
            self.measured = 0
        else:
            self.interval = min(2 * self.interval, MAX_INTERVAL)
            self.measured = 0  # back on the current count: its first step may wake threads
        self.steps_to_probe = self.interval


@contextmanager
def on_threads(count: int | None) -> Iterator[None]:
    """torch's thread count set to ``count`` (None: as it is) inside, restored afterwards."""
    saved = torch.get_num_threads()
    if count is None or count == saved:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def step_on(threads: ThreadPolicy | None) -> AbstractContextManager[None]:
    """``threads.step()``; for None, torch's thread count as it is."""
    return threads.step() if threads is not None else on_threads(None)


def prompt_on(threads: ThreadPolicy | None) -> AbstractContextManager[None]:
    """``threads.prompt()``; for None, torch's thread count as it is."""
    return threads.prompt() if threads is not None else on_threads(None)


def ema(previous: float, value: float, keep: float) -> float:
    return keep * previous + (1 - keep) * value


def thread_invariant(
    backend: Backend, threads: int, prompt_reader: Backend | None = None, recheck: bool = False
) -> bool:
    """``threads_agree``'s verdict, kept beside a compiled backend's graphs (keyed like its verify-cost
    calibration: graphs, weights, code, CPU), so it is checked once (~1 s for the default model in int4 on
    an AVX2 machine: the prompt is read in fp32), not at every load; ``recheck`` checks again."""
    if threads <= 1:
        return True
    store = backend.calibration
    name = f"threads_agree threads={threads}"
    kept = store.read_calibration(name) if store is not None and not recheck else None
    if kept is not None and threads in kept:
        return kept[threads] == 1.0
    agree = threads_agree(backend, threads, prompt_reader)
    if store is not None:
        store.write_calibration(name, {threads: float(agree)})
    return agree


def threads_agree(
    backend: Backend, threads: int, prompt_reader: Backend | None = None, rows: int = 3, context: int = 96
) -> bool:
    """Whether a pass of ``rows`` new tokens after a ``context``-token prompt gives the same logits,
    bit for bit, on ``threads`` threads and on one (torch's count is restored). The prompt is read as
    prompts are: on ``threads`` threads (``ThreadPolicy.prompt``), by ``prompt_reader`` (a quantized
    model's prompt twin) or the backend, more than 64 tokens at once."""
    if threads <= 1:
        return True
    reader = prompt_reader or backend
    saved = torch.get_num_threads()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, backend.shape.vocab_size, (context + rows,), generator=generator)
    causal = torch.ones(context + rows, context + rows, dtype=torch.bool).tril()
    logits = []
    try:
        for count in (threads, 1):
            torch.set_num_threads(threads)
            cache = backend.new_cache(context + rows)
            reader.forward(tokens[:context], torch.arange(context), causal[:context, :context], cache)
            torch.set_num_threads(count)
            out = backend.forward(tokens[context:], torch.arange(context, context + rows), causal[context:], cache)
            logits.append(out.logits)
    finally:
        torch.set_num_threads(saved)
    return torch.equal(logits[0], logits[1])
