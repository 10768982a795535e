"""Weight-only int8 / int4: literal round trips, the GGUF Q4_1 mapping, forward agreement, cache."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from causaldraft.api import load
from causaldraft.errors import CausalDraftError
from causaldraft.models.gguf_q4 import q4_1_blocks_to_int4, read_q4_1_weights, unpermute_order
from causaldraft.models.native import NativeLlama
from causaldraft.models.packed import PackedLinear
from causaldraft.models.products import native_bf16_products
from causaldraft.models.quant import (
    Int4Linear,
    Int4Weights,
    Int8Linear,
    dequantize_int4,
    dequantize_int8,
    pack_nibbles,
    quantize_int4,
    quantize_int8,
    unpack_nibbles,
)
from causaldraft.models.quant_load import cache_path, load_quantized
from tests.tiny import save_tiny_llama

Q4_1 = GGMLQuantizationType.Q4_1


def bf16(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.bfloat16).float()


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rows -> GGUF rows)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


# ---------------------------------------------------------------- literal round trips


def test_int8_round_trip_literal() -> None:
    weight = torch.zeros(2, 16)  # the kernel needs in_features % 16 == 0
    weight[:, :4] = torch.tensor([[1.27, -0.5, 0.0, 0.3], [0.03, -0.04, 0.01, 0.0]])
    int8 = quantize_int8(weight)
    assert torch.allclose(int8.scales, torch.tensor([0.01, 0.04 / 127]))
    assert int8.values[:, :4].tolist() == [[127, -50, 0, 30], [95, -127, 32, 0]]
    restored = dequantize_int8(int8)
    assert (restored - weight).abs().le(int8.scales[:, None] / 2 + 1e-7).all()
    linear = Int8Linear(int8, None)
    kernel = linear(torch.eye(16)).float().t()  # [out, in]: the kernel's view of the weight
    assert torch.allclose(kernel, restored, rtol=2**-7, atol=1e-6)
    assert torch.allclose(linear.weight.float(), restored, rtol=2**-7, atol=1e-6)


def test_nibbles_literal() -> None:
    values = torch.tensor([[1, 2, 15, 0], [7, 8, 9, 10]], dtype=torch.uint8)
    packed = pack_nibbles(values)
    assert packed.tolist() == [[0x21, 0x0F], [0x87, 0xA9]]
    assert torch.equal(unpack_nibbles(packed), values)


def test_int4_round_trip_literal() -> None:
    # one group of 32 on [-0.5, 0.4375] with step 1/16 (exact in bf16): q = 0..15 twice
    q = torch.arange(32) % 16
    row = q.float() / 16 - 0.5
    weight = torch.stack((row, row.flip(0) * 2))  # [2, 32]
    int4 = quantize_int4(weight)
    assert int4.values[0].tolist() == q.tolist()
    assert torch.allclose(int4.scales, torch.tensor([[1 / 16], [1 / 8]]))
    assert torch.allclose(int4.zeros, torch.tensor([[-0.5 + 8 / 16], [-1.0 + 8 / 8]]))  # low + 8 step
    assert torch.equal(dequantize_int4(int4), weight)
    padded = Int4Weights(int4.values.repeat(8, 1), int4.scales.repeat(8, 1), int4.zeros.repeat(8, 1))
    kernel = Int4Linear(padded, None).dequantized()  # [16, 32], kernel needs out % 16 == 0
    assert torch.equal(kernel, weight.repeat(8, 1))  # (q - 8) * scale + zero, exact here


def test_int4_random_round_trip_within_half_step() -> None:
    torch.manual_seed(0)
    weight = torch.randn(32, 96)
    int4 = quantize_int4(weight)
    error = (dequantize_int4(int4) - weight).abs().reshape(32, 3, 32)
    assert error.le(int4.scales[..., None] / 2 + 1e-6).all()
    kernel = Int4Linear(int4, None).dequantized()
    reference = dequantize_int4(Int4Weights(int4.values, bf16(int4.scales), bf16(int4.zeros)))
    assert torch.allclose(kernel, reference, rtol=2**-8, atol=1e-6)


def test_ragged_shapes_are_clear_errors() -> None:
    with pytest.raises(CausalDraftError, match="multiple of 32"):
        quantize_int4(torch.randn(16, 48))
    with pytest.raises(CausalDraftError, match="in_features % 16"):
        quantize_int8(torch.randn(16, 40))


# ---------------------------------------------------------------- GGUF Q4_1 mapping


def check_q4_1_mapping(blocks: np.ndarray, in_features: int) -> None:
    """Unpacking reproduces gguf's dequantization; the kernel does within bf16 of scale and zero."""
    reference = torch.from_numpy(dequantize(blocks, Q4_1).astype(np.float32))  # [out, in]
    int4 = q4_1_blocks_to_int4(blocks, in_features)
    assert torch.allclose(dequantize_int4(int4), reference, rtol=0, atol=1e-5)
    kernel = Int4Linear(int4, None).dequantized()
    scale_error = (int4.scales - bf16(int4.scales)).abs()  # [out, groups]
    zero_error = (int4.zeros - bf16(int4.zeros)).abs()
    bound = (8 * scale_error + zero_error).repeat_interleave(32, dim=1) + reference.abs() * 2**-8 + 1e-6
    assert (kernel - reference).abs().le(bound).all()


