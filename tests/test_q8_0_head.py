"""The Q8_0 LM head: its record layout, the GGUF blocks, the kernel's sums, row and thread invariance,
and a model converted from a GGUF file with a Q8_0 head decoding exactly through it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from causaldraft.api import load
from causaldraft.models import q8_0_head
from causaldraft.models.native import NativeLlama
from causaldraft.models.q8_0_head import Q8_0Head, Q8_0Weights, from_blocks, pack, unpack, use_q8_0_head
from causaldraft.models.quant_load import cache_path, load_quantized, source_key
from tests.test_exact import assert_rows_match_one_row_passes
from tests.tiny import save_tiny_llama

Q8_0 = GGMLQuantizationType.Q8_0
needs_kernel = pytest.mark.skipif(not q8_0_head.available(), reason="the Q8_0 head needs AVX-512 with bf16")


def random_weights(out_features: int, in_features: int, seed: int = 0) -> Q8_0Weights:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(-127, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
    scales = (torch.rand(out_features, in_features // 32, generator=generator) * 0.02 + 1e-3).to(torch.float16)
    return Q8_0Weights(values, scales)


def test_records_hold_each_pair_of_inputs_channel_by_channel() -> None:
    weights = random_weights(32, 64)
    records = pack(weights)
    assert records.shape == (2, 2, 544) and records.dtype == torch.uint8
    # record (block 1, group 1), pair 5, channel 3, parity 1: channel 16 + 3 at input 32 + 11
    assert records[1, 1, 32 * 5 + 2 * 3 + 1].view(torch.int8) == weights.values[19, 43]
    scales = records[1, 1, 512:].contiguous().view(torch.float16)
    assert torch.equal(scales, weights.scales[16:32, 1])
    restored = unpack(records)
    assert torch.equal(restored.values, weights.values) and torch.equal(restored.scales, weights.scales)
    with pytest.raises(ValueError, match="out % 16"):
        pack(random_weights(24, 64))


def test_gguf_blocks_read_as_gguf_dequantizes_them() -> None:
    matrix = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    blocks = quantize(matrix, Q8_0)  # [48, 3 * 34] bytes
    weights = from_blocks(blocks, 48, 96)
    assert torch.equal(weights.dequantize(), torch.from_numpy(dequantize(blocks, Q8_0)))
    with pytest.raises(ValueError, match="do not fit"):
        from_blocks(blocks, 48, 64)


@needs_kernel
def test_the_product_sums_the_checkpoint_s_values_in_fp32() -> None:
    weights = random_weights(256, 576, seed=1)
    x = torch.randn(5, 576).to(torch.bfloat16)
    logits = q8_0_head.product(x, pack(weights))
    assert logits.dtype == torch.float32 and logits.shape == (5, 256)
    exact = x.double() @ weights.dequantize().double().T
    # fp32 sums of exact products: within a few ulps of the largest partial sum
    bound = 1e-5 * (x.double().abs() @ weights.dequantize().double().abs().T).max()
    assert (logits.double() - exact).abs().max() <= bound
    assert not torch.equal(logits, (x.float() @ weights.dequantize().to(torch.bfloat16).float().T))  # not bf16 weights


@needs_kernel
def test_every_row_is_what_a_one_row_call_gives_whatever_the_rows_and_threads() -> None:
    records = pack(random_weights(512, 192, seed=2))
    x = torch.randn(33, 192).to(torch.bfloat16)  # 33 rows: three tiles of 11 in the AMX build
    alone = torch.cat([q8_0_head.product(x[i : i + 1].contiguous(), records) for i in range(33)])
    for count in range(1, 34):
        assert torch.equal(q8_0_head.product(x[:count].contiguous(), records), alone[:count]), count
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(q8_0_head.product(x, records), alone)
    finally:
        torch.set_num_threads(threads)


# Runs the product of the build this process loads (argv[3]: "amx" or "avx512") on random rows; saves its logits.
RUN_BUILD = """
import sys, torch
from causaldraft.models import q8_0_head
from tests.test_q8_0_head import random_weights
assert q8_0_head.loaded_build() == sys.argv[2], q8_0_head.loaded_build()
records = q8_0_head.pack(random_weights(512, 576, seed=4))
rows = torch.randn(21, 576, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
torch.save(q8_0_head.product(rows, records), sys.argv[1])
"""


def build_logits(build: str, tmp_path: Path) -> torch.Tensor:
    """The logits of the build ``build`` names (``CAUSALDRAFT_Q8_0_HEAD``), in a child process."""
    path = tmp_path / f"{build}.pt"
    environment = {**os.environ, q8_0_head.SWITCH: "" if build == "amx" else build}
    command = [sys.executable, "-c", RUN_BUILD, str(path), build]
    root = Path(__file__).parent.parent
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    return torch.load(path)


@needs_kernel
@pytest.mark.skipif(len(q8_0_head.builds()) < 2, reason="needs a CPU with AMX bf16 tiles Linux grants")
def test_the_amx_build_sums_in_another_order_within_fp32_rounding(tmp_path: Path) -> None:
    """The AMX build's tile products sum a record's 32 products in another order than the two dot-product
    chains: the logits differ in their last bits, nowhere by more than fp32 rounding of the sums."""
    weights = random_weights(512, 576, seed=4)
    rows = torch.randn(21, 576, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    amx, avx512 = build_logits("amx", tmp_path), build_logits("avx512", tmp_path)
    assert not torch.equal(amx, avx512)  # the other arithmetic ran
    bound = 1e-5 * (rows.double().abs() @ weights.dequantize().double().abs().T).max()
    assert (amx.double() - avx512.double()).abs().max() <= bound


@needs_kernel
@pytest.mark.skipif(len(q8_0_head.builds()) < 2, reason="needs a CPU with AMX bf16 tiles Linux grants")
def test_the_avx512_build_passes_the_kernel_tests() -> None:
    """Where this session runs the AMX build, the other one runs the product and invariance tests in a child."""
    environment = {**os.environ, q8_0_head.SWITCH: "avx512"}
    tests = "the_product_sums or every_row_is_what"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", tests]
    result = subprocess.run(command, env=environment, capture_output=True, text=True)
    assert result.returncode == 0 and "2 passed" in result.stdout, result.stdout[-3000:]


def test_a_head_that_is_not_the_checkpoint_s_is_refused() -> None:
    weights = random_weights(64, 64, seed=3)
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.copy_(weights.dequantize().to(torch.bfloat16))
        model.lm_head.weight[7, 3] += 1.0
    assert not use_q8_0_head(model, weights)
    assert isinstance(model.lm_head, torch.nn.Linear)
    if q8_0_head.available():
        with torch.no_grad():
            model.lm_head.weight[7, 3] -= 1.0
        assert torch.equal(model.lm_head.weight, weights.dequantize().to(torch.bfloat16))
        assert use_q8_0_head(model, weights) and isinstance(model.lm_head, Q8_0Head)


def tiny_gguf_model(tmp_path: Path) -> Path:
    """A tiny tied Llama converted "from" a GGUF file whose token_embd is Q8_0: the checkpoint holds
    the blocks' dequantized values, as transformers' conversion writes them."""
    model_dir = save_tiny_llama(tmp_path / "model", hidden_size=128, intermediate_size=256, vocab_size=272,
                                tie_word_embeddings=True)  # fmt: skip
    weights_path = model_dir / "model.safetensors"
    state = load_file(str(weights_path))
    embed = state["model.embed_tokens.weight"].float().numpy()
    blocks = quantize(embed * 4.0, Q8_0)  # peaked logits, as the tiny models' scaled heads give
    state["model.embed_tokens.weight"] = torch.from_numpy(dequantize(blocks, Q8_0))
    state.pop("lm_head.weight", None)
    save_file(state, str(weights_path), metadata={"format": "pt"})
    gguf_path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(gguf_path), "llama")
    writer.add_tensor("token_embd.weight", blocks, raw_dtype=Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (model_dir / "causaldraft_source.json").write_text(json.dumps({"gguf": str(gguf_path)}))
    return model_dir


@needs_kernel
def test_a_model_from_a_gguf_with_a_q8_0_head_uses_it_and_decodes_exactly(tmp_path: Path) -> None:
    model_dir = tiny_gguf_model(tmp_path)
    model = load_quantized(model_dir, "int4").model
    assert isinstance(model.lm_head, Q8_0Head)
    assert cache_path(model_dir, "head-q8_0").is_file()  # the next load reads no GGUF header
    assert isinstance(load_quantized(model_dir, "int4").model.lm_head, Q8_0Head)
    assert isinstance(load_quantized(model_dir, "int8").model.lm_head, Q8_0Head)
    cache = cache_path(model_dir, "head-q8_0")
    cache.write_bytes(b"not safetensors")  # a corrupt cache: the GGUF file is read again and the cache rewritten
    assert isinstance(load_quantized(model_dir, "int4").model.lm_head, Q8_0Head)
    assert q8_0_head.load_head(cache, source_key(model_dir, "head-q8_0", tmp_path / "tiny.gguf")) is not None
    reference = NativeLlama.from_pretrained(model_dir, torch.float32).lm_head.weight  # the blocks' values
    x = torch.randn(3, 128).to(torch.bfloat16)
    assert torch.allclose(model.lm_head(x), x.float() @ reference.T, rtol=1e-5, atol=1e-4)

    plain = load(model=str(model_dir), dtype="int4", drafter="none", calibrate=False, compile=False)
    backend = plain.model.backend
    assert isinstance(backend, NativeLlama) and isinstance(backend.lm_head, Q8_0Head)
    for prefix in (5, 40):
        assert_rows_match_one_row_passes(backend, prefix, (1,))
    spec = load(loaded=plain.model, drafter="lookup", tree="dynamic", calibrate=False, fallback=False, compile=False)
    for prompt in ("abcabcabcabc", "the cat sat on the mat. the cat"):
        expected = plain.generate(prompt, max_new_tokens=48).token_ids
        result = spec.generate(prompt, max_new_tokens=48)
        assert result.token_ids == expected, prompt
        assert sum(step.nodes - 1 for step in result.stats.steps) > 0  # it really speculated


def test_quantize_rounds_each_block_of_32_to_its_own_step() -> None:
    weight = torch.zeros(16, 64)
    weight[0, :3] = torch.tensor([0.254, 0.1, -0.0011])  # block 0 of row 0: step 0.002
    weight[0, 32] = -1.27  # block 1: step 0.01
    quantized = q8_0_head.quantize(weight)
    assert quantized.scales[0].tolist() == [torch.tensor(0.002).half().item(), torch.tensor(0.01).half().item()]
    assert quantized.values[0, :3].tolist() == [127, 50, -1] and quantized.values[0, 32] == -127
    assert quantized.scales[1].tolist() == [0.0, 0.0] and not quantized.values[1].any()  # zero blocks stay zero
    restored = quantized.dequantize()
    assert (restored - weight).abs().max() <= 0.01 / 2 + 1e-6


@needs_kernel
def test_drafting_products_of_few_rows_read_q8_0_weights() -> None:
    from causaldraft.models.packed import Q8_0_MAX_ROWS, DraftLinear

    weight = (torch.randn(96, 192, generator=torch.Generator().manual_seed(4)) * 0.05).to(torch.bfloat16)
    linear = DraftLinear(weight)
    assert linear.q8_0 is not None
    for rows in (1, 5, Q8_0_MAX_ROWS):
        x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        expected = q8_0_head.product(x, linear.q8_0).to(torch.bfloat16)
        assert torch.equal(linear(x), expected)  # the Q8_0 path, not another
        torch.testing.assert_close(linear(x).float(), x.float() @ weight.float().T, atol=3e-2, rtol=3e-2)
