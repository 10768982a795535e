"""Decoding speed by weight dtype on MT-bench (T=0): plain decoding in bf16 / int8 / int4, speculative
decoding in int4 (lookup, self-draft), and llama.cpp on the same GGUF when llama-cpp-python is installed.

Also prints t_verify(n) (ms per target pass over n new tokens, measured at engine load) per dtype and
the greedy match rate of each int4 speculative method against plain int4 decoding (an M-row pass
rounds differently from a 1-row pass, so near-ties can flip).

    .venv/bin/python bench/quant_speed.py --prompts 8 --tokens 128
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from causaldraft.adapt import measure_verify_cost
from causaldraft.api import Engine, load
from causaldraft.bench.methods import LlamaCppMethod, RunSettings
from causaldraft.bench.prompts import read_questions
from causaldraft.models.loading import LoadedModel, default_gguf_path, load_model

MT_BENCH = str(Path(__file__).resolve().parent / "prompts" / "mt-bench-8.jsonl")  # repository default
PLAIN_DTYPES = ("bfloat16", "int8", "int4")
SPECULATIVE_INT4 = ("lookup", "draft")
VERIFY_SIZES = (1, 2, 4, 8, 16, 32, 64)


def run_engine(engine: Engine, prompts: list[list[int]], tokens: int) -> tuple[float, float, list[list[int]]]:
    """Tokens per second (prefill included), mean tokens per target pass, and the outputs."""
    engine.generate(prompts[0][:16], max_new_tokens=8)  # warm-up
    outputs, new_tokens, forwards, wall = [], 0, 0, 0.0
    for prompt in prompts:
        result = engine.generate(prompt, max_new_tokens=tokens)
        outputs.append(result.token_ids)
        new_tokens += result.stats.new_tokens
        forwards += result.stats.target_forwards
        wall += result.stats.wall_s
    return new_tokens / wall, new_tokens / max(forwards, 1), outputs


def match_rate(expected: list[list[int]], actual: list[list[int]]) -> float:
    """Share of positions equal up to the first divergence, per prompt, pooled."""
    same, total = 0, 0
    for left, right in zip(expected, actual, strict=True):
        prefix = 0
        while prefix < min(len(left), len(right)) and left[prefix] == right[prefix]:
            prefix += 1
        same += prefix
        total += max(len(left), len(right))
    return same / max(total, 1)


def run_llamacpp(prompts: list[list[int]], tokens: int) -> float | None:
    try:
        method = LlamaCppMethod("llamacpp", default_gguf_path(), seed=0)
    except ImportError:
        return None
    settings = RunSettings(max_new_tokens=tokens, temperature=0.0, seed=0)
    method.generate(prompts[0][:16], RunSettings(8, 0.0, 0))  # warm-up
    new_tokens, wall = 0, 0.0
    for prompt in prompts:
        output = method.generate(prompt, settings)
        new_tokens += len(output.token_ids)
        wall += output.wall_s
    return new_tokens / wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--file", default=MT_BENCH)
    args = parser.parse_args()

    rows: list[tuple[str, float, float, str]] = []
    verify: dict[str, dict[int, float]] = {}
    loaded: dict[str, LoadedModel] = {}
    prompts: list[list[int]] = []
    plain_int4: list[list[int]] = []
    for dtype in PLAIN_DTYPES:
        loaded[dtype] = load_model("default", "native", dtype)
        engine = load(dtype=dtype, drafter="none", loaded=loaded[dtype], compile=False)
        if not prompts:
            questions = read_questions(args.file, limit=args.prompts)
            prompts = [engine.encode_chat([{"role": "user", "content": q.turns[0]}]) for q in questions]
        cost = measure_verify_cost(loaded[dtype].backend, max(VERIFY_SIZES), repeats=3)
        verify[dtype] = {n: cost(n) * 1000 for n in VERIFY_SIZES}
        speed, per_pass, outputs = run_engine(engine, prompts, args.tokens)
        if dtype == "int4":
            plain_int4 = outputs
        rows.append((f"plain {dtype}", speed, per_pass, ""))
        print(f"plain {dtype}: {speed:.1f} tokens/s", flush=True)
    for drafter in SPECULATIVE_INT4:
        engine = load(dtype="int4", drafter=drafter, loaded=loaded["int4"], compile=False)
        speed, per_pass, outputs = run_engine(engine, prompts, args.tokens)
        rows.append((f"{drafter} int4", speed, per_pass, f"{match_rate(plain_int4, outputs):.3f}"))
        print(f"{drafter} int4: {speed:.1f} tokens/s", flush=True)
    llamacpp = run_llamacpp(prompts, args.tokens)
    if llamacpp is not None:
        rows.append(("llama.cpp (Q4_1 GGUF)", llamacpp, 1.0, ""))

    print(f"\n{len(prompts)} MT-bench prompts x {args.tokens} new tokens, T=0, prefill included\n")
    reference = llamacpp or rows[0][1]
    name = "llama.cpp" if llamacpp else "plain bfloat16"
    print(f"| method | tokens/s | x {name} | tokens per target pass | greedy match vs plain int4 |")
    print("|---|---|---|---|---|")
    for method, speed, per_pass, match in rows:
        print(f"| {method} | {speed:.1f} | {speed / reference:.2f} | {per_pass:.2f} | {match} |")
    print("\nt_verify(n), ms per target pass over n new tokens after a 128-token context:\n")
    print("| dtype | " + " | ".join(f"n={n}" for n in VERIFY_SIZES) + " |")
    print("|---|" + "---|" * len(VERIFY_SIZES))
    for dtype, costs in verify.items():
        print(f"| {dtype} | " + " | ".join(f"{costs[n]:.1f}" for n in VERIFY_SIZES) + " |")
    return 0


if __name__ == "__main__":
    started = time.perf_counter()
    code = main()
    print(f"\n(total {time.perf_counter() - started:.0f} s)")
    raise SystemExit(code)
