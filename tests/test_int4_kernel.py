"""causaldraft's int4 kernel (models/int4_kernel.py): the layout, the products, row invariance, the switch.

The kernel tests run on the build this CPU picks; ``test_the_other_builds_pass_the_kernel_tests``
runs them again in a subprocess for each other build the CPU can run (the AVX2 build on an AVX-512
bf16 CPU; where it runs both the AVX-512 bf16 and the VNNI build, the one the machine's timing did not choose)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from causaldraft.models import int4_kernel, kernel_choice
from causaldraft.models.packed import PackedLinear
from causaldraft.models.quant import (
    Bf16BlockLinear,
    Int4Linear,
    Int4Weights,
    Int8Linear,
    dequantize_int4,
    quantize_int4,
    quantize_int8,
    use_block_linears,
)

needs_kernel = pytest.mark.skipif(
    not int4_kernel.cpu_supported() or shutil.which("c++") is None, reason="no AVX-512 bf16 or AVX2, or no compiler"
)
KERNEL_TESTS = (
    "(products_match or weight_seen or alone or thread or refused_by_the_kernel or build_asked_for)"
    " and not int8 and not bf16"
)
INT8_TESTS = "int8"  # the AVX2 build's int8 product
BF16_TESTS = "bf16"  # the bf16 product of the AVX-512 bf16, VNNI and AVX2 builds
needs_int8 = pytest.mark.skipif(
    not (int4_kernel.cpu_supported() and int4_kernel.build_for_cpu().int8_products) or shutil.which("c++") is None,  # type: ignore[union-attr]
    reason="the int8 product is the AVX2 build's",
)
needs_bf16 = pytest.mark.skipif(
    not (int4_kernel.cpu_supported() and int4_kernel.build_for_cpu().bf16_products) or shutil.which("c++") is None,  # type: ignore[union-attr]
    reason="the bf16 product is the AVX-512 bf16, the VNNI and the AVX2 builds'",
)


def weights(out_features: int, in_features: int, seed: int) -> Int4Weights:
    generator = torch.Generator().manual_seed(seed)
    return quantize_int4(torch.randn(out_features, in_features, generator=generator) * 0.05)


def as_used(quantized: Int4Weights) -> torch.Tensor:
    """The weight both kernels multiply by: scales and zeros rounded to bf16, float64."""
    rounded = Int4Weights(
        quantized.values, quantized.scales.to(torch.bfloat16).float(), quantized.zeros.to(torch.bfloat16).float()
    )
    return dequantize_int4(rounded).double()


def bf16_columns(table: torch.Tensor, groups: int) -> torch.Tensor:
    """[out, groups] -> [out, in] float64 after bf16 rounding."""
    return table.to(torch.bfloat16).double().repeat_interleave(int4_kernel.GROUP, dim=1)


def test_records_hold_each_value_where_the_layout_says() -> None:
    """Channel n, input k of a record: chunk (k % 32) // 4, byte 2 * (n % 16) + k % 2, low nibble
    when (k % 4) < 2; scales and zeros follow as bf16."""
    values = torch.randint(0, 16, (32, 64), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    scales = torch.rand(32, 2) + 0.5
    zeros = torch.rand(32, 2) - 0.5
    records = int4_kernel.pack_blocks(values, scales, zeros)
    assert records.shape == (2, 2, int4_kernel.RECORD_BYTES) and records.dtype == torch.uint8
    for n, k in [(0, 0), (0, 1), (0, 2), (0, 3), (5, 9), (17, 38), (31, 63)]:
        record = records[n // 16, k // 32]
        byte = int(record[32 * ((k % 32) // 4) + 2 * (n % 16) + k % 2])
        assert (byte & 15 if k % 4 < 2 else byte >> 4) == int(values[n, k]), (n, k)
        tail = record[256:].view(torch.bfloat16).float()
        assert tail[n % 16] == scales[n, k // 32].to(torch.bfloat16).float()
        assert tail[16 + n % 16] == zeros[n, k // 32].to(torch.bfloat16).float()


def test_records_in_quads_hold_each_value_where_the_layout_says() -> None:
    """The VNNI build's order: channel n, input k of a record: piece (k % 32) // 8, byte 4 * (n % 16) + k % 4,
    low nibble when (k % 8) < 4; scales and zeros as in the other order."""
    values = torch.randint(0, 16, (32, 64), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    scales, zeros = torch.rand(32, 2) + 0.5, torch.rand(32, 2) - 0.5
    records = int4_kernel.pack_blocks(values, scales, zeros, quads=True)
    assert torch.equal(records[..., 256:], int4_kernel.pack_blocks(values, scales, zeros)[..., 256:])
    for n in range(32):
        for k in range(64):
            byte = int(records[n // 16, k // 32, 64 * ((k % 32) // 8) + 4 * (n % 16) + k % 4])
            assert (byte & 15 if k % 8 < 4 else byte >> 4) == int(values[n, k]), (n, k)


def test_pack_refuses_shapes_the_kernel_cannot_take() -> None:
    with pytest.raises(ValueError, match="out % 16"):
        int4_kernel.pack_blocks(torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8, 1), torch.zeros(8, 1))
    with pytest.raises(ValueError, match="in % 32"):
        int4_kernel.pack_blocks(torch.zeros(16, 48, dtype=torch.uint8), torch.ones(16, 1), torch.zeros(16, 1))


@needs_kernel
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 32), (48, 96), (192, 576), (64, 1536)])
def test_products_match_the_build_s_arithmetic_within_bf16_rounding(out_features: int, in_features: int) -> None:
    """bf16 activations (the AVX-512 build): the exact product of x and the weight, up to fp32 sums and the
    bf16 output. int8 activations (the AVX2 build): exact integer dot products of the rounded activations,
    scaled per group, up to the same; and within the activations' rounding (half a step each) of the exact
    product."""
    assert int4_kernel.available()
    build = int4_kernel.build_for_cpu()
    assert build is not None
    quantized = weights(out_features, in_features, seed=out_features)
    linear = Int4Linear(quantized, None)
    assert linear.kernel == "blocks"
    x = torch.randn(7, in_features, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x[3, :32] = 0  # a group of zeros (step 0)
    exact = x.double() @ as_used(quantized).t()  # [7, out]
    got = linear(x).double()
    groups = quantized.scales.shape[1]
    if not build.int8_activations:
        # fp32 sums of the terms x * (q - 8) * scale and x * zero, rounded once to bf16: half a bf16 ulp
        # plus the fp32 sums' error, bounded by the terms' magnitudes
        magnitude = ((quantized.values.double() - 8).abs() * bf16_columns(quantized.scales, groups)).abs()
        magnitude = magnitude + bf16_columns(quantized.zeros, groups).abs()
        bound = exact.abs() * 2**-8 + 1e-5 * (x.double().abs() @ magnitude.t())
        assert ((got - exact).abs() <= bound).all()
        return
    values, steps = int4_kernel.quantize_activations(x)  # [7, groups, 32], [7, groups, 1]
    assert values.abs().max() <= 127 and torch.equal(values, values.round())
    q = (quantized.values.double() - 8).reshape(out_features, groups, int4_kernel.GROUP)
    dots = torch.einsum("mgk,ngk->mng", values.double(), q)  # exact integers [7, out, groups]
    sums = values.sum(dim=-1)  # [7, groups]
    scale_steps = (quantized.scales.to(torch.bfloat16).float()[None] * steps.squeeze(-1)[:, None]).double()
    step_sums = (steps.squeeze(-1) * sums).double()[:, None]  # fp32 products, as the kernel rounds them
    terms = dots * scale_steps + quantized.zeros.to(torch.bfloat16).double()[None] * step_sums  # [7, out, groups]
    reference = terms.sum(dim=-1)
    bound = reference.abs() * 2**-8 + 1e-5 * terms.abs().sum(dim=-1)
    assert ((got - reference).abs() <= bound).all()
    rounding = steps.double().expand(-1, -1, int4_kernel.GROUP).reshape(7, in_features) * 0.5  # per input
    assert ((got - exact).abs() <= bound + rounding @ as_used(quantized).abs().t()).all()


@needs_kernel
def test_the_weight_seen_through_the_kernel_is_the_bf16_scaled_weight() -> None:
    """Through the identity: the bf16 weight bit for bit with bf16 activations; with int8 activations (each
    row of the identity is 127 steps of 1/127) within the fp32 rounding of scale * step, i.e. one bf16 step."""
    quantized = weights(32, 64, seed=3)
    seen = Int4Linear(quantized, None).dequantized().double()
    expected = as_used(quantized).to(torch.bfloat16).double()
    build = int4_kernel.build_for_cpu()
    assert build is not None
    if not build.int8_activations:
        assert torch.equal(seen, expected)
        return
    assert ((seen - expected).abs() <= expected.abs() * 2**-7).all()
    assert (seen == expected).float().mean() > 0.9


@needs_kernel
def test_every_row_is_computed_as_if_alone() -> None:
    """Rows of a call of any size, at any place in it, give the bits of a one-row call (the builds
    take rows 8, 4, 3, 2 or 1 at a time: every path is crossed)."""
    linear = Int4Linear(weights(96, 576, seed=5), None)
    x = torch.randn(19, 576, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    alone = torch.cat([linear(x[i : i + 1]) for i in range(19)])
    for start, stop in [(0, 19), (0, 13), (0, 4), (1, 3), (2, 9), (5, 12), (3, 19), (12, 13)]:
        assert torch.equal(linear(x[start:stop]), alone[start:stop]), (start, stop)


@needs_kernel
def test_thread_count_does_not_change_a_bit() -> None:
    linear = Int4Linear(weights(256, 128, seed=7), None)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    threads = torch.get_num_threads()  # the test session runs on one thread (conftest)
    try:
        torch.set_num_threads(1)
        single = linear(x)
        torch.set_num_threads(2)
        assert torch.get_num_threads() == 2
        double = linear(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(double, single)


@needs_kernel
def test_bad_operands_are_refused_by_the_kernel() -> None:
    assert int4_kernel.available()
    packed = int4_kernel.pack_blocks(torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 2), torch.zeros(16, 2))
    with pytest.raises(RuntimeError, match="packed does not fit x"):
        int4_kernel.product(torch.zeros(2, 32, dtype=torch.bfloat16), packed)
    with pytest.raises(RuntimeError, match="bf16"):
        int4_kernel.product(torch.zeros(2, 64), packed)


KERNEL_OF_A_LINEAR = (
    "import torch; from causaldraft.models.quant import Int4Linear, quantize_int4; "
    "print(Int4Linear(quantize_int4(torch.randn(16, 32)), None).kernel)"
)


def kernel_under_switch(value: str) -> subprocess.CompletedProcess[str]:
    """A new process (the switch is read once per process) that prints the kernel an int4 linear gets."""
    env = {**os.environ, int4_kernel.SWITCH: value}
    return subprocess.run(
        [sys.executable, "-c", KERNEL_OF_A_LINEAR], env=env, capture_output=True, text=True, check=True
    )


def test_the_switch_selects_torchs_kernel() -> None:
    """CAUSALDRAFT_INT4_KERNEL=torch: int4 linears use torch's kernel (read once per process)."""
    assert kernel_under_switch("torch").stdout.strip() == "torch"


