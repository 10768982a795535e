"""The LM head through oneDNN (models/packed.py): row-invariant at every row count, the head of
bf16 and quantized models, exact where it replaces F.linear's one-row product; the prompt twin of
quantized models (packed bf16, or fp32 where oneDNN takes no bf16 weights)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from causaldraft.models import int4_kernel, q8_0_head
from causaldraft.models.loading import LoadedModel
from causaldraft.models.native import NativeLlama
from causaldraft.models.packed import (
    FLOAT32_MIN_ROWS,
    MAX_ROWS_PER_CALL,
    Float32Linear,
    PackedLinear,
    is_linear,
    pack,
    packed_head,
    packed_product,
    padded_product,
    prefill_model,
    rows_agree,
)
from causaldraft.models.products import native_bf16_products
from causaldraft.models.screened_head import ScreenedHead

needs_packing = pytest.mark.skipif(
    not native_bf16_products(), reason="oneDNN is missing or takes no bf16 weights on this CPU"
)


def random_weight(out_features: int, in_features: int, seed: int = 0) -> nn.Parameter:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * in_features**-0.5
    return nn.Parameter(weight.bfloat16(), requires_grad=False)


@needs_packing
@pytest.mark.parametrize("in_features", [64, 576, 1536])
def test_every_row_is_its_one_row_product(in_features: int) -> None:
    """Calls of 1..80 rows (crossing the split into calls of at most 32) give each row bit for bit
    as one row, on several random inputs. in_features 1536 is a shape where oneDNN's unpadded
    one-row product differs from its many-row products for some inputs (measured): the padding of
    short calls is what keeps it exact."""
    head = packed_head(random_weight(1024, in_features))
    assert head is not None
    for seed in range(4):
        rows = torch.randn(80, in_features, generator=torch.Generator().manual_seed(seed)).bfloat16()  # [80, in]
        alone = torch.cat([head(rows[i : i + 1]) for i in range(80)])  # [80, out]
        for count in (2, 3, 4, 5, 7, 16, 17, 18, 31, 32, 33, 64, 80):
            assert torch.equal(head(rows[:count]), alone[:count]), (seed, count)
        assert torch.equal(head(rows[:6].view(2, 3, in_features)), alone[:6].view(2, 3, -1))  # leading dims kept


@needs_packing
def test_unpadded_one_row_products_can_differ() -> None:
    """Why short calls are padded: for in_features 1536 some input's unpadded one-row product
    differs from the same row in a call of four (measured on AMD Zen 3 and Zen 5). Where this CPU's
    oneDNN computes one row as it computes four (an Intel Xeon with AMX, stop 35), the padding is
    merely unneeded, and the test says so by skipping; the padded product is checked either way."""
    weight = random_weight(1024, 1536)
    packed = pack(weight, MAX_ROWS_PER_CALL)
    differs = False
    for seed in range(8):
        rows = torch.randn(4, 1536, generator=torch.Generator().manual_seed(seed)).bfloat16()
        one = torch.cat([packed_product(rows[i : i + 1], packed) for i in range(4)])
        differs |= not torch.equal(packed_product(rows, packed), one)
        assert torch.equal(padded_product(rows[:1], packed), packed_product(rows, packed)[:1])
    if not differs:
        pytest.skip("this CPU's oneDNN computes an unpadded row as it does in a call of four: padding is unneeded here")


@needs_packing
def test_matches_the_plain_linear_of_two_or_more_rows() -> None:
    """For a bf16 model the packed head computes what ``native.Linear`` (F.linear, a one-row input
    run as two rows) computed, bit for bit, so plain decoding's text does not change with it."""
    weight = random_weight(4096, 576)
    head = packed_head(weight)
    assert head is not None
    rows = torch.randn(20, 576, generator=torch.Generator().manual_seed(2)).bfloat16()
    for count in (1, 2, 5, 20):
        plain = F.linear(rows[: max(count, 2)], weight)[:count]
        assert torch.equal(head(rows[:count]), plain), count


