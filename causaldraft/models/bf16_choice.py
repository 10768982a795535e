"""Which products a bf16 model's compiled graphs run its layers through, where two can: measured once per machine.

Where causaldraft's bf16 kernel is built (``int4_kernel.bf16_available``) a bf16 model's layer linears are
``quant.Bf16BlockLinear`` (``bf16_mm``): row-invariant from one row, weights read at about the memory's speed.
On a CPU where oneDNN also takes bf16 weights (``products.native_bf16_products``), compiled graphs can instead
hold the layer weights as constants that inductor reorders once for oneDNN (``compiled.frozen_weights``), which
on some CPUs is much faster at the rows of a verify pass. Measured, ms for a pass's 120 layer products of the
default model's shapes (``bench/kernel_speed.py --dtype bfloat16``) at 1 / 8 / 16 rows:

- AMD Zen 5 (stop 33): ``bf16_mm`` ~3.8-5.2 at one row and ~5-6 at 8, oneDNN ~6-7 and ~7.5: the kernel;
- an Intel Xeon with AMX (stop 35): ``bf16_mm`` 10.6 / 13.6 / 21.7, oneDNN 11.8 / 11.7 / 12.1 (AMX tiles;
  its one-row calls run as two rows, see below). Verify passes of 2 / 16 / 32 rows cost 16.4 / 19.6 / 25.0 ms
  through oneDNN against 18.2 / 29.1 / 49.8 through the kernel.

So the first compile of a bf16 model on such a machine times both on products shaped like a pass
(``timed_products``, a few seconds, in this process: both run here side by side) and keeps the answer in
``$CAUSALDRAFT_HOME/kernels/bf16-choice-<digest>.json``. oneDNN is chosen when its sum over ``PROBE_ROWS``
is below ``MARGIN`` of the kernel's, each product's sum the fastest of ``PROBE_ROUNDS`` probes (since stop 46).
Both are exact products of bf16 numbers with fp32 sums (in different orders), so the choice changes speed, not
accuracy. ``CAUSALDRAFT_BF16_PRODUCTS=kernel`` (or ``onednn``)
skips the timing.

What oneDNN changes (``compiled.use_chosen_bf16_products``, the first thing ``compile_model`` does): the model's
kernel linears become its plain linears over the same numbers (``quant.use_plain_linears``), so the graphs freeze
the weights for oneDNN and long prompts, read eagerly, run oneDNN's products too: on AMX they cost a fraction of
the kernel's (a first version kept the kernel for eager passes and lost ~10 % of every method's speed to prompts).
oneDNN rounds a one-row product differently from its products of two or more rows, so such graphs have no one-row
bucket: a plain step runs as two rows, one of them padding, and plain decoding costs a little more per token.
Every speculative step costs less, and with deeper trees (``adapt.dynamic_depth``) bf16 speculation gained
15-22 % here (docs/int4-kernel.md). Eager passes of few rows (the self-draft's layers) then reorder the weights
on every call, as bf16 models did before stop 33.
"""

from __future__ import annotations

import functools
import hashlib
import os
import statistics
import time
from pathlib import Path

import torch

from causaldraft.errors import CausalDraftError
from causaldraft.models import int4_kernel
from causaldraft.models.kernel_choice import cpu_model, keep_choice, kept_choice
from causaldraft.models.products import native_bf16_products
from causaldraft.paths import causaldraft_home

SWITCH = "CAUSALDRAFT_BF16_PRODUCTS"  # "kernel" or "onednn": that one, without timing
KERNEL = "kernel"
ONEDNN = "onednn"
CHOICES = (KERNEL, ONEDNN)
MARGIN = 0.9  # oneDNN must take less than this share of the kernel's time (both are exact; this absorbs noise)
PROBE_ROWS = (1, 8, 16)  # a plain step, and verify passes of trees of 8 and 16 nodes
ONEDNN_MIN_ROWS = 2  # compiled oneDNN graphs start at two rows (COMPILE_BUCKETS)
PROBE_LAYERS = 30  # layers of the default model's shapes: ~212 MB of bf16 weights, beyond any cache
PROBE_REPEATS = 9  # rounds over every row count, the two products alternating; each median is kept
# probes of both products; each one's fastest sum is kept. One probe in a busy moment of stop 46 gave kernel 61.0 ms
# against oneDNN 59.8 (so the kernel) where three more a few minutes later gave 0.82-0.85 (oneDNN), and the kernel's
# bf16 trees stayed at depth 8: eagle3 accepted 3.10 tokens per pass against 3.76 through oneDNN's
PROBE_ROUNDS = 2
PROBE_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # fused qkv, o, fused gate and up, down