def test_q4_1_synthetic_blocks_map_exactly() -> None:
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((32, 128)) * 0.05 + 0.01).astype(np.float32)
    check_q4_1_mapping(quantize(weight, Q4_1), 128)


def test_unpermute_order_inverts_llama_cpp() -> None:
    assert unpermute_order(8, 1).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    weight = np.arange(24 * 3).reshape(24, 3)
    permuted = llama_cpp_permute(weight, heads=3)
    assert not np.array_equal(permuted, weight)
    assert np.array_equal(permuted[unpermute_order(24, 3).numpy()], weight)


def write_q4_1_gguf(model_dir: Path, path: Path) -> dict[str, np.ndarray]:
    """A GGUF of the tiny model's layers in Q4_1 (q/k permuted as llama.cpp does); its blocks by name."""
    model = NativeLlama.from_pretrained(model_dir, torch.float32)
    shape = model.llama_shape
    writer = GGUFWriter(str(path), "llama")
    blocks_by_name: dict[str, np.ndarray] = {}
    for index, layer in enumerate(model.layers):
        q, k, _ = layer.self_attn.qkv_proj.weight.split(shape.part_rows("self_attn.qkv_proj"))
        for gguf_part, weight_tensor in (("attn_q", q), ("attn_k", k), ("ffn_down", layer.mlp.down_proj.weight)):
            weight = weight_tensor.numpy()
            heads = {"attn_q": shape.num_heads, "attn_k": shape.kv_heads}.get(gguf_part)
            if heads is not None:
                weight = llama_cpp_permute(weight, heads)
            blocks = quantize(weight, Q4_1)
            writer.add_tensor(f"blk.{index}.{gguf_part}.weight", blocks, raw_dtype=Q4_1)
            blocks_by_name[f"layers.{index}.{gguf_part}"] = blocks
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return blocks_by_name


def test_gguf_q4_1_loaded_as_int4_unpermuted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = save_tiny_llama(tmp_path / "model", hidden_size=128, intermediate_size=256)
    gguf_path = tmp_path / "tiny.Q4_1.gguf"
    blocks = write_q4_1_gguf(model_dir, gguf_path)
    (model_dir / "causaldraft_source.json").write_text(json.dumps({"gguf": str(gguf_path)}))
    model = load_quantized(model_dir, "int4").model
    assert "loaded as int4 without re-quantization" in capsys.readouterr().err
    fp32 = NativeLlama.from_pretrained(model_dir, torch.float32)
    for index, layer in enumerate(model.layers):
        qkv_proj = layer.self_attn.qkv_proj
        assert isinstance(qkv_proj, Int4Linear)
        q_rows = qkv_proj.dequantized()[:128]  # q_proj is stacked first in qkv_proj
        gguf_q = torch.from_numpy(dequantize(blocks[f"layers.{index}.attn_q"], Q4_1))  # GGUF row order
        hf_q = gguf_q[unpermute_order(128, 4)]
        assert torch.allclose(q_rows, hf_q, rtol=2**-7, atol=1e-4)
        # the unpermuted Q4_1 weights are close to the original ones (not a shuffled copy)
        original = fp32.layers[index].self_attn.qkv_proj.weight[:128]
        assert (q_rows - original).abs().max() < 0.1 * original.abs().max()
        assert not torch.allclose(gguf_q, original, atol=0.1 * float(original.abs().max()))
        # v_proj was not in the GGUF file: quantized from the checkpoint, stacked after q and k
        v_rows = qkv_proj.dequantized()[128 + 64 :]
        original_v = fp32.layers[index].self_attn.qkv_proj.weight[128 + 64 :]
        assert (v_rows - original_v).abs().max() < 0.1 * original_v.abs().max()


@pytest.mark.slow
def test_q4_1_default_gguf_tensor_and_permutation() -> None:
    from gguf import GGUFReader

    from causaldraft.models.loading import default_gguf_path, resolve_model_dir

    path = default_gguf_path()
    tensor = next(t for t in GGUFReader(str(path)).tensors if t.name == "blk.3.attn_k.weight")
    assert tensor.tensor_type == Q4_1
    check_q4_1_mapping(np.asarray(tensor.data), int(tensor.shape[0]))
    model = NativeLlama.from_pretrained(resolve_model_dir("default"), torch.float32)
    names = {"layers.3.self_attn.q_proj", "layers.3.self_attn.k_proj", "layers.3.mlp.up_proj"}
    weights = read_q4_1_weights(path, model.llama_shape, names)
    q, k, _ = model.layers[3].self_attn.qkv_proj.weight.split(model.llama_shape.part_rows("self_attn.qkv_proj"))
    _, up = model.layers[3].mlp.gate_up_proj.weight.chunk(2)
    checkpoint = {"layers.3.self_attn.q_proj": q, "layers.3.self_attn.k_proj": k, "layers.3.mlp.up_proj": up}
    for name in names:  # the converted checkpoint is transformers' dequantization, unpermuted
        assert torch.allclose(dequantize_int4(weights[name]), checkpoint[name], atol=1e-6)


