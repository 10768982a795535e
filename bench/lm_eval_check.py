"""lm-evaluation-harness against causaldraft's server: its ``local-completions`` model scores log-likelihoods
(``echo`` + ``logprobs`` requests, one prompt or several per request; with the checkpoint's tokenizer, then with
the server's ``/tokenize`` endpoints) and generates, and every score equals what the engine itself reports
(``prompt_logprobs``). Exits 1 on a difference.

lm_eval is not a dependency of causaldraft; install it beside the project without touching torch, e.g.

    pip install --target /tmp/lmeval --no-deps lm_eval aiohttp multidict yarl frozenlist aiosignal attrs \\
        propcache aiohappyeyeballs tenacity
    PYTHONPATH=/tmp/lmeval .venv/bin/python bench/lm_eval_check.py --model default

(measured with lm_eval 0.4.13: docs/results/history.md, stop 53).
"""

from __future__ import annotations

import argparse
import sys

from causaldraft.api import Engine, load
from causaldraft.serve.app import create_app
from causaldraft.serve.server import BackgroundServer

PAIRS = [
    ("The capital of France is", " Paris"),
    ("The capital of France is", " London"),
    ("The capital of France is", " banana"),
    ("Question: Which animal barks?\nAnswer:", " a dog"),
    ("2 + 2 =", " 4"),
    ("The sky is", " blue"),
]
QUESTIONS = ["Question: What is 2+2?\nAnswer:", "The capital of France is"]


def engine_scores(engine: Engine, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """Each continuation's log-likelihood given its context, and whether greedy decoding writes it, from the
    engine's own prompt log-probabilities."""
    scores = []
    for context, continuation in pairs:
        result = engine.generate(context + continuation, max_new_tokens=1, prompt_logprobs=1)
        assert result.prompt_logprobs is not None
        entries = result.prompt_logprobs[len(context) - 1 :]
        greedy = all(entry.top[0][0] == entry.token_id for entry in entries)
        scores.append((sum(entry.logprob for entry in entries), greedy))
    return scores


def harness_for(engine: Engine, url: str, batch_size: int, remote: bool = False):  # type: ignore[no-untyped-def]
    """The harness's client; ``remote``: it finds the server's tokenizer endpoints itself (``auto``) instead of
    reading the checkpoint's tokenizer."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    name = engine.model.model_dir.name
    tokenizer = {"tokenizer_backend": "auto"} if remote else {"tokenizer_backend": "huggingface",
                                                               "tokenizer": str(engine.model.model_dir)}  # fmt: skip
    harness = LocalCompletionsAPI(model=name, base_url=f"{url}/v1/completions", tokenized_requests=True,
                                  batch_size=batch_size, max_retries=1, **tokenizer)  # fmt: skip
    assert harness.tokenizer_backend == ("remote" if remote else "huggingface")
    return harness


def main() -> int:
    from lm_eval.api.instance import Instance

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="int4")
    args = parser.parse_args()
    engine = load(model=args.model, dtype=args.dtype)
    # the reference first: the server's worker owns the engine once it runs (the engine is not thread-safe)
    pairs = [harness_for(engine, "http://unused", 1)._encode_pair(*pair) for pair in PAIRS]
    expected = engine_scores(engine, pairs)
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(PAIRS)]
    failed = False
    with BackgroundServer(create_app(engine, model_name=engine.model.model_dir.name)) as server:
        for batch_size in (1, 4):  # batch 4: several prompts per request, and the server's tokenizer endpoints
            harness = harness_for(engine, server.url, batch_size, remote=batch_size > 1)
            for (context, continuation), (logprob, greedy), (want, want_greedy) in zip(
                PAIRS, harness.loglikelihood(requests), expected, strict=True
            ):
                same = logprob == want and greedy == want_greedy
                failed |= not same
                print(f"batch {batch_size}: {context!r} + {continuation!r}: {logprob:.6f} greedy={greedy}"
                      f" (engine {want:.6f} {want_greedy}){'' if same else '  DIFFERENT'}")  # fmt: skip
        questions = [Instance(request_type="generate_until", doc={}, arguments=(question, {"until": ["\n"],
                     "max_gen_toks": 24}), idx=i) for i, question in enumerate(QUESTIONS)]  # fmt: skip
        print("generate_until:", harness_for(engine, server.url, 2).generate_until(questions))
    print("FAILED" if failed else "every score is the engine's")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
