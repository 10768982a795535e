"""The eagle3 drafter: greedy equivalence for every tree kind, drafting == training (TTT), batched
feature generation == plain decoding, the sampling law, and loading errors."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy.stats import chisquare

from causaldraft.adapt import DepthGate, VerifyCost, initial_adapt_state
from causaldraft.api import load
from causaldraft.cli import main
from causaldraft.config import SamplingConfig, TreeConfig
from causaldraft.decode import PROMPT_CHUNK
from causaldraft.drafters.base import DraftContext
from causaldraft.drafters.eagle3 import Eagle3Drafter, RootRecorder, load_eagle3_drafter, teacher_forced_rows
from causaldraft.drafters.eagle3_model import (
    CONFIG_FILE,
    LINEARS,
    WEIGHTS_FILE,
    Eagle3Layer,
    load_layer,
    new_layer,
    pack_linears,
    read_config,
    rope_frequencies,
    save_layer,
    widen_vocabulary,
)
from causaldraft.drafters.registry import DrafterOptions
from causaldraft.errors import CausalDraftError
from causaldraft.models.loading import LoadedModel, load_model
from causaldraft.models.native import NativeLlama, default_aux_layers
from causaldraft.models.packed import INT8_MAX_ROWS, Q8_0_MAX_ROWS, DraftLinear
from causaldraft.models.products import native_bf16_products
from causaldraft.train.calibration import NOISE_SCORE_TEMPERATURES, SAMPLING_SCALES, SCORE_TEMPERATURES
from causaldraft.train.eagle3_recipe import eagle3_config
from causaldraft.train.eagle3_train import (
    Eagle3TrainConfig,
    draft_index,
    draft_vocabulary,
    evaluate_layer,
    grown_vocabulary,
    load_sequences,
    make_batch,
    token_counts,
    train_layer,
    ttt_outputs,
)
from causaldraft.train.feature_data import FeatureGenConfig, generate_features
from causaldraft.tree import Tree
from tests.test_decode import exact_law

PROMPTS = ["hello hello hello world", "the cat sat on the mat and the cat", "abcabcabc"]
AUX = (1, 2, 3)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), "native", "float32")


def random_layer(
    tiny: LoadedModel, seed: int = 0, draft_vocab: int = 200, aux_layers: tuple[int, ...] = AUX
) -> Eagle3Layer:
    vocab = tiny.backend.shape.vocab_size
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values
    layer = new_layer(eagle3_config(tiny, draft_vocab, aux_layers), ids, tiny.backend.lm_head_weight(), seed)
    noise = torch.Generator().manual_seed(seed)  # the same layer whichever tests ran before in this process
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=noise, dtype=parameter.dtype) * 0.05)
    return layer.eval()


def layer_dir(
    tiny: LoadedModel, directory: Path, seed: int = 0, calibrated: bool = False, aux_layers: tuple[int, ...] = AUX
) -> Path:
    """A random layer saved to ``directory``; ``calibrated``: with temperatures other than 1; ``aux_layers``: the
    target layers it reads (a compiled target's graphs return ``default_aux_layers`` only)."""
    layer = random_layer(tiny, seed, aux_layers=aux_layers)
    if calibrated:
        layer.config = dataclasses.replace(layer.config, score_temperature=0.6, sampling_temperature_scale=0.5,
                                           noise_score_temperature=2.0)  # fmt: skip
    save_layer(layer, directory)
    return directory


@pytest.fixture(scope="module")
def generated(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Self-distillation data of the tiny model made by the batched generator (3 rows, refills)."""
    directory = tmp_path_factory.mktemp("eagle3-data")
    prompts = directory / "prompts.txt"
    prompts.write_text("\n".join([*PROMPTS, "one two three", "zzz", "the mat", "a b c d"]))
    config = FeatureGenConfig(tokens=10_000, max_new_tokens=24, batch_size=3, refill=1, top_k=4,
                              sequences_per_shard=2, threads=1)  # fmt: skip
    assert isinstance(tiny.backend, NativeLlama)
    generate_features(tiny.backend, tiny.tokenizer, [prompts], directory / "data", AUX, config, tiny.fingerprint)
    return directory / "data"


def plain(tiny: LoadedModel, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    engine = load(loaded=tiny, drafter="none", calibrate=False, compile=False)
    return [engine.generate(prompt, max_new_tokens=max_new_tokens).token_ids for prompt in prompts]


@pytest.mark.parametrize("tree", ["chain", "static", "dynamic"])
@pytest.mark.parametrize("lookup_merge", [True, False])
def test_greedy_output_is_token_identical_to_plain(
    tiny: LoadedModel, tmp_path: Path, tree: str, lookup_merge: bool
) -> None:
    directory = layer_dir(tiny, tmp_path / "eagle3")
    expected = plain(tiny, PROMPTS, 40)
    engine = load(loaded=tiny, drafter="eagle3", tree=tree, heads=str(directory), lookup_merge=lookup_merge,
                  calibrate=False, fallback=False, compile=False)  # fmt: skip
    for prompt, tokens in zip(PROMPTS, expected, strict=True):
        result = engine.generate(prompt, max_new_tokens=40)
        assert result.token_ids == tokens
        assert max(step.nodes for step in result.stats.steps) > 2  # it really drafted trees


@pytest.mark.parametrize("calibrated", [False, True])
def test_greedy_identity_with_fallback_and_cost_model(tiny: LoadedModel, tmp_path: Path, calibrated: bool) -> None:
    """Fallback steps skip drafting; the features of those steps must still reach the draft cache.
    Calibrated temperatures change the scores the tree and the cost model see, not the output."""
    directory = layer_dir(tiny, tmp_path / "eagle3", calibrated=calibrated)
    expected = plain(tiny, PROMPTS, 48)
    engine = load(loaded=tiny, drafter="eagle3", heads=str(directory), calibrate=True, compile=False)
    for prompt, tokens in zip(PROMPTS, expected, strict=True):
        assert engine.generate(prompt, max_new_tokens=48).token_ids == tokens


def test_sampled_data_draws_from_the_targets_distribution(tiny: LoadedModel, tmp_path: Path) -> None:
    """--data-temperature: response tokens are samples of the target's distribution at that
    temperature (chi-square over many keys), the same tokens whenever the data are generated, and
    other than the greedy ones."""
    logprobs = torch.log_softmax(torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -30.0]), dim=-1)
    config = FeatureGenConfig(seed=5, temperature=0.8)
    draws = 6000
    tokens = config.choose(logprobs.expand(draws, -1), [(index, 7 + index % 3) for index in range(draws)])
    expected = torch.softmax(logprobs / 0.8, dim=-1)
    counts = Counter(tokens)
    assert counts[5] == 0 and FeatureGenConfig().choose(logprobs[None], [(0, 0)]) == [0]
    observed = [counts[token] for token in range(5)]
    assert chisquare(observed, (expected[:5] / expected[:5].sum() * draws).tolist()).pvalue > 1e-3
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join([*PROMPTS, "one two three", "the mat"]))
    assert isinstance(tiny.backend, NativeLlama)
    runs = []
    for name in ("data", "again"):
        config = FeatureGenConfig(tokens=10_000, max_new_tokens=24, batch_size=3, refill=1, top_k=4,
                                  sequences_per_shard=2, threads=1, seed=5, temperature=1.0)  # fmt: skip
        generate_features(tiny.backend, tiny.tokenizer, [prompts], tmp_path / name, AUX, config, tiny.fingerprint)
        runs.append(load_sequences(tmp_path / name))
    assert [seq.tokens.tolist() for seq in runs[0]] == [seq.tokens.tolist() for seq in runs[1]]
    off_greedy = sum(
        int((seq.tokens[seq.prompt_length :] != seq.topk_ids[:, 0]).sum()) for seq in runs[0]
    )  # fmt: skip
    assert off_greedy > 0
    with pytest.raises(CausalDraftError, match="holds data made differently"):
        greedy = FeatureGenConfig(tokens=10_000, max_new_tokens=24, top_k=4, seed=5)
        generate_features(tiny.backend, tiny.tokenizer, [prompts], tmp_path / "data", AUX, greedy, tiny.fingerprint)
    other = tmp_path / "other.txt"
    other.write_text("a prompt the data was not made from\n")
    with pytest.raises(CausalDraftError, match="holds data made differently \\(prompts"):
        generate_features(tiny.backend, tiny.tokenizer, [other], tmp_path / "data", AUX, config, tiny.fingerprint)
    record = tmp_path / "data" / "meta.json"
    meta = json.loads(record.read_text())
    record.write_text(json.dumps({key: value for key, value in meta.items() if key != "prompts"}))
    generate_features(tiny.backend, tiny.tokenizer, [prompts], tmp_path / "data", AUX, config, tiny.fingerprint)
    assert json.loads(record.read_text()) == meta  # a folder from before prompts were recorded: taken, completed


def test_batched_generation_equals_plain_decoding_and_its_features(tiny: LoadedModel, generated: Path) -> None:
    sequences = load_sequences(generated)
    engine = load(loaded=tiny, drafter="none", calibrate=False, compile=False)
    assert len(sequences) == 7
    for seq in sequences:
        prompt = seq.tokens[: seq.prompt_length].tolist()
        expected = engine.generate(prompt, max_new_tokens=24).token_ids
        assert seq.tokens[seq.prompt_length :].tolist() == expected
        n = seq.tokens.shape[0] - 1
        cache = tiny.backend.new_cache(n)
        out = tiny.backend.forward(seq.tokens[:n], torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(),
                                   cache, aux_layers=AUX)  # fmt: skip
        assert out.aux is not None
        torch.testing.assert_close(seq.features.float(), out.aux.float(), atol=2e-2, rtol=1e-2)  # stored bf16
        assert torch.equal(seq.topk_ids[:, 0], seq.tokens[seq.prompt_length :])  # greedy = top-1


def test_batched_generation_of_a_qwen3_equals_plain_decoding_and_its_features(
    tiny_qwen3_dir: Path, tmp_path: Path
) -> None:
    """The batched generator's own attention (models/batched.py) applies Qwen3's query and key norms too."""
    qwen3 = load_model(str(tiny_qwen3_dir), "native", "float32")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS))
    config = FeatureGenConfig(tokens=1000, max_new_tokens=16, batch_size=2, refill=1, top_k=4, threads=1)
    assert isinstance(qwen3.backend, NativeLlama) and qwen3.backend.llama_shape.qk_norm
    generate_features(qwen3.backend, qwen3.tokenizer, [prompts], tmp_path / "data", AUX, config, qwen3.fingerprint)
    engine = load(loaded=qwen3, drafter="none", calibrate=False, compile=False)
    sequences = load_sequences(tmp_path / "data")
    assert len(sequences) == len(PROMPTS)
    for seq in sequences:
        expected = engine.generate(seq.tokens[: seq.prompt_length].tolist(), max_new_tokens=16).token_ids
        assert seq.tokens[seq.prompt_length :].tolist() == expected
        n = seq.tokens.shape[0] - 1
        out = qwen3.backend.forward(seq.tokens[:n], torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(),
                                    qwen3.backend.new_cache(n), aux_layers=AUX)  # fmt: skip
        assert out.aux is not None
        torch.testing.assert_close(seq.features.float(), out.aux.float(), atol=2e-2, rtol=1e-2)


def test_batched_generation_ends_answers_at_every_end_token(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Self-distilled answers end where the engine's plain decoding ends them: at any ``eos_token_id`` of
    generation_config.json (``LoadedModel.end_token_ids``), not only the tokenizer's EOS."""
    directory = tmp_path / "ends"
    shutil.copytree(tiny_llama_dir, directory)
    plain = load(model=str(directory), dtype="float32", drafter="none", calibrate=False, compile=False)
    end = plain.generate(PROMPTS[1], max_new_tokens=16).token_ids[5]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, end]}))
    loaded = load_model(str(directory), "native", "float32")
    assert loaded.end_token_ids() == {2, end} and isinstance(loaded.backend, NativeLlama)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS))
    config = FeatureGenConfig(tokens=1000, max_new_tokens=16, batch_size=2, refill=1, top_k=4, threads=1)
    generate_features(loaded.backend, loaded.tokenizer, [prompts], tmp_path / "data", AUX, config, loaded.fingerprint,
                      ends=loaded.end_token_ids())  # fmt: skip
    engine = load(loaded=loaded, drafter="none", calibrate=False, compile=False)
    answers = [seq.tokens[seq.prompt_length :].tolist() for seq in load_sequences(tmp_path / "data")]
    prompts_ids = [seq.tokens[: seq.prompt_length].tolist() for seq in load_sequences(tmp_path / "data")]
    for prompt_ids, answer in zip(prompts_ids, answers, strict=True):
        assert answer == engine.generate(prompt_ids, max_new_tokens=16).token_ids
    assert any(answer[-1] == end and len(answer) < 16 for answer in answers)


