"""The thread policy: its decisions on simulated step times (quiet, loaded, load gone), torch's count
set for a step and restored, and token-identical output when the count changes between steps."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

import causaldraft
from causaldraft.batch import generate_batch
from causaldraft.models.compiled import GraphStore, compile_model
from causaldraft.threads import (
    FIRST_INTERVAL,
    MAX_INTERVAL,
    MIN_GAP,
    PROBE_STEPS,
    ThreadPolicy,
    thread_invariant,
    threads_agree,
)
from tests.test_compiled import key_of, native

QUIET = {2: 1.0, 1: 1.4}  # slowdown per thread count, as measured on a quiet 2-core machine
LOADED = {2: 3.5, 1: 1.45}  # one busy process beside it (docs/threads.md)


def simulate(policy: ThreadPolicy, slowdown: Callable[[int], dict[int, float]], steps: int) -> list[int]:
    """The count each step ran on, when a step on count c takes slowdown(step)[c] of its expected time."""
    ran = []
    for step in range(steps):
        count = policy.running
        ran.append(count)
        policy.observe(slowdown(step)[count], 1.0)
    return ran


@pytest.fixture
def two_threads() -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


def test_a_quiet_machine_keeps_all_threads_and_probes_less_and_less() -> None:
    policy = ThreadPolicy(2)
    ran = simulate(policy, lambda step: QUIET, 2000)
    assert policy.current == 2 and policy.switches == 0
    assert ran[:FIRST_INTERVAL].count(1) == 0  # no probe before the first interval
    probes = ran.count(1) // PROBE_STEPS  # after 64, 128, 256, then every 256 steps
    assert ran.count(1) % PROBE_STEPS == 0
    assert 2000 // (MAX_INTERVAL + PROBE_STEPS) <= probes <= 2000 // MAX_INTERVAL + 2
    assert policy.interval == MAX_INTERVAL


def test_load_moves_to_one_thread_within_a_few_steps_and_back_when_it_ends() -> None:
    policy = ThreadPolicy(2)

    def load_between_300_and_600(step: int) -> dict[int, float]:
        return LOADED if 300 <= step < 600 else QUIET

    ran = simulate(policy, load_between_300_and_600, 1000)
    switched = ran.index(1, 300)
    assert switched <= 300 + 2  # the alarm: two threads are now slower than one was
    assert ran[switched:600].count(1) >= 0.95 * (600 - switched)  # probes of two threads aside
    back = next(step for step in range(600, 1000) if ran[step : step + 20] == [2] * 20)
    assert back <= 600 + MAX_INTERVAL + PROBE_STEPS  # the next probe of two threads finds them fast
    assert policy.current == 2


def test_a_loaded_start_switches_before_the_first_interval() -> None:
    policy = ThreadPolicy(2)
    ran = simulate(policy, lambda step: LOADED, 100)
    assert policy.current == 1 and ran.index(1) <= MIN_GAP + 2


def test_the_first_step_after_a_change_is_not_counted() -> None:
    policy = ThreadPolicy(2, current=1)
    policy.observe(50.0, 1.0)  # threads waking up
    assert 1 not in policy.slowdown
    policy.observe(1.5, 1.0)
    assert policy.slowdown[1] == 1.5


def test_a_probe_slower_than_the_margin_does_not_switch() -> None:
    policy = ThreadPolicy(2, steps_to_probe=MIN_GAP + 1)
    simulate(policy, lambda step: {2: 1.0, 1: 0.97}, MIN_GAP + 1 + PROBE_STEPS)
    assert policy.current == 2 and policy.interval == 2 * FIRST_INTERVAL


def test_one_thread_has_no_policy() -> None:
    policy = ThreadPolicy(1)
    assert not policy.enabled
    policy.observe(100.0, 1.0)
    assert policy.slowdown == {} and policy.running == 1


def test_a_step_runs_on_the_chosen_count_and_restores_torch_s(two_threads: None) -> None:
    policy = ThreadPolicy(2, current=1)
    with policy.step():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), policy.step():
        raise RuntimeError("a failed step")
    assert torch.get_num_threads() == 2
    with ThreadPolicy(2, current=1, enabled=False).step():
        assert torch.get_num_threads() == 2


def test_a_prompt_is_read_on_all_threads_whatever_the_steps_run_on(two_threads: None) -> None:
    policy = ThreadPolicy(2, current=1)
    with policy.step():
        assert torch.get_num_threads() == 1
        with policy.prompt():  # a request started while the steps run on one thread
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
    with policy.prompt():
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 2


@dataclass
class CountingReader:
    """A backend that records the thread count of each ``forward`` call and is otherwise ``backend``."""

    backend: object
    counts: list[int]

    def forward(self, *args: object, **kwargs: object) -> object:
        self.counts.append(torch.get_num_threads())
        return self.backend.forward(*args, **kwargs)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:  # everything else is the backend's
        return getattr(self.backend, name)


@dataclass
class EveryOtherStep(ThreadPolicy):
    """Alternates between one thread and all of them, step by step, and counts its steps."""

    steps: int = 0

    @property
    def running(self) -> int:
        return 1 if self.steps % 2 else self.full

    def observe(self, seconds: float, expected: float) -> None:
        self.steps += 1


@pytest.mark.parametrize("dtype", ["int4", "bfloat16"])
def test_output_is_token_identical_when_the_thread_count_changes_between_steps(
    tiny_llama_dir: Path, two_threads: None, dtype: str
) -> None:
    settings = {"dtype": dtype, "calibrate": False, "draft_layers": 1, "compile": False}
    plain = causaldraft.load(str(tiny_llama_dir), drafter="none", adapt_threads=False, **settings)
    prompts = ["hello world hello world", "the cat sat on the mat. the cat"]
    expected = [plain.generate(prompt, max_new_tokens=40).token_ids for prompt in prompts]
    assert threads_agree(plain.model.backend, 2)
    for drafter in ("none", "lookup", "draft"):
        spec = causaldraft.load(str(tiny_llama_dir), drafter=drafter, **settings)
        assert spec.threads.enabled  # the check at load found the passes thread-invariant
        spec.threads = EveryOtherStep(2)
        assert [spec.generate(prompt, max_new_tokens=40).token_ids for prompt in prompts] == expected
        assert spec.threads.steps >= 40 // 4  # the loop asked it at every step
        assert torch.get_num_threads() == 2
    spec.threads = EveryOtherStep(2)
    batched = generate_batch(spec, prompts, size=2, max_new_tokens=40)
    assert [result.token_ids for result in batched] == expected and spec.threads.steps > 0


def test_prompts_are_read_on_all_threads_while_the_steps_run_on_one(tiny_llama_dir: Path, two_threads: None) -> None:
    """A prompt pass need not be thread-invariant (on AMX machines, oneDNN's products over hundreds of rows
    are not), so an engine whose steps run on one thread still reads every prompt, single or batched, on all."""
    spec = causaldraft.load(str(tiny_llama_dir), drafter="lookup", dtype="int4", calibrate=False, compile=False)
    counts: list[int] = []
    reader = CountingReader(spec.decoder.prefill_target or spec.decoder.target, counts)
    spec.decoder = replace(spec.decoder, prefill_target=reader)  # type: ignore[arg-type]
    spec.threads = ThreadPolicy(2, current=1)
    ran: list[int] = []
    tracked = spec.decoder.target
    spec.decoder = replace(spec.decoder, target=CountingReader(tracked, ran))  # type: ignore[arg-type]
    spec.generate("hello world hello world", max_new_tokens=8)
    generate_batch(spec, ["the cat sat", "on the mat"], size=2, max_new_tokens=8)
    assert counts == [2, 2, 2]  # three prompts, all threads
    assert ran and set(ran) == {1}  # the steps ran where the policy said
    assert torch.get_num_threads() == 2


def test_the_verdict_is_kept_beside_the_graphs(tiny_llama_dir: Path, graph_root: Path, two_threads: None) -> None:
    backend = native(tiny_llama_dir, "int4")
    compile_model(backend, buckets=(1, 4), store=GraphStore(key_of(backend), graph_root))
    assert backend.graph_store is not None
    assert thread_invariant(backend, 2)
    name = "threads_agree threads=2"
    assert backend.graph_store.read_calibration(name) == {2: 1.0}
    backend.graph_store.write_calibration(name, {2: 0.0})  # as if a pass had differed
    assert not thread_invariant(backend, 2)  # read, not checked again
    assert thread_invariant(backend, 2, recheck=True)
    assert backend.graph_store.read_calibration(name) == {2: 1.0}
    assert thread_invariant(backend, 1)  # one thread: nothing to compare
