"""``causaldraft chat``: each turn answers the whole conversation as ``Engine.generate`` does, copies the
earlier whole chunks of it (kept prompt prefixes), resets and survives a turn the engine refuses."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from causaldraft.api import load
from causaldraft.chat import chat_loop
from causaldraft.cli import main
from causaldraft.decode import PROMPT_CHUNK

LONG = "tell me about the quick brown fox that jumps over the lazy dog, " * 5  # 320 byte tokens


def test_each_turn_is_the_whole_conversation_s_generation(tiny_llama_dir: Path) -> None:
    engine = load(model=str(tiny_llama_dir), dtype="float32", drafter="lookup", calibrate=False, compile=False)
    reference = load(model=str(tiny_llama_dir), dtype="float32", drafter="none", calibrate=False, compile=False,
                     prefix_cache_mb=0)  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    options = {"max_new_tokens": 6}
    lines = [LONG + "\n", "\n", "and then?\n", "/reset\n", "hi\n", "/exit\n", "never read\n"]
    messages = chat_loop(engine, lines, out, err, "be brief", options)
    system = {"role": "system", "content": "be brief"}
    first = reference.generate([system, {"role": "user", "content": LONG}], **options).text
    history = [system, {"role": "user", "content": LONG}, {"role": "assistant", "content": first}]
    second = reference.generate([*history, {"role": "user", "content": "and then?"}], **options).text
    third = reference.generate([system, {"role": "user", "content": "hi"}], **options).text
    assert out.getvalue() == f"{first}\n{second}\n{third}\n"
    assert messages == [system, {"role": "user", "content": "hi"}, {"role": "assistant", "content": third}]
    stats = [line for line in err.getvalue().splitlines() if line.startswith("[")]
    assert len(stats) == 3 and "(a new conversation)" in err.getvalue()
    assert stats[0].endswith(" 0 copied]") and stats[1].endswith(f" {PROMPT_CHUNK} copied]")


def test_a_refused_turn_is_reported_and_left_out(tiny_llama_dir: Path) -> None:
    engine = load(model=str(tiny_llama_dir), dtype="float32", drafter="none", calibrate=False, compile=False)
    out, err = io.StringIO(), io.StringIO()
    messages = chat_loop(engine, ["x" * 600, "hello"], out, err, None, {"max_new_tokens": 4})
    assert "exceeds the model's context" in err.getvalue() and "/reset" in err.getvalue()
    assert [message["content"] for message in messages if message["role"] == "user"] == ["hello"]


def test_the_command_reads_stdin_and_refuses_bad_options_before_loading(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["chat", "--model", str(tiny_llama_dir), "--dtype", "float32", "--no-compile", "--drafter", "lookup"]
    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\n"))
    assert main([*flags, "--max-new-tokens", "5"]) == 0
    captured = capsys.readouterr()
    engine = load(model=str(tiny_llama_dir), dtype="float32", drafter="none", calibrate=False, compile=False)
    expected = engine.generate([{"role": "user", "content": "hello there"}], max_new_tokens=5).text
    assert captured.out == expected + "\n" and "tokens/s" in captured.err
    assert main([*flags, "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