def test_a_switch_naming_no_runnable_build_says_so() -> None:
    """CAUSALDRAFT_INT4_KERNEL=<typo>: int4 linears still work, on torch's kernel, with a message naming the builds."""
    result = kernel_under_switch("vnn")
    assert result.stdout.strip() == "torch"
    assert "CAUSALDRAFT_INT4_KERNEL=vnn: not a build (one of avx512_bf16, vnni, avx2, or torch)" in result.stderr


@needs_kernel
def test_a_failed_build_falls_back_to_torchs_kernel_with_a_message(tmp_path: Path) -> None:
    """No working compiler (CXX=false) and an empty home: int4 linears still work, on torch's kernel."""
    code = (
        "import torch; from causaldraft.models.quant import Int4Linear, quantize_int4; "
        "linear = Int4Linear(quantize_int4(torch.randn(16, 32)), None); "
        "print(linear.kernel, tuple(linear(torch.randn(2, 32)).shape))"
    )
    env = {**os.environ, "CXX": "false", "CAUSALDRAFT_HOME": str(tmp_path)}
    env.pop(int4_kernel.SWITCH, None)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "torch (2, 16)"
    assert "int4 kernel not built" in result.stderr


@needs_kernel
def test_the_build_asked_for_is_the_one_loaded() -> None:
    wanted = os.environ.get(int4_kernel.SWITCH, "")
    build = int4_kernel.build_for_cpu()
    assert build is not None and int4_kernel.available()
    assert build.isa == (wanted or next(b.isa for b in int4_kernel.BUILDS if b.source == build.source))
    runnable = [b for b in int4_kernel.BUILDS if set(b.cpu_flags) <= set(int4_kernel.cpu_flags())]
    if not wanted and not {"avx512_bf16", "vnni"} <= {b.isa for b in runnable}:
        assert build == runnable[0]  # no choice to make: the first build this CPU runs


