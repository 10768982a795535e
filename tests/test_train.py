"""train-heads on the tiny model: data formats, feature layout, loss falls, evaluation, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from causaldraft.api import load
from causaldraft.cli import main
from causaldraft.drafters.heads import HeadsConfig, load_heads, new_heads
from causaldraft.errors import CausalDraftError
from causaldraft.models.loading import load_model
from causaldraft.train.data import encode_prompts, mix_prompts, read_prompts
from causaldraft.train.evaluate import evaluate
from causaldraft.train.feature_data import shard_answers
from causaldraft.train.features import (
    LAST_ROW_LOGPROB,
    answer_features,
    draft_vocabulary,
    sequence_features,
    split_features,
)
from causaldraft.train.trainer import TrainConfig, train
from tests.tiny import byte_tokenizer

WORDS = ["the cat sat", "hello world", "abc abc", "one two three", "red green blue", "up down", "yes no"]


def write_prompts(directory: Path) -> Path:
    path = directory / "prompts.txt"
    path.write_text("\n".join(f"{a} and {b}" for a in WORDS for b in WORDS[:4]) + "\n")
    return path


@pytest.fixture(scope="module")
def trained(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One CLI run per head kind over a shared work directory (the data is generated once)."""
    root = tmp_path_factory.mktemp("train")
    prompts = write_prompts(root)
    outputs = {}
    for kind in ("markov", "medusa"):
        code = main(["train-heads", "--model", str(tiny_llama_dir), "--prompts", str(prompts), "--heads", kind,
                     "--num-heads", "3", "--draft-vocab", "160", "--tokens", "1200", "--max-new-tokens", "48",
                     "--gen-batch-size", "8", "--steps", "40", "--batch-size", "128", "--dtype", "float32",
                     "--work", str(root / "work"), "--out", str(root / kind)])  # fmt: skip
        assert code == 0
        outputs[kind] = root / kind
    outputs["work"] = root / "work"
    return outputs


