"""Offline batched passes (models/batched.py): the products they run through."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from causaldraft.models import batched, int4_kernel
from causaldraft.models.batched import BatchCache, batched_forward, use_batch_products
from causaldraft.models.loading import LoadedModel, load_model
from causaldraft.models.native import NativeLlama, default_aux_layers
from causaldraft.models.products import native_bf16_products
from causaldraft.models.quant import has_block_linears

needs_both = pytest.mark.skipif(
    not (native_bf16_products() and int4_kernel.bf16_available()),
    reason="needs oneDNN's bf16 products and causaldraft's bf16 kernel on this CPU",
)


def native(directory: Path, dtype: str) -> NativeLlama:
    backend = load_model(str(directory), "native", dtype).backend
    assert isinstance(backend, NativeLlama)
    return backend


def forward(model: NativeLlama) -> tuple[torch.Tensor, torch.Tensor]:
    """A 3-row prefill of different lengths' worth of tokens, then one decode step: hidden and features."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.llama_shape.vocab_size, (3, 7), generator=generator)
    aux = default_aux_layers(model.llama_shape.num_layers)
    cache = BatchCache.empty(model, 3, 16)
    with torch.inference_mode():
        batched_forward(model, tokens, torch.arange(7)[None].expand(3, 7), cache, aux)
        hidden, features = batched_forward(model, tokens[:, :1], torch.tensor([[7], [5], [6]]), cache, aux)
    assert features is not None
    return hidden.float(), features.float()


@needs_both
def test_batch_products_swap_the_kernel_for_onednn_over_the_same_numbers(tiny_llama_dir: Path) -> None:
    model = native(tiny_llama_dir, "bfloat16")
    assert has_block_linears(model)
    before = forward(model)
    assert use_batch_products(model) and not has_block_linears(model)
    assert not use_batch_products(model)  # nothing left to swap
    after = forward(model)
    for old, new in zip(before, after, strict=True):  # the same bf16 products, summed in other orders
        assert torch.allclose(old, new, rtol=5e-2, atol=5e-2)
        assert not torch.equal(old, torch.zeros_like(old))


@needs_both
def test_batch_products_keep_the_kernel_where_onednn_takes_no_bf16(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = native(tiny_llama_dir, "bfloat16")
    monkeypatch.setattr(batched, "native_bf16_products", lambda: False)
    assert not use_batch_products(model) and has_block_linears(model)


def test_batch_products_change_nothing_in_float32(tiny_llama_dir: Path) -> None:
    model = native(tiny_llama_dir, "float32")
    before = forward(model)
    linears = [type(module) for module in model.modules()]
    assert not use_batch_products(model)
    assert [type(module) for module in model.modules()] == linears
    for old, new in zip(before, forward(model), strict=True):
        assert torch.equal(old, new)


def test_batch_products_leave_quantized_models_alone(models: dict[str, LoadedModel]) -> None:
    backend = models["int4"].backend
    assert isinstance(backend, NativeLlama) and backend.quantized
    linears = [type(module) for module in backend.modules()]
    assert not use_batch_products(backend)
    assert [type(module) for module in backend.modules()] == linears
