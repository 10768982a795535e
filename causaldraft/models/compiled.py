"""Compiled forward graphs kept on disk: one AOTInductor package per bucket of new-token rows.

A package is built once (``torch.export`` of ``NativeLlama.body`` + ``aoti_compile_and_package``,
about a minute per bucket on 2 cores) and loaded by later processes in about a second
(``aoti_load_package``). Inductor's process-wide settings are never touched (its options are passed
to the one compile call). Where the weights live depends on the dtype (``frozen_weights``):

- int8/int4, bf16 whose layers run through causaldraft's bf16 kernel (``quant.use_block_linears``,
  since stop 33 wherever it is built), and fp32: the weights are inputs of the graph, so a package holds
  code only (a few MB) and every bucket reads the same weights in memory.
- other bf16 models of up to ``MAX_FROZEN_BYTES`` of layer weights: the layer weights are frozen into each
  package as constants, which inductor reorders once for oneDNN. A product with a weight passed as an
  input reorders it on every call: the default model's bf16 pass over 2 rows took 34 ms that way.
  The cost is one copy of the layer weights per package, on disk and in memory, so the key then also
  covers the weights' values.

Packages live under ``$CAUSALDRAFT_HOME/compiled/<key>/``; the key covers everything that changes
the graph: the model's architecture, weight names/shapes/dtypes and rope frequencies, the dtype,
the feature layers the graph returns, this package's model code, the torch version and the CPU.
A directory for another key is never read. A package that fails to load is deleted and rebuilt,
with a message. The verify-cost calibration measured with a set of graphs is kept beside them.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from causaldraft.errors import CausalDraftError
from causaldraft.models import attention_kernel, bf16_choice, blocked, int4_kernel, native, products, quant
from causaldraft.models.blocked import KEY_BLOCK, BlockedKeys, sequence_keys, stack_keys
from causaldraft.models.native import COMPILE_BUCKETS, QUANTIZED_BUCKETS, NativeLlama, default_aux_layers
from causaldraft.paths import causaldraft_home

COMPILED_FORMAT = 2
# Every graph rounds each intermediate to its dtype as eager code does, and runs its own kernels
# on one thread: without the first, fusions that differ between buckets change the rounding;
# without the second, a one-row graph may split its reductions across threads. So each bucket
# computes the same bits per row (docs/exactness.md).
INDUCTOR_OPTIONS = {"cpp.threads": 1, "emulate_precision_casts": True}
FROZEN_DTYPES = (torch.bfloat16,)  # oneDNN's reordered bf16 products agree row for row (models/packed.py)
MAX_FROZEN_BYTES = 512 << 20  # layer weights frozen into every package up to this size
INPUT_WEIGHTS = ("embed_tokens.weight",)  # stays an input when the layers are frozen (a lookup, no product)
# first-build estimate per bucket for the default model on 2 cores: AVX-512 machines took ~75 s, an
# AVX2 Zen 3 ~155 s (int4: 12 min 54 s for 5 buckets); the message gives the range
SECONDS_PER_BUCKET = 75.0
SLOW_CPU_FACTOR = 2.1
SECONDS_PER_FROZEN_BUCKET = 150.0  # the same with its weights frozen in (bf16)
Runner = Callable[..., Any]


def weights_of(model: NativeLlama) -> dict[str, torch.Tensor]:
    """The graph's weight inputs by name (parameters and buffers, in a fixed order)."""
    named: dict[str, torch.Tensor] = dict(model.named_parameters())
    named.update(dict(model.named_buffers()))
    return {name: named[name] for name in sorted(named)}


def frozen_constants(model: NativeLlama) -> dict[str, torch.Tensor]:
    """The weights a frozen package holds: all but INPUT_WEIGHTS."""
    return {name: tensor for name, tensor in weights_of(model).items() if name not in INPUT_WEIGHTS}


def kernel_products(model: NativeLlama) -> bool:
    """Whether the graphs call causaldraft's own products (int4/int8 kernels, the bf16 kernel): row-invariant
    from one row, with their weights as inputs, and keyed by the kernels' sources."""
    return model.quantized or quant.has_block_linears(model)