def test_a_build_is_chosen_only_when_clearly_faster() -> None:
    first, vnni = (next(b for b in int4_kernel.BUILDS if b.isa == isa) for isa in ("avx512_bf16", "vnni"))
    assert kernel_choice.prefer((first, vnni), {"avx512_bf16": 20.3, "vnni": 11.8}) == vnni
    assert kernel_choice.prefer((first, vnni), {"avx512_bf16": 7.9, "vnni": 10.4}) == first
    assert kernel_choice.prefer((first, vnni), {"avx512_bf16": 7.9, "vnni": 7.0}) == first  # within the margin
    assert kernel_choice.prefer((first, vnni), {"avx512_bf16": 7.9, "vnni": None}) == first  # its probe failed
    assert kernel_choice.prefer((first, vnni), {"avx512_bf16": None, "vnni": 3.0}) == first


both_choices = pytest.mark.skipif(
    not {"avx512_bf16", "vnni"}
    <= {b.isa for b in int4_kernel.BUILDS if set(b.cpu_flags) <= set(int4_kernel.cpu_flags())}
    or shutil.which("c++") is None,
    reason="needs a CPU that runs both the AVX-512 bf16 and the VNNI build",
)


@both_choices
@pytest.mark.parametrize("kept", ["avx512_bf16", "vnni"])
def test_the_kept_choice_is_the_build_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kept: str) -> None:
    """Once a machine's choice is kept, every load reads it (no timing): here a choice written by hand."""
    monkeypatch.setenv("CAUSALDRAFT_HOME", str(tmp_path))
    monkeypatch.delenv(int4_kernel.SWITCH, raising=False)
    contenders = tuple(b for b in int4_kernel.BUILDS if b.isa in int4_kernel.CHOICES)
    path = kernel_choice.choice_path(contenders)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"isa": kept}))
    kernel_choice.chosen_build.cache_clear()
    try:
        assert int4_kernel.build_for_cpu().isa == kept  # type: ignore[union-attr]
    finally:
        kernel_choice.chosen_build.cache_clear()


