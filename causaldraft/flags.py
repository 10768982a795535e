"""Command-line flags shared by every command that builds an engine (generate, show-tree, bench,
serve), and the engine options they map to. A module of its own, so command modules import it
instead of each other."""

from __future__ import annotations

import argparse
import json
import re

from causaldraft.config import (
    ACCEPTANCE_RULES,
    BACKENDS,
    DEFAULT_DEPTHS,
    DTYPES,
    PENALTIES,
    SAMPLERS,
    TREE_KINDS,
    DecodeConfig,
    EngineConfig,
    TreeConfig,
)


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="default, a local HF checkpoint directory or a .gguf file")
    parser.add_argument("--backend", choices=BACKENDS, default="native")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="auto (default): int4 for a model from a 4-bit GGUF file, as the default model is; "
                        "bfloat16 otherwise")  # fmt: skip
    parser.add_argument("--compile", dest="compile", action="store_true", default=None,
                        help="compiled forward graphs, built once and kept on disk (the default)")  # fmt: skip
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="run the forward eagerly")


def add_drafter_flags(parser: argparse.ArgumentParser, default_drafter: str) -> None:
    parser.add_argument("--drafter", default=default_drafter,
                        help="auto (default: the trained drafter in --heads DIR; else the shipped eagle3 layer where "
                        "it fits a bf16 or fp32 target; else lookup), none, lookup, "
                        "draft, medusa, markov, eagle3")  # fmt: skip
    parser.add_argument("--tree", choices=TREE_KINDS, default=TreeConfig().kind,
                        help="draft shape: one chain, a fixed tree, or a tree grown where the drafter is sure and "
                        "cut to the measured verify cost (default: %(default)s)")  # fmt: skip
    add_draft_options(parser)


