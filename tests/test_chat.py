"""``causaldraft chat``: each turn answers the whole conversation as ``Engine.generate`` does, copies the
earlier whole chunks of it (kept prompt prefixes), resets and survives a turn the engine refuses."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from causaldraft.api import load
from causaldraft.chat import chat_loop
from causaldraft.cli import main
from causaldraft.decode import PROMPT_CHUNK
from causaldraft.errors import CausalDraftError

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


def test_chat_template_kwargs_reach_the_template(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's ``chat_template_kwargs`` (Qwen3's ``enable_thinking``): the template renders with them, in ``encode``,
    a request and the CLI; what cannot be a template variable, or a prompt the template does not render, is
    refused; a template's own refusal is a CausalDraftError."""
    engine = load(model=str(tiny_llama_dir), dtype="float32", drafter="lookup", calibrate=False, compile=False)
    messages = [{"role": "user", "content": "hi"}]
    thinking_off = {"enable_thinking": False}
    plain, switched = engine.encode(messages), engine.encode(messages, chat_template_kwargs=thinking_off)
    assert switched == plain + engine.encode("<think></think>")
    assert engine.encode("hi", chat=True, chat_template_kwargs=thinking_off) == switched
    assert engine.encode(messages, chat_template_kwargs={"enable_thinking": True}) == plain
    expected = engine.generate(switched, max_new_tokens=8).token_ids
    assert engine.generate(messages, max_new_tokens=8, chat_template_kwargs=thinking_off).token_ids == expected
    assert main(["generate", "--no-compile", "--prompt", "hi", "--chat", "--model", str(tiny_llama_dir),
                 "--dtype", "float32", "--max-new-tokens", "8", "--json",
                 "--chat-template-kwargs", '{"enable_thinking": false}']) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["token_ids"] == expected
    for prompt, options, message in [
        (messages, {"chat_template_kwargs": {"tokenize": True}}, "cannot set 'tokenize'"),
        (messages, {"chat_template_kwargs": {"messages": []}}, "cannot set 'messages'"),  # the render call's own
        (messages, {"chat_template_kwargs": ["enable_thinking"]}, "must be a dict"),
        (messages, {"chat_template_kwargs": {"not a name": 1}}, "must be a dict"),
        ("hi", {"chat_template_kwargs": thinking_off}, "rendered by the chat template"),
        ([5, 6], {"chat_template_kwargs": thinking_off}, "rendered by the chat template"),
        ([{"role": "wizard", "content": "hi"}], {}, "refused these messages: unknown role wizard"),
    ]:  # fmt: skip
        with pytest.raises(CausalDraftError, match=message):
            engine.generate(prompt, max_new_tokens=2, **options)
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--prompt", "hi", "--chat", "--model", str(tiny_llama_dir), "--chat-template-kwargs", "[1]"])
    assert exited.value.code == 2
    assert "expected a JSON object" in capsys.readouterr().err