# ---------------------------------------------------------------- models


@pytest.fixture(scope="module")
def quant_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Dimensions that are multiples of 32 (int4 groups) and 16 (int4 packing)."""
    return save_tiny_llama(tmp_path_factory.mktemp("quant-llama"), hidden_size=128, intermediate_size=256)


def full_logits(model: NativeLlama, tokens: torch.Tensor) -> torch.Tensor:
    n = tokens.shape[0]
    cache = model.new_cache(n)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    return model.forward(tokens, torch.arange(n), mask, cache).logits  # [n, vocab]


# Stated tolerance on the random tiny model (measured: bf16 0.007 / 2e-5 / 100%, int8 0.016 / 1e-4
# / 94-98%, int4 0.15-0.20 / 0.010-0.015 / 62-69%): relative RMS error of the logits (against the
# fp32 logits' spread), mean KL(fp32 || quantized) of next-token distributions, argmax agreement.
# Random weights are int4's worst case (no outliers to spare, many near-ties between logits).
TOLERANCE = {"int8": (0.04, 1e-3, 0.9), "int4": (0.3, 0.05, 0.5)}


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_forward_agrees_with_fp32(quant_llama_dir: Path, dtype: str) -> None:
    tokens = torch.randint(3, 259, (48,), generator=torch.Generator().manual_seed(0))
    reference = full_logits(NativeLlama.from_pretrained(quant_llama_dir, torch.float32), tokens)
    model = load_quantized(quant_llama_dir, dtype).model
    linear_type = Int8Linear if dtype == "int8" else Int4Linear
    assert isinstance(model.layers[0].mlp.down_proj, linear_type)
    # the checkpoint's head in bf16 through oneDNN (models/packed.py) where the CPU takes bf16 there, else int8
    assert isinstance(model.lm_head, PackedLinear if native_bf16_products() else Int8Linear)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    logits = full_logits(model, tokens)  # [48, vocab]
    max_error, max_kl, min_agreement = TOLERANCE[dtype]
    spread = (reference - reference.mean(-1, keepdim=True)).norm()
    assert (logits - reference).norm() <= max_error * spread
    kl = F.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="batchmean")
    assert kl <= max_kl
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= min_agreement


def test_cache_is_written_and_reused(quant_llama_dir: Path) -> None:
    first = load_quantized(quant_llama_dir, "int4").model
    path = cache_path(quant_llama_dir, "int4")
    assert path == quant_llama_dir / "quant-int4.safetensors" and path.is_file()
    stamp = path.stat().st_mtime_ns
    second = load_quantized(quant_llama_dir, "int4").model
    assert path.stat().st_mtime_ns == stamp  # read, not rewritten
    for name, buffer in first.named_buffers():
        assert torch.equal(buffer, dict(second.named_buffers())[name]), name


def test_self_draft_shares_quantized_layers(quant_llama_dir: Path) -> None:
    model = load_quantized(quant_llama_dir, "int4").model
    draft = model.truncated(2)
    assert draft.layers[1] is model.layers[1] and draft.lm_head is model.lm_head
    assert isinstance(draft.layers[1].self_attn.o_proj, Int4Linear)


def test_int4_falls_back_to_int8_with_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = save_tiny_llama(tmp_path / "ragged", hidden_size=48, intermediate_size=128)
    model = load_quantized(model_dir, "int4").model
    assert "use int8 instead" in capsys.readouterr().err
    assert isinstance(model.layers[0].self_attn.qkv_proj, Int8Linear)  # in_features 48
    assert isinstance(model.layers[0].mlp.down_proj, Int4Linear)  # in_features 128


def test_speculative_int4_match_rate(quant_llama_dir: Path) -> None:
    """Greedy lookup speculation in int4 vs plain int4 decoding: reported, not asserted identical
    (an M-row pass rounds differently from a 1-row pass)."""
    prompt = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat"
    plain = load(str(quant_llama_dir), dtype="int4", drafter="none", calibrate=False, compile=False)
    speculative = load(str(quant_llama_dir), dtype="int4", drafter="lookup", calibrate=False, fallback=False,
                       loaded=plain.model, compile=False)  # fmt: skip
    expected = plain.generate(prompt, max_new_tokens=48).token_ids
    result = speculative.generate(prompt, max_new_tokens=48)
    same = sum(a == b for a, b in zip(expected, result.token_ids, strict=False))
    match_rate = same / max(len(expected), 1)
    print(f"int4 greedy lookup vs plain: match rate {match_rate:.2f}, "
          f"{result.stats.mean_accepted:.2f} tokens per target forward")  # fmt: skip
    assert result.stats.target_forwards < len(result.token_ids)  # speculation accepted drafts
    assert match_rate >= 0.5