@pytest.mark.parametrize("score_temperature", [1.0, 0.6])
def test_drafting_computes_exactly_what_training_unrolls(
    tiny: LoadedModel, generated: Path, score_temperature: float
) -> None:
    """A chain drafted along the true continuation proposes, at depth j, what TTT step j computes
    at the root's row: training and drafting feed the layer the same tokens, hidden states,
    positions and keys (the Markov heads once differed here without a test noticing). The child's
    score is the layer's probability at its calibrated score temperature."""
    layer = random_layer(tiny)
    layer.config = dataclasses.replace(layer.config, score_temperature=score_temperature)
    seq = max(load_sequences(generated), key=lambda s: s.response_length)
    steps = 4
    batch = make_batch([seq], steps, context=1000, to_draft=draft_index(layer.vocab_ids, 259))
    with torch.no_grad():
        trained = ttt_outputs(layer, tiny.backend.embed(torch.arange(259)).float(), batch, steps)  # [1, N, h] each
    drafter = Eagle3Drafter(layer, tiny.backend, lookup_merge=False)
    tokens = seq.tokens.tolist()
    root_row = seq.prompt_length + 2  # the root x_{p+1} is the token of draft row p
    context_tokens = tuple(tokens[: root_row + 2])
    drafter.start(context_tokens, seq.features[: root_row + 1].float())
    with torch.no_grad():
        drafter.catch_up()
        expand = drafter.expander(DraftContext(context_tokens, None, "chain", steps, 1, 8, SamplingConfig(), None))
        tree = Tree.chain(tokens[root_row + 1 : root_row + 1 + steps])
        for depth in range(steps):
            [[(token, prob)]] = expand(tree, [depth])
            expected = torch.softmax(layer.logits(trained[depth][0, root_row]) / score_temperature, dim=-1)
            assert token == int(layer.vocab_ids[int(expected.argmax())]), depth
            assert prob == pytest.approx(float(expected.max()), abs=1e-4), depth


