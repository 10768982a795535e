"""Which int4 build runs where the CPU runs more than one of the preferred two: measured once per machine.

A CPU with AVX-512 bf16 and VNNI runs both the AVX-512 bf16 build (exact bf16 products) and the VNNI build (int8
activations per group of 32 and exact integer dot products: llama.cpp's arithmetic on the same file, and the AVX2
build's bits). Which is faster depends on the core, not on its flags:

- AMD Zen 5 (stops 32-34): the bf16 build's 4-row products 2.1-2.2 ms, the VNNI build's 3.1-3.5;
- an Intel Xeon with AMX (stop 35, `bench/kernel_speed.py`, a pass's 120 products, ms at 1 / 4 / 8 / 16 rows):
  the bf16 build 3.11 / 5.96 / 11.01 / 21.50, the VNNI build 2.11 / 3.00 / 5.22 / 9.88. There the issue bench
  in int4 ran plain decoding at 136 tokens/s with the bf16 build and 161 with the VNNI build.

So the first load on a machine times both, each in a process of its own (both define the same operator), on
products shaped like a pass (``probe``), and keeps the answer in ``$CAUSALDRAFT_HOME/kernels/choice-<digest>.json``
(digest: the CPU's model and flags, the sources and flags of both builds, torch's version). The VNNI build is
chosen only when it takes less than ``MARGIN`` of the bf16 build's time: the bf16 build's products are exact, and
the int8 activations cost the default model's int4 output some accuracy (KL against fp32 0.00277 against 0.00066,
``bench/quant_quality.py``, stop 32). ``CAUSALDRAFT_INT4_KERNEL=avx512_bf16`` (or ``vnni``) skips the choice.

Either way decoding stays exact: each build is row- and thread-invariant, and the compiled graphs are keyed by
the build.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from causaldraft.models.int4_kernel import SWITCH, Build, cpu_flags, source_digest
from causaldraft.paths import causaldraft_home

MARGIN = 0.8  # a later build must take less than this share of the first's time to be chosen
PROBE_ROWS = (1, 4, 8)  # rows of the timed products (a plain step, and trees of 4 and 8 nodes)
PROBE_LAYERS = 30  # layers of products shaped like the default model's (qkv, o, gate and up, down): ~45 MB
PROBE_REPEATS = 9  # rounds over every row count; each count's median is kept
PROBE_ROUNDS = 2  # probes of each build, alternating; its fastest is kept (a busy moment slows one probe)
PROBE_TIMEOUT_S = 600  # a build (~10 s) and the timing (a few s), on a busy machine


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")


def choice_path(candidates: Sequence[Build]) -> Path:
    digest = hashlib.sha256(cpu_model().encode())
    digest.update(" ".join(cpu_flags()).encode())
    for build in candidates:
        digest.update(build.isa.encode())
        for source in build.sources:
            digest.update(source_digest(source, build.flags).encode())
    return causaldraft_home() / "kernels" / f"choice-{digest.hexdigest()[:16]}.json"


def prefer(candidates: Sequence[Build], milliseconds: dict[str, float | None]) -> Build:
    """The first candidate, unless a later one measured less than ``MARGIN`` of its time (the fastest such).

    Example: {avx512_bf16: 20.1, vnni: 10.3} gives vnni (10.3 < 16.1); {avx512_bf16: 7.9, vnni: 10.4} and
    {avx512_bf16: 7.9, vnni: 7.0} give avx512_bf16; a build whose probe failed (None) is never chosen."""
    first = candidates[0]
    base = milliseconds.get(first.isa)
    if base is None:
        return first
    faster = [b for b in candidates[1:] if (ms := milliseconds.get(b.isa)) is not None and ms < MARGIN * base]
    return min(faster, key=lambda b: milliseconds[b.isa] or 0.0, default=first)


@functools.cache
def chosen_build(candidates: tuple[Build, ...]) -> Build:
    """The kept choice for this machine, or a new one measured now (and kept); read once per process."""
    path = choice_path(candidates)
    names = {build.isa: build for build in candidates}
    kept = kept_choice(path, "isa", tuple(names))
    if kept is not None:
        return names[kept]
    from causaldraft.models.quant import notify

    notify(f"timing the int4 builds {', '.join(names)} once on this CPU (~1 min)")
    rounds = [{build.isa: probe(build) for build in candidates} for _ in range(PROBE_ROUNDS)]
    milliseconds = {build.isa: fastest([r[build.isa] for r in rounds]) for build in candidates}
    choice = prefer(candidates, milliseconds)
    keep_choice(path, {"isa": choice.isa, "ms": milliseconds, "rows": PROBE_ROWS, "cpu": cpu_model()})
    shown = ", ".join(f"{isa} {ms:.2f} ms" if ms is not None else f"{isa} failed" for isa, ms in milliseconds.items())
    notify(f"int4 products of rows {'/'.join(map(str, PROBE_ROWS))}: {shown}; using {choice.isa} (kept in {path})")
    return choice


def kept_choice(path: Path, field: str, names: tuple[str, ...]) -> str | None:
    """The choice kept in ``path`` (its ``field``) where it is one of ``names``; None for a missing, corrupt or
    foreign file (then the caller measures again)."""
    try:
        kept = json.loads(path.read_text())[field]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return kept if kept in names else None


def keep_choice(path: Path, record: dict[str, object]) -> None:
    """Write a measured choice for later processes (a read-only home only costs a new measurement next time)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
    except OSError:
        pass


