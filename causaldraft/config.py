"""Frozen, validated configuration shared by the API, CLI, server and bench."""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, replace

from causaldraft.errors import CausalDraftError

DTYPES = ("auto", "float32", "bfloat16", "int8", "int4")  # auto: int4 for a 4-bit GGUF model, else bfloat16
BACKENDS = ("native", "hf")
TREE_KINDS = ("chain", "static", "dynamic")
ACCEPTANCE_RULES = ("lossless", "naive")
SAMPLERS = ("gumbel", "rejection")
PATH_FIELDS = ("model", "draft_model", "heads", "store")  # EngineConfig's fields that name files


def number(value: object) -> bool:
    """An int or a float, not a bool (``True`` is no temperature)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")  # SamplingConfig's, in this order


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen. temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    # penalties on tokens already there (``penalties.py``; vLLM's and OpenAI's meanings): 0, 0 and 1 are off
    presence_penalty: float = 0.0  # subtracted once from each token in the output, in [-2, 2]
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output, in [-2, 2]
    repetition_penalty: float = 1.0  # > 0: divides positive logits (multiplies negative) of tokens in prompt or output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids ascending (``bias_pairs``)

    def __post_init__(self) -> None:
        if not number(self.temperature) or not math.isfinite(self.temperature):
            raise CausalDraftError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise CausalDraftError(f"temperature must be >= 0, got {self.temperature}")
        if not number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise CausalDraftError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not integer(self.top_k) or self.top_k < 0:
            raise CausalDraftError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and not integer(self.seed):
            raise CausalDraftError(f"seed must be an integer, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not number(value) or not -2.0 <= value <= 2.0:
                raise CausalDraftError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise CausalDraftError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if bias_pairs(self.logit_bias) != self.logit_bias:
            raise CausalDraftError(
                f"logit_bias must be (token id, bias) pairs in ascending ids, got {self.logit_bias!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the target's logits change before a token is chosen: penalties, a logit bias (``penalties.py``)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
        )


MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a bias: [-100, 100]


def bias_pairs(logit_bias: object) -> tuple[tuple[int, float], ...]:
    """A logit bias as ``SamplingConfig`` holds it, from a mapping {token id: bias} or pairs: (id, bias) pairs in
    ascending ids, each id an integer >= 0 and each bias a number in [-100, 100]; else a CausalDraftError."""
    items = logit_bias.items() if isinstance(logit_bias, typing.Mapping) else logit_bias
    if not isinstance(items, typing.Iterable) or isinstance(items, (str, bytes)):
        raise CausalDraftError(f"logit_bias must map token ids to biases, got {logit_bias!r}")
    pairs = []
    for item in items:
        if not isinstance(item, tuple) or len(item) != 2:
            raise CausalDraftError(f"logit_bias must map token ids to biases, got {logit_bias!r}")
        token, bias = item
        if not integer(token) or token < 0:
            raise CausalDraftError(f"logit_bias keys are token ids (integers >= 0), got {token!r}")
        if not number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise CausalDraftError(f"a logit_bias value is a number in [-100, 100], got {bias!r} for token {token}")
        pairs.append((token, float(bias)))
    return tuple(sorted(dict(pairs).items()))


CHAIN_DEPTH = 6  # a chain's default depth (it spends its nodes on one path)
STATIC_DEPTH = 5  # a static tree drafts every level of its fixed shape
# A dynamic tree's depth is a ceiling: its depth gate drafts a level only where the cost model says it pays.
# 8 since stop 28 (5 before): with attention's AVX-512 build, 8 gave every tree drafter 4-13 % more tokens/s
# in bf16 (the prompts and 16 others), and 12 or 16 less than 8 (docs/results/history.md, stop 28).
# Where verify passes cost about the same over 2 and 16 rows, the engine takes 12 instead (``adapt.dynamic_depth``,
# stop 36).
DYNAMIC_DEPTH = 8
DEFAULT_DEPTHS = {"chain": CHAIN_DEPTH, "static": STATIC_DEPTH, "dynamic": DYNAMIC_DEPTH}


@dataclass(frozen=True)
class TreeConfig:
    """Shape of the draft: kind, initial depth and width, and the node budget ceiling."""

    kind: str = "dynamic"
    depth: int = DYNAMIC_DEPTH  # the default kind's
    width: int = 3
    max_nodes: int = 32
    # Prompt-lookup paths (the lookup drafter's, and those merged into model drafters' trees) are copied
    # from the text, so their length costs no drafting: with lookup_depth N an adaptive policy lets them
    # reach N deep and its cost model prunes their nodes like any others; fixed trees (--no-adapt) keep
    # them within `depth`. None (the default): `depth`. 24 raised bf16's mean accepted length by ~0.3 at
    # the same tokens/s, and cost int4 2-4 % (more drafting work per step; docs/results/history.md, stop 34).
    lookup_depth: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in TREE_KINDS:
            raise CausalDraftError(f"tree must be one of {', '.join(TREE_KINDS)}, got {self.kind!r}")
        if self.depth < 1 or self.depth > 32:
            raise CausalDraftError(f"depth must be in [1, 32], got {self.depth}")
        if self.width < 1 or self.width > 16:
            raise CausalDraftError(f"width must be in [1, 16], got {self.width}")
        if self.max_nodes < 2 or self.max_nodes > 256:
            raise CausalDraftError(f"max_nodes must be in [2, 256], got {self.max_nodes}")
        if self.lookup_depth is not None and not 1 <= self.lookup_depth <= 64:
            raise CausalDraftError(f"lookup_depth must be in [1, 64], got {self.lookup_depth}")


@dataclass(frozen=True)
class DecodeConfig:
    """Decode-loop policy: acceptance rule, adaptation and fallback."""

    acceptance: str = "lossless"
    adapt: bool = True
    fallback: bool = True
    reprobe_every: int = 16
    # lossless sampling: "gumbel" (Gumbel-max with noise keyed by (seed, position): the output is a
    # function of the seed and the model alone, whatever the drafter and tree) or "rejection"
    # (recursive rejection sampling with the request's generator)
    sampler: str = "gumbel"
    # An untimed policy (seeded rejection sampling: no decision may depend on the clock) drafts a
    # level while its frontier holds a node this sure and verifies only nodes this sure. Before it,
    # such trees grew to max_nodes (~31 nodes: 28 ms a bf16 pass against 11 for one row) for ~0.5
    # accepted tokens, and seeded rejection sampling ran at 0.54x plain decoding (docs/results/history.md, stop 32).
    untimed_min_score: float = 0.2

    def __post_init__(self) -> None:
        if not 0.0 <= self.untimed_min_score <= 1.0:
            raise CausalDraftError(f"untimed_min_score must be in [0, 1], got {self.untimed_min_score}")
        if self.acceptance not in ACCEPTANCE_RULES:
            raise CausalDraftError(f"acceptance must be one of {', '.join(ACCEPTANCE_RULES)}, got {self.acceptance!r}")
        if self.sampler not in SAMPLERS:
            raise CausalDraftError(f"sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}")
        if self.reprobe_every < 1:
            raise CausalDraftError("reprobe_every must be >= 1")


def tree_config_of(
    kind: str, depth: int | None, width: int | None, max_nodes: int | None, lookup_depth: int | None = None
) -> TreeConfig:
    """A tree of ``kind`` with the given sizes, the kind's defaults for the ones left None."""
    defaults = TreeConfig()
    chain = kind == "chain"
    return TreeConfig(
        kind=kind,
        depth=depth if depth is not None else DEFAULT_DEPTHS.get(kind, defaults.depth),
        width=width if width is not None else (1 if chain else defaults.width),
        max_nodes=max_nodes if max_nodes is not None else defaults.max_nodes,
        lookup_depth=lookup_depth if lookup_depth is not None else defaults.lookup_depth,
    )


