"""Native vs transformers parity, the hf adapter over trees, and loading errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import causaldraft
from causaldraft.errors import CausalDraftError
from causaldraft.models.base import Backend
from causaldraft.models.hf import HFBackend
from causaldraft.models.loading import (
    file_sha256,
    holds_conversion_of,
    install_conversion,
    load_model,
    read_source_record,
    source_identity,
    write_source_record,
)
from causaldraft.models.native import NativeLlama
from causaldraft.tree import Tree, compile_tree, full_mask
from tests.tiny import byte_tokenizer, save_tiny_gpt2, save_tiny_llama, tiny_llama_config

PREFIX = [5, 17, 42, 99, 3, 250, 8, 61]


def run_prefix_and_tree(backend: Backend, tree: Tree) -> tuple[torch.Tensor, torch.Tensor]:
    cache = backend.new_cache(64)
    n = len(PREFIX)
    prefix_out = backend.forward(
        torch.tensor(PREFIX), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(), cache
    )
    compiled = compile_tree(tree)
    tree_out = backend.forward(torch.tensor(tree.tokens), compiled.depths + n, full_mask(compiled, n), cache)
    return prefix_out.logits, tree_out.logits


TREES = {
    "chain": Tree.chain([7, 8, 9, 10]),
    "branching": Tree(parents=(-1, 0, 0, 1, 1, 2), tokens=(7, 8, 30, 9, 31, 32)),
}


@pytest.mark.parametrize("shape", list(TREES))
def test_native_matches_transformers_on_prefix_and_tree(tiny_llama_dir: Path, shape: str) -> None:
    native = NativeLlama.from_pretrained(tiny_llama_dir, torch.float32)
    reference = HFBackend.from_pretrained(tiny_llama_dir, torch.float32)
    native_prefix, native_tree = run_prefix_and_tree(native, TREES[shape])
    hf_prefix, hf_tree = run_prefix_and_tree(reference, TREES[shape])
    assert (native_prefix - hf_prefix).abs().max() < 1e-3
    assert (native_tree - hf_tree).abs().max() < 1e-3


def assert_matches_transformers(native: NativeLlama, directory: Path) -> None:
    """fp32 logits of ``native`` within 1e-3 of transformers' over a prefix and each of ``TREES``."""
    reference = HFBackend.from_pretrained(directory, torch.float32)
    for tree in TREES.values():
        native_prefix, native_tree = run_prefix_and_tree(native, tree)
        hf_prefix, hf_tree = run_prefix_and_tree(reference, tree)
        assert (native_prefix - hf_prefix).abs().max() < 1e-3
        assert (native_tree - hf_tree).abs().max() < 1e-3


def test_native_qwen2_layout_with_qkv_bias_matches_transformers(tiny_qwen_dir: Path) -> None:
    native = NativeLlama.from_pretrained(tiny_qwen_dir, torch.float32)
    assert native.llama_shape.qkv_bias and native.llama_shape.tie_embeddings
    assert_matches_transformers(native, tiny_qwen_dir)


def test_native_qwen3_layout_with_query_and_key_norms_matches_transformers(tiny_qwen3_dir: Path) -> None:
    native = NativeLlama.from_pretrained(tiny_qwen3_dir, torch.float32)
    shape = native.llama_shape
    assert shape.qk_norm and not shape.qkv_bias and shape.head_dim * shape.num_heads != shape.hidden_size
    assert_matches_transformers(native, tiny_qwen3_dir)