def fastest(values: list[float | None]) -> float | None:
    measured = [value for value in values if value is not None]
    return min(measured) if measured else None


def probe(build: Build) -> float | None:
    """Milliseconds of ``build``'s timed products (``timed_products``), in a process of its own; None on failure."""
    env = {**os.environ, SWITCH: build.isa}
    command = [sys.executable, "-m", "causaldraft.models.kernel_choice"]
    try:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        return float(json.loads(result.stdout.strip().splitlines()[-1])["ms"]) if result.returncode == 0 else None
    except (subprocess.SubprocessError, OSError, ValueError, IndexError, KeyError):
        return None


def timed_products() -> float:
    """Sum over ``PROBE_ROWS`` of the median time of ``PROBE_LAYERS`` layers' int4 products (the default
    model's shapes: 576 -> 960 fused qkv, 576 -> 576, 576 -> 3072 fused gate and up, 1536 -> 576), in ms, on
    this process's build (``SWITCH``)."""
    from causaldraft.models.int4_kernel import available
    from causaldraft.models.quant import Int4Linear, Int4Weights

    if not available():
        raise RuntimeError("the build did not load")
    generator = torch.Generator().manual_seed(0)
    linears = []
    for _ in range(PROBE_LAYERS):
        for out_features, in_features in ((960, 576), (576, 576), (3072, 576), (576, 1536)):
            values = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
            scales = torch.rand(out_features, in_features // 32, generator=generator) * 0.01
            zeros = (torch.rand(out_features, in_features // 32, generator=generator) - 0.5) * 0.01
            linears.append(Int4Linear(Int4Weights(values, scales, zeros), None))
    inputs = {rows: torch.randn(rows, 1536, generator=generator).to(torch.bfloat16) for rows in PROBE_ROWS}
    timings: dict[int, list[float]] = {rows: [] for rows in PROBE_ROWS}
    with torch.inference_mode():
        for _ in range(PROBE_REPEATS + 1):  # the first round warms up
            for rows in PROBE_ROWS:
                started = time.perf_counter()
                for linear in linears:
                    linear(inputs[rows][:, : linear.in_features].contiguous())
                timings[rows].append(time.perf_counter() - started)
    return sum(statistics.median(times[1:]) * 1000 for times in timings.values())


if __name__ == "__main__":
    print(json.dumps({"ms": timed_products()}))
