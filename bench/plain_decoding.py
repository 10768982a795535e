"""Plain-decoding tokens/s: causaldraft native bf16 (eager and compiled) vs transformers generate.

Usage: python bench/plain_decoding.py [--model default] [--prompts N] [--max-new-tokens 128]
Greedy, chat template, MT-bench first turns; all engines in the same process and run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import causaldraft
from causaldraft.models.compiled import compile_model
from causaldraft.models.loading import load_model

PROMPTS = Path(__file__).resolve().parent / "prompts" / "mt-bench-8.jsonl"  # repository default


def read_prompts(path: Path, count: int) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    step = max(1, len(rows) // count)
    return [row["turns"][0] for row in rows[::step][:count]]


def time_causaldraft(engine: causaldraft.Engine, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, int]:
    engine.generate(prompts[0], max_new_tokens=8)  # warm-up
    tokens, started = 0, time.perf_counter()
    for ids in prompts:
        tokens += len(engine.generate(ids, max_new_tokens=max_new_tokens).token_ids)
    return time.perf_counter() - started, tokens


def time_transformers(
    model_dir: Path, dtype: torch.dtype, prompts: list[list[int]], max_new_tokens: int
) -> tuple[float, int]:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    model.generate(torch.tensor([prompts[0]]), max_new_tokens=8, do_sample=False)
    tokens, started = 0, time.perf_counter()
    for ids in prompts:
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
        tokens += out.shape[1] - len(ids)
    return time.perf_counter() - started, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompt-file", type=Path, default=PROMPTS)
    args = parser.parse_args()
    loaded = load_model(args.model, "native", "bfloat16")
    texts = read_prompts(args.prompt_file, args.prompts)
    eager = causaldraft.load(drafter="none", loaded=loaded, calibrate=False, compile=False)
    prompts = [eager.encode(text, chat=True) for text in texts]
    rows = {}
    seconds, tokens = time_transformers(loaded.model_dir, torch.bfloat16, prompts, args.max_new_tokens)
    rows["transformers generate bf16"] = tokens / seconds
    seconds, tokens = time_causaldraft(eager, prompts, args.max_new_tokens)
    rows["native bf16 eager"] = tokens / seconds
    compiled_model = load_model(args.model, "native", "bfloat16")
    compile_model(compiled_model.backend)  # type: ignore[arg-type]
    compiled = causaldraft.load(drafter="none", loaded=compiled_model, calibrate=False, compile=False)
    seconds, tokens = time_causaldraft(compiled, prompts, args.max_new_tokens)
    rows["native bf16 compiled"] = tokens / seconds
    base = rows["transformers generate bf16"]
    print(f"{'engine':32} {'tokens/s':>9} {'vs transformers':>16}")
    for name, rate in rows.items():
        print(f"{name:32} {rate:9.1f} {rate / base:15.2f}x")


if __name__ == "__main__":
    main()
