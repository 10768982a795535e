"""Methods under test, all behind one adapter: ``generate(prompt_ids, settings) -> MethodOutput``.

Method strings: ``hf`` (transformers generate), ``hf-lookup`` (transformers prompt-lookup decoding),
``ar`` (causaldraft plain decoding), ``NAME[:chain|static|dynamic]`` for every causaldraft drafter,
and ``llamacpp`` (the same GGUF through llama-cpp-python, when it is installed). Every method shares
the one loaded target of the run (the ``hf`` methods load the same checkpoint, in the same dtype,
into transformers, unless the target already is a transformers model).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from causaldraft.config import TREE_KINDS, EngineConfig, TreeConfig
from causaldraft.decode import StepStats
from causaldraft.drafters.registry import DRAFTERS
from causaldraft.errors import CausalDraftError
from causaldraft.models.loading import TORCH_DTYPES, LoadedModel, default_gguf_path

HF_METHODS = ("hf", "hf-lookup")
PROMPT_LOOKUP_TOKENS = 10
LLAMACPP_THREADS = 2
LLAMACPP_CONTEXT = 4096


@dataclass(frozen=True)
class MethodSpec:
    """A parsed method string; ``name`` is kept exactly as given."""

    name: str
    kind: str  # "hf" | "hf-lookup" | "causaldraft" | "llamacpp"
    drafter: str = "none"
    tree: str = TreeConfig().kind

    @property
    def speculative(self) -> bool:
        return self.kind == "causaldraft" and self.drafter != "none"


def parse_method(name: str) -> MethodSpec:
    base, separator, tree = name.strip().partition(":")
    if base in (*HF_METHODS, "llamacpp", "ar"):
        if separator:
            raise CausalDraftError(f"method {name!r}: {base} takes no tree kind")
        if base == "ar":
            return MethodSpec(name, "causaldraft", "none")
        return MethodSpec(name, base)
    choices = ", ".join(["hf", "hf-lookup", "ar", "llamacpp", *(d for d in DRAFTERS if d != "none")])
    if base not in DRAFTERS or base == "none":
        raise CausalDraftError(f"unknown method {name!r}; choose from {choices} (drafters take :chain|static|dynamic)")
    if separator and tree not in TREE_KINDS:
        raise CausalDraftError(f"method {name!r}: tree kind must be one of {', '.join(TREE_KINDS)}")
    return MethodSpec(name, "causaldraft", base, tree or TreeConfig().kind)


def parse_methods(text: str) -> list[str]:
    """Split a comma-separated list, dropping empty entries; every name is checked here, before the model
    loads, and a name meaning what an earlier one means (``lookup`` and ``lookup:dynamic``) is dropped."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise CausalDraftError("--methods needs at least one method")
    kept: dict[tuple[str, str, str], str] = {}
    for name in names:
        spec = parse_method(name)
        kept.setdefault((spec.kind, spec.drafter, spec.tree), name)
    return list(kept.values())


@dataclass(frozen=True)
class RunSettings:
    max_new_tokens: int
    temperature: float
    seed: int


@dataclass(frozen=True)
class MethodOutput:
    token_ids: tuple[int, ...]  # new tokens only; EOS included when the method stopped on it
    wall_s: float  # prefill + decoding
    target_forwards: int  # target passes that produced new tokens (prefill included for hf methods)
    steps: tuple[StepStats, ...] = ()
    depth_attempts: tuple[int, ...] = ()
    depth_accepts: tuple[int, ...] = ()


class Method(Protocol):
    name: str

    def generate(self, prompt_ids: list[int], settings: RunSettings) -> MethodOutput: ...


class CausalDraftMethod:
    def __init__(self, name: str, engine: Any) -> None:  # engine: causaldraft.api.Engine
        self.name = name
        self.engine = engine

    def generate(self, prompt_ids: list[int], settings: RunSettings) -> MethodOutput:
        result = self.engine.generate(
            prompt_ids, max_new_tokens=settings.max_new_tokens, temperature=settings.temperature, seed=settings.seed
        )
        stats = result.stats
        return MethodOutput(tuple(result.token_ids), stats.wall_s, stats.target_forwards, tuple(stats.steps),
                            tuple(stats.depth_attempts), tuple(stats.depth_accepts))  # fmt: skip


