"""``causaldraft chat``: a conversation on the terminal. Each line read is the user's next message; the
answer is printed as it is decoded, then one line of its stats on stderr. Every turn sends the whole
conversation through the chat template, as a chat client does, and the engine's kept prompt prefixes
(``prefix.py``) spare reading its earlier whole chunks again. ``/reset`` starts a new conversation (the
system message stays); ``/exit`` or the end of the input ends it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from typing import Any, TextIO

from causaldraft.api import Completion, Engine
from causaldraft.errors import CausalDraftError


def chat_loop(
    engine: Engine, lines: Iterable[str], out: TextIO, err: TextIO, system: str | None, options: dict[str, Any]
) -> list[dict[str, str]]:
    """Answer each line of ``lines`` in turn (``options``: those of ``Engine.generate``); returns the
    conversation at the end. A turn the engine refuses (a conversation grown past the context, say) is
    reported on ``err`` and left out of the conversation."""
    opening = [{"role": "system", "content": system}] if system else []
    messages = list(opening)
    for line in lines:
        text = line.rstrip("\r\n")
        command = text.strip()
        if not command:
            continue
        if command == "/exit":
            break
        if command == "/reset":
            messages = list(opening)
            print("(a new conversation)", file=err)
            continue
        messages.append({"role": "user", "content": text})
        pieces: list[str] = []
        completion: Completion | None = None
        try:
            for item in engine.events(messages, **options):
                if isinstance(item, Completion):
                    completion = item
                elif item.text:
                    out.write(item.text)
                    out.flush()
                    pieces.append(item.text)
        except CausalDraftError as error:
            messages.pop()
            print(f"causaldraft: error: {error} (/reset starts a new conversation)", file=err)
            continue
        out.write("\n")
        messages.append({"role": "assistant", "content": "".join(pieces)})
        if completion is not None:
            stats = completion.stats
            print(f"[{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tokens/s, {stats.mean_accepted:.2f} "
                  f"per pass; prompt {completion.prompt_tokens} tokens, {stats.cached_prompt_tokens} copied]",
                  file=err)  # fmt: skip
    return messages


def run_chat(args: argparse.Namespace) -> int:
    from causaldraft.api import check_request_options, load
    from causaldraft.flags import engine_config, request_options

    options = request_options(args)
    check_request_options(options)  # a bad value costs no load
    engine = load(engine_config(args))
    if sys.stdin.isatty():
        print("causaldraft chat: a message per line; /reset starts over, /exit (or Ctrl-D) ends", file=sys.stderr)
    chat_loop(engine, sys.stdin, sys.stdout, sys.stderr, args.system, options)
    return 0