@pytest.mark.parametrize("calibrate", [False, True])
def test_decode_steps_draft_from_what_one_pass_over_the_output_gives(
    tiny: LoadedModel, tmp_path: Path, calibrate: bool
) -> None:
    """The decode loop feeds the draft cache from verify passes (accepted paths, bonus tokens, fallback steps
    with ``calibrate``): at every step the row proposing the root's children must equal that row of one
    teacher-forced layer pass over prompt + output, with the features of one plain target pass (what training
    sees). On the real model they were equal at every MT-bench step (stop 37, ``bench/eagle3_replay.py``); this
    keeps them so. Lookup merges make multi-token steps. The last prompt is read in two chunks, whose
    features the drafter gets together."""
    directory = layer_dir(tiny, tmp_path / "eagle3")
    engine = load(loaded=tiny, drafter="eagle3", tree="chain", depth=3, heads=str(directory), calibrate=calibrate,
                  fallback=calibrate, compile=False)  # fmt: skip
    recorder = RootRecorder(engine.decoder.drafter)  # type: ignore[arg-type]
    engine.decoder = dataclasses.replace(engine.decoder, drafter=recorder)
    accepted = total = 0
    long_prompt = "the quick brown fox jumps over the lazy dog. " * 7  # 315 bytes
    assert len(engine.encode(long_prompt)) > PROMPT_CHUNK + 1
    for prompt in [*PROMPTS, long_prompt]:
        result = engine.generate(prompt, max_new_tokens=40)
        accepted = max(accepted, *(step.accepted for step in result.stats.steps))
        tokens = engine.encode(prompt) + result.token_ids
        length = len(tokens)
        forced = teacher_forced_rows(recorder.inner, tokens)
        checked = [n for n in recorder.roots if n <= length]
        # Steps drafted by lookup alone (the gate declined the layer's level: with ``calibrate`` the clock
        # decides, and a loaded machine declines more) feed no root: the prompts' counts vary, their sum less.
        assert len(checked) >= 2
        total += len(checked)
        for n in checked:  # the step with n tokens: root x_{n-1}, proposed by row n - 2
            torch.testing.assert_close(recorder.roots[n], forced[n - 2], atol=1e-4, rtol=1e-4)
    assert total >= 16
    assert accepted >= 2  # multi-token commits were fed too