def test_a_tokenizer_without_a_chat_template_trains_on_the_prompts_as_plain_text(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A base model has no chat template: its prompts are encoded as ``generate`` without --chat encodes
    them (this once raised transformers' ValueError from inside train-heads)."""
    tokenizer = byte_tokenizer()
    templated = encode_prompts(tokenizer, ["hi there"], 64)
    tokenizer.chat_template = None
    assert encode_prompts(tokenizer, ["hi there", "x" * 100], 64) == [
        tokenizer.encode("hi there", add_special_tokens=False)
    ]
    assert templated[0] != tokenizer.encode("hi there", add_special_tokens=False)
    assert "no chat template" in capsys.readouterr().err


def test_prompt_formats(tmp_path: Path) -> None:
    sharegpt = tmp_path / "a.json"
    first = {"conversations": [{"from": "human", "value": " hi "}, {"from": "gpt", "value": "x"}]}
    sharegpt.write_text(json.dumps([first, {"conversations": [{"from": "gpt", "value": "only gpt"}]}]))
    questions = tmp_path / "b.jsonl"
    questions.write_text('{"question": "q1"}\n{"turns": ["t1", "t2"]}\n')
    assert read_prompts(sharegpt) == ["hi"]
    assert read_prompts(questions) == ["q1", "t1"]
    assert mix_prompts([sharegpt, questions], seed=0)[0] == "hi"
    bad = tmp_path / "c.jsonl"
    bad.write_text("{broken\n")
    with pytest.raises(CausalDraftError, match="cannot read prompts"):
        read_prompts(bad)
    with pytest.raises(CausalDraftError, match="does not exist"):
        read_prompts(tmp_path / "none.json")
    keys = tmp_path / "d.jsonl"
    keys.write_text('{"question": "q1"}\n{"prompt": "p"}\n')  # found by an audit: the error named only 'turns'
    with pytest.raises(CausalDraftError, match='line 2 is not an object with a "question"'):
        read_prompts(keys)


@pytest.mark.parametrize("kind", ["markov", "eagle3"])
def test_too_few_prompts_are_refused_before_any_data_is_made(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """Found by an audit: with fewer answers than the evaluation's stride (every 20th is held out) training
    generated all its data, then failed in torch.cat."""
    prompts = tmp_path / "few.txt"
    prompts.write_text("".join(f"question {index}?\n" for index in range(8)))
    code = main(["train-heads", "--model", str(tiny_llama_dir), "--prompts", str(prompts), "--heads", kind,
                 "--tokens", "200", "--max-new-tokens", "8", "--dtype", "float32", "--work", str(tmp_path / "work"),
                 "--out", str(tmp_path / "out")])  # fmt: skip
    assert code == 2
    assert "8 prompts in the prompt files" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


def test_a_work_folder_refuses_data_of_another_model_or_other_prompts(
    trained: dict[str, Path], tiny_llama_dir: Path, tiny_qwen_dir: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """Rerunning train-heads on the fixture's --work with another model, other prompts, longer answers or
    another dtype is refused before anything is generated or trained: it once resumed the old data and
    stamped heads trained on one model with another's fingerprint. The answers depend on the dtype they
    were generated in, which the load's fingerprint says."""
    other_prompts = tmp_path / "other.txt"
    other_prompts.write_text("".join(f"a prompt the fixture never saw, number {index}\n" for index in range(20)))
    base = {"--model": str(tiny_llama_dir), "--prompts": str(write_prompts(tmp_path)), "--max-new-tokens": "48",
            "--dtype": "float32"}  # fmt: skip
    changes = [({"--model": str(tiny_qwen_dir)}, "fingerprint"), ({"--prompts": str(other_prompts)}, "prompts"),
               ({"--max-new-tokens": "64"}, "max_new_tokens"), ({"--dtype": "bfloat16"}, "fingerprint")]  # fmt: skip
    for change, named in changes:
        flags = [item for pair in {**base, **change}.items() for item in pair]
        code = main(["train-heads", *flags, "--heads", "markov", "--num-heads", "3", "--draft-vocab", "160",
                     "--tokens", "1200", "--gen-batch-size", "8", "--steps", "40", "--batch-size", "128",
                     "--work", str(trained["work"]), "--out", str(tmp_path / "heads")])  # fmt: skip
        assert code == 2, change
        error = capsys.readouterr().err
        assert "holds data made differently" in error and named in error, error
        assert not (tmp_path / "heads").exists()


def test_a_rerun_at_another_learning_rate_trains_instead_of_reloading_the_finished_run(
    trained: dict[str, Path], tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fixture's markov run again on its --work at another --lr: the training checkpoint is another one,
    so it trains (the finished checkpoint of the fixture's run was once reloaded, and its loss reported)."""
    capsys.readouterr()
    flags = ["train-heads", "--model", str(tiny_llama_dir), "--prompts", str(write_prompts(tmp_path)), "--heads",
             "markov", "--num-heads", "3", "--draft-vocab", "160", "--tokens", "1200", "--max-new-tokens", "48",
             "--gen-batch-size", "8", "--steps", "40", "--batch-size", "128", "--dtype", "float32",
             "--work", str(trained["work"])]  # fmt: skip
    assert main([*flags, "--lr", "0.01", "--out", str(tmp_path / "other-lr")]) == 0
    summary = json.loads(capsys.readouterr().out)
    first = json.loads((trained["markov"] / "heads_config.json").read_text())["training"]
    assert summary["first_loss"] == pytest.approx(first["first_loss"])  # the same start (same seed and data)
    assert summary["last_loss"] != pytest.approx(first["last_loss"]) and summary["seconds_this_run"]["train_s"] > 0
    assert len(list(trained["work"].glob("ckpt-markov-*.pt"))) == 2


def test_feature_segments_follow_the_documented_layout(trained: dict[str, Path], tiny_llama_dir: Path) -> None:
    """The rows kept while generating are what one pass over each whole answer computes (``sequence_features``):
    the same tokens and top-k, the same hidden states up to bf16 rounding; the last row is the documented
    placeholder."""
    work = trained["work"]
    answers = [answer for path in sorted((work / "heads-data").glob("shard_*.pt")) for answer in shard_answers(path)]
    tiny = load_model(str(tiny_llama_dir), "native", "float32")
    features = answer_features(work / "heads-data")
    assert features.segments == len(answers) and features.hidden.dtype == torch.bfloat16
    start = 0
    for prompt, response in answers[:6]:
        end = int(features.ends[start])
        assert end - start == len(response)
        assert features.tokens[start : end + 1].tolist() == prompt[-1:] + response
        # each row's top-1 is the target's greedy next token (the response was generated greedily)
        assert features.topk_ids[start:end, 0].tolist() == response
        with torch.inference_mode():
            whole = sequence_features(tiny.backend, prompt, response, features.topk_ids.shape[1])
        assert torch.equal(features.topk_ids[start:end], whole["topk_ids"][:-1].long())
        torch.testing.assert_close(features.topk_logprobs[start:end], whole["topk_logprobs"][:-1].float(),
                                   atol=2e-3, rtol=1e-3)  # fmt: skip
        torch.testing.assert_close(features.hidden[start:end].float(), whole["hidden"][:-1].float(), atol=0.02,
                                   rtol=0.02)  # fmt: skip
        assert not features.hidden[end].any() and (features.topk_logprobs[end] == LAST_ROW_LOGPROB).all()
        start = end + 1


def test_training_reduces_the_loss_and_evaluates(trained: dict[str, Path], tiny_llama_dir: Path) -> None:
    tiny = load_model(str(tiny_llama_dir), "native", "float32")
    features = answer_features(trained["work"] / "heads-data")
    train_set, eval_set = split_features(features, eval_every=5)
    assert train_set.tokens.numel() + eval_set.tokens.numel() == features.tokens.numel()
    shape = tiny.backend.shape
    vocab_ids = draft_vocabulary(train_set, shape.vocab_size, 128)
    embed = tiny.backend.embed(torch.arange(shape.vocab_size)).detach().float()
    for kind in ("markov", "medusa"):
        config = HeadsConfig(kind, 3, shape.hidden_size, shape.vocab_size, 128, tiny.base_fingerprint)
        heads = new_heads(config, vocab_ids, tiny.backend.lm_head_weight())
        before = evaluate(heads, eval_set, embed)
        history = train(heads, train_set, embed, TrainConfig(steps=60, batch_size=128, warmup=5))
        after = evaluate(heads, eval_set, embed)
        assert sum(history[-10:]) / 10 < 0.95 * history[0]
        assert after.top1[0] > before.top1[0]
        assert all(0.0 <= value <= 1.0 for value in after.top1 + after.top5)
        assert after.top5[0] >= after.top1[0]


def test_checkpoint_resume_matches_one_run(trained: dict[str, Path], tiny_llama_dir: Path, tmp_path: Path) -> None:
    tiny = load_model(str(tiny_llama_dir), "native", "float32")
    features = answer_features(trained["work"] / "heads-data")
    shape = tiny.backend.shape
    vocab_ids = draft_vocabulary(features, shape.vocab_size, 128)
    embed = tiny.backend.embed(torch.arange(shape.vocab_size)).detach().float()
    config = HeadsConfig("markov", 2, shape.hidden_size, shape.vocab_size, 128, tiny.base_fingerprint)
    straight = new_heads(config, vocab_ids, tiny.backend.lm_head_weight())
    full = train(straight, features, embed, TrainConfig(steps=8, batch_size=32, autocast=False))
    resumed = new_heads(config, vocab_ids, tiny.backend.lm_head_weight())
    checkpoint = tmp_path / "ckpt.pt"
    train(resumed, features, embed, TrainConfig(steps=4, batch_size=32, autocast=False, checkpoint_every=4), checkpoint)
    state = torch.load(checkpoint, weights_only=False)
    state["step"] = 4
    again = new_heads(config, vocab_ids, tiny.backend.lm_head_weight())
    history = train(again, features, embed, TrainConfig(steps=8, batch_size=32, autocast=False), checkpoint)
    assert history == pytest.approx(full, rel=1e-5)


@pytest.mark.parametrize("kind", ["markov", "medusa"])
@pytest.mark.parametrize("tree", ["chain", "static", "dynamic"])
def test_trained_heads_keep_greedy_output(trained: dict[str, Path], tiny_llama_dir: Path, kind: str, tree: str) -> None:
    tiny = load_model(str(tiny_llama_dir), "native", "float32")
    config = json.loads((trained[kind] / "heads_config.json").read_text())
    assert config["fingerprint"] == tiny.base_fingerprint and config["training"]["steps"] == 40
    plain = load(loaded=tiny, drafter="none", calibrate=False, compile=False)
    engine = load(loaded=tiny, drafter=kind, tree=tree, heads=str(trained[kind]), lookup_merge=False,
                  calibrate=False, fallback=False, compile=False)  # fmt: skip
    for prompt in ("the cat sat and up down", "yes no and hello world"):
        expected = plain.generate(prompt, max_new_tokens=40).token_ids
        result = engine.generate(prompt, max_new_tokens=40)
        assert result.token_ids == expected
    heads = load_heads(trained[kind], tiny, kind)
    assert heads.config.num_heads == 3


def test_an_out_or_work_path_that_is_a_file_is_refused_first(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    for flag in ("--out", "--work"):
        paths = {"--out": str(tmp_path / "out"), "--work": str(tmp_path / "work"), flag: str(afile)}
        code = main(["train-heads", "--model", str(tiny_llama_dir), "--prompts", str(write_prompts(tmp_path)),
                     *(item for pair in paths.items() for item in pair)])  # fmt: skip
        assert code == 2 and f"{flag} {afile} is a file" in capsys.readouterr().err
        assert not (tmp_path / "work").exists()


def test_flags_of_the_other_drafter_kind_are_refused_and_explicit_values_are_kept(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--steps given to eagle3 or --epochs to markov heads was silently unused; an explicit --lr 0.002,
    --gen-batch-size 32 or --threads 1 for eagle3 was replaced by its defaults because it equalled the heads'."""
    from causaldraft.train import cli as train_cli

    base = ["train-heads", "--model", str(tiny_llama_dir), "--prompts", str(write_prompts(tmp_path)),
            "--out", str(tmp_path / "out")]  # fmt: skip
    for kind, extra, named in (("eagle3", ["--steps", "5", "--num-heads", "2"], "--num-heads, --steps apply to "
                               "--heads markov/medusa only"), ("markov", ["--epochs", "1"], "--epochs applies to "
                               "--heads eagle3 only")):  # fmt: skip
        assert main([*base, "--heads", kind, *extra]) == 2
        assert named in capsys.readouterr().err
    recipes: list[object] = []
    monkeypatch.setattr(train_cli, "run_eagle3_recipe", lambda recipe: recipes.append(recipe) or {})
    explicit = ["--lr", "0.002", "--gen-batch-size", "32", "--threads", "1"]
    assert main([*base, "--heads", "eagle3", *explicit]) == 0
    assert main([*base, "--heads", "eagle3"]) == 0
    chosen, default = recipes
    assert (chosen.training.lr, chosen.generation.batch_size, chosen.generation.threads) == (0.002, 32, 1)  # type: ignore[attr-defined]
    assert default.training.lr == 1e-3 and default.generation.batch_size == 48  # type: ignore[attr-defined]


def test_answers_without_hidden_states_are_refused(tmp_path: Path) -> None:
    (tmp_path / "meta.json").write_text(json.dumps({"fingerprint": "x", "aux_layers": [], "top_k": 16}))
    with pytest.raises(CausalDraftError, match="keeps no hidden states"):
        answer_features(tmp_path)
    (tmp_path / "meta.json").write_text(json.dumps({"hidden": True}))
    with pytest.raises(CausalDraftError, match="no generated data"):
        answer_features(tmp_path)


def test_a_generation_batch_under_six_rows_trains(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by an audit: --gen-batch-size under 6 (the refill threshold, not an option) was refused. And when the
    prompts run out before --tokens, a line says so (only the progress bar did)."""
    code = main(["train-heads", "--model", str(tiny_llama_dir), "--prompts", str(write_prompts(tmp_path)), "--heads",
                 "markov", "--num-heads", "2", "--draft-vocab", "160", "--tokens", "100000", "--max-new-tokens", "8",
                 "--gen-batch-size", "3", "--steps", "4", "--batch-size", "32", "--dtype", "float32",
                 "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")])  # fmt: skip
    assert code == 0
    assert "the prompts ran out at" in capsys.readouterr().err