@dataclass(frozen=True)
class EngineConfig:
    """Everything that builds an engine, validated once: the target (model, backend, dtype,
    compile), the drafter and its options, the draft tree and the decode policy.

    ``load(config)`` takes it; the CLI builds it from flags (``flags.engine_config``); the bench
    derives its methods from it (``for_method``) and its reproducing command from ``flags()``.
    Tree sizes left None take the tree kind's defaults (``tree_config``)."""

    model: str = "default"
    backend: str = "native"
    dtype: str = "auto"
    compile: bool | None = None  # None: compiled on the native backend, as the CLI (``compiled``)
    drafter: str = "auto"  # registry.auto_choice: --heads DIR's drafter, a shipped eagle3 layer, lookup
    tree: str = "dynamic"
    depth: int | None = None
    width: int | None = None
    max_nodes: int | None = None
    lookup_depth: int | None = None
    acceptance: str = "lossless"
    sampler: str = "gumbel"
    adapt: bool = True
    fallback: bool = True
    calibrate: bool = True
    adapt_threads: bool = True  # one thread while other processes slow the passes (threads.py)
    draft_model: str | None = None
    draft_layers: int = 4
    heads: str | None = None
    lookup_merge: bool = True
    store: str | None = None  # n-gram store for prompt lookup; None: the shipped one when it fits the model
    use_store: bool = True
    # prompt prefixes kept between requests (prefix.py), in MiB; 0: every prompt is read whole
    prefix_cache_mb: int = 256

    def __post_init__(self) -> None:
        for name in PATH_FIELDS:  # a pathlib.Path is as good as its string
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        check_field_types(self)
        if self.backend not in BACKENDS:
            raise CausalDraftError(f"backend must be native or hf, got {self.backend!r}")
        if self.dtype not in DTYPES:
            raise CausalDraftError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.compile and self.backend != "native":
            raise CausalDraftError("compiling needs the native backend (--backend native)")
        if self.draft_layers < 1:
            raise CausalDraftError(f"draft layers must be >= 1, got {self.draft_layers}")
        if self.prefix_cache_mb < 0:
            raise CausalDraftError(f"the prefix cache's size must be >= 0 MiB, got {self.prefix_cache_mb}")
        self.tree_config  # noqa: B018  (validates the tree sizes)
        self.decode_config  # noqa: B018

    @property
    def compiled(self) -> bool:
        """Whether the target's passes run compiled graphs: ``compile`` when set, else wherever they can (the
        native backend; the hf backend has no compiled path)."""
        return self.compile if self.compile is not None else self.backend == "native"

    @property
    def tree_config(self) -> TreeConfig:
        return tree_config_of(self.tree, self.depth, self.width, self.max_nodes, self.lookup_depth)

    @property
    def decode_config(self) -> DecodeConfig:
        # plain decoding has nothing to fall back from
        fallback = self.fallback and self.drafter != "none"
        return DecodeConfig(acceptance=self.acceptance, adapt=self.adapt, fallback=fallback, sampler=self.sampler)

    def for_method(self, drafter: str, tree: str, max_nodes: int | None = None) -> EngineConfig:
        """The same settings for another drafter and tree kind (the bench's methods)."""
        return replace(self, drafter=drafter, tree=tree, max_nodes=max_nodes or self.max_nodes)

    def flags(self) -> list[str]:
        """Command-line flags that rebuild this configuration (drafter and tree excepted: the bench
        names them per method)."""
        default = EngineConfig()
        parts = ["--model", self.model, "--backend", self.backend, "--dtype", self.dtype]
        parts.append("--compile" if self.compiled else "--no-compile")
        for flag, value, unset in (("--depth", self.depth, None), ("--width", self.width, None),
                                   ("--max-nodes", self.max_nodes, None), ("--lookup-depth", self.lookup_depth, None),
                                   ("--draft-model", self.draft_model, None),
                                   ("--heads", self.heads, None), ("--store", self.store, None),
                                   ("--acceptance", self.acceptance, default.acceptance),
                                   ("--sampler", self.sampler, default.sampler),
                                   ("--draft-layers", self.draft_layers, default.draft_layers),
                                   ("--prefix-cache-mb", self.prefix_cache_mb, default.prefix_cache_mb)):  # fmt: skip
            if value != unset:
                parts += [flag, str(value)]
        for flag, enabled in (("--no-lookup-merge", self.lookup_merge), ("--no-store", self.use_store),
                              ("--no-adapt", self.adapt),
                              ("--no-fallback", self.fallback), ("--fixed-threads", self.adapt_threads)):  # fmt: skip
            if not enabled:
                parts.append(flag)
        return parts