def test_queued_rows_run_only_when_the_gate_allows_a_first_level(tiny: LoadedModel, generated: Path) -> None:
    """The prompt's rows run at start (prefill); a step's rows wait until the gate allows the first
    level, so a step kept plain runs no layer pass, and then run before that level's clock restarts,
    so the gate's level times are drafting alone (a catch-up once counted as the first level's cost
    starved eagle3 of trees). The next tree is the tree of a drafter that never declined."""
    layer = random_layer(tiny)
    seq = max(load_sequences(generated), key=lambda s: s.response_length)
    tokens = seq.tokens.tolist()
    root_row = seq.prompt_length + 2
    prompt = tuple(tokens[: seq.prompt_length])
    context_tokens = tuple(tokens[: root_row + 2])
    asked: list[tuple[int, int]] = []  # (committed, pending) at each gate question

    def gate_of(drafter: Eagle3Drafter, answer: bool) -> object:
        def gate(scores: object, frontier: object, level: int) -> bool:
            asked.append((drafter.committed, len(drafter.pending_tokens)))
            return answer and level == 0

        return gate

    def context(gate: object) -> DraftContext:
        return DraftContext(context_tokens, None, "dynamic", 3, 2, 8, SamplingConfig(), None, gate=gate)  # type: ignore[arg-type]

    drafters = [Eagle3Drafter(layer, tiny.backend, lookup_merge=False) for _ in range(3)]
    queued = len(context_tokens) - len(prompt)
    for drafter in drafters:
        drafter.start(prompt, seq.features[: len(prompt) - 1].float())
        assert drafter.committed == len(prompt) - 1 and not drafter.pending_tokens
        drafter.queue(context_tokens[len(prompt) :], seq.features[len(prompt) - 1 : root_row + 1].float())
    declining, allowing, drafting = drafters
    declined = declining.propose(context(gate_of(declining, False)))
    assert declined.tree.size == 1 and asked == [(len(prompt) - 1, queued)]
    assert declining.committed == len(prompt) - 1  # kept plain: the queued rows still wait
    drafted = declining.propose(context(None))
    assert declining.committed == root_row + 1 and drafted.tree.size > 1
    assert drafted.tree == drafting.propose(context(None)).tree
    asked.clear()
    one_level = allowing.propose(context(gate_of(allowing, True)))
    assert asked[0] == (len(prompt) - 1, queued) and asked[1] == (root_row + 1, 0)  # ran between the questions
    assert one_level.tree.size > 1 and max(one_level.tree.depths) == 1


def test_a_restarted_level_does_not_count_the_drafter_s_bookkeeping() -> None:
    cost = VerifyCost({1: 0.01, 2: 0.011, 4: 0.012}, ())
    state = initial_adapt_state(TreeConfig())
    gate = DepthGate(state, cost, 8, reprobe_every=4, started=time.perf_counter(), always_first=True)
    assert gate([], [1.0], 0)
    time.sleep(0.05)  # bookkeeping after the question
    gate.restart_level()
    assert gate.level_times(time.perf_counter() - gate.started)[0] < 0.04


def test_trained_layer_beats_random_and_accepts_more(tiny: LoadedModel, generated: Path, tmp_path: Path) -> None:
    sequences = load_sequences(generated)
    vocab_ids = draft_vocabulary(sequences, 259, 128)
    layer = new_layer(eagle3_config(tiny, 128, AUX), vocab_ids, tiny.backend.lm_head_weight(), 0)
    embed = tiny.backend.embed(torch.arange(259)).float()
    before = evaluate_layer(layer, sequences, embed, 3, 8)
    config = Eagle3TrainConfig(epochs=30, rows_per_batch=64, steps=3, context=8, lr=3e-3, warmup=5, autocast=False)
    history = train_layer(layer, sequences, embed, config, tmp_path / "ckpt.pt")
    after = evaluate_layer(layer, sequences, embed, 3, 8)
    assert history[-1] < history[0]
    assert after.top1[0] > before.top1[0] + 0.2
    assert after.chain_accepted > before.chain_accepted
    resumed = train_layer(layer, sequences, embed, config, tmp_path / "ckpt.pt")  # finished: nothing to do
    assert resumed == history