def cut_at_eos(tokens: list[int], ends: frozenset[int]) -> tuple[int, ...]:
    """Keep tokens through the first end token (inclusive), as causaldraft counts them."""
    first = next((index for index, token in enumerate(tokens) if token in ends), None)
    return tuple(tokens if first is None else tokens[: first + 1])


class HFMethod:
    """transformers ``generate``: plain, or prompt-lookup decoding when ``lookup_tokens`` is set."""

    def __init__(self, name: str, model: Any, ends: frozenset[int], lookup_tokens: int | None) -> None:
        self.name = name
        self.model = model
        self.ends = ends
        self.lookup_tokens = lookup_tokens

    def generation_config(self, settings: RunSettings) -> Any:
        from transformers import GenerationConfig

        sampled = settings.temperature > 0
        options: dict[str, Any] = {"max_new_tokens": settings.max_new_tokens, "do_sample": sampled,
                                   "eos_token_id": sorted(self.ends) or None,
                                   "pad_token_id": min(self.ends, default=None)}  # fmt: skip
        if sampled:
            options.update(temperature=settings.temperature, top_k=0, top_p=1.0)
        if self.lookup_tokens:
            options["prompt_lookup_num_tokens"] = self.lookup_tokens
        return GenerationConfig(**options)

    def generate(self, prompt_ids: list[int], settings: RunSettings) -> MethodOutput:
        config = self.generation_config(settings)
        input_ids = torch.tensor([prompt_ids], dtype=torch.long)  # [1, prompt]
        forwards = [0]

        def count(*_: object) -> None:
            forwards[0] += 1

        handle = self.model.register_forward_hook(count)
        try:
            if settings.temperature > 0:
                torch.manual_seed(settings.seed)
            started = time.perf_counter()
            with torch.inference_mode():
                output = self.model.generate(
                    input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
                )  # [1, prompt + new]
            wall_s = time.perf_counter() - started
        finally:
            handle.remove()
        tokens = cut_at_eos(output[0, len(prompt_ids) :].tolist(), self.ends)
        return MethodOutput(tokens, wall_s, forwards[0])


class LlamaCppMethod:
    """The same GGUF through llama.cpp (llama-cpp-python), fed the same prompt token ids.

    llama.cpp runs in a child process: a native crash there (a build that emits instructions this
    CPU lacks segfaults in its first ``generate``) is recorded as this method's error instead of
    killing the bench and every other method's results. Times are measured inside the child."""

    def __init__(self, name: str, gguf: Path, seed: int, worker: Callable[..., None] | None = None) -> None:
        """``worker``: the child's entry point (``llamacpp_worker``; tests pass a crashing one)."""
        import multiprocessing

        self.name = name
        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(target=worker or llamacpp_worker, args=(child, str(gguf), seed), daemon=True)
        self.process.start()
        child.close()
        self.eos = int(self.receive())

    def receive(self) -> Any:
        try:
            kind, value = self.connection.recv()
        except (EOFError, OSError) as error:
            self.process.join(timeout=5)
            raise CausalDraftError(f"llamacpp crashed (child exit code {self.process.exitcode})") from error
        if kind == "error":
            raise CausalDraftError(f"llamacpp: {value}")
        return value

    def generate(self, prompt_ids: list[int], settings: RunSettings) -> MethodOutput:
        if len(prompt_ids) + settings.max_new_tokens > LLAMACPP_CONTEXT:
            raise CausalDraftError(f"llamacpp: prompt + max_new_tokens exceed its context of {LLAMACPP_CONTEXT}")
        if not self.process.is_alive():
            raise CausalDraftError(f"llamacpp crashed earlier (child exit code {self.process.exitcode})")
        self.connection.send((list(prompt_ids), settings.temperature, settings.max_new_tokens))
        tokens, wall_s = self.receive()
        return MethodOutput(tuple(tokens), wall_s, len(tokens))

    def __del__(self) -> None:
        process = getattr(self, "process", None)
        if process is not None and process.is_alive():
            process.kill()