def add_draft_options(parser: argparse.ArgumentParser) -> None:
    """Tree, acceptance and drafter options shared by every command that builds engines."""
    tree = TreeConfig()
    depths = ", ".join(f"{kind} {depth}" for kind, depth in DEFAULT_DEPTHS.items())
    parser.add_argument(
        "--depth",
        type=int,
        default=None,
        help=f"draft depth (default: {depths}; dynamic 12 where the measured verify passes are flat)",
    )
    parser.add_argument("--width", type=int, default=None, help=f"tree width (default {tree.width})")
    parser.add_argument("--max-nodes", type=int, default=None, help=f"node budget ceiling (default {tree.max_nodes})")
    parser.add_argument("--lookup-depth", type=int, default=None,
                        help="longest prompt-lookup path while adapting (default: --depth; 24 for a dynamic tree where "
                        "the measured verify passes are flat)")  # fmt: skip
    parser.add_argument("--acceptance", choices=ACCEPTANCE_RULES, default="lossless")
    parser.add_argument("--sampler", choices=SAMPLERS, default=DecodeConfig().sampler,
                        help="lossless sampling: gumbel (output depends on the seed alone) or rejection")  # fmt: skip
    parser.add_argument("--draft-model", default=None, help="local draft model path (same vocabulary)")
    parser.add_argument("--draft-layers", type=int, default=4, help="self-draft: target layers to use")
    parser.add_argument("--heads", default=None, help="trained drafter directory (markov/medusa/eagle3)")
    parser.add_argument("--no-lookup-merge", action="store_true", help="heads trees without lookup candidates")
    store = parser.add_mutually_exclusive_group()
    store.add_argument("--store", default=None,
                       help="n-gram store of the model's answers for prompt lookup (causaldraft build-store; "
                       "default: the shipped one for the default model)")  # fmt: skip
    store.add_argument("--no-store", action="store_true", help="prompt lookup in the text so far only")
    parser.add_argument("--no-adapt", action="store_true", help="fixed depth/width/budget")
    parser.add_argument("--no-fallback", action="store_true", help="never fall back to plain decoding")
    parser.add_argument("--prefix-cache-mb", type=int, default=None,
                        help="MiB of prompt prefixes kept between requests, copied instead of read again when a "
                        f"prompt starts with one (the same bits; default {EngineConfig().prefix_cache_mb}, "
                        "bench 0; 0: off)")  # fmt: skip
    parser.add_argument("--fixed-threads", action="store_true",
                        help="keep torch's thread count (default: one thread while other processes slow "
                        "the passes)")  # fmt: skip


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine settings the flags ask for (model flags, drafter flags and draft options)."""
    return EngineConfig(
        model=args.model, backend=args.backend, dtype=args.dtype, compile=args.compile,
        drafter=getattr(args, "drafter", "none"), tree=getattr(args, "tree", TreeConfig().kind),
        depth=args.depth, width=args.width, max_nodes=args.max_nodes, lookup_depth=args.lookup_depth,
        acceptance=args.acceptance,
        sampler=args.sampler, adapt=not args.no_adapt, fallback=not args.no_fallback, draft_model=args.draft_model,
        adapt_threads=not args.fixed_threads, draft_layers=args.draft_layers, heads=args.heads,
        lookup_merge=not args.no_lookup_merge, store=args.store, use_store=not args.no_store,
        prefix_cache_mb=EngineConfig().prefix_cache_mb if args.prefix_cache_mb is None else args.prefix_cache_mb,
    )  # fmt: skip


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    """A request's flags: its ``SamplingConfig``, max_new_tokens and when its output ends (``request_options``)."""
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy (token-identical to plain decoding); > 0: sample (default: %(default)s)",
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1] (default: 1: off)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default: 0: off)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the sampling: the same seed gives the same text with every drafter under the "
                        "default gumbel sampler "
                        "(default: a fresh one)")  # fmt: skip
    parser.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="subtracted from each token already in the output, in [-2, 2] (default: 0: off)",
    )
    parser.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="subtracted per occurrence in the output, in [-2, 2] (default: 0: off)",
    )
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="> 0: divides the positive logits (multiplies the negative) of tokens in the prompt or "
                        "the output (default: 1: off)")  # fmt: skip
    parser.add_argument("--logit-bias", action="append", default=None, type=bias_flag, metavar="ID=BIAS",
                        help="add BIAS (in [-100, 100]) to token ID's logit (repeatable)")  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=256, help="new tokens at most (default: %(default)s)")
    parser.add_argument(
        "--stop-token-id",
        action="append",
        type=int,
        default=None,
        dest="stop_token_ids",
        metavar="ID",
        help="a token that ends the output, as EOS does (repeatable)",
    )
    parser.add_argument("--ignore-eos", action="store_true", help="EOS does not end the output")
    parser.add_argument("--min-tokens", type=int, default=0, help="no stop token before this many new tokens")
    parser.add_argument("--stop", action="append", default=None, type=stop_string,
                        help=r"stop string (repeatable); \n, \t, \r and \\ in it are a newline, a tab, a carriage "
                        r"return and a backslash")  # fmt: skip
    parser.add_argument("--chat-template-kwargs", type=json_object, default=None, metavar="JSON",
                        help="more variables for the chat template, "
                        "e.g. '{\"enable_thinking\": false}' (Qwen3)")  # fmt: skip


def json_object(text: str) -> dict[str, object]:
    """``--chat-template-kwargs``' JSON object (its names are checked with the request's other values)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


STOP_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def stop_string(text: str) -> str:
    """``--stop``'s value with its escapes read: a shell passes ``--stop "\\n"`` as a backslash and an n, and
    a stop string of those two characters is rarely what was meant. Example: ``a\\n\\\\n`` -> a, newline,
    backslash, n."""
    return re.sub(r"\\([ntr\\])", lambda match: STOP_ESCAPES[match.group(1)], text)


def request_options(args: argparse.Namespace) -> dict[str, object]:
    """A request's options (``api.REQUEST_OPTIONS``) from ``add_sampling_flags``' flags."""
    names = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", *PENALTIES, "stop", "stop_token_ids",
             "ignore_eos", "min_tokens")  # fmt: skip
    options = {**{name: getattr(args, name) for name in names}, "logit_bias": dict(args.logit_bias or [])}
    if args.chat_template_kwargs is not None:
        options["chat_template_kwargs"] = args.chat_template_kwargs
    return options


def bias_flag(text: str) -> tuple[int, float]:
    """``--logit-bias``'s ``ID=BIAS`` (the values are checked with the request's)."""
    token, _, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS, such as 42=-100, got {text!r}") from None