@pytest.mark.parametrize("sampler", ["gumbel", "rejection"])
def test_sampled_output_follows_the_exact_target_law(
    tiny: LoadedModel, tiny_llama_dir: Path, tmp_path: Path, sampler: str
) -> None:
    directory = layer_dir(tiny, tmp_path / "eagle3")
    engine = load(loaded=tiny, drafter="eagle3", heads=str(directory), tree="static", depth=2,
                  calibrate=False, fallback=False, adapt=False, sampler=sampler, compile=False)  # fmt: skip
    prompt_ids = engine.encode(PROMPTS[0])
    sampling = SamplingConfig(temperature=1.0, top_k=4)
    law = exact_law(tiny_llama_dir, prompt_ids, sampling)
    counts: Counter[tuple[int, int]] = Counter()
    drafted = 0
    for seed in range(1000):
        result = engine.generate(prompt_ids, max_new_tokens=2, temperature=1.0, top_k=4, seed=seed)
        counts[(result.token_ids[0], result.token_ids[1])] += 1
        drafted += result.stats.steps[0].nodes - 1
    assert drafted > 1000
    assert set(counts) <= set(law)
    keys = sorted(law)
    observed = [counts[key] for key in keys]
    expected = [law[key] / sum(law.values()) * 1000 for key in keys]
    assert chisquare(observed, expected).pvalue > 1e-4