def frozen_weights(model: NativeLlama) -> bool:
    """Whether the packages hold the layer weights as constants (bf16 through oneDNN, up to MAX_FROZEN_BYTES)."""
    if kernel_products(model) or model.dtype not in FROZEN_DTYPES:
        return False
    constants = frozen_constants(model).values()
    return sum(tensor.numel() * tensor.element_size() for tensor in constants) <= MAX_FROZEN_BYTES


def graph_inputs(model: NativeLlama, key: GraphKey) -> dict[str, torch.Tensor]:
    """The weights a package takes as inputs: all of them, or only INPUT_WEIGHTS when frozen."""
    weights = weights_of(model)
    return {name: weights[name] for name in INPUT_WEIGHTS} if key.weights else weights


def values_digest(model: NativeLlama) -> str:
    """The values of the weights a frozen package holds (0.1 s for the default model's 212 MB)."""
    digest = hashlib.sha256()
    for name, tensor in frozen_constants(model).items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    return digest.hexdigest()[:16]


def architecture_digest(model: NativeLlama) -> str:
    """What the graph bakes in about the model: its shape, the rope constants and the names,
    shapes and dtypes of its weights (their values are inputs, or GraphKey.weights when frozen)."""
    digest = hashlib.sha256()
    digest.update(repr(model.llama_shape).encode())
    digest.update(repr(model.rope_scaling).encode())
    digest.update(model.inv_freq.float().numpy().tobytes())
    for name, tensor in weights_of(model).items():
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    return digest.hexdigest()[:16]


def code_digest(kernels: bool) -> str:
    """The code of the modules the graph is traced from: their syntax trees without docstrings, so
    formatting, comments and documentation do not count; with ``kernels`` (``kernel_products``) also the
    int4 kernels' sources (the graphs call their operators: a new kernel, new calibrations)."""
    digest = hashlib.sha256()
    for module in (native, blocked, products, quant, sys.modules[__name__]):
        digest.update(ast.dump(without_docstrings(ast.parse(inspect.getsource(module)))).encode())
    for source in int4_kernel.SOURCES if kernels else ():
        digest.update(source.read_bytes())
    # blocked attention: the kernel's source and build (its arithmetic) where the graphs call it, else torch's ops
    flags = attention_kernel.loaded_flags()
    build = b"torch attention" if flags is None else attention_kernel.SOURCE.read_bytes() + " ".join(flags).encode()
    digest.update(build)
    return digest.hexdigest()[:16]


def without_docstrings(tree: ast.Module) -> ast.Module:
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    node.body = body[1:] or [ast.Pass()]
    return tree


def cpu_signature() -> str:
    name = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                name += line
    except OSError:
        pass
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{platform.machine()}-{capability}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"


@dataclass(frozen=True)
class GraphKey:
    architecture: str
    dtype: str
    aux_layers: tuple[int, ...]
    code: str
    torch_version: str
    cpu: str
    weights: str = ""  # the frozen weights' values_digest; "" when the weights are inputs
    format: int = COMPILED_FORMAT

    @staticmethod
    def of(model: NativeLlama, aux_layers: tuple[int, ...]) -> GraphKey:
        dtype = str(model.dtype)
        if model.quantized:
            kernels = quant.int4_kernels(model)  # the graphs call one kernel or the other
            build = int4_kernel.build_for_cpu()  # which build's operator, and so which costs
            blocks = f"int4-blocks-{build.isa}" if build is not None else "int4-blocks"
            dtype = "int8" if not kernels else blocks if "blocks" in kernels else "int4"
        elif kernel_products(model):  # bf16 layers through one build's bf16 product
            build = int4_kernel.build_for_cpu()
            dtype = f"{dtype}-blocks-{build.isa if build is not None else ''}"
        architecture = architecture_digest(model)
        weights = values_digest(model) if frozen_weights(model) else ""
        code = code_digest(kernel_products(model))
        return GraphKey(architecture, dtype, aux_layers, code, torch.__version__, cpu_signature(), weights)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:20]


