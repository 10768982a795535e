"""Command line: generate, chat, show-tree, compile, export-heads, bench, train-heads, build-store, serve."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from causaldraft.config import DTYPES, MAX_TOP_LOGPROBS, TreeConfig
from causaldraft.errors import CausalDraftError
from causaldraft.flags import add_drafter_flags, add_model_flags, add_sampling_flags, engine_config, request_options

if TYPE_CHECKING:
    from causaldraft.logprobs import TokenLogprob


def run_generate(args: argparse.Namespace) -> int:
    from causaldraft.api import check_request_options, load

    # the request's values are checked before any model loads: a bad one costs no load
    options = {**request_options(args), "chat": args.chat, "logprobs": args.logprobs,
               "prompt_logprobs": args.prompt_logprobs}  # fmt: skip
    check_request_options(options)
    for flag, value in (("--logprobs", args.logprobs), ("--prompt-logprobs", args.prompt_logprobs)):
        if value is not None and not args.json:
            raise CausalDraftError(f"{flag} is printed in --json's object: add --json")
    engine = load(engine_config(args))
    if args.stream:
        for piece in engine.stream(args.prompt, **options):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    result = engine.generate(args.prompt, **options)
    if args.json:
        stats = {**result.stats.summary(), "drafter": engine.drafter_name, "dtype": engine.model.dtype,
                 "compiled": engine.compiled}  # fmt: skip
        payload = {"text": result.text, "token_ids": result.token_ids, "stats": stats,
                   "finish_reason": result.finish_reason}  # fmt: skip
        if result.logprobs is not None:
            payload["logprobs"] = logprobs_json(result.logprobs, engine.tokenizer)
        if result.prompt_logprobs is not None:
            payload["prompt_logprobs"] = logprobs_json(result.prompt_logprobs, engine.tokenizer)
        print(json.dumps(payload))
    else:
        print(result.text)
    return 0


def logprobs_json(entries: Sequence[TokenLogprob], tokenizer: Any) -> list[dict[str, Any]]:
    """``generate --json --logprobs N`` (``--prompt-logprobs N``): each new (prompt) token's id, text,
    log-probability and rank, with its alternatives."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token_id": token_id, "token": tokenizer.decode([token_id]), "logprob": logprob}

    return [{**item(entry.token_id, entry.logprob), "rank": entry.rank, "top": [item(*best) for best in entry.top]}
            for entry in entries]  # fmt: skip


def run_chat(args: argparse.Namespace) -> int:
    from causaldraft.chat import run_chat as chat

    return chat(args)


def run_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from causaldraft.drafters import heads
    from causaldraft.drafters.eagle3_model import read_config
    from causaldraft.export import export_eagle3
    from causaldraft.models.loading import load_model

    directory = Path(args.directory)
    if (directory / heads.CONFIG_FILE).is_file():
        raise CausalDraftError(f"{directory} holds markov/medusa heads: export-heads writes eagle3 layers (what vLLM "
                               "serves); train one with causaldraft train-heads --heads eagle3")  # fmt: skip
    config, _ = read_config(directory)  # before the target loads (the default model converts on first use)
    target = load_model(args.model, "native", "bfloat16")
    if config.fingerprint != target.base_fingerprint and args.model == "default":
        raise CausalDraftError(f"the eagle3 layer in {directory} was not trained for the default model: pass the "
                               "target it was trained for with --model PATH")  # fmt: skip
    out = export_eagle3(directory, target, Path(args.out), args.verifier)
    print(json.dumps({"exported": str(out), "format": args.format}))
    return 0


def run_compile(args: argparse.Namespace) -> int:
    """Build the compiled graphs ahead (``make setup`` runs this for the default model) and time
    verify passes for the default node budget, for drafters with and without target features (kept
    with the graphs; ``--recalibrate`` times them again)."""
    import torch

    from causaldraft.api import compile_backend, quiet_graph_builds, verify_cost
    from causaldraft.models.compiled import GraphStore, compile_batch
    from causaldraft.models.loading import load_model
    from causaldraft.models.native import NativeLlama, default_aux_layers
    from causaldraft.models.quant import int4_kernels
    from causaldraft.threads import thread_invariant

    max_nodes = TreeConfig(max_nodes=args.max_nodes).max_nodes if args.max_nodes is not None else TreeConfig().max_nodes
    target = load_model(args.model, "native", args.dtype)
    backend = target.backend
    assert isinstance(backend, NativeLlama)
    if not compile_backend(target):
        return 1
    seconds = {}
    for aux_layers in ((), default_aux_layers(backend.llama_shape.num_layers)):
        cost = verify_cost(backend, max_nodes, aux_layers, remeasure=args.recalibrate)
        seconds[str(list(aux_layers))] = {size: round(value * 1000, 2) for size, value in sorted(cost.seconds.items())}
    if args.batch > 1:  # the server's batch passes (``causaldraft serve --max-batch``)
        with quiet_graph_builds():
            compile_batch(backend, args.batch)
    threads = torch.get_num_threads()
    invariant = thread_invariant(backend, threads, target.prefill, recheck=args.recalibrate)
    store = backend.graph_store
    directory = store.directory if isinstance(store, GraphStore) else ""
    kernels = int4_kernels(backend)
    print(json.dumps({"model": str(target.model_dir), "dtype": target.dtype, "buckets": list(backend.buckets),
                      "batch_buckets": list(backend.batch_graphs), "graphs": str(directory),
                      **({"int4_kernel": "+".join(kernels)} if kernels else {}),
                      "lm_head": type(backend.lm_head).__name__,  # Q8_0Head, PackedLinear, ... (models/)
                      **({"lm_head_build": build} if (build := getattr(backend.lm_head, "build", None)) else {}),
                      "verify_ms": seconds, "threads": threads, "thread_invariant": invariant}))  # fmt: skip
    return 0