def test_query_and_key_norms_in_a_llama_checkpoint_are_refused(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    """Per-head norms belong to Qwen3: a checkpoint that has them under another model type would decode
    without them, so the native backend refuses it."""
    directory = tmp_path / "relabelled"
    shutil.copytree(tiny_qwen3_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CausalDraftError, match=r"does not read \d+ tensors .*_norm\.weight.*--backend hf"):
        load_model(str(directory), backend="native", dtype="float32")


def plain_causal_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("model_dir", ["tiny_gpt2_dir", "tiny_llama_dir"])
def test_tree_forward_equals_plain_forwards_over_each_path(model_dir: str, request: pytest.FixtureRequest) -> None:
    directory = request.getfixturevalue(model_dir)
    backend = HFBackend.from_pretrained(directory, torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    tree = TREES["branching"]
    _, tree_logits = run_prefix_and_tree(backend, tree)
    for path in compile_tree(tree).paths:
        tokens = PREFIX + [tree.tokens[node] for node in path]
        expected = plain_causal_logits(plain, tokens)[len(PREFIX) :]
        assert (tree_logits[list(path)] - expected).abs().max() < 1e-4


def test_native_tree_forward_equals_plain_forwards_over_each_path(tiny_llama_dir: Path) -> None:
    native = NativeLlama.from_pretrained(tiny_llama_dir, torch.float32)
    tree = TREES["branching"]
    _, tree_logits = run_prefix_and_tree(native, tree)
    for path in compile_tree(tree).paths:
        tokens = PREFIX + [tree.tokens[node] for node in path]
        cache = native.new_cache(32)
        n = len(tokens)
        out = native.forward(torch.tensor(tokens), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(), cache)
        assert (tree_logits[list(path)] - out.logits[len(PREFIX) :]).abs().max() < 1e-4


def test_self_draft_shares_the_targets_weights(tiny_llama_dir: Path) -> None:
    native = NativeLlama.from_pretrained(tiny_llama_dir, torch.float32)
    draft = native.truncated(2)
    assert draft.layers[0] is native.layers[0] and draft.lm_head is native.lm_head
    assert len(draft.layers) == 2
    with pytest.raises(CausalDraftError):
        native.truncated(4)


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CausalDraftError, match="does not exist"):
        load_model(str(tmp_path / "nope"))


def test_directory_without_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CausalDraftError, match="config.json"):
        load_model(str(tmp_path))


def test_a_directory_without_a_tokenizer_is_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama_dir / name, weights_only / name)
    with pytest.raises(CausalDraftError, match="has no tokenizer"):
        load_model(str(weights_only), dtype="float32")


def test_corrupt_weights_are_a_clear_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CausalDraftError, match="corrupt"):
        load_model(str(broken), dtype="float32")


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_config_that_contradicts_the_weights_or_is_not_json_is_a_clear_error(
    tiny_llama_dir: Path, tmp_path: Path, dtype: str
) -> None:
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    for name, text, message in (
        ("vocab", json.dumps({**config, "vocab_size": 300}), "do not fit its config.json"),
        ("intermediate", json.dumps({**config, "intermediate_size": 96}), "do not fit its config.json"),
        ("notjson", '{"model_type": "llama",', "not JSON"),
        ("list", "[1, 2]", "not a JSON object"),
    ):  # fmt: skip
        broken = tmp_path / name
        shutil.copytree(tiny_llama_dir, broken)
        (broken / "config.json").write_text(text)
        with pytest.raises(CausalDraftError, match=message):
            load_model(str(broken), dtype=dtype)


def test_missing_weights_are_a_clear_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "noweights"
    shutil.copytree(tiny_llama_dir, broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(CausalDraftError, match="safetensors"):
        load_model(str(broken), dtype="float32")
    # a quantized cache left beside the checkpoint is not mistaken for its weights
    save_file({"layers.0.qkv.nibbles": torch.zeros(2, dtype=torch.uint8)}, str(broken / "quant-int4.safetensors"))
    with pytest.raises(CausalDraftError, match="safetensors"):
        load_model(str(broken), dtype="float32")


@pytest.mark.parametrize("variant", ["attention_bias", "mlp_bias"])
def test_a_llama_with_biases_native_drops_is_refused_and_hf_decodes_it(tmp_path: Path, variant: str) -> None:
    """A Llama with ``attention_bias`` has an ``o_proj`` bias, one with ``mlp_bias`` MLP biases; the native
    backend reads neither, so it would decode another model: it refuses, and ``--backend hf`` decodes it as
    transformers does."""
    directory = save_tiny_llama(tmp_path / variant, **{variant: True})
    with torch.no_grad():  # transformers starts biases at zero: make them matter
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0, 0.5)
        model.save_pretrained(str(directory))
    part = "o_proj.bias" if variant == "attention_bias" else "_proj.bias"
    with pytest.raises(CausalDraftError, match=rf"does not read \d+ tensors .*{part}.*--backend hf"):
        load_model(str(directory), backend="native", dtype="float32")
    engine = causaldraft.load(model=str(directory), backend="hf", dtype="float32", drafter="lookup", compile=False,
                              calibrate=False)  # fmt: skip
    prompt = "abcabc abcabc"
    ids = engine.tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert engine.generate(prompt, max_new_tokens=12).token_ids == expected[0, ids.shape[1] :].tolist()


SCALED_ROPES = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}  # fmt: skip


@pytest.mark.parametrize("rope", sorted(SCALED_ROPES))
def test_scaled_ropes_compute_what_transformers_computes(tmp_path: Path, rope: str) -> None:
    """The native backend runs a scaled rope (Llama 3's, yarn with its cos/sin scaling, linear, dynamic NTK
    within the context) as transformers does, past the original length (logits of a 48-token pass, which
    the default rope would change but for dynamic NTK); longrope, whose frequencies transformers switches
    at that length, is refused (next test)."""
    directory = save_tiny_llama(tmp_path / rope, rope_scaling=SCALED_ROPES[rope], rope_theta=50000.0)
    plain_rope = save_tiny_llama(tmp_path / "default", rope_theta=50000.0)  # the same weights (seed 0)
    tokens = torch.randint(3, 259, (48,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)(tokens[None]).logits[0]
        unscaled = AutoModelForCausalLM.from_pretrained(str(plain_rope), dtype=torch.float32)(tokens[None]).logits[0]
    backend = load_model(str(directory), backend="native", dtype="float32").backend
    causal = torch.ones(48, 48, dtype=torch.bool).tril()
    with torch.inference_mode():
        logits = backend.forward(tokens, torch.arange(48), causal, backend.new_cache(48)).logits.float()
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    if rope == "dynamic":  # dynamic NTK scales past max_position_embeddings only, beyond any context
        torch.testing.assert_close(unscaled, expected)
    else:
        assert float((unscaled - expected).abs().max()) > 1e-2  # the scaling matters at these positions


def test_a_rope_that_changes_with_the_context_length_is_refused_natively(tmp_path: Path) -> None:
    factors = [1.0 + index / 8 for index in range(8)]  # head_dim 16: 8 frequencies
    longrope = {"rope_type": "longrope", "short_factor": factors, "long_factor": [2 * f for f in factors],
                "original_max_position_embeddings": 16}  # fmt: skip
    directory = save_tiny_llama(tmp_path / "longrope", rope_scaling=longrope)
    with pytest.raises(CausalDraftError, match="longrope changes them with the context length: use --backend hf"):
        load_model(str(directory), backend="native", dtype="float32")


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_a_sliding_window_caps_the_context_where_decoding_stays_the_models(tmp_path: Path, backend: str) -> None:
    """Both backends attend to the whole context, which is what a Mistral with a sliding window computes
    only while the context fits in the window: the context is capped there, a longer request is refused,
    and within it the output is transformers' (whose own sliding cache once crashed the hf backend)."""
    from transformers import MistralConfig, MistralForCausalLM

    directory = tmp_path / "mistral"
    torch.manual_seed(0)
    settings = tiny_llama_config().to_dict()
    settings.update(model_type="mistral", sliding_window=16)
    for key in ("architectures", "transformers_version", "rope_scaling"):
        settings.pop(key, None)
    model = MistralForCausalLM(MistralConfig(**settings))
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(str(directory))
    byte_tokenizer().save_pretrained(str(directory))
    engine = causaldraft.load(model=str(directory), backend=backend, dtype="float32", drafter="lookup",
                              compile=False, calibrate=False)  # fmt: skip
    assert engine.model.backend.shape.max_positions == 16
    prompt = "abcabc"
    ids = engine.tokenizer(prompt, return_tensors="pt").input_ids
    new = 16 - ids.shape[1]
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert engine.generate(prompt, max_new_tokens=new).token_ids == expected[0, ids.shape[1] :].tolist()
    with pytest.raises(CausalDraftError, match="context of 16 tokens"):
        engine.generate(prompt, max_new_tokens=new + 1)


def test_pickle_checkpoints_of_other_weights_have_other_fingerprints(tmp_path: Path) -> None:
    """A ``*.bin`` checkpoint (hf backend only) has no safetensors rows to sample: its files' sizes, heads and
    tails stand for its weights, so two seeds are two models and a copy is the same one."""
    from transformers import GPT2LMHeadModel

    fingerprints = []
    for seed in (0, 1, 0):
        directory = save_tiny_gpt2(tmp_path / f"safetensors-{len(fingerprints)}", seed=seed)
        pickled = tmp_path / f"pickled-{len(fingerprints)}"  # written by hand: transformers 5 saves safetensors only
        pickled.mkdir()
        shutil.copy(directory / "config.json", pickled / "config.json")
        torch.save(GPT2LMHeadModel.from_pretrained(str(directory)).state_dict(), pickled / "pytorch_model.bin")
        byte_tokenizer().save_pretrained(str(pickled))
        assert not list(pickled.glob("*.safetensors")) and list(pickled.glob("*.bin"))
        fingerprints.append(load_model(str(pickled), backend="hf", dtype="float32").base_fingerprint)
    assert fingerprints[0] != fingerprints[1] and fingerprints[0] == fingerprints[2]


def test_unsupported_architecture_on_native_points_to_hf(tiny_gpt2_dir: Path) -> None:
    with pytest.raises(CausalDraftError, match="--backend hf"):
        load_model(str(tiny_gpt2_dir), backend="native", dtype="float32")
    loaded = load_model(str(tiny_gpt2_dir), backend="hf", dtype="float32")
    assert loaded.backend.shape.vocab_size == 259


def test_bad_gguf_file_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAUSALDRAFT_HOME", str(tmp_path / "home"))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf")
    with pytest.raises(CausalDraftError, match="cannot convert"):
        load_model(str(fake))
    text = tmp_path / "weights.bin"
    text.write_bytes(b"x")
    with pytest.raises(CausalDraftError, match="not a .gguf"):
        load_model(str(text))


def test_a_converted_folder_is_reused_only_for_the_bytes_it_was_converted_from(tmp_path: Path) -> None:
    """The default model's folder is keyed by name: its record decides whether it still holds a
    conversion of the installed GGUF file (a moved environment keeps it; another file does not)."""
    converted = tmp_path / "converted"
    converted.mkdir()
    gguf = tmp_path / "env-a" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    assert not holds_conversion_of(converted, gguf)  # no config.json: nothing converted yet
    (converted / "config.json").write_text("{}")
    assert not holds_conversion_of(converted, gguf)  # no record
    write_source_record(converted, {**source_identity(gguf), "sha256": file_sha256(gguf), "four_bit": True})
    assert holds_conversion_of(converted, gguf)

    # the package reinstalled in another environment, the old one deleted: same bytes, new place
    moved = tmp_path / "env-b" / "model.gguf"
    moved.parent.mkdir()
    shutil.copyfile(gguf, moved)
    gguf.unlink()
    assert holds_conversion_of(converted, moved)
    record = read_source_record(converted)
    assert record["gguf"] == str(moved.resolve()) and record["size"] == moved.stat().st_size
    assert record["four_bit"] is True  # what was learnt about the same bytes is kept

    # another release of the file: converted again
    moved.write_bytes(b"GGUF" + bytes(range(255, -1, -1)) * 64)
    assert not holds_conversion_of(converted, moved)
    # an earlier causaldraft's record (the path only) of a file that moved; a corrupt record
    write_source_record(converted, {"gguf": str(gguf)})
    assert not holds_conversion_of(converted, moved)
    (converted / "causaldraft_source.json").write_text("{not json")
    assert read_source_record(converted) == {}
    assert not holds_conversion_of(converted, moved)


def test_a_conversion_lands_whole_and_one_another_process_finished_stays(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)))

    def conversion(name: str, marker: str) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(marker)
        write_source_record(folder, {**source_identity(gguf), "sha256": file_sha256(gguf)})
        return folder

    out_dir = tmp_path / "models" / "m"
    out_dir.parent.mkdir()
    install_conversion(conversion("first", "1"), out_dir, gguf)  # nothing there yet
    assert (out_dir / "config.json").read_text() == "1"
    second = conversion("second", "2")
    install_conversion(second, out_dir, gguf)  # another process's conversion of these bytes landed first: kept
    assert (out_dir / "config.json").read_text() == "1" and second.is_dir()  # (convert_gguf deletes its own)
    gguf.write_bytes(b"GGUF" + bytes(range(255, -1, -1)))  # another file: the old conversion is replaced
    install_conversion(conversion("third", "3"), out_dir, gguf)
    assert (out_dir / "config.json").read_text() == "3"
    assert [item.name for item in out_dir.parent.iterdir()] == ["m"]  # nothing left aside


def test_unknown_dtype_and_backend_are_clear_errors(tiny_llama_dir: Path) -> None:
    with pytest.raises(CausalDraftError, match="dtype"):
        load_model(str(tiny_llama_dir), dtype="float8")
    with pytest.raises(CausalDraftError, match="backend"):
        load_model(str(tiny_llama_dir), backend="onnx", dtype="float32")


@pytest.mark.slow
def test_compiled_native_backend_gives_identical_greedy_output(tiny_llama_dir: Path, graph_root: Path) -> None:
    import causaldraft
    from causaldraft.models.compiled import GraphKey, GraphStore, compile_model
    from causaldraft.models.native import default_aux_layers

    plain = causaldraft.load(str(tiny_llama_dir), dtype="float32", drafter="none", calibrate=False, compile=False)
    expected = plain.generate("hello world hello world", max_new_tokens=20).token_ids
    loaded = load_model(str(tiny_llama_dir), "native", "float32")
    backend = loaded.backend
    assert isinstance(backend, NativeLlama)
    store = GraphStore(GraphKey.of(backend, default_aux_layers(backend.llama_shape.num_layers)), graph_root)
    compile_model(backend, buckets=(1, 4, 32), store=store)
    spec = causaldraft.load(
        loaded=loaded, drafter="lookup", calibrate=False, fallback=False, max_nodes=4, compile=False
    )
    assert spec.generate("hello world hello world", max_new_tokens=20).token_ids == expected
    # another prompt length and cache size reuses the same graphs: only the attention span is dynamic
    builds = store.builds
    longer = "the quick brown fox jumps over the lazy dog, the quick brown fox"
    expected = plain.generate(longer, max_new_tokens=30).token_ids
    assert spec.generate(longer, max_new_tokens=30).token_ids == expected
    assert store.builds == builds
    assert sorted(path.name for path in store.directory.glob("*.pt2")) == [f"bucket-{n}.pt2" for n in (1, 32, 4)]


@pytest.mark.parametrize("model_dir", ["tiny_gpt2_dir", "tiny_llama_dir"])
def test_hf_backend_through_the_real_engine_commits_and_rolls_back(
    model_dir: str, request: pytest.FixtureRequest
) -> None:
    """Loading with calibration rolls the hf cache back after every timed pass, and tree steps
    commit accepted slots: both through transformers' cache as installed (a release once changed
    what ``DynamicCache.crop`` means and broke this path unnoticed)."""
    import causaldraft

    directory = str(request.getfixturevalue(model_dir))
    plain = causaldraft.load(directory, backend="hf", dtype="float32", drafter="none", calibrate=True)
    expected = plain.generate("abcabcabc abcabc", max_new_tokens=24).token_ids
    spec = causaldraft.load(directory, backend="hf", dtype="float32", drafter="lookup", tree="static",
                            calibrate=True, fallback=False)  # fmt: skip
    result = spec.generate("abcabcabc abcabc", max_new_tokens=24)
    assert result.token_ids == expected
    assert max(step.nodes for step in result.stats.steps) > 1
    cache = spec.model.backend.new_cache(16)
    spec.model.backend.forward(torch.arange(5), torch.arange(5), torch.ones(5, 5, dtype=torch.bool).tril(), cache)
    cache.rollback(3)
    out = spec.model.backend.forward(torch.tensor([7]), torch.tensor([3]), torch.ones(1, 4, dtype=torch.bool), cache)
    fresh = spec.model.backend.new_cache(16)
    tokens = torch.tensor([0, 1, 2, 7])
    reference = spec.model.backend.forward(tokens, torch.arange(4), torch.ones(4, 4, dtype=torch.bool).tril(), fresh)
    assert (out.logits[0] - reference.logits[-1]).abs().max() < 1e-4


def test_the_weights_read_are_the_ones_transformers_reads(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Found by an audit: every ``*.safetensors`` in the folder was read. A sharded checkpoint is its index's
    shards (a missing one is named), an unsharded one is ``model.safetensors``: Mistral's
    ``consolidated.safetensors`` or a stale file beside them is not merged in."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    sharded = tmp_path / "sharded"
    model.save_pretrained(str(sharded), max_shard_size="100KB")
    byte_tokenizer().save_pretrained(str(sharded))
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 2 and (sharded / "model.safetensors.index.json").is_file()
    expected = causaldraft.load(str(tiny_llama_dir), dtype="float32", compile=False).generate(
        PREFIX, max_new_tokens=8, temperature=0
    )
    stale = {"model.embed_tokens.weight": torch.zeros(259, 64), "layers.0.attention.wk.weight": torch.zeros(32, 64)}
    for folder in (sharded, tiny_llama_dir.parent / "with-extra"):
        if folder != sharded:
            shutil.copytree(tiny_llama_dir, folder)
        save_file({"model.embed_tokens.weight": stale["model.embed_tokens.weight"]}, str(folder / "old.safetensors"))
        save_file({"layers.0.attention.wk.weight": stale["layers.0.attention.wk.weight"]},
                  str(folder / "consolidated.safetensors"))  # fmt: skip
        if folder == sharded:
            save_file({"model.embed_tokens.weight": torch.zeros(259, 64)}, str(folder / "model.safetensors"))
        engine = causaldraft.load(str(folder), dtype="float32", compile=False)
        assert engine.generate(PREFIX, max_new_tokens=8, temperature=0).token_ids == expected.token_ids
    shards[1].unlink()
    with pytest.raises(CausalDraftError, match=f"lacks {shards[1].name}"):
        load_model(str(sharded), dtype="float32")


def test_an_untied_checkpoint_without_its_lm_head_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Found by an audit: a checkpoint whose config says the LM head is its own (``tie_word_embeddings`` false)
    but which lacks ``lm_head.weight`` decoded with the embeddings as its head, silently another model."""
    from safetensors.torch import load_file

    headless = tmp_path / "headless"
    shutil.copytree(tiny_llama_dir, headless)
    weights = load_file(str(headless / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(headless / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CausalDraftError, match="lacks weights.*lm_head.weight"):
        load_model(str(headless), dtype="float32")


def test_an_activation_other_than_silu_is_refused_natively(tmp_path: Path) -> None:
    """Found by an audit: the native MLP computes SiLU whatever ``hidden_act`` says."""
    directory = save_tiny_llama(tmp_path / "gelu", hidden_act="gelu")
    with pytest.raises(CausalDraftError, match="hidden_act is 'gelu'"):
        load_model(str(directory), dtype="float32")
    assert load_model(str(directory), dtype="float32", backend="hf").backend is not None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_head_sizes_the_attention_kernel_lacks_go_through_torch(tmp_path: Path, dtype: str) -> None:
    """Found by an audit: a head size of 8 (or 24, or 256) crashed in the attention kernel. Such caches attend
    through torch's operations, speculative decoding still equal to plain decoding, and fp32 to transformers."""
    directory = save_tiny_llama(tmp_path / "hd8", num_attention_heads=8, num_key_value_heads=4)
    plain = causaldraft.load(str(directory), dtype=dtype, drafter="none", compile=False)
    expected = plain.generate(PREFIX, max_new_tokens=24, temperature=0).token_ids
    for options in ({"drafter": "lookup", "tree": "dynamic"}, {"drafter": "draft", "draft_layers": 2, "tree": "static"},
                    {"drafter": "draft", "draft_model": str(directory), "tree": "chain"}):  # fmt: skip
        engine = causaldraft.load(str(directory), dtype=dtype, compile=False, **options)
        assert engine.generate(PREFIX, max_new_tokens=24, temperature=0).token_ids == expected, options
    if dtype == "float32":
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
        reference = model.generate(torch.tensor([PREFIX]), max_new_tokens=24, do_sample=False)[0, len(PREFIX) :]
        assert expected == reference.tolist()


def test_a_pickled_llama_on_the_native_backend_points_to_hf(tiny_llama_dir: Path, tmp_path: Path) -> None:
    pickled = tmp_path / "pickled-llama"
    pickled.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", pickled / "config.json")
    torch.save(AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)).state_dict(), pickled / "pytorch_model.bin")
    byte_tokenizer().save_pretrained(str(pickled))
    with pytest.raises(CausalDraftError, match="its PyTorch .bin weights are read by --backend hf"):
        load_model(str(pickled), dtype="float32")
    assert load_model(str(pickled), backend="hf", dtype="float32").backend.shape.vocab_size == 259
