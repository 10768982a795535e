"""Decoding speed while other processes hold the cores: the engine's thread policy (docs/threads.md)
against torch's thread count held fixed, and against one thread.

Starts ``--busy`` processes that spin (one per core they take), then runs the same requests through
three engines sharing one loaded target:

- ``policy``: the default, all threads until passes slow down, then one thread;
- ``fixed``: ``adapt_threads=False``, torch's count throughout;
- ``one thread``: torch set to one thread before the engine is built.

    .venv/bin/python bench/threads_under_load.py --busy 1
    .venv/bin/python bench/threads_under_load.py --busy 0   # a quiet machine, for comparison
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

import causaldraft
from causaldraft.api import Engine, compile_backend
from causaldraft.models.loading import load_model

PROMPT = "Write a short story about a robot learning to paint."


def spin() -> None:
    while True:
        pass


@contextmanager
def busy_processes(count: int) -> Iterator[None]:
    processes = [multiprocessing.Process(target=spin, daemon=True) for _ in range(count)]
    for process in processes:
        process.start()
    time.sleep(1.0 if processes else 0.0)
    try:
        yield
    finally:
        for process in processes:
            process.terminate()


def tokens_per_s(engine: Engine, requests: int, tokens: int) -> list[float]:
    engine.generate(PROMPT, chat=True, max_new_tokens=32)  # warm-up
    return [engine.generate(PROMPT, chat=True, max_new_tokens=tokens).stats.tokens_per_s for _ in range(requests)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--drafter", default="none")
    parser.add_argument("--busy", type=int, default=1, help="spinning processes to start")
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    loaded = load_model(args.model, dtype=args.dtype)
    compile_backend(loaded, progress=True)
    threads = torch.get_num_threads()
    settings = {"model": args.model, "dtype": args.dtype, "drafter": args.drafter, "compile": True}
    print(f"{threads} threads, {args.busy} busy processes, {args.requests} requests of {args.tokens} tokens")
    with busy_processes(args.busy):
        for variant in ("policy", "fixed", "one thread"):
            torch.set_num_threads(1 if variant == "one thread" else threads)
            engine = causaldraft.load(loaded=loaded, adapt_threads=variant == "policy", **settings)  # type: ignore[arg-type]
            speeds = tokens_per_s(engine, args.requests, args.tokens)
            policy = engine.threads
            state = f"on {policy.current} thread(s), {policy.switches} switches" if policy.enabled else "off"
            print(f"{variant:10s}  {statistics.median(speeds):6.1f} tok/s (median; {min(speeds):.1f}-{max(speeds):.1f})"
                  f"  policy {state}")  # fmt: skip
    torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