def run_show_tree(args: argparse.Namespace) -> int:
    from causaldraft.inspect import show_tree

    show_tree(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="causaldraft", description="Lossless speculative decoding")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate text")
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--chat", action="store_true", help="apply the chat template")
    output = generate.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print one JSON object")
    output.add_argument("--stream", action="store_true", help="print text as it is generated")
    generate.add_argument("--logprobs", type=int, default=None, metavar="N",
                          help=f"with --json: each new token's log-probability (the model's, before temperature, "
                          f"top-k and top-p) and its N likeliest alternatives (0-{MAX_TOP_LOGPROBS})")  # fmt: skip
    generate.add_argument(
        "--prompt-logprobs",
        type=int,
        default=None,
        metavar="N",
        help="with --json: the same for each prompt token but the first (which nothing predicts)",
    )
    add_model_flags(generate)
    add_drafter_flags(generate, default_drafter="auto")
    add_sampling_flags(generate)
    generate.set_defaults(func=run_generate)

    chat = commands.add_parser("chat", help="a conversation on the terminal: a message per line, answers streamed")
    chat.add_argument("--system", default=None, help="the conversation's system message")
    add_model_flags(chat)
    add_drafter_flags(chat, default_drafter="auto")
    add_sampling_flags(chat)
    chat.set_defaults(func=run_chat)

    show = commands.add_parser("show-tree", help="print one step's draft tree and attention mask")
    show.add_argument("--prompt", required=True)
    show.add_argument("--chat", action="store_true")
    show.add_argument("--png", default=None, help="also save the mask as a PNG")
    add_model_flags(show)
    add_drafter_flags(show, default_drafter="auto")
    show.set_defaults(func=run_show_tree)

    compile_command = commands.add_parser("compile", help="build the compiled graphs for a model ahead (kept on disk)")
    compile_command.add_argument("--model", default="default", help="default, a checkpoint directory or a .gguf file")
    compile_command.add_argument("--dtype", choices=DTYPES, default="auto")
    compile_command.add_argument("--max-nodes", type=int, default=None, help="node budget ceiling to time passes for")
    compile_command.add_argument("--recalibrate", action="store_true",
                                 help="time verify passes again (on a quiet machine), not the kept times")  # fmt: skip
    compile_command.add_argument("--batch", type=int, default=0,
                                 help="also build the graphs of batch passes over N sequences")  # fmt: skip
    compile_command.set_defaults(func=run_compile)

    export = commands.add_parser("export-heads", help="write a trained eagle3 drafter for vLLM (speculators layout)")
    export.add_argument("directory", help="trained eagle3 directory (causaldraft train-heads --heads eagle3)")
    export.add_argument("--format", choices=("eagle3",), default="eagle3")
    export.add_argument("--out", required=True, help="output directory")
    export.add_argument("--model", default="default", help="the target the drafter was trained for")
    export.add_argument("--verifier", default=None, help="target name for vLLM (default: its local checkpoint dir)")
    export.set_defaults(func=run_export)

    optional = (("bench", "causaldraft.bench.cli"), ("train-heads", "causaldraft.train.cli"),
                ("build-store", "causaldraft.train.store_cli"), ("serve", "causaldraft.serve.cli"))  # fmt: skip
    for name, module in optional:
        register_optional(commands, name, module)
    return parser


def register_optional(commands: argparse._SubParsersAction, name: str, module: str) -> None:  # type: ignore[type-arg]
    import importlib

    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as error:
        if not error.name or not error.name.startswith("causaldraft"):
            raise
        return
    loaded.register(commands)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except CausalDraftError as error:
        print(f"causaldraft: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