def llamacpp_worker(connection: Any, gguf: str, seed: int) -> None:
    """Child process: load the GGUF, then answer (prompt ids, temperature, max tokens) requests."""
    try:
        from llama_cpp import Llama

        llm = Llama(model_path=gguf, n_threads=LLAMACPP_THREADS, n_ctx=LLAMACPP_CONTEXT, seed=seed, verbose=False)
        eos = int(llm.token_eos())
    except Exception as error:  # report any load failure to the parent
        connection.send(("error", f"cannot load {gguf}: {error}"))
        return
    connection.send(("ok", eos))
    while True:
        try:
            prompt_ids, temperature, max_new_tokens = connection.recv()
        except EOFError:
            return
        llm.reset()  # no prompt-cache reuse between requests: every method prefills the whole prompt
        sampler: dict[str, Any] = {"temp": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}
        tokens: list[int] = []
        started = time.perf_counter()
        for token in llm.generate(prompt_ids, **sampler):
            tokens.append(int(token))
            if token == eos or len(tokens) >= max_new_tokens:
                break
        connection.send(("ok", (tokens, time.perf_counter() - started)))


@dataclass
class MethodFactory:
    """Builds methods on one loaded target; the transformers model is loaded once for hf methods."""

    loaded: LoadedModel
    config: EngineConfig  # the run's settings; each causaldraft method changes drafter and tree
    seed: int = 0
    hf_model: Any = field(default=None, repr=False)

    def build(self, spec: MethodSpec, max_nodes: int | None = None) -> Method:
        if spec.kind in HF_METHODS:
            lookup = PROMPT_LOOKUP_TOKENS if spec.kind == "hf-lookup" else None
            return HFMethod(spec.name, self.transformers_model(), self.loaded.end_token_ids(), lookup)
        if spec.kind == "llamacpp":
            return self.llamacpp(spec)
        return self.causaldraft(spec, max_nodes)

    def transformers_model(self) -> Any:
        if self.hf_model is None:
            from causaldraft.models.hf import HFBackend  # transformers' modeling code (~1.4 s to import): hf only

            if isinstance(self.loaded.backend, HFBackend):
                self.hf_model = self.loaded.backend.model
            else:
                from transformers import AutoModelForCausalLM

                # transformers has no CPU int4/int8 path for these checkpoints: its baselines run bfloat16
                loaded_dtype = self.loaded.dtype
                dtype = TORCH_DTYPES.get(loaded_dtype, torch.bfloat16)
                if loaded_dtype not in TORCH_DTYPES:
                    print(f"causaldraft: the hf baselines run bfloat16 weights (transformers has no {loaded_dtype} "
                          "CPU path)", file=sys.stderr)  # fmt: skip
                model = AutoModelForCausalLM.from_pretrained(str(self.loaded.model_dir), dtype=dtype)
                self.hf_model = model.eval().requires_grad_(False)
        return self.hf_model

    def llamacpp(self, spec: MethodSpec) -> Method:
        try:
            import llama_cpp  # noqa: F401
        except ImportError as error:
            message = (
                "llamacpp skipped: llama-cpp-python is not installed (pip install -e .[llamacpp]; README, Benchmarks)"
            )
            raise CausalDraftError(message) from error
        if self.config.model == "default":
            gguf = default_gguf_path()
        elif self.config.model.endswith(".gguf"):
            gguf = Path(self.config.model)
        else:
            raise CausalDraftError("llamacpp needs --model default or a .gguf file")
        return LlamaCppMethod(spec.name, gguf, self.seed)

    def causaldraft(self, spec: MethodSpec, max_nodes: int | None) -> Method:
        from causaldraft.api import load

        engine = load(self.config.for_method(spec.drafter, spec.tree, max_nodes), loaded=self.loaded)
        return CausalDraftMethod(spec.name, engine)
