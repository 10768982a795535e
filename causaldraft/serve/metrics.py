"""Server counters, rendered in the Prometheus text exposition format.

One ``Metrics`` object per app (no module-level state). The worker thread records generations and
the HTTP layer records responses, so every update takes the lock.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from causaldraft.decode import GenerationStats

OUTCOMES = ("completed", "cancelled", "rejected", "failed")
RATE_BUCKETS = (5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)  # per-request tokens/s histogram bounds


@dataclass
class Metrics:
    responses: Counter[tuple[str, int]] = field(default_factory=Counter)  # (path, status) -> count
    outcomes: Counter[str] = field(default_factory=Counter)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of those, copied from kept prefixes (prefix.py)
    generated_tokens: int = 0
    target_forwards: int = 0
    draft_positions: int = 0  # per step, the tree's depth: draft tokens that could have been accepted
    accepted_positions: int = 0  # draft tokens accepted
    generation_s: float = 0.0
    steps: int = 0  # decoding steps (one target pass each, over every active request)
    step_streams: int = 0  # requests in those steps, summed
    last_batch: int = 0  # requests in the last step
    request_rates: Counter[float] = field(default_factory=Counter)  # tokens/s bucket bound -> requests at or under it
    request_rate_sum: float = 0.0
    requests_timed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record_response(self, path: str, status: int) -> None:
        with self.lock:
            self.responses[(path, status)] += 1

    def record_outcome(self, outcome: str) -> None:
        with self.lock:
            self.outcomes[outcome] += 1

    def record_step(self, streams: int) -> None:
        with self.lock:
            self.steps += 1
            self.step_streams += streams
            self.last_batch = streams

    def record_generation(self, stats: GenerationStats, prompt_tokens: int, seconds: float) -> None:
        with self.lock:
            rate = stats.new_tokens / seconds if seconds > 0 else 0.0
            for bound in RATE_BUCKETS:
                self.request_rates[bound] += int(rate <= bound)
            self.request_rate_sum += rate
            self.requests_timed += 1
            self.prompt_tokens += prompt_tokens
            self.cached_prompt_tokens += stats.cached_prompt_tokens
            self.generated_tokens += stats.new_tokens
            self.target_forwards += stats.target_forwards
            self.draft_positions += sum(stats.depth_attempts)
            self.accepted_positions += sum(stats.depth_accepts)
            self.generation_s += seconds

    def render(self, queue_depth: int, queue_capacity: int, running: int) -> str:
        """Prometheus text format 0.0.4."""
        with self.lock:
            mean_accepted = self.generated_tokens / self.target_forwards if self.target_forwards else 0.0
            acceptance = self.accepted_positions / self.draft_positions if self.draft_positions else 0.0
            tokens_per_s = self.generated_tokens / self.generation_s if self.generation_s > 0 else 0.0
            lines: list[str] = []
            lines += metric("requests_total", "counter", "HTTP responses by path and status code",
                            [(f'path="{path}",status="{status}"', count)
                             for (path, status), count in sorted(self.responses.items())])  # fmt: skip
            lines += metric("generations_total", "counter", "generation jobs by outcome",
                            [(f'outcome="{outcome}"', self.outcomes[outcome]) for outcome in OUTCOMES])  # fmt: skip
            lines += metric("prompt_tokens_total", "counter", "prompt tokens processed", [("", self.prompt_tokens)])
            lines += metric("cached_prompt_tokens_total", "counter", "prompt tokens copied from kept prefixes",
                            [("", self.cached_prompt_tokens)])  # fmt: skip
            lines += metric("generated_tokens_total", "counter", "tokens generated", [("", self.generated_tokens)])
            lines += metric("target_forwards_total", "counter", "target model passes (decoding steps)",
                            [("", self.target_forwards)])  # fmt: skip
            lines += metric("draft_positions_total", "counter", "draft positions (tree depth per step) verified",
                            [("", self.draft_positions)])  # fmt: skip
            lines += metric("accepted_positions_total", "counter", "draft tokens accepted",
                            [("", self.accepted_positions)])  # fmt: skip
            lines += metric("generation_seconds_total", "counter", "time spent generating", [("", self.generation_s)])
            lines += metric("mean_accepted_length", "gauge", "tokens emitted per target pass", [("", mean_accepted)])
            lines += metric("acceptance_rate", "gauge", "accepted / drafted positions", [("", acceptance)])
            lines += metric("tokens_per_second", "gauge", "generated tokens / generation time", [("", tokens_per_s)])
            lines += metric("batch_steps_total", "counter", "decoding steps (one target pass each)", [("", self.steps)])
            lines += metric("batch_streams_total", "counter", "requests decoded in those steps, summed",
                            [("", self.step_streams)])  # fmt: skip
            mean_batch = self.step_streams / self.steps if self.steps else 0.0
            lines += metric("batch_size_mean", "gauge", "requests per decoding step, on average", [("", mean_batch)])
            lines += metric("batch_size", "gauge", "requests in the last decoding step", [("", self.last_batch)])
            buckets = [(f'le="{bound:g}"', self.request_rates[bound]) for bound in RATE_BUCKETS]
            buckets.append(('le="+Inf"', self.requests_timed))
            lines += metric("request_tokens_per_second", "histogram", "each finished request's tokens/s", [])
            lines += [f"causaldraft_request_tokens_per_second_bucket{{{labels}}} {count}" for labels, count in buckets]
            lines.append(f"causaldraft_request_tokens_per_second_sum {format_value(self.request_rate_sum)}")
            lines.append(f"causaldraft_request_tokens_per_second_count {self.requests_timed}")
        lines += metric("queue_depth", "gauge", "requests waiting for the engine", [("", queue_depth)])
        lines += metric("queue_capacity", "gauge", "size of the bounded queue", [("", queue_capacity)])
        lines += metric("requests_running", "gauge", "requests being generated now", [("", running)])
        return "\n".join(lines) + "\n"


def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> list[str]:
    full = f"causaldraft_{name}"
    lines = [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
    for labels, value in samples:
        label_text = f"{{{labels}}}" if labels else ""
        lines.append(f"{full}{label_text} {format_value(value)}")
    return lines


def format_value(value: float) -> str:
    return str(value) if isinstance(value, int) else repr(float(value))


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name with labels: value} (comments skipped)."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples
