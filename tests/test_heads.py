"""Markov / medusa heads drafters: greedy equivalence, seeded sampling, loading errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from causaldraft.api import load
from causaldraft.config import SamplingConfig
from causaldraft.drafters.base import DraftContext
from causaldraft.drafters.eagle3 import load_eagle3_drafter
from causaldraft.drafters.heads import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    HeadsConfig,
    HeadsDrafter,
    load_heads,
    load_heads_drafter,
    new_heads,
    save_heads,
)
from causaldraft.drafters.registry import DrafterOptions, auto_choice
from causaldraft.errors import CausalDraftError
from causaldraft.models.loading import LoadedModel, load_model
from causaldraft.models.packed import DraftLinear
from causaldraft.models.products import native_bf16_products
from causaldraft.models.quant import Int8Linear
from causaldraft.tree import Tree
from tests.test_eagle3 import layer_dir

PROMPTS = ["hello hello hello world", "the cat sat on the mat and the cat", "abcabcabc"]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), "native", "float32")


def random_heads_dir(
    tiny: LoadedModel, kind: str, directory: Path, seed: int = 0, fingerprint: str | None = None
) -> Path:
    shape = tiny.backend.shape
    config = HeadsConfig(kind, 4, shape.hidden_size, shape.vocab_size, 200, fingerprint or tiny.base_fingerprint)
    vocab_ids = torch.randperm(shape.vocab_size, generator=torch.Generator().manual_seed(seed))[:200].sort().values
    heads = new_heads(config, vocab_ids, tiny.backend.lm_head_weight(), seed)
    generator = torch.Generator().manual_seed(seed)  # not the global RNG: the same heads whatever ran before
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.2)  # medusa blocks start at zero
    save_heads(heads, directory)
    return directory


def plain_outputs(tiny: LoadedModel, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    engine = load(loaded=tiny, drafter="none", calibrate=False, compile=False)
    return [engine.generate(prompt, max_new_tokens=max_new_tokens).token_ids for prompt in prompts]


@pytest.mark.parametrize("kind", ["markov", "medusa"])
@pytest.mark.parametrize("tree", ["chain", "static", "dynamic"])
@pytest.mark.parametrize("lookup_merge", [True, False])
def test_random_heads_greedy_equivalence(
    tiny: LoadedModel, tmp_path: Path, kind: str, tree: str, lookup_merge: bool
) -> None:
    heads_dir = random_heads_dir(tiny, kind, tmp_path / kind)
    expected = plain_outputs(tiny, PROMPTS, 40)
    engine = load(loaded=tiny, drafter=kind, tree=tree, heads=str(heads_dir), lookup_merge=lookup_merge,
                  calibrate=False, fallback=False, compile=False)  # fmt: skip
    for prompt, plain in zip(PROMPTS, expected, strict=True):
        result = engine.generate(prompt, max_new_tokens=40)
        assert result.token_ids == plain
        assert max(step.nodes for step in result.stats.steps) > 1  # it really speculated


def test_seeded_sampling_is_reproducible(tiny: LoadedModel, tmp_path: Path) -> None:
    heads_dir = random_heads_dir(tiny, "markov", tmp_path / "markov")
    engine = load(loaded=tiny, drafter="markov", heads=str(heads_dir), calibrate=False, fallback=False, compile=False)
    first = engine.generate(PROMPTS[1], max_new_tokens=48, temperature=0.8, seed=123)
    second = engine.generate(PROMPTS[1], max_new_tokens=48, temperature=0.8, seed=123)
    other = engine.generate(PROMPTS[1], max_new_tokens=48, temperature=0.8, seed=124)
    assert first.token_ids == second.token_ids
    assert len(first.token_ids) == 48 and first.token_ids != other.token_ids


def test_markov_children_depend_on_their_path(tiny: LoadedModel, tmp_path: Path) -> None:
    markov = load_heads(random_heads_dir(tiny, "markov", tmp_path / "m"), tiny)
    drafter = HeadsDrafter(markov, tiny.backend, lookup_merge=False)
    hidden = torch.randn(tiny.backend.shape.hidden_size)
    context = DraftContext((5, 6, 7), hidden, "static", 3, 3, 32, SamplingConfig(), None)
    draft = drafter.propose(context)
    tree = draft.tree
    level_one = tree.children(0)
    assert len(level_one) == 3 and draft.child_mode == "deterministic"
    grandchildren = [tuple(tree.tokens[c] for c in tree.children(node)) for node in level_one]
    assert len(set(grandchildren)) > 1  # a medusa tree would repeat the same children
    assert all(score <= 1.0 for score in draft.scores)


def test_root_only_without_hidden(tiny: LoadedModel, tmp_path: Path) -> None:
    heads = load_heads(random_heads_dir(tiny, "medusa", tmp_path / "m"), tiny)
    drafter = HeadsDrafter(heads, tiny.backend)
    draft = drafter.propose(DraftContext((9,), None, "dynamic", 4, 3, 16, SamplingConfig(), None))
    assert draft.tree.tokens == (9,)


def test_fingerprint_mismatch_is_a_clear_error(tiny: LoadedModel, tmp_path: Path) -> None:
    heads_dir = random_heads_dir(tiny, "markov", tmp_path / "m", fingerprint="0123456789abcdef")
    with pytest.raises(CausalDraftError, match="another base model"):
        load_heads_drafter("markov", tiny, DrafterOptions(heads=str(heads_dir)))


def test_a_fine_tune_or_another_rope_is_another_model_whatever_the_dtype(
    tiny: LoadedModel, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """The fingerprint heads are paired with covers every weight and the rope: a fine-tune that keeps its
    base's embeddings, or the same weights under another rope, is refused the base's heads (the old
    fingerprint, sizes and the first embeddings, let both through). A copy elsewhere, or another dtype, is
    the same model."""
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama_dir, copy)
    for dtype in ("float32", "bfloat16", "int8"):
        assert load_model(str(copy), "native", dtype).base_fingerprint == tiny.base_fingerprint
    assert load_model(str(copy), "native", "bfloat16").fingerprint != tiny.fingerprint  # work folders differ
    heads_dir = random_heads_dir(tiny, "markov", tmp_path / "heads")
    tuned = tmp_path / "tuned"
    shutil.copytree(tiny_llama_dir, tuned)
    weights = load_file(str(tuned / "model.safetensors"))
    weights["model.layers.3.mlp.down_proj.weight"][-1, 0] += 0.01  # one weight of the last row of a late layer
    save_file(weights, str(tuned / "model.safetensors"), metadata={"format": "pt"})
    roped = tmp_path / "roped"
    shutil.copytree(tiny_llama_dir, roped)
    config = json.loads((roped / "config.json").read_text())
    config["rope_theta"] = 50000.0
    (roped / "config.json").write_text(json.dumps(config))
    for other in (tuned, roped):
        loaded = load_model(str(other), "native", "float32")
        assert loaded.base_fingerprint != tiny.base_fingerprint
        with pytest.raises(CausalDraftError, match="another base model .*older fingerprint"):
            load_heads(heads_dir, loaded)


def test_kind_mismatch_and_missing_default(tiny: LoadedModel, tmp_path: Path) -> None:
    heads_dir = random_heads_dir(tiny, "medusa", tmp_path / "m")
    with pytest.raises(CausalDraftError, match="medusa heads, not markov"):
        load_heads_drafter("markov", tiny, DrafterOptions(heads=str(heads_dir)))
    with pytest.raises(CausalDraftError, match="no trained markov heads for this model"):
        load_heads_drafter("markov", tiny, DrafterOptions())
    with pytest.raises(CausalDraftError, match="does not exist"):
        load_heads_drafter("markov", tiny, DrafterOptions(heads=str(tmp_path / "nowhere")))
    weights_file = next(path for path in heads_dir.iterdir() if path.suffix == ".safetensors")
    with pytest.raises(CausalDraftError, match=f"is a file: pass the directory that holds it \\({heads_dir}\\)"):
        load_heads_drafter("medusa", tiny, DrafterOptions(heads=str(weights_file)))  # found by an audit
    eagle3_dir = layer_dir(tiny, tmp_path / "eagle3")  # the other kind of trained drafter: named, not "missing"
    with pytest.raises(CausalDraftError, match="holds an eagle3 layer, not markov/medusa heads: use --drafter eagle3"):
        load_heads_drafter("markov", tiny, DrafterOptions(heads=str(eagle3_dir)))
    with pytest.raises(CausalDraftError, match="holds markov/medusa heads, not an eagle3 layer"):
        load_eagle3_drafter(tiny, DrafterOptions(heads=str(heads_dir)))


def test_corrupt_or_missing_files(tiny: LoadedModel, tmp_path: Path) -> None:
    heads_dir = random_heads_dir(tiny, "markov", tmp_path / "m")
    (heads_dir / WEIGHTS_FILE).write_bytes(b"not a safetensors file at all")
    with pytest.raises(CausalDraftError, match="corrupt heads weights"):
        load_heads_drafter("markov", tiny, DrafterOptions(heads=str(heads_dir)))
    (heads_dir / WEIGHTS_FILE).unlink()
    with pytest.raises(CausalDraftError, match="missing"):
        load_heads_drafter("markov", tiny, DrafterOptions(heads=str(heads_dir)))
    (heads_dir / CONFIG_FILE).write_text("{ not json")
    with pytest.raises(CausalDraftError, match="corrupt heads config"):
        load_heads_drafter("markov", tiny, DrafterOptions(heads=str(heads_dir)))
    (heads_dir / CONFIG_FILE).write_text(json.dumps({"format": 1, "kind": "markov"}))
    with pytest.raises(CausalDraftError, match="corrupt heads config"):
        load_heads_drafter("markov", tiny, DrafterOptions(heads=str(heads_dir)))


def test_auto_runs_the_trained_drafter_that_fits(tiny: LoadedModel, tmp_path: Path) -> None:
    from tests.test_eagle3 import layer_dir

    # no --heads: prompt lookup
    assert auto_choice(tiny, DrafterOptions()) == "lookup"
    assert load(loaded=tiny, calibrate=False, compile=False).drafter_name == "lookup"
    for kind in ("markov", "medusa"):
        heads_dir = random_heads_dir(tiny, kind, tmp_path / kind)
        engine = load(loaded=tiny, calibrate=False, heads=str(heads_dir), compile=False)
        assert engine.drafter_name == kind and isinstance(engine.decoder.drafter, HeadsDrafter)
    eagle3_dir = layer_dir(tiny, tmp_path / "eagle3")
    assert load(loaded=tiny, calibrate=False, heads=str(eagle3_dir), compile=False).drafter_name == "eagle3"
    with pytest.raises(CausalDraftError, match="does not exist"):
        auto_choice(tiny, DrafterOptions(heads=str(tmp_path / "nowhere")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CausalDraftError, match="no trained drafter"):
        auto_choice(tiny, DrafterOptions(heads=str(tmp_path / "empty")))


@pytest.mark.slow
def test_shipped_default_heads_match_plain_decoding() -> None:
    questions = Path(__file__).resolve().parents[1] / "bench" / "prompts" / "mt-bench-other16.jsonl"
    prompts = [json.loads(line)["turns"][0] for line in questions.read_text().splitlines()[:2]]
    target = load_model("default", "native", "float32")
    # the default drafter: the shipped eagle3 layer on a bf16 or fp32 target, prompt lookup on an int4 one
    assert auto_choice(target, DrafterOptions()) == "eagle3"
    assert auto_choice(load_model("default", "native", "int4"), DrafterOptions()) == "lookup"
    plain = load(loaded=target, drafter="none", calibrate=False, compile=False)
    expected = [plain.generate(prompt, max_new_tokens=64, chat=True).token_ids for prompt in prompts]
    for kind in ("markov", "medusa"):
        engine = load(loaded=target, drafter=kind, calibrate=False, fallback=False, compile=False)
        for prompt, tokens in zip(prompts, expected, strict=True):
            result = engine.generate(prompt, max_new_tokens=64, chat=True)
            assert result.token_ids == tokens
            assert result.stats.mean_accepted > 1.1


def test_int8_drafting_agrees_with_bf16_drafting(tiny: LoadedModel, tmp_path: Path) -> None:
    """Drafting projects one or two rows in int8 (DraftLinear; without oneDNN, every row for
    quantized targets): the same chains as bf16 drafting but for near-ties (lossless either way:
    drafts only decide what gets verified)."""
    markov = load_heads(random_heads_dir(tiny, "markov", tmp_path / "m"), tiny)
    bf16 = HeadsDrafter(markov, tiny.backend, lookup_merge=False)
    out_weight = markov.out_weight.to(torch.bfloat16)
    bf16.project = lambda x: x @ out_weight.t()
    int8 = HeadsDrafter(markov, tiny.backend, lookup_merge=False, int8=True)
    assert isinstance(int8.project, DraftLinear if native_bf16_products() else Int8Linear)
    same = 0
    for seed in range(20):
        hidden = torch.randn(tiny.backend.shape.hidden_size, generator=torch.Generator().manual_seed(seed))
        context = DraftContext((5, 6, 7), hidden, "chain", 3, 1, 4, SamplingConfig(), None)
        same += bf16.propose(context).tree.tokens == int8.propose(context).tree.tokens
    assert same >= 16, same


@pytest.mark.parametrize("kind", ["markov", "medusa"])
def test_drafting_feeds_every_head_as_training_does(tiny: LoadedModel, tmp_path: Path, kind: str) -> None:
    """Along the true continuation, the drafter's depth-k candidates equal the trainer's head-k
    logits on the same row: path tokens, states and output norms are fed identically for every
    head, the last one included."""
    from causaldraft.train.features import Features, sequence_features
    from causaldraft.train.trainer import draft_index, head_logits, make_batch

    heads = load_heads(random_heads_dir(tiny, kind, tmp_path / kind), tiny)
    prompt = tiny.tokenizer.encode(PROMPTS[1])
    response = (
        load(loaded=tiny, drafter="none", calibrate=False, compile=False).generate(prompt, max_new_tokens=12).token_ids
    )
    with torch.inference_mode():
        item = sequence_features(tiny.backend, prompt, response, 4)
    rows = item["tokens"].shape[0]
    features = Features(item["tokens"].long(), item["hidden"].float(), item["topk_ids"].long(),
                        item["topk_logprobs"].float(), torch.full((rows,), rows - 1), 1)  # fmt: skip
    embed = tiny.backend.embed(torch.arange(259)).float()
    row = 1
    batch = make_batch(features, torch.tensor([row]), embed, draft_index(heads.vocab_ids, 259), heads.config.num_heads)
    with torch.no_grad():
        trained = [torch.softmax(logits[0], dim=-1) for logits in head_logits(heads, batch)]
    drafter = HeadsDrafter(heads, tiny.backend, lookup_merge=False)
    path = features.tokens[row + 1 : row + 1 + heads.config.num_heads].tolist()  # root, then the true tokens
    context = DraftContext(tuple(path[:1]), features.hidden[row], "chain", 4, 1, 8, SamplingConfig(), None)
    expand = drafter.expander(context)
    tree = Tree.chain(path)
    with torch.no_grad():
        for depth in range(heads.config.num_heads):
            [[(token, prob)]] = expand(tree, [depth])
            assert token == int(heads.vocab_ids[int(trained[depth].argmax())]), depth
            assert prob == pytest.approx(float(trained[depth].max()), rel=2e-2), depth  # drafting reads bf16 rows