def layer_products() -> str:
    """``KERNEL`` or ``ONEDNN``: what a compiled bf16 model with kernel linears runs its layers through here.

    A CPU where only one of the two can serve gets that one; elsewhere ``SWITCH`` decides where it is set,
    else the choice measured once for this machine (``measured_choice``)."""
    wanted = os.environ.get(SWITCH, "").strip().lower()
    if wanted and wanted not in CHOICES:
        raise CausalDraftError(f"{SWITCH} must be one of {', '.join(CHOICES)}, got {wanted!r}")
    if not native_bf16_products():  # oneDNN takes no bf16 weights on this CPU
        return KERNEL
    if not int4_kernel.bf16_available():
        return ONEDNN
    return wanted or measured_choice()


def choice_path() -> Path:
    digest = hashlib.sha256(cpu_model().encode())
    digest.update(" ".join(int4_kernel.cpu_flags()).encode())
    build = int4_kernel.build_for_cpu()
    if build is not None:
        digest.update(build.isa.encode())
        for source in (*build.sources, *((build.bf16_source,) if build.bf16_source is not None else ())):
            digest.update(int4_kernel.source_digest(source, build.flags).encode())
    digest.update(torch.__version__.encode())
    return causaldraft_home() / "kernels" / f"bf16-choice-{digest.hexdigest()[:16]}.json"


def prefer(milliseconds: dict[str, float]) -> str:
    """``ONEDNN`` when it took less than ``MARGIN`` of the kernel's time, else ``KERNEL``.

    Example: {kernel: 45.9, onednn: 35.6} gives onednn (35.6 < 41.3); {kernel: 20.0, onednn: 19.0} gives kernel."""
    return ONEDNN if milliseconds[ONEDNN] < MARGIN * milliseconds[KERNEL] else KERNEL


@functools.cache
def measured_choice() -> str:
    """The kept choice for this machine, or a new one measured now (and kept); read once per process."""
    from causaldraft.models.quant import notify

    path = choice_path()
    kept = kept_choice(path, "products", CHOICES)
    if kept is not None:
        return kept
    notify("timing bf16 layer products (causaldraft's kernel, oneDNN) once on this CPU (~20 s)")
    rounds = [timed_products() for _ in range(PROBE_ROUNDS)]
    milliseconds = {name: min(measured[name] for measured in rounds) for name in CHOICES}
    choice = prefer(milliseconds)
    keep_choice(path, {"products": choice, "ms": milliseconds, "rows": PROBE_ROWS, "cpu": cpu_model()})
    shown = ", ".join(f"{name} {ms:.2f} ms" for name, ms in milliseconds.items())
    notify(f"bf16 layer products of rows {'/'.join(map(str, PROBE_ROWS))}: {shown}; using {choice} (kept in {path})")
    return choice


def timed_products() -> dict[str, float]:
    """Sum over ``PROBE_ROWS`` of the median time of ``PROBE_LAYERS`` layers' bf16 products, in ms, for
    ``KERNEL`` (``Bf16BlockLinear``) and ``ONEDNN`` (weights reordered for oneDNN's rows, as inductor freezes
    them; at least ``ONEDNN_MIN_ROWS`` rows), alternating within every round."""
    from causaldraft.models.packed import pack, packed_product
    from causaldraft.models.quant import Bf16BlockLinear

    generator = torch.Generator().manual_seed(0)
    weights = [
        (torch.randn(out_features, in_features, generator=generator) * 0.02).to(torch.bfloat16)
        for _ in range(PROBE_LAYERS)
        for out_features, in_features in PROBE_SHAPES
    ]
    kernel = [Bf16BlockLinear(weight, None) for weight in weights]
    onednn_rows = {rows: max(rows, ONEDNN_MIN_ROWS) for rows in PROBE_ROWS}
    reordered = {rows: [pack(weight, count) for weight in weights] for rows, count in onednn_rows.items()}
    del weights
    inputs = {
        (rows, in_features): torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
        for rows in {*PROBE_ROWS, *onednn_rows.values()}
        for in_features in {shape[1] for shape in PROBE_SHAPES}
    }

    def run_kernel(rows: int) -> None:
        for linear in kernel:
            linear(inputs[rows, linear.in_features])

    def run_onednn(rows: int) -> None:
        for linear, packed in zip(kernel, reordered[rows], strict=True):
            packed_product(inputs[onednn_rows[rows], linear.in_features], packed)

    timings: dict[str, dict[int, list[float]]] = {
        KERNEL: {r: [] for r in PROBE_ROWS},
        ONEDNN: {r: [] for r in PROBE_ROWS},
    }
    with torch.inference_mode():
        for _ in range(PROBE_REPEATS + 1):  # the first round warms up
            for rows in PROBE_ROWS:
                for name, run in ((KERNEL, run_kernel), (ONEDNN, run_onednn)):
                    started = time.perf_counter()
                    run(rows)
                    timings[name][rows].append(time.perf_counter() - started)
    return {
        name: sum(statistics.median(times[1:]) * 1000 for times in by_rows.values())
        for name, by_rows in timings.items()
    }