@both_choices
def test_the_probe_times_a_build_in_a_process_of_its_own() -> None:
    vnni = next(b for b in int4_kernel.BUILDS if b.isa == "vnni")
    milliseconds = kernel_choice.probe(vnni)
    assert milliseconds is not None and 0 < milliseconds < 10_000
    assert kernel_choice.probe(dataclasses.replace(vnni, isa="no-such-build")) is None  # a failed probe


def other_builds() -> list[str]:
    flags = set(int4_kernel.cpu_flags())
    runnable = [build.isa for build in int4_kernel.BUILDS if set(build.cpu_flags) <= flags]
    loaded = int4_kernel.build_for_cpu()
    return [isa for isa in runnable if loaded is None or isa != loaded.isa]  # not the one this session's tests ran


@needs_kernel
@pytest.mark.parametrize("isa", other_builds() or [pytest.param("none", marks=pytest.mark.skip("one build here"))])
def test_the_other_builds_pass_the_kernel_tests(isa: str) -> None:
    env = {**os.environ, int4_kernel.SWITCH: isa}
    build = next(build for build in int4_kernel.BUILDS if build.isa == isa)
    tests = " or ".join([f"({KERNEL_TESTS})"] + [INT8_TESTS] * build.int8_products + [BF16_TESTS] * build.bf16_products)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", tests]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout


