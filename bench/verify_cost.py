"""What a verify pass costs by its rows and by the context it attends to: a chain of n new rows after
``context`` cached positions, through the backend's own forward (compiled graphs, LM head on every row).

Each extra row attends to the whole context, so the cost of a tree grows with the context as well as with
its nodes; the cost model measures its passes while decoding (``adapt.VerifyCost``).

    .venv/bin/python bench/verify_cost.py --dtype int4 --rows 1,2,4,8,16 --contexts 64,512,1024,2048
"""

from __future__ import annotations

import argparse
import time

import torch

from causaldraft.api import compile_backend
from causaldraft.models.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--rows", type=counts, default="1,2,4,8,16", help="new rows per pass")
    parser.add_argument("--contexts", type=counts, default="64,512,1024,2048", help="cached positions before the pass")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    rows: list[int] = args.rows
    loaded = load_model(args.model, dtype=args.dtype)
    if not compile_backend(loaded, progress=True):
        print("(eager: this backend has no compiled graphs)")
    print("median ms per pass; columns: new rows")
    print("context  " + "  ".join(f"{n:>7d}" for n in rows))
    for context in args.contexts:
        times = [pass_ms(loaded.backend, context, n, args.repeats) for n in rows]
        print(f"{context:7d}  " + "  ".join(f"{ms:7.2f}" for ms in times), flush=True)


def counts(text: str) -> list[int]:
    """Comma-separated positive integers (argparse refuses anything else with its usage line)."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"comma-separated positive integers, got {text!r}")
    return values


def pass_ms(backend: object, context: int, n: int, repeats: int) -> float:
    """Median ms of an n-row chain pass after ``context`` random cached tokens (rolled back after each)."""
    generator = torch.Generator().manual_seed(context)
    vocab = backend.shape.vocab_size  # type: ignore[attr-defined]
    cache = backend.new_cache(context + n + 64)  # type: ignore[attr-defined]
    with torch.inference_mode():
        prompt = torch.randint(0, vocab, (context,), generator=generator)
        causal = torch.ones(context, context, dtype=torch.bool).tril()
        backend.forward(prompt, torch.arange(context), causal, cache)  # type: ignore[attr-defined]
        tokens = torch.randint(0, vocab, (n,), generator=generator)
        positions = torch.arange(context, context + n)
        mask = torch.cat([torch.ones(n, context, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], 1)
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            backend.forward(tokens, positions, mask, cache, logits_rows=torch.arange(n))  # type: ignore[attr-defined]
            seconds.append(time.perf_counter() - start)
            cache.rollback(context)
    return sorted(seconds)[repeats // 2] * 1e3


if __name__ == "__main__":
    main()