def use_chosen_bf16_products(model: NativeLlama) -> None:
    """A bf16 model whose layers run through causaldraft's kernel, on a CPU where oneDNN's reordered products were
    timed faster (``bf16_choice.layer_products``): its layer linears become plain ``nn.Linear`` over the same numbers
    (``quant.use_plain_linears``, in place), so the graphs freeze their weights for oneDNN and eager passes (long
    prompts) run oneDNN's products too. Nothing changes otherwise. ``compile_model`` calls it first."""
    if not model.quantized and quant.has_block_linears(model) and bf16_choice.layer_products() == bf16_choice.ONEDNN:
        quant.use_plain_linears(model)


def compile_model(
    model: NativeLlama, buckets: tuple[int, ...] | None = None, store: GraphStore | None = None,
    progress: bool = True,
) -> None:  # fmt: skip
    """Run ``model``'s passes of up to max(buckets) new tokens through compiled graphs, built on
    first use for this model, dtype and CPU (about a minute per bucket on 2 cores) and loaded from
    disk by later processes in about a second.

    New-token counts are padded up to ``buckets`` (default ``COMPILE_BUCKETS``,
    ``QUANTIZED_BUCKETS`` for int8/int4 weights); larger passes (a long prefill) run eagerly. The
    attention span is dynamic, so one graph per bucket serves every cache length. Graphs always
    return the inputs of ``default_aux_layers``, so plain decoding and feature drafters share them.
    Measured here, int4, 1 row: eager 32 ms, torch.compile 15 ms, these graphs 9 ms.
    A given ``store``'s key must be that of the model after ``use_chosen_bf16_products``."""
    use_chosen_bf16_products(model)
    if buckets is None:
        buckets = QUANTIZED_BUCKETS if model.quantized else COMPILE_BUCKETS
        if not model.quantized and kernel_products(model):
            buckets = (1, *buckets)  # row-invariant linears from one row: a one-row plain step pads nothing
        if model.llama_shape.num_heads == model.llama_shape.kv_heads:
            buckets = tuple(size for size in buckets if size > 1)  # one query row per kv head: see COMPILE_BUCKETS
    buckets = tuple(sorted(buckets))
    aux_layers = default_aux_layers(model.llama_shape.num_layers)
    store = store or GraphStore(GraphKey.of(model, aux_layers))
    if bool(store.key.weights) != frozen_weights(model):
        raise CausalDraftError("the graph store's key is not the model's (compiled.use_chosen_bf16_products)")
    weights = graph_inputs(model, store.key)
    packages = store.load_or_build(model, buckets, progress)
    model.graphs = {bucket: BoundGraph(package, weights, model.llama_shape.num_layers)
                    for bucket, package in packages.items()}  # fmt: skip
    model.graph_store = store
    model.buckets = buckets
    model.graph_aux_layers = aux_layers


def compile_batch(
    model: NativeLlama, sequences: int, progress: bool = True, buckets: tuple[int, ...] | None = None
) -> None:
    """Graphs for passes over ``sequences`` sequences at once (``NativeLlama.forward_batch``), one
    per bucket of rows per sequence (default ``batch_row_buckets``); the model must be compiled
    (``compile_model``) first, and shares its store."""
    store = model.graph_store
    if not isinstance(store, GraphStore):
        raise CausalDraftError("compile the model (compile_model) before its batch graphs")
    buckets = tuple(sorted(buckets or batch_row_buckets(model)))
    packages = store.load_or_build(model, buckets, progress, sequences)
    weights = graph_inputs(model, store.key)
    model.batch_graphs = {bucket: BoundGraph(package, weights, model.llama_shape.num_layers)
                          for bucket, package in packages.items()}  # fmt: skip
    model.batch_sequences = sequences


def batch_row_buckets(model: NativeLlama) -> tuple[int, ...]:
    """Rows per sequence of the batch graphs: the passes a batch of streams runs are smaller trees
    than one stream's (int4 pays for every row; bf16 up to 32 rows cost about two one-row passes)."""
    return (1, 2) if model.quantized else (1, 2, 4)


