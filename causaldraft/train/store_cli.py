"""``causaldraft build-store``: an n-gram store of the target's own greedy answers for prompt lookup.

The target answers the prompts greedily with the batched generator of the eagle3 recipe (no
features kept), shard by shard into ``WORK/store-data-seed{S}`` (resumable after a kill); the
responses become the store (``drafters/store.py``). ``--from DIR`` builds it from sequences already
generated there instead (e.g. an eagle3 recipe's greedy ``eagle3-data``). ``--extend STORE`` puts that store's
answers first and leaves out the new answers that repeat one of them (``store.add_answers``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from causaldraft.drafters.store import StoreConfig, add_answers, corpus_sequences, load_corpus, save_store
from causaldraft.errors import CausalDraftError
from causaldraft.models.batched import use_batch_products
from causaldraft.models.loading import load_model
from causaldraft.models.native import NativeLlama
from causaldraft.paths import causaldraft_home
from causaldraft.train.data import read_meta
from causaldraft.train.eagle3_train import load_sequences
from causaldraft.train.feature_data import FeatureGenConfig, generate_features


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    generation = FeatureGenConfig()
    parser = commands.add_parser("build-store", help="an n-gram store of the model's own answers for prompt lookup")
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompts", nargs="+", type=Path, default=(), help="prompt files (.json/.jsonl/.txt)")
    parser.add_argument("--from", dest="source", type=Path, default=None,
                        help="build from greedy sequences already generated in this directory")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=generation.tokens, help="response tokens to generate")
    parser.add_argument("--max-new-tokens", type=int, default=generation.max_new_tokens)
    parser.add_argument("--data-seed", type=int, default=generation.seed, help="order of the prompts answered")
    parser.add_argument("--threads", type=int, default=generation.threads)
    parser.add_argument("--work", type=Path, default=None, help="cache of the generated answers")
    parser.add_argument("--extend", type=Path, default=None,
                        help="a store of this model whose answers come first; the new ones that repeat one are left "
                             "out")  # fmt: skip
    parser.add_argument("--out", type=Path, required=True)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if (args.source is None) == (not args.prompts):
        raise CausalDraftError("pass either --prompts FILES (to generate answers) or --from DIR (answers generated)")
    for path in args.prompts:  # before the model loads
        if not path.is_file():
            raise CausalDraftError(f"prompt file {path} does not exist")
    if args.extend is not None and not args.extend.is_dir():
        raise CausalDraftError(f"store to extend {args.extend} does not exist")
    loaded = load_model(args.model, "native", "bfloat16")
    backend = loaded.backend
    if not isinstance(backend, NativeLlama):
        raise CausalDraftError("build-store needs the native backend")
    use_batch_products(backend)  # answers are generated 48 rows at a time
    # the store to extend is checked before any answer is generated
    base = None if args.extend is None else load_corpus(args.extend, loaded.base_fingerprint, backend.shape.vocab_size)
    began = time.perf_counter()
    if args.source is not None:
        directory, generated = args.source, None
    else:
        config = FeatureGenConfig(tokens=args.tokens, max_new_tokens=args.max_new_tokens, seed=args.data_seed,
                                  threads=args.threads)  # fmt: skip
        work = args.work or causaldraft_home() / "train" / loaded.fingerprint
        directory = work / f"store-data-seed{args.data_seed}"
        fingerprint = loaded.fingerprint
        generated = generate_features(backend, loaded.tokenizer, args.prompts, directory, (), config, fingerprint,
                                      ends=loaded.end_token_ids())  # fmt: skip
    sequences = load_sequences(directory)
    meta = read_meta(directory) or {}
    if meta.get("fingerprint", loaded.fingerprint) != loaded.fingerprint:
        raise CausalDraftError(f"{directory} holds another model's answers (fingerprint {meta.get('fingerprint')})")
    if meta.get("temperature", 0.0):
        raise CausalDraftError(f"{directory} holds sampled answers; the store wants greedy ones")
    responses = [sequence.tokens[sequence.prompt_length :].tolist() for sequence in sequences]
    record: dict[str, object] = {
        "command": shlex.join(["causaldraft", *sys.argv[1:]]),
        "data": str(directory),
        "data_meta": meta,
        "generation_seconds": round(generated[1], 1) if generated else None,
    }
    if base is not None:
        old, tokens, starts = base
        responses, repeats = add_answers(corpus_sequences(tokens, starts), responses)
        record["extends"] = {"store": str(args.extend), "tokens": old.tokens, "sequences": old.sequences,
                             "record": old.record, "repeated_answers_left_out": repeats}  # fmt: skip
    config_out = StoreConfig(loaded.base_fingerprint, backend.shape.vocab_size, sum(map(len, responses)),
                             len(responses), record=record)  # fmt: skip
    store = save_store(args.out, responses, config_out)
    summary = {"out": str(args.out), "tokens": config_out.tokens, "sequences": config_out.sequences,
               "ngrams": len(store), "seconds": round(time.perf_counter() - began, 1)}  # fmt: skip
    print(json.dumps(summary))
    return 0