def test_loading_errors_are_clear(tiny: LoadedModel, tmp_path: Path) -> None:
    options = DrafterOptions(heads=str(tmp_path / "missing"))
    with pytest.raises(CausalDraftError, match="does not exist"):
        load_eagle3_drafter(tiny, options)
    directory = layer_dir(tiny, tmp_path / "good")
    fingerprint = tiny.base_fingerprint
    with pytest.raises(CausalDraftError, match="another base model"):
        load_layer(directory, "0" * 16, 259, 64)
    with pytest.raises(CausalDraftError, match="no trained eagle3 drafter"):
        load_eagle3_drafter(tiny, DrafterOptions())  # no shipped layer for the tiny model

    weights = load_file(str(directory / WEIGHTS_FILE))
    weights["vocab_ids"] = weights["vocab_ids"].flip(0).contiguous()  # unsorted: does not fit the target
    save_file(weights, str(directory / WEIGHTS_FILE))
    with pytest.raises(CausalDraftError, match="does not fit"):
        load_layer(directory, fingerprint, 259, 64)
    (directory / WEIGHTS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(CausalDraftError, match="corrupt eagle3 weights"):
        load_layer(directory, fingerprint, 259, 64)
    (directory / WEIGHTS_FILE).unlink()
    with pytest.raises(CausalDraftError, match="missing"):
        load_layer(directory, fingerprint, 259, 64)
    calibrated = layer_dir(tiny, tmp_path / "calibrated", calibrated=True)
    assert read_config(calibrated)[0].sampling_temperature_scale == 0.5
    record = json.loads((calibrated / CONFIG_FILE).read_text())
    assert read_config(calibrated)[0].noise_score_temperature == 2.0
    for name in ("score_temperature", "sampling_temperature_scale", "noise_score_temperature"):
        del record[name]  # a config written before calibration: the plain distribution
    (calibrated / CONFIG_FILE).write_text(json.dumps(record))
    assert read_config(calibrated)[0].score_temperature == 1.0
    assert read_config(calibrated)[0].noise_score_temperature == 1.0
    for bad in ({"score_temperature": 0.0}, {"noise_score_temperature": float("nan")},
                {"sampling_temperature_scale": float("inf")}):  # fmt: skip
        (calibrated / CONFIG_FILE).write_text(json.dumps({**record, **bad}))
        with pytest.raises(CausalDraftError, match="temperatures must be positive"):
            load_layer(calibrated, fingerprint, 259, 64)
    record = json.loads((directory / CONFIG_FILE).read_text())
    del record["draft_vocab"]
    (directory / CONFIG_FILE).write_text(json.dumps(record))
    with pytest.raises(CausalDraftError, match="corrupt eagle3 config"):
        load_layer(directory, fingerprint, 259, 64)
    other = layer_dir(tiny, tmp_path / "big")
    with pytest.raises(CausalDraftError, match="another base model"):
        load_layer(other, fingerprint, 1000, 64)  # a target with another vocabulary


@pytest.mark.slow
def test_compiled_target_serves_eagle3_features_from_the_same_graphs(
    tiny_llama_dir: Path, tmp_path: Path, graph_root: Path
) -> None:
    """Compiled graphs return the default feature layers always: plain decoding and eagle3 share
    one graph per bucket, and eagle3 output stays token-identical."""
    from causaldraft.models.compiled import GraphKey, GraphStore, compile_model

    loaded = load_model(str(tiny_llama_dir), "native", "float32")
    expected = plain(loaded, PROMPTS[:2], 24)
    assert isinstance(loaded.backend, NativeLlama)
    aux_layers = default_aux_layers(loaded.backend.llama_shape.num_layers)
    store = GraphStore(GraphKey.of(loaded.backend, aux_layers), graph_root)
    compile_model(loaded.backend, buckets=(1, 4, 32), store=store)
    plain_compiled = load(loaded=loaded, drafter="none", calibrate=False, compile=False)
    assert plain_compiled.generate(PROMPTS[0], max_new_tokens=24).token_ids == expected[0]
    graphs = store.builds
    vocab_ids = torch.arange(0, 259, 2)
    layer = new_layer(eagle3_config(loaded, vocab_ids.numel()), vocab_ids, loaded.backend.lm_head_weight(), 0)
    assert layer.config.aux_layers == loaded.backend.graph_aux_layers
    save_layer(layer, tmp_path / "eagle3")
    spec = load(loaded=loaded, drafter="eagle3", heads=str(tmp_path / "eagle3"), calibrate=False, fallback=False,
                max_nodes=4, compile=False)  # fmt: skip
    for prompt, tokens in zip(PROMPTS[:2], expected, strict=True):
        assert spec.generate(prompt, max_new_tokens=24).token_ids == tokens
    assert store.builds == graphs
    # a layer reading a layer the graphs do not return would verify eagerly: refused, not silently inexact
    assert not set(AUX) <= set(aux_layers)
    with pytest.raises(CausalDraftError, match=r"compiled graphs return .*missing \(3,\)"):
        load(
            loaded=loaded,
            drafter="eagle3",
            heads=str(layer_dir(loaded, tmp_path / "other")),
            calibrate=False,
            compile=False,
        )


@pytest.mark.parametrize("calibrated", [False, True])
def test_gumbel_seeded_output_is_the_same_for_every_tree(tiny: LoadedModel, tmp_path: Path, calibrated: bool) -> None:
    """Drafts ranked with the target's own noise: the tokens are plain seeded sampling's, whatever
    temperature scale the drafter ranks at."""
    directory = layer_dir(tiny, tmp_path / "eagle3", calibrated=calibrated)
    plain_engine = load(loaded=tiny, drafter="none", calibrate=False, compile=False)
    for seed in (4, 5):
        expected = plain_engine.generate(PROMPTS[1], max_new_tokens=32, temperature=1.0, seed=seed).token_ids
        for tree in ("chain", "static", "dynamic"):
            engine = load(loaded=tiny, drafter="eagle3", heads=str(directory), tree=tree, calibrate=True, compile=False)
            assert engine.generate(PROMPTS[1], max_new_tokens=32, temperature=1.0, seed=seed).token_ids == expected


def test_packed_layer_drafts_what_the_plain_layer_drafts(tiny: LoadedModel) -> None:
    """bf16 drafting runs the layer's products in int8 for one or two rows and through oneDNN's
    reordered weights for more (int8 for all where oneDNN takes no bf16 weights: pack_linears);
    the drafts are those of the plain layer."""
    plain_layer = random_layer(tiny).cast(torch.bfloat16)
    packed = copy.deepcopy(plain_layer)
    assert pack_linears(packed)  # where oneDNN takes no bf16 weights, int8 serves every call
    assert all(isinstance(getattr(packed, name), DraftLinear) for name in LINEARS)
    assert not pack_linears(random_layer(tiny))  # float32 stays as it is
    c = plain_layer.config
    generator = torch.Generator().manual_seed(0)
    for rows in (1, 3, 8):
        embeds = torch.randn(rows, c.hidden_size, generator=generator).bfloat16()
        features = torch.randn(rows, c.feature_size, generator=generator).bfloat16()
        mask = torch.ones(rows, 10 + rows, dtype=torch.bool)
        outs = []
        for layer in (plain_layer, packed):
            keys = torch.zeros(c.kv_heads, 32, c.head_dim, dtype=torch.bfloat16)
            values = torch.randn(c.kv_heads, 32, c.head_dim, generator=torch.Generator().manual_seed(1)).bfloat16()
            keys[:, :10] = values[:, :10]
            positions = torch.full((rows,), 10)
            slots = torch.arange(10, 10 + rows)
            with torch.inference_mode():
                out = layer.step(embeds, layer.fc(features), positions, mask, keys, values, slots)
                outs.append(layer.logits(out).float())
        # int8 weights round each product to 1/254 of its row's largest weight, Q8_0 weights to 1/254 of each
        # 32 inputs' largest; packed bf16 only reorders
        q8_0 = rows <= Q8_0_MAX_ROWS and any(getattr(packed, name).q8_0 is not None for name in LINEARS)
        tolerance = 6e-2 if rows <= INT8_MAX_ROWS or q8_0 or not native_bf16_products() else 2e-2
        torch.testing.assert_close(outs[1], outs[0], atol=tolerance, rtol=tolerance)
        top = outs[0].topk(2, dim=-1).values
        clear = top[:, 0] - top[:, 1] > 2 * tolerance  # no near-tie: the same draft
        assert torch.equal(outs[1].argmax(-1)[clear], outs[0].argmax(-1)[clear])


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128}  # fmt: skip


