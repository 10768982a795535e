"""Quality of each weight dtype against float32: mean KL of next-token distributions and greedy match.

For each MT-bench prompt (first turn, chat template), float32 greedy-decodes ``--tokens`` tokens;
every dtype then scores prompt + that continuation in one teacher-forced pass. Reported per dtype:
mean KL(fp32 || dtype) over the continuation positions, and the greedy match rate (the share of
positions where the dtype's argmax equals fp32's greedy token). ``int4-requantized`` quantizes the
fp32 weights (themselves the GGUF's dequantized Q4_1) again with min/max groups of 32, to show
what loading the Q4_1 blocks as they are saves.

    .venv/bin/python bench/quant_quality.py --prompts 10 --tokens 64
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from causaldraft.api import load
from causaldraft.bench.prompts import read_questions
from causaldraft.models.base import Backend
from causaldraft.models.loading import load_model, resolve_model_dir
from causaldraft.models.native import NativeLlama
from causaldraft.models.quant import install_quantized, quantize_model_weights

MT_BENCH = str(Path(__file__).resolve().parent / "prompts" / "mt-bench-8.jsonl")  # repository default
DTYPES = ("float32", "bfloat16", "int8", "int4", "int4-requantized")


def teacher_forced_logits(backend: Backend, tokens: list[int], first: int) -> torch.Tensor:
    """Logits [len(tokens) - first, vocab] predicting tokens[first:], from one pass over tokens[:-1]."""
    inputs = torch.tensor(tokens[:-1], dtype=torch.long)
    n = inputs.shape[0]
    cache = backend.new_cache(n)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    rows = torch.arange(first - 1, n)
    return backend.forward(inputs, torch.arange(n), mask, cache, rows).logits.float()


def load_backend(reference: Backend, model: str, dtype: str) -> Backend:
    """``int4-requantized``: min/max int4 from the fp32 weights, ignoring the GGUF's Q4_1 blocks."""
    if dtype == "float32":
        return reference
    if dtype != "int4-requantized":
        return load_model(model, "native", dtype).backend
    model_dir = resolve_model_dir(model)
    assert isinstance(reference, NativeLlama)
    weights = quantize_model_weights(reference, "int4")
    return install_quantized(NativeLlama.from_pretrained(model_dir, torch.bfloat16), weights)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--file", default=MT_BENCH)
    args = parser.parse_args()

    reference = load(args.model, dtype="float32", drafter="none", calibrate=False, compile=False)
    sequences: list[tuple[list[int], int]] = []  # (prompt + fp32 greedy continuation, prompt length)
    for question in read_questions(args.file, limit=args.prompts):
        prompt = reference.encode_chat([{"role": "user", "content": question.turns[0]}])
        continuation = reference.generate(prompt, max_new_tokens=args.tokens).token_ids
        sequences.append((prompt + continuation, len(prompt)))
    total = sum(len(tokens) - first for tokens, first in sequences)
    print(f"{len(sequences)} MT-bench prompts, {total} fp32 greedy tokens teacher-forced\n")
    reference_logits = [teacher_forced_logits(reference.model.backend, t, f) for t, f in sequences]
    print("| dtype | mean KL(fp32 ‖ dtype) | greedy match vs fp32 | seconds |")
    print("|---|---|---|---|")
    for dtype in DTYPES:
        started = time.perf_counter()
        backend = load_backend(reference.model.backend, args.model, dtype)
        kl_sum, matches = 0.0, 0
        for (tokens, first), target_logits in zip(sequences, reference_logits, strict=True):
            logits = teacher_forced_logits(backend, tokens, first)  # [m, vocab]
            target_log_probs = target_logits.log_softmax(-1)
            kl = F.kl_div(logits.log_softmax(-1), target_log_probs, log_target=True, reduction="sum")
            kl_sum += float(kl)
            matches += int((logits.argmax(-1) == torch.tensor(tokens[first:])).sum())
        elapsed = time.perf_counter() - started
        print(f"| {dtype} | {kl_sum / total:.5f} | {matches / total:.3f} | {elapsed:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