@needs_packing
def test_the_check_passes_for_model_shapes() -> None:
    for in_features in (64, 576, 960, 1536):
        weight = random_weight(512, in_features)
        assert rows_agree(pack(weight, MAX_ROWS_PER_CALL), in_features, torch.bfloat16)


def test_fp32_weights_are_not_packed() -> None:
    assert packed_head(nn.Parameter(torch.randn(64, 32), requires_grad=False)) is None


@needs_packing
@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "int4"])
def test_models_use_the_packed_head(models: dict[str, LoadedModel], dtype: str) -> None:
    """bf16 models where the Q8_0 kernel runs have the screened head (tests/test_screened_head.py) instead."""
    backend = models[dtype].backend
    screened = dtype == "bfloat16" and q8_0_head.available() and int4_kernel.bf16_available()
    assert isinstance(backend.lm_head, ScreenedHead if screened else PackedLinear)
    assert backend.lm_head.weight.dtype == torch.bfloat16
    assert backend.lm_head_weight().shape == (backend.shape.vocab_size, backend.shape.hidden_size)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_models_read_prompts_with_a_twin(models: dict[str, LoadedModel], dtype: str) -> None:
    """The twin shares the model's embeddings, norms and head, computes its layers in packed bf16
    (fp32 where oneDNN takes no bf16 weights), and reads a prompt to nearly the same hidden states
    and cache (a different kernel, so not bit for bit: plain and speculative decoding both start
    from the twin's cache)."""
    loaded = models[dtype]
    model, twin = loaded.backend, loaded.prefill
    assert isinstance(model, NativeLlama) and isinstance(twin, NativeLlama)
    assert twin.embed_tokens is model.embed_tokens and twin.lm_head is model.lm_head and twin.norm is model.norm
    assert twin.layers[0].input_layernorm is model.layers[0].input_layernorm
    twin_linear = PackedLinear if native_bf16_products() else Float32Linear
    assert isinstance(twin.layers[0].mlp.down_proj, twin_linear) and not twin.graphs
    count = 96  # from FLOAT32_MIN_ROWS rows the fp32 twin uses its own weights
    tokens = torch.randint(3, 200, (count,), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(count, count, dtype=torch.bool).tril()
    outputs, caches = [], []
    for backend in (model, twin):
        cache = backend.new_cache(count + 8)
        outputs.append(backend.forward(tokens, torch.arange(count), mask, cache))
        caches.append(cache)
    spread = outputs[0].logits.std()
    assert (outputs[0].logits - outputs[1].logits).abs().max() < 0.1 * spread
    assert caches[1].length == count
    keys = [cache.keys[0][:, :count] for cache in caches]
    assert (keys[0] - keys[1]).abs().max() < 0.05 * keys[0].abs().max()


def test_the_fp32_twin_reads_short_prompts_with_the_quantized_product(models: dict[str, LoadedModel]) -> None:
    linear = models["int4"].backend.layers[0].mlp.down_proj
    twin = Float32Linear(torch.randn(linear.out_features, linear.in_features), None, linear)
    short = torch.randn(FLOAT32_MIN_ROWS - 1, linear.in_features).bfloat16()
    assert torch.equal(twin(short), linear(short))
    long = torch.randn(FLOAT32_MIN_ROWS, linear.in_features).bfloat16()
    assert torch.equal(twin(long), F.linear(long.float(), twin.weight).bfloat16())


def test_no_twin_beyond_the_memory_bound(models: dict[str, LoadedModel]) -> None:
    model = models["int4"].backend
    assert isinstance(model, NativeLlama)
    modules = model.named_modules()
    linears = [(name, module) for name, module in modules if name.startswith("layers.") and is_linear(module)]
    weights = {name: torch.zeros(module.out_features, module.in_features) for name, module in linears}
    assert prefill_model(model, weights.get) is not None
    assert prefill_model(model, weights.get, max_bytes=1024) is None
    assert prefill_model(model, dict(list(weights.items())[1:]).get) is None  # a missing weight
    assert models["bfloat16"].prefill is None  # bf16 models read prompts with their own layers