def check_field_types(config: object) -> None:
    """Every field of a config dataclass holds a value of its annotated type (str, int, float, bool, or
    None where the annotation allows it; an int for a float; never a bool for an int), so a value of the
    wrong type is named here, not met later as another error. Example: ``depth="3"`` -> "depth must be
    int or None, got '3'"."""
    hints = typing.get_type_hints(type(config))
    for field in dataclasses.fields(config):  # type: ignore[arg-type]
        value = getattr(config, field.name)
        allowed = typing.get_args(hints[field.name]) or (hints[field.name],)
        if value is None and type(None) in allowed:
            continue
        fits = any(
            isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
            for kind in (*allowed, *((int,) if float in allowed else ()))
            if isinstance(kind, type) and kind is not type(None)
        )
        if not fits:
            names = " or ".join(
                "None" if kind is type(None) else getattr(kind, "__name__", str(kind)) for kind in allowed
            )
            raise CausalDraftError(f"{field.name} must be {names}, got {value!r}")


def validate_max_new_tokens(max_new_tokens: object) -> int:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise CausalDraftError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise CausalDraftError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return max_new_tokens


MAX_TOP_LOGPROBS = 20  # alternatives per token a request's logprobs may carry (OpenAI's chat limit, vLLM's default)


def validate_top_logprobs(value: object, name: str = "logprobs") -> int | None:
    """``logprobs`` (or ``prompt_logprobs``, named ``name``) as a request gives it: None (off) or the number of
    alternatives per token, 0..MAX_TOP_LOGPROBS (0: the tokens' own log-probabilities only; ``logprobs.py``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise CausalDraftError(
            f"{name} must be None or an integer from 0 to {MAX_TOP_LOGPROBS} (alternatives per token), got {value!r}"
        )
    return value