def test_a_scaled_rope_target_trains_a_layer_that_runs_its_rope(tmp_path: Path) -> None:
    """A Llama 3 style target (llama3 rope scaling): the layer is trained with the target's own rope, saved
    with it, drafts with it, and greedy output stays the target's."""
    from tests.tiny import save_tiny_llama

    model = save_tiny_llama(tmp_path / "llama3-rope", rope_scaling=LLAMA3_ROPE, rope_theta=500000.0)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"the cat {index}" for index in range(24)) + "\n")
    assert main(["train-heads", "--model", str(model), "--prompts", str(prompts), "--heads", "eagle3",
                 "--draft-vocab", "128", "--tokens", "400", "--max-new-tokens", "16", "--ttt-steps", "2",
                 "--rows-per-batch", "64", "--context", "8", "--dtype", "float32", "--work", str(tmp_path / "work"),
                 "--out", str(tmp_path / "out")]) == 0  # fmt: skip
    config, _ = read_config(tmp_path / "out")
    assert config.rope_parameters is not None and config.rope_parameters["rope_type"] == "llama3"
    assert config.rope_theta == config.rope_parameters["rope_theta"] == 500000.0
    target = load_model(str(model), "native", "float32")
    assert isinstance(target.backend, NativeLlama)
    layer = load_layer(tmp_path / "out", target.base_fingerprint, 259, 64)
    assert torch.equal(layer.inv_freq, target.backend.inv_freq)  # the target's scaled frequencies
    assert not torch.equal(layer.inv_freq, rope_frequencies(replace(config, rope_parameters=None))[0])
    expected = plain(target, PROMPTS, 32)
    for tree in ("chain", "dynamic"):
        engine = load(loaded=target, drafter="eagle3", tree=tree, heads=str(tmp_path / "out"), calibrate=False,
                      fallback=False, compile=False)  # fmt: skip
        assert [engine.generate(prompt, max_new_tokens=32).token_ids for prompt in PROMPTS] == expected


def test_a_target_rope_the_layer_cannot_take_is_refused_before_any_data_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Dynamic NTK rope changes its frequencies with the sequence length (and vLLM runs it otherwise than
    transformers): such a target is refused at once, not after the data generation (hours at the default
    --tokens); a layer config naming such a rope is refused too."""
    from tests.tiny import save_tiny_llama

    model = save_tiny_llama(tmp_path / "dynamic-rope", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat\n" * 20)
    code = main(["train-heads", "--model", str(model), "--prompts", str(prompts), "--heads", "eagle3",
                 "--tokens", "400", "--dtype", "float32", "--work", str(tmp_path / "work"),
                 "--out", str(tmp_path / "out")])  # fmt: skip
    assert code == 2 and "linear, llama3, yarn ropes, not 'dynamic'" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()
    tiny = load_model(str(save_tiny_llama(tmp_path / "plain")), "native", "float32")
    with pytest.raises(CausalDraftError, match="not 'longrope'"):
        replace(eagle3_config(tiny, 64), rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0})


def test_train_heads_cli_trains_eagle3_and_continues_from_init(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """train-heads --heads eagle3 end to end on the tiny model; --init DIR continues from a trained
    layer (its own checkpoint, the same draft vocabulary) and records where it started; --data-seed
    answers the prompts in another order, in a data folder of its own."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"{word} {index}" for index in range(24) for word in ["the cat"]) + "\n")
    common = ["train-heads", "--model", str(tiny_llama_dir), "--prompts", str(prompts), "--heads", "eagle3",
              "--draft-vocab", "128", "--tokens", "400", "--max-new-tokens", "16", "--ttt-steps", "2",
              "--rows-per-batch", "64", "--context", "8", "--dtype", "float32",
              "--work", str(tmp_path / "work")]  # fmt: skip
    assert main([*common, "--epochs", "2", "--out", str(tmp_path / "first")]) == 0
    first, first_record = read_config(tmp_path / "first")
    assert first.aux_layers == default_aux_layers(tiny_llama_config_layers(tiny_llama_dir))
    calibration = first_record["training"]["calibration"]  # type: ignore[index]
    assert calibration["rows"] > 0 and len(calibration["sampling_agreement"]) == len(SAMPLING_SCALES)
    assert first.score_temperature == calibration["score_temperature"] in SCORE_TEMPERATURES
    assert first.sampling_temperature_scale == calibration["sampling_temperature_scale"] in SAMPLING_SCALES
    assert first.noise_score_temperature == calibration["noise_score_temperature"] in NOISE_SCORE_TEMPERATURES
    assert len(calibration["noise_score_loss"]) == len(NOISE_SCORE_TEMPERATURES)
    second_run = ["--epochs", "1", "--data-seed", "1", "--init", str(tmp_path / "first"),
                  "--out", str(tmp_path / "second")]  # fmt: skip
    assert main([*common, *second_run]) == 0
    second, record = read_config(tmp_path / "second")
    orders = [
        [seq.tokens[: seq.prompt_length].tolist() for seq in load_sequences(tmp_path / "work" / name)]
        for name in ("eagle3-data", "eagle3-data-seed1")
    ]
    assert orders[0] != orders[1]  # another order of the prompts
    assert record["training"]["init"] == str(tmp_path / "first")  # type: ignore[index]
    assert record["training"]["init_training"] == first_record["training"]  # type: ignore[index]
    tensors = [load_file(str(tmp_path / name / WEIGHTS_FILE)) for name in ("first", "second")]
    assert torch.equal(tensors[0]["vocab_ids"], tensors[1]["vocab_ids"])
    assert not torch.equal(tensors[0]["fc.weight"], tensors[1]["fc.weight"])  # it trained on
    checkpoints = sorted(path.name for path in (tmp_path / "work").glob("ckpt-eagle3-*.pt"))
    assert len(checkpoints) == 2 and any("-init" in name for name in checkpoints)
    third_run = ["--epochs", "0.5", "--draft-vocab", "160", "--init", str(tmp_path / "second"),
                 "--out", str(tmp_path / "third")]  # fmt: skip
    assert main([*common, *third_run]) == 0  # a larger --draft-vocab than the init's grows it
    third = load_file(str(tmp_path / "third" / WEIGHTS_FILE))
    assert third["vocab_ids"].numel() == 160 == read_config(tmp_path / "third")[0].draft_vocab
    assert bool(torch.isin(tensors[1]["vocab_ids"], third["vocab_ids"]).all())
    shrink = [*common, "--epochs", "0.5", "--init", str(tmp_path / "third"), "--out", str(tmp_path / "fourth")]
    assert main([*shrink, "--draft-vocab", "100"]) != 0  # the later --draft-vocab wins
    assert "can only grow" in capsys.readouterr().err and not (tmp_path / "fourth").exists()
    assert main([*common[:6], "markov", "--init", str(tmp_path / "first"), "--out", str(tmp_path / "m")]) != 0
    assert "--init applies to --heads eagle3 only" in capsys.readouterr().err


