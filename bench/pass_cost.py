"""Where a one-row decoding pass spends its time, by the number of cached positions: the compiled graph
(layers and attention), the LM head, and the host's work around them (key layout, padding).

Attention is the part that grows with the context; on a CPU without native bf16 products it ran
through torch's generic bf16 kernel until stop 22 (docs/exactness.md).

    .venv/bin/python bench/pass_cost.py --dtype int4 --contexts 1,64,256,512
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from causaldraft.api import compile_backend
from causaldraft.models.blocked import blocked_keys
from causaldraft.models.loading import load_model
from causaldraft.models.native import NativeLlama, pad_to_bucket


def median_ms(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--contexts", default="1,64,256,512", help="cached positions before the pass")
    parser.add_argument("--repeats", type=int, default=41)
    args = parser.parse_args()
    loaded = load_model(args.model, dtype=args.dtype)
    backend = loaded.backend
    if not isinstance(backend, NativeLlama) or not compile_backend(loaded, progress=True):
        raise SystemExit("this measures the native backend's compiled graphs")
    print(f"cache dtype {backend.cache_dtype}, LM head {type(backend.lm_head).__name__}")
    print("context  graph ms  head ms  host ms")
    for context in (int(value) for value in args.contexts.split(",")):
        graph_ms, head_ms, host_ms = measure(backend, context, args.repeats)
        print(f"{context:7d}  {graph_ms:8.2f}  {head_ms:7.2f}  {host_ms:7.3f}")


def measure(backend: NativeLlama, context: int, repeats: int) -> tuple[float, float, float]:
    """Median ms of a one-row pass's graph, LM head and host work after ``context`` cached positions."""
    cache = backend.new_cache(context + 64)
    prompt = torch.randint(0, backend.shape.vocab_size, (context,))
    causal = torch.ones(context, context, dtype=torch.bool).tril()
    backend.forward(prompt, torch.arange(context), causal, cache)
    length = cache.length
    token, position = torch.tensor([5]), torch.tensor([length])
    mask = torch.ones(1, length + 1, dtype=torch.bool)
    layout = blocked_keys(mask, position, length, 1)
    assert layout is not None
    keys, values = [k.unsqueeze(0) for k in cache.keys], [v.unsqueeze(0) for v in cache.values]
    padded = [row[None] for row in pad_to_bucket(token, position, length, 1)]
    graph = backend.graphs[1]
    hidden = torch.randn(1, backend.shape.hidden_size).to(backend.dtype)

    def pass_graph() -> object:
        return graph(*padded, *layout.tensors(), keys, values)  # writes slot `length` only, each time

    def head() -> object:
        return backend.lm_head(hidden).float()

    def host() -> object:
        blocked_keys(mask, position, length, 1)
        return pad_to_bucket(token, position, length, 1)

    with torch.no_grad():
        graph_ms, head_ms, host_ms = (median_ms(run, repeats) for run in (pass_graph, head, host))
    return graph_ms, head_ms, host_ms


if __name__ == "__main__":
    main()