PRODUCTS_CODE = """
import sys, torch
from causaldraft.models import int4_kernel
from causaldraft.models.quant import Int4Linear, quantize_int4
assert int4_kernel.build_for_cpu().isa == sys.argv[2]
generator = torch.Generator().manual_seed(4)
outputs = []
for out_features, in_features, rows in [(16, 32, 1), (48, 96, 3), (192, 576, 9), (64, 1536, 5)]:
    linear = Int4Linear(quantize_int4(torch.randn(out_features, in_features, generator=generator) * 0.05), None)
    assert linear.kernel == "blocks"
    x = (torch.randn(rows, in_features, generator=generator) * 3).to(torch.bfloat16)
    x[0, :32] = 0  # a group of zeros
    x[-1, 32 % in_features] = 1e4  # a group dominated by one input
    outputs.append(linear(x))
torch.save(outputs, sys.argv[1])
"""


@pytest.mark.skipif(
    not {"avx2", "vnni"} <= {b.isa for b in int4_kernel.BUILDS if set(b.cpu_flags) <= set(int4_kernel.cpu_flags())}
    or shutil.which("c++") is None,
    reason="needs a CPU that runs both the AVX2 and the VNNI build",
)
def test_the_vnni_build_computes_the_avx2_build_s_bits(tmp_path: Path) -> None:
    """The two int8-activation builds: the same rounding, exact integer dot products and the same fp32 steps,
    so every output is the same bf16 value (each build runs in its own process: both define the operator)."""
    results = {}
    for isa in ("avx2", "vnni"):
        env = {**os.environ, int4_kernel.SWITCH: isa}
        path = tmp_path / f"{isa}.pt"
        subprocess.run([sys.executable, "-c", PRODUCTS_CODE, str(path), isa], env=env, check=True)
        results[isa] = torch.load(path)
    for avx2, vnni in zip(results["avx2"], results["vnni"], strict=True):
        assert avx2.dtype == torch.bfloat16 and torch.equal(avx2, vnni)