def tiny_llama_config_layers(directory: Path) -> int:
    return int(json.loads((directory / "config.json").read_text())["num_hidden_layers"])


def test_calibrate_script_refits_a_layer_in_place(tiny_llama_dir: Path, tiny: LoadedModel, tmp_path: Path) -> None:
    """bench/calibrate_eagle3.py generates fresh responses, fits the three temperatures and, with
    --write, stores them (and the fit) in the layer's config; the weights are untouched."""
    directory = layer_dir(tiny, tmp_path / "eagle3")
    weights = (directory / WEIGHTS_FILE).read_bytes()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"the cat {index}" for index in range(30)) + "\n")
    script = Path(__file__).resolve().parent.parent / "bench" / "calibrate_eagle3.py"
    command = [sys.executable, str(script), "--model", str(tiny_llama_dir), "--dtype", "float32", "--heads",
               str(directory), "--prompts", str(prompts), "--tokens", "300", "--steps", "2", "--context", "8",
               "--work", str(tmp_path / "work"), "--write"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    config, record = read_config(directory)
    refit = record["training"]["recalibration"]  # type: ignore[index]
    assert refit["rows"] > 0 and refit["response_tokens"] >= 300
    assert config.noise_score_temperature == refit["noise_score_temperature"] in NOISE_SCORE_TEMPERATURES
    assert config.score_temperature == refit["score_temperature"] in SCORE_TEMPERATURES
    assert config.sampling_temperature_scale == refit["sampling_temperature_scale"] in SAMPLING_SCALES
    assert (directory / WEIGHTS_FILE).read_bytes() == weights
    missing = [*command[:7], str(tmp_path / "absent"), *command[8:]]  # --heads names no layer
    done = subprocess.run(missing, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1 and "calibrate_eagle3: no eagle3 drafter in" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_widened_vocabulary_keeps_the_trained_rows_and_starts_new_ones_from_the_target(tiny: LoadedModel) -> None:
    layer = random_layer(tiny, draft_vocab=100)
    lm_head = tiny.backend.lm_head_weight()
    extra = torch.tensor([index for index in range(259) if index not in set(layer.vocab_ids.tolist())][:30])
    wider = widen_vocabulary(layer, extra[torch.randperm(30)], lm_head)
    assert wider.config.draft_vocab == 130 and bool((wider.vocab_ids.diff() > 0).all())
    assert set(wider.vocab_ids.tolist()) == set(layer.vocab_ids.tolist()) | set(extra.tolist())
    out = torch.randn(5, layer.config.hidden_size)
    old, new = layer.logits(out), wider.logits(out)  # [5, 100], [5, 130]
    kept = torch.isin(wider.vocab_ids, layer.vocab_ids)
    torch.testing.assert_close(new[:, kept], old)  # the trained rows, in the same order
    torch.testing.assert_close(wider.lm_head.weight[~kept], lm_head.float()[wider.vocab_ids[~kept]])
    for name in ("fc.weight", "qkv_proj.weight", "norm.weight"):
        assert torch.equal(wider.state_dict()[name], layer.state_dict()[name])
    with pytest.raises(CausalDraftError, match="new and distinct"):
        widen_vocabulary(layer, layer.vocab_ids[:2], lm_head)


def test_a_vocabulary_grows_by_the_most_frequent_ids_it_lacks(generated: Path) -> None:
    sequences = load_sequences(generated)
    ranked = draft_vocabulary(sequences, 259, 259)
    small = draft_vocabulary(sequences, 259, 20)
    extra = grown_vocabulary(small, sequences, 259, 50)
    assert extra.numel() == 30 and not bool(torch.isin(extra, small).any())
    counts = token_counts(sequences, 259)
    chosen = torch.zeros(259, dtype=torch.bool)
    chosen[small], chosen[extra] = True, True
    assert float(counts[extra].min()) >= float(counts[~chosen].max())  # no id left out is more frequent
    assert ranked.numel() == 259 and grown_vocabulary(small, sequences, 259, 10).numel() == 0
