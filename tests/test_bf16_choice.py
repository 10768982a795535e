"""The choice between causaldraft's bf16 kernel and oneDNN's frozen products for a compiled bf16 model's
layers (models/bf16_choice.py), and the swap to plain linears that oneDNN's graphs are traced from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from causaldraft.errors import CausalDraftError
from causaldraft.models import bf16_choice, int4_kernel
from causaldraft.models.compiled import (
    GraphKey,
    GraphStore,
    compile_model,
    frozen_weights,
    kernel_products,
    use_chosen_bf16_products,
)
from causaldraft.models.loading import load_model
from causaldraft.models.native import Linear, NativeLlama, default_aux_layers
from causaldraft.models.products import native_bf16_products
from causaldraft.models.quant import Bf16BlockLinear, has_block_linears, use_plain_linears

needs_both = pytest.mark.skipif(
    not (native_bf16_products() and int4_kernel.bf16_available()),
    reason="needs oneDNN's bf16 products and causaldraft's bf16 kernel on this CPU",
)


def bf16_native(directory: Path) -> NativeLlama:
    backend = load_model(str(directory), "native", "bfloat16").backend
    assert isinstance(backend, NativeLlama)
    return backend


def test_onednn_is_chosen_only_when_clearly_faster() -> None:
    assert bf16_choice.prefer({"kernel": 45.9, "onednn": 35.6}) == "onednn"  # an AMX Xeon, stop 35
    assert bf16_choice.prefer({"kernel": 20.0, "onednn": 19.0}) == "kernel"  # within the margin
    assert bf16_choice.prefer({"kernel": 15.0, "onednn": 22.5}) == "kernel"  # Zen 5


@needs_both
@pytest.mark.parametrize("wanted", ["kernel", "onednn", "ONEDNN "])
def test_the_switch_decides_without_timing(monkeypatch: pytest.MonkeyPatch, wanted: str) -> None:
    monkeypatch.setattr(bf16_choice, "measured_choice", lambda: pytest.fail("timed although the switch was set"))
    monkeypatch.setenv(bf16_choice.SWITCH, wanted)
    assert bf16_choice.layer_products() == wanted.strip().lower()


def test_a_bad_switch_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(bf16_choice.SWITCH, "amx")
    with pytest.raises(CausalDraftError, match="kernel, onednn"):
        bf16_choice.layer_products()


def test_without_the_kernel_the_layers_go_through_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    if not native_bf16_products():
        pytest.skip("oneDNN takes no bf16 weights here")
    monkeypatch.setenv(int4_kernel.SWITCH, "torch")  # no causaldraft kernel: nothing to choose
    monkeypatch.setenv(bf16_choice.SWITCH, "kernel")
    assert bf16_choice.layer_products() == "onednn"


@needs_both
@pytest.mark.parametrize("kept", ["kernel", "onednn"])
def test_the_kept_choice_is_read_back_and_a_corrupt_one_measured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kept: str
) -> None:
    monkeypatch.setenv("CAUSALDRAFT_HOME", str(tmp_path))
    monkeypatch.delenv(bf16_choice.SWITCH)
    path = bf16_choice.choice_path()
    assert path.is_relative_to(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"products": kept}))
    # two probes, the first in a busy moment for oneDNN: each product's fastest sum decides (10.0 against 5.0)
    probes = [{"kernel": 10.0, "onednn": 12.0}, {"kernel": 11.0, "onednn": 5.0}]
    measured: list[int] = []

    def timed() -> dict[str, float]:
        measured.append(1)
        return probes[(len(measured) - 1) % len(probes)]

    monkeypatch.setattr(bf16_choice, "timed_products", timed)
    bf16_choice.measured_choice.cache_clear()
    try:
        assert bf16_choice.layer_products() == kept and not measured
        path.write_text("{not json")  # corrupt: timed again, and the new answer kept
        bf16_choice.measured_choice.cache_clear()
        assert bf16_choice.layer_products() == "onednn" and len(measured) == bf16_choice.PROBE_ROUNDS == 2
        record = json.loads(path.read_text())
        assert record["products"] == "onednn" and record["ms"] == {"kernel": 10.0, "onednn": 5.0}
    finally:
        bf16_choice.measured_choice.cache_clear()


@needs_both
def test_the_probe_times_both_products(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bf16_choice, "PROBE_LAYERS", 2)
    monkeypatch.setattr(bf16_choice, "PROBE_REPEATS", 2)
    milliseconds = bf16_choice.timed_products()
    assert set(milliseconds) == {"kernel", "onednn"} and all(ms > 0 for ms in milliseconds.values())


@needs_both
def test_plain_linears_compute_torch_s_product_of_the_same_numbers(tiny_llama_dir: Path) -> None:
    model = bf16_native(tiny_llama_dir)
    blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, Bf16BlockLinear)]
    assert blocks and use_plain_linears(model) and not has_block_linears(model)
    assert not use_plain_linears(model)  # nothing left to replace
    modules = dict(model.named_modules())
    for name, block in blocks:
        plain = modules[name]
        assert isinstance(plain, Linear) and plain.weight.dtype == torch.bfloat16
        assert torch.equal(plain.weight, block.weight) and not plain.weight.requires_grad
        x = torch.randn(3, block.in_features).to(torch.bfloat16)
        assert torch.allclose(plain(x).float(), block(x).float(), rtol=2e-2, atol=1e-3)  # bf16 rounding apart


@needs_both
def test_the_model_swaps_its_linears_only_where_onednn_is_chosen(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = bf16_native(tiny_llama_dir)
    use_chosen_bf16_products(model)  # conftest: kernel
    assert has_block_linears(model) and kernel_products(model)
    monkeypatch.setenv(bf16_choice.SWITCH, "onednn")
    use_chosen_bf16_products(model)
    assert not has_block_linears(model) and frozen_weights(model) and not kernel_products(model)
    assert GraphKey.of(model, default_aux_layers(model.llama_shape.num_layers)).weights


@needs_both
def test_a_store_for_other_graphs_is_refused(
    tiny_llama_dir: Path, graph_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = bf16_native(tiny_llama_dir)
    key = GraphKey.of(model, default_aux_layers(model.llama_shape.num_layers))  # the kernel's graphs
    monkeypatch.setenv(bf16_choice.SWITCH, "onednn")
    with pytest.raises(CausalDraftError, match="use_chosen_bf16_products"):
        compile_model(model, buckets=(2,), store=GraphStore(key, graph_root), progress=False)