@needs_int8
def test_int8_records_and_products() -> None:
    """The AVX2 build's int8 product: records hold each block's 8 channels per group of 32 inputs;
    the weight read back is the one given; each row's result is its int8-rounded activations'
    exact integer dot products per group, scaled by the group's step (fp32 sums, in group order)
    and the channel's bf16 scale, rounded once to bf16; and within that rounding plus half a step
    per input of the exact product."""
    generator = torch.Generator().manual_seed(11)
    quantized = quantize_int8(torch.randn(48, 96, generator=generator))
    linear = Int8Linear(quantized, None)
    assert linear.kernel == "blocks" and linear.qweight.shape == (6, 3, 8, 32)
    assert torch.equal(linear.qweight[1, 2, 5], quantized.values[13, 64:96])
    assert torch.equal(int4_kernel.unpack_int8_records(linear.qweight), quantized.values)
    x = torch.randn(5, 96, generator=generator).to(torch.bfloat16)
    x[2, 32:64] = 0  # a group of zeros (step 0)
    got = linear(x).double()
    values, steps = int4_kernel.quantize_activations(x)  # [5, 3, 32], [5, 3, 1]
    q = quantized.values.double().reshape(48, 3, 32)
    dots = torch.einsum("mgk,ngk->mng", values.double(), q)  # exact integers [5, 48, 3]
    scales = quantized.scales.to(torch.bfloat16).double()
    terms = dots * steps.squeeze(-1).double()[:, None]  # [5, 48, 3]
    reference = terms.sum(dim=-1) * scales  # [5, 48]
    bound = reference.abs() * 2**-8 + 1e-6 * terms.abs().sum(dim=-1) * scales.abs()
    assert ((got - reference).abs() <= bound).all()
    weight = quantized.values.double() * scales[:, None]
    exact = x.double() @ weight.t()
    rounding = steps.double().expand(-1, -1, 32).reshape(5, 96) * 0.5  # per input
    assert ((got - exact).abs() <= bound + rounding @ weight.abs().t()).all()
    assert not torch.equal(got, exact.to(torch.bfloat16).double())  # the activations' rounding shows
    torch_kernel = torch.ops.aten._weight_int8pack_mm(x, quantized.values.contiguous(), linear.scales).double()
    torch_bound = exact.abs() * 2**-8 + 1e-5 * (x.double().abs() @ weight.abs().t())
    assert ((torch_kernel - exact).abs() <= torch_bound).all()  # torch's kernel: bf16 activations


@needs_int8
def test_int8_rows_are_computed_as_if_alone_on_any_thread_count() -> None:
    linear = Int8Linear(quantize_int8(torch.randn(64, 576, generator=torch.Generator().manual_seed(12))), None)
    assert_rows_as_if_alone(linear, torch.randn(7, 576, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16))


def assert_rows_as_if_alone(linear: torch.nn.Module, x: torch.Tensor) -> None:
    """Each of x's rows (7 or more) gives the same bits alone, in pairs, in threes, in the call of all rows
    and in others, and on 1 and 2 threads."""
    n = x.shape[0]
    alone = torch.cat([linear(x[i : i + 1]) for i in range(n)])
    for start, stop in [(0, n), (0, 2), (1, 4), (3, n), (0, 5), (n - 1, n), (2, n - 1)]:  # threes, pairs, alone
        assert torch.equal(linear(x[start:stop]), alone[start:stop]), (start, stop)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert torch.equal(linear(x), alone)
    finally:
        torch.set_num_threads(threads)


@needs_int8
def test_int8_bad_operands_are_refused_by_the_kernel() -> None:
    packed = int4_kernel.pack_int8_records(torch.zeros(16, 64, dtype=torch.int8))
    scales = torch.ones(16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="packed does not fit x"):
        int4_kernel.int8_product(torch.zeros(2, 32, dtype=torch.bfloat16), packed, scales)
    with pytest.raises(RuntimeError, match="scales"):
        int4_kernel.int8_product(torch.zeros(2, 64, dtype=torch.bfloat16), packed, scales[:8])
    with pytest.raises(ValueError, match="out % 8"):
        int4_kernel.pack_int8_records(torch.zeros(12, 64, dtype=torch.int8))
    with pytest.raises(ValueError, match="in % 32"):
        int4_kernel.pack_int8_records(torch.zeros(16, 48, dtype=torch.int8))
    assert Int8Linear(quantize_int8(torch.randn(16, 48)), None).kernel == "torch"  # in % 32: torch's kernel