def compiler_available() -> str | None:
    """None when AOTInductor can build here, else why not (one line)."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as error:  # raises when no C++ compiler is found
        return f"no C++ compiler for torch's inductor ({error})"
    return None


class BoundGraph:
    """A loaded package with the model's weights bound, called with the body's per-pass tensors.

    The package's own call re-parses its input spec and walks every weight through ``pytree`` on
    each call (0.7 ms of a 12 ms int4 step, measured); here the flat weights are kept once and the
    per-pass tensors are appended in the export's order (weights by name, tokens, positions,
    slots, seen, tail_slots, each layer's keys, each layer's values), which is checked against
    the package's spec when bound.
    """

    def __init__(self, package: Any, weights: dict[str, torch.Tensor], num_layers: int) -> None:
        from torch.utils import _pytree as pytree

        self.loader = package.loader
        in_spec, out_spec = (pytree.treespec_loads(spec) for spec in self.loader.get_call_spec())
        tensor = torch.empty(0)
        caches = [tensor] * num_layers
        expected = pytree.tree_structure(((weights, *[tensor] * 5, caches, caches), {}))
        if in_spec != expected:
            raise CausalDraftError("a compiled graph's inputs differ from the model's; delete its directory to rebuild")
        self.weights = list(weights.values())
        self.out_spec = out_spec
        self.unflatten = pytree.tree_unflatten

    def __call__(
        self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, seen: torch.Tensor,
        tail_slots: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        flat = [*self.weights, tokens, positions, slots, seen, tail_slots, *keys, *values]
        hidden, aux = self.unflatten(self.loader.boxed_run(flat), self.out_spec)
        return hidden, aux


class _Body(torch.nn.Module):
    """The traced function: the weights passed as inputs first (``graph_inputs``; the others are the
    module's own parameters, constants of a frozen package), then the body's arguments."""

    def __init__(self, model: NativeLlama, aux_layers: tuple[int, ...]) -> None:
        super().__init__()
        self.model = model
        self.aux_layers = aux_layers

    def forward(
        self, weights: dict[str, torch.Tensor], tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
        seen: torch.Tensor, tail_slots: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
    ) -> Any:  # fmt: skip
        bound = _Bound(self.model, self.aux_layers)
        named = {f"model.{name}": tensor for name, tensor in weights.items()}
        layout = (seen, tail_slots)
        return torch.func.functional_call(bound, named, (tokens, positions, slots, layout, keys, values))


class _Bound(torch.nn.Module):
    def __init__(self, model: NativeLlama, aux_layers: tuple[int, ...]) -> None:
        super().__init__()
        self.model = model
        self.aux_layers = aux_layers

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
        layout: tuple[torch.Tensor, ...], keys: list[torch.Tensor], values: list[torch.Tensor],
    ) -> Any:  # fmt: skip
        return self.model.body(tokens, positions, BlockedKeys(*layout), slots, keys, values, self.aux_layers)


class GraphStore:
    """The packages of one key: ``bucket-<n>.pt2`` files, ``key.json`` and ``calibration.json``."""

    def __init__(self, key: GraphKey, root: Path | None = None) -> None:
        self.key = key
        self.directory = (root or causaldraft_home() / "compiled") / key.digest()
        self.builds = 0  # packages built by this process (tests check that nothing is rebuilt)

    def package(self, bucket: int, sequences: int = 1) -> Path:
        name = f"bucket-{bucket}" if sequences == 1 else f"batch-{sequences}x{bucket}"
        return self.directory / f"{name}.pt2"

    def load(self, bucket: int, sequences: int = 1) -> Runner | None:
        path = self.package(bucket, sequences)
        if not path.is_file():
            return None
        try:
            return torch._inductor.aoti_load_package(str(path))
        except Exception as error:  # a truncated or foreign file raises several types
            print(f"causaldraft: compiled graph {path} is unreadable ({error}); rebuilding it", file=sys.stderr)
            path.unlink(missing_ok=True)
            return None

    def build(self, model: NativeLlama, bucket: int, sequences: int = 1) -> Runner:
        """Export the body for ``sequences`` sequences of ``bucket`` rows (the attention span and
        cache capacity dynamic) and package it; the file appears atomically."""
        from torch.export import Dim

        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "key.json").write_text(json.dumps(asdict(self.key), indent=1))
        shape = model.llama_shape
        length = KEY_BLOCK + 6  # a head of one block: its length (the layout's span) is dynamic
        size = (sequences, shape.kv_heads, 5 * KEY_BLOCK + bucket, shape.head_dim)
        keys = [torch.zeros(size, dtype=model.cache_dtype) for _ in range(shape.num_layers)]
        values = [torch.zeros(size, dtype=model.cache_dtype) for _ in range(shape.num_layers)]
        mask = torch.ones(bucket, length + bucket, dtype=torch.bool).tril(length)
        positions = torch.arange(length, length + bucket)
        one = sequence_keys(mask, positions, length, bucket)
        if one is None:
            raise CausalDraftError(f"bucket {bucket} does not fit a key block of {KEY_BLOCK}")
        layout = stack_keys([one] * sequences)
        positions = positions.repeat(sequences, 1)
        slots = positions.clone()  # a distinct tensor: export would make one input of the same one passed twice
        args = (torch.zeros(sequences, bucket, dtype=torch.long), positions, slots, *layout.tensors(), keys, values)
        weights = graph_inputs(model, self.key)
        # the head length (the layout's span) and the cache capacity vary at run time; export
        # infers their ranges
        capacity, span = Dim.AUTO, Dim.AUTO
        dynamic = ({name: None for name in weights}, None, None, None, {2: span}, None,
                   [{2: capacity}] * len(keys), [{2: capacity}] * len(values))  # fmt: skip
        options = {**INDUCTOR_OPTIONS, "freezing": bool(self.key.weights)}
        with torch.no_grad(), tempfile.TemporaryDirectory(dir=self.directory) as work:  # freezing needs no_grad
            exported = torch.export.export(
                _Body(model, self.key.aux_layers), (weights, *args), dynamic_shapes=dynamic, strict=False
            )
            scratch = Path(work) / self.package(bucket, sequences).name
            torch._inductor.aoti_compile_and_package(exported, package_path=str(scratch), inductor_configs=options)
            scratch.replace(self.package(bucket, sequences))
        self.builds += 1
        runner = self.load(bucket, sequences)
        if runner is None:
            raise CausalDraftError(f"the compiled graph just built at {self.package(bucket, sequences)} does not load")
        return runner

    def load_or_build(
        self, model: NativeLlama, buckets: tuple[int, ...], progress: bool = True, sequences: int = 1
    ) -> dict[int, Runner]:
        runners: dict[int, Runner] = {}
        for bucket in buckets:
            runner = self.load(bucket, sequences)
            if runner is not None:
                runners[bucket] = runner
        missing = [bucket for bucket in buckets if bucket not in runners]
        if missing:
            per_bucket = SECONDS_PER_FROZEN_BUCKET if self.key.weights else SECONDS_PER_BUCKET
            seconds = len(missing) * per_bucket * max(0.3, model.llama_shape.num_layers / 30)
            slow = seconds * SLOW_CPU_FACTOR
            estimate = f"{seconds / 60:.0f}-{slow / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f}-{slow:.0f} s"
            what = "graphs" if sequences == 1 else f"graphs for batches of {sequences} sequences"
            print(f"causaldraft: compiling {len(missing)} {what} for this model, dtype and CPU, once "
                  f"(about {estimate}; later starts load them from {self.directory})", file=sys.stderr)  # fmt: skip
            bar = tqdm(missing, desc="compile", unit="graph", disable=not progress)
            for bucket in bar:
                bar.set_postfix(rows=bucket, sequences=sequences)
                runners[bucket] = self.build(model, bucket, sequences)
        return runners

    def read_calibration(self, name: str) -> dict[int, float] | None:
        path = self.directory / "calibration.json"
        try:
            saved = json.loads(path.read_text())[name]
            return {int(size): float(seconds) for size, seconds in saved.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def write_calibration(self, name: str, seconds: dict[int, float]) -> None:
        path = self.directory / "calibration.json"
        try:
            saved = json.loads(path.read_text()) if path.is_file() else {}
        except ValueError:
            saved = {}
        saved[name] = {str(size): value for size, value in seconds.items()}
        scratch = path.with_suffix(f".{time.time_ns()}.tmp")
        scratch.write_text(json.dumps(saved, indent=1))
        scratch.replace(path)

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
