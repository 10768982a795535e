"""The CLI contract: JSON output, streaming, show-tree, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from causaldraft.cli import main
from causaldraft.errors import CausalDraftError


def test_generate_json_contract(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", "--no-compile", "--prompt", "hello world hello world", "--model", str(tiny_llama_dir),
                 "--dtype", "float32", "--max-new-tokens", "12", "--json", "--drafter", "lookup"])  # fmt: skip
    assert code == 0
    payload = json.loads(capsys.readouterr().out)
    assert set(payload) >= {"text", "token_ids", "stats"}
    assert len(payload["token_ids"]) == 12
    assert set(payload["stats"]) >= {"new_tokens", "target_forwards", "mean_accepted", "wall_s", "tokens_per_s"}
    assert payload["stats"]["new_tokens"] == 12 and payload["stats"]["drafter"] == "lookup"
    assert payload["stats"]["mean_accepted"] == pytest.approx(12 / payload["stats"]["target_forwards"], abs=1e-3)


def test_generate_json_carries_logprobs_when_asked(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["generate", "--no-compile", "--prompt", "abcabc", "--model", str(tiny_llama_dir), "--dtype", "int4",
              "--max-new-tokens", "10", "--json", "--drafter", "lookup"]  # fmt: skip
    assert main([*common, "--logprobs", "2"]) == 0
    payload = json.loads(capsys.readouterr().out)
    entries = payload["logprobs"]
    assert [entry["token_id"] for entry in entries] == payload["token_ids"]
    assert all(len(entry["top"]) == 2 and entry["top"][0]["token_id"] == entry["token_id"] for entry in entries)
    assert all(entry["logprob"] == entry["top"][0]["logprob"] <= 0 for entry in entries)  # greedy: the likeliest
    assert all(entry["rank"] == 1 for entry in entries)
    assert main([*common, "--prompt-logprobs", "1"]) == 0
    scored = json.loads(capsys.readouterr().out)["prompt_logprobs"]
    assert [entry["token"] for entry in scored] == list("bcabc")  # the byte tokenizer: a token per character
    assert all(len(entry["top"]) == 1 and entry["logprob"] <= entry["top"][0]["logprob"] for entry in scored)
    assert main(common) == 0
    assert not {"logprobs", "prompt_logprobs"} & set(json.loads(capsys.readouterr().out))


def test_generate_takes_the_penalties(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from causaldraft.api import load

    common = ["generate", "--no-compile", "--prompt", "abcabc", "--model", str(tiny_llama_dir), "--dtype", "int4",
              "--max-new-tokens", "16", "--json", "--drafter", "lookup"]  # fmt: skip
    assert main([*common, "--frequency-penalty", "1.5", "--repetition-penalty", "1.3", "--logit-bias", "100=2.5",
                 "--logit-bias", "120=-3"]) == 0  # fmt: skip
    penalized = json.loads(capsys.readouterr().out)["token_ids"]
    engine = load(model=str(tiny_llama_dir), dtype="int4", drafter="none", compile=False, calibrate=False)
    assert penalized == engine.generate("abcabc", max_new_tokens=16, frequency_penalty=1.5, repetition_penalty=1.3,
                                        logit_bias={100: 2.5, 120: -3.0}).token_ids  # fmt: skip
    assert penalized != engine.generate("abcabc", max_new_tokens=16).token_ids
    stop = engine.generate("abcabc", max_new_tokens=16).token_ids[5]
    assert main([*common, "--stop-token-id", str(stop), "--min-tokens", "3", "--ignore-eos"]) == 0
    payload = json.loads(capsys.readouterr().out)
    expected = engine.generate("abcabc", max_new_tokens=16, stop_token_ids=[stop], min_tokens=3, ignore_eos=True)
    assert payload["token_ids"] == expected.token_ids and payload["finish_reason"] == expected.finish_reason


def test_generate_stream_prints_the_same_text(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["generate", "--no-compile", "--prompt", "abcabc", "--model", str(tiny_llama_dir), "--dtype", "float32",
              "--max-new-tokens", "10"]  # fmt: skip
    assert main([*common, "--json"]) == 0
    text = json.loads(capsys.readouterr().out)["text"]
    assert main([*common, "--stream"]) == 0
    assert capsys.readouterr().out == text + "\n"


def test_chat_flag_applies_the_template(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--no-compile", "--prompt", "hi", "--chat", "--model", str(tiny_llama_dir),
                 "--dtype", "float32", "--max-new-tokens", "3", "--json"]) == 0  # fmt: skip
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 3


def test_show_tree_prints_tree_mask_and_png(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "mask.png"
    assert main(["show-tree", "--no-compile", "--prompt", "hello world hello world", "--model", str(tiny_llama_dir),
                 "--dtype", "float32", "--drafter", "draft", "--draft-layers", "2", "--tree", "static",
                 "--png", str(png)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "attention mask" in out and "[0]" in out and "paths" in out
    assert png.stat().st_size > 1000
    nowhere = tmp_path / "no-folder" / "mask.png"
    assert main(["show-tree", "--prompt", "hi", "--model", str(tmp_path / "no-model"), "--png", str(nowhere)]) == 2
    assert f"the folder {nowhere.parent} does not exist" in capsys.readouterr().err  # before the model loads
    for nodes in ("500", "0"):  # once timed up to 64 rows without a word, or took 0 as the default
        assert main(["compile", "--model", str(tmp_path / "no-model"), "--max-nodes", nodes]) == 2
        assert f"max_nodes must be in [2, 256], got {nodes}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--temperature", "-1"], "temperature"), (["--max-new-tokens", "0"], "max_new_tokens"),
     (["--drafter", "oracle"], "unknown drafter"), (["--top-p", "2"], "top_p")],
)  # fmt: skip
def test_bad_input_is_one_clear_line(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    code = main(
        ["generate", "--no-compile", "--prompt", "x", "--model", str(tiny_llama_dir), "--dtype", "float32", *extra]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--top-p", "2"], "top_p"), (["--max-new-tokens", "0"], "max_new_tokens"),
     (["--temperature", "nan"], "temperature"), (["--top-k", "-1"], "top_k"),
     (["--json", "--logprobs", "21"], "logprobs"), (["--logprobs", "2"], "add --json"),
     (["--json", "--prompt-logprobs", "-1"], "prompt_logprobs"), (["--prompt-logprobs", "0"], "add --json"),
     (["--repetition-penalty", "0"], "repetition_penalty"), (["--presence-penalty", "3"], "presence_penalty"),
     (["--logit-bias", "5=101"], "logit_bias"), (["--min-tokens", "-2"], "min_tokens")],
)  # fmt: skip
def test_bad_request_values_are_refused_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    """The model path does not exist: the request's own error comes first, so no model was looked for."""
    code = main(["generate", "--prompt", "x", "--model", str(tmp_path / "missing"), *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and "does not exist" not in err


def test_missing_model_from_a_real_process_is_one_line(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "causaldraft.cli", "generate", "--prompt", "x", "--model",
                             str(tmp_path / "missing")], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("causaldraft: error:")
    assert "Traceback" not in result.stderr


def test_engine_config_round_trips_through_its_flags() -> None:
    """The bench's reproducing command is derived from the config: parsing its flags rebuilds it."""
    from causaldraft.cli import build_parser
    from causaldraft.config import EngineConfig
    from causaldraft.flags import engine_config

    config = EngineConfig(model="m", dtype="int4", compile=True, drafter="markov", tree="static", depth=3,
                          max_nodes=12, sampler="rejection", adapt=False, draft_layers=2, heads="h",
                          lookup_merge=False)  # fmt: skip
    args = build_parser().parse_args(["generate", "--prompt", "x", "--drafter", "markov", "--tree", "static",
                                      *config.flags()])  # fmt: skip
    assert engine_config(args) == config
    assert EngineConfig(tree="chain").tree_config.depth == 6 and EngineConfig().tree_config.depth == 8
    assert EngineConfig(tree="static").tree_config.depth == 5
    with pytest.raises(CausalDraftError):
        EngineConfig(depth=0)


def test_stop_strings_from_the_shell_read_escapes() -> None:
    """``--stop "\\n\\n"`` reaches the program as backslashes and n's: it means two newlines (the README's example
    once never stopped); ``\\\\`` keeps a backslash."""
    from causaldraft.cli import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "x", "--stop", r"\n\n", "--stop", r"a\tb\\n\x"])
    assert args.stop == ["\n\n", "a\tb\\n\\x"]


def test_stream_and_json_are_one_or_the_other(capsys: pytest.CaptureFixture[str]) -> None:
    from causaldraft.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--stream", "--json"])
    assert "not allowed with argument" in capsys.readouterr().err
    commands = (["generate", "--prompt", "x"], ["serve"], ["bench", "--prompts", "p", "--methods", "ar"])
    for command in commands:  # a store and no store: once the store was silently dropped
        with pytest.raises(SystemExit):
            build_parser().parse_args([*command, "--store", "s", "--no-store"])
        assert "not allowed with argument --store" in capsys.readouterr().err