@needs_bf16
def test_bf16_block_linear_products_rows_and_threads() -> None:
    """The build's bf16 product (vdpbf16ps on AVX-512 bf16, fp32 multiply-adds on AVX2): within bf16
    rounding of the float64 product (bias added after), also with an odd number of input pairs; the
    weight read back is the one given, and each row computes the same bits alone, in pairs, in threes,
    in calls of up to 19 rows and on any thread count."""
    generator = torch.Generator().manual_seed(14)
    weight = (torch.randn(48, 96, generator=generator) * 0.1).to(torch.bfloat16)
    bias = torch.randn(48, generator=generator).to(torch.bfloat16)
    linear = Bf16BlockLinear(weight, bias)
    assert linear.packed.shape == (3, 96, 16) and torch.equal(linear.weight, weight)
    x = torch.randn(19, 96, generator=generator).to(torch.bfloat16)  # rows go 8, 4, 2, 1 at a time (AVX-512)
    products = linear(x).double() - bias.double()  # the bias is added in bf16 after the product's rounding
    exact = x.double() @ weight.double().t()
    bound = (exact.abs() + bias.double().abs()) * 2**-7 + 1e-5 * (x.double().abs() @ weight.double().abs().t())
    assert ((products - exact).abs() <= bound).all()
    assert_rows_as_if_alone(linear, x)
    narrow = Bf16BlockLinear(weight[:40], bias[:40])  # padded to 48 channels, cut back to 40
    assert torch.equal(narrow.weight, weight[:40]) and torch.equal(narrow(x), linear(x)[:, :40])
    odd = torch.randn(16, 102, generator=generator).to(torch.bfloat16)  # 51 input pairs: the last one alone
    rows = torch.randn(9, 102, generator=generator).to(torch.bfloat16)
    exact = rows.double() @ odd.double().t()
    got = Bf16BlockLinear(odd, None)(rows).double()
    assert ((got - exact).abs() <= exact.abs() * 2**-7 + 1e-5 * (rows.double().abs() @ odd.double().abs().t())).all()
    assert_rows_as_if_alone(Bf16BlockLinear(odd, None), rows)
    with pytest.raises(RuntimeError, match="packed does not fit x"):
        int4_kernel.bf16_product(torch.zeros(2, 32, dtype=torch.bfloat16), linear.packed)


@needs_bf16
def test_bf16_models_use_the_block_kernel(tiny_llama_dir: Path) -> None:
    """The layers' linears always; the LM head is the screened head where the Q8_0 kernel runs (its products
    through this kernel too), else the packed head where oneDNN takes bf16 weights, else a block linear."""
    from causaldraft.models import q8_0_head
    from causaldraft.models.loading import load_model
    from causaldraft.models.native import NativeLlama
    from causaldraft.models.products import native_bf16_products
    from causaldraft.models.screened_head import ScreenedHead

    backend = load_model(str(tiny_llama_dir), "native", "bfloat16").backend
    assert isinstance(backend, NativeLlama)
    blocks = [module for module in backend.modules() if isinstance(module, Bf16BlockLinear)]
    if q8_0_head.available():
        assert len(blocks) == 4 * backend.llama_shape.num_layers  # qkv, o, gate_up, down
        assert isinstance(backend.lm_head, ScreenedHead)
    elif native_bf16_products():
        assert len(blocks) == 4 * backend.llama_shape.num_layers
        assert isinstance(backend.lm_head, PackedLinear)  # oneDNN's bf16 products with the reordered weight
    else:
        assert len(blocks) == 4 * backend.llama_shape.num_layers + 1  # and the LM head
    assert not use_block_linears(backend)  # nothing left to replace


def test_a_build_lock_left_by_a_killed_process_is_removed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """torch waits without end for a build directory's lock to go: one older than any build is removed (with a
    message), a fresh one (another process building now) is kept."""
    from causaldraft.models.int4_kernel import STALE_LOCK_SECONDS, clear_stale_lock

    lock = tmp_path / "lock"
    assert not clear_stale_lock(lock)  # none
    lock.touch()
    assert not clear_stale_lock(lock) and lock.exists()  # fresh: a build under way
    old = time.time() - STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    assert clear_stale_lock(lock) and not lock.exists()
    assert "build lock" in capsys.readouterr().err
