"""The ``eagle3`` drafter: the EAGLE-3 draft layer grows a tree level by level with its own KV cache.

Draft cache (one layer, rows = rope positions): rows 0 .. T-1 mirror the target's committed prefix
(row p: token x_{p+1}, hidden fc(a_p) from the target's features). Features arrive after each
step for the accepted path (root and accepted nodes) and at prefill for the prompt. The prompt's
rows run at once (part of the prefill); a step's rows wait in ``pending`` and run in one pass once
the cost model's gate lets the next tree draft its first level, with the gate's clock for that level
restarted after them: the gate's level times are drafting alone (docs/eagle3.md: what went wrong
when they were not), and a step the gate keeps plain runs no layer pass at all. Rows left waiting
run every ``CATCH_UP_ROWS``, in one pass. The last prefix row (token = the root) predicts the root's
children.

Drafting a tree: the nodes of depth d >= 1 are one pass of the layer, each node a row at position
T - 1 + d with its own token and its parent row's output as hidden, attending to the prefix and
to its ancestors' rows (tree mask), written after the prefix. They are discarded by the next
catch-up, which overwrites them: rollback is just the prefix length.

Worked example (T = 10, root r, depth-1 nodes a, b, depth-2 node c under a): rows 0..9 hold the
prefix (row 9 has token r). Level 1: rows 10 (a) and 11 (b), both at position 10, hidden = output
of row 9; mask: columns 0..9 and their own column. Level 2: row 12 (c) at position 11, hidden =
output of row 10; columns 0..9, 10 and 12. If the target then accepts a and emits bonus y, the
pending rows are 10 (token a, features of r) and 11 (token y, features of a): the catch-up
overwrites rows 10 and 11, and row 11's output proposes y's children.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from causaldraft.adapt import DepthGate
from causaldraft.drafters.base import Draft, DraftContext, StepResult
from causaldraft.drafters.eagle3_model import CONFIG_FILE, Eagle3Layer, load_layer, pack_linears, read_config
from causaldraft.drafters.lookup import LookupMerge
from causaldraft.drafters.ranking import rank_children
from causaldraft.drafters.store import NgramStore
from causaldraft.errors import CausalDraftError
from causaldraft.models.base import Backend
from causaldraft.models.loading import LoadedModel
from causaldraft.models.quant import Int8Linear, quantize_int8
from causaldraft.paths import trained_directory
from causaldraft.tree import Candidates, LevelGate, Tree, build_tree

INITIAL_ROWS = 1024


CATCH_UP_ROWS = 16  # queued rows that are processed at once, outside the timed drafting


class Eagle3Drafter:
    name = "eagle3"

    def __init__(
        self,
        layer: Eagle3Layer,
        backend: Backend,
        lookup_merge: bool = True,
        int8: bool = False,
        store: NgramStore | None = None,
    ) -> None:
        """``int8``: output projection in int8 per row (for quantized targets whose layer could not be
        packed for oneDNN: ``pack_linears``). ``store``: the n-gram store the merged lookup also walks."""
        self.layer = layer
        self.backend = backend
        self.int8 = int8
        self.feature_layers = layer.config.aux_layers
        self.lookup = LookupMerge(store) if lookup_merge else None
        c = layer.config
        self.keys = torch.zeros(c.kv_heads, INITIAL_ROWS, c.head_dim, dtype=layer.dtype)  # [kvh, rows, hd]
        self.values = torch.zeros_like(self.keys)
        self.committed = 0  # prefix rows in the cache
        self.pending_tokens: list[int] = []  # tokens x_{p+1} of the rows waiting to be run
        self.pending_features: list[torch.Tensor] = []  # their features, [m, F] chunks
        self.root_out: torch.Tensor | None = None  # [h] output of the last prefix row
        self.project: Callable[[torch.Tensor], torch.Tensor] = (
            Int8Linear(quantize_int8(layer.lm_head.weight.detach()), None) if int8 else layer.lm_head
        )  # [m, h] -> [m, V']

    def fork(self) -> Eagle3Drafter:
        store = self.lookup.lookup.store if self.lookup is not None else None
        return Eagle3Drafter(self.layer, self.backend, self.lookup is not None, self.int8, store)

    def start(self, prompt: tuple[int, ...], features: torch.Tensor | None) -> None:
        self.committed = 0
        self.root_out = None
        self.pending_tokens, self.pending_features = [], []
        if features is not None:
            self.queue(prompt[1:], features)
            with torch.inference_mode():
                self.catch_up()
        if self.lookup is not None:
            self.lookup.start(prompt)

    def queue(self, tokens: tuple[int, ...] | list[int], features: torch.Tensor) -> None:
        """Rows for the next target positions: features [m, F] and the m tokens that follow them."""
        if features.shape[0] != len(tokens):
            raise ValueError(f"{features.shape[0]} feature rows for {len(tokens)} tokens")
        self.pending_tokens.extend(tokens)
        self.pending_features.append(features)

    def ensure_rows(self, rows: int) -> None:
        if rows <= self.keys.shape[1]:
            return
        size = max(rows, 2 * self.keys.shape[1])
        for name in ("keys", "values"):
            old = getattr(self, name)
            grown = torch.zeros(old.shape[0], size, old.shape[2], dtype=old.dtype)
            grown[:, : old.shape[1]] = old
            setattr(self, name, grown)

    def catch_up(self) -> None:
        """Run the pending prefix rows (one causal pass); the last one's output proposes children."""
        if not self.pending_tokens:
            return
        count, start = len(self.pending_tokens), self.committed
        self.ensure_rows(start + count + 1)
        features = torch.cat(self.pending_features).to(self.layer.dtype)  # [m, F]
        tokens = torch.tensor(self.pending_tokens, dtype=torch.long)
        mask = torch.ones(count, start + count, dtype=torch.bool)
        mask[:, start:] = torch.ones(count, count, dtype=torch.bool).tril()
        rows = torch.arange(start, start + count)
        out = self.layer.step(
            self.backend.embed(tokens).to(self.layer.dtype), self.layer.fc(features), rows, mask,
            self.keys, self.values, rows,
        )  # fmt: skip
        self.root_out = out[-1]
        self.committed += count
        self.pending_tokens, self.pending_features = [], []

    def propose(self, context: DraftContext) -> Draft:
        """The tree; the queued prefix rows run when the gate allows a first level (``catching_up``)."""
        rows = self.committed + len(self.pending_tokens)
        if rows != len(context.tokens) - 1 or (self.root_out is None and not self.pending_tokens):
            return Draft.root_only(context.tokens[-1])
        paths = self.lookup.paths(context) if self.lookup is not None else []
        with torch.inference_mode():
            expand = self.expander(context)
            merged = self.lookup.scores(paths) if self.lookup is not None else {}
            draft = build_tree(context.tree_kind, context.tokens[-1], expand, context.depth, context.width,
                               context.max_nodes, self.catching_up(context.gate), merged)  # fmt: skip
        if self.lookup is not None:
            draft = self.lookup.merge(draft, paths, context.max_nodes)
        return Draft.from_tree_draft(draft, "deterministic")

    def catching_up(self, gate: LevelGate | None) -> LevelGate | None:
        """``gate``, with the queued rows run once it allows the first level, and that level's clock
        restarted after them (a ``DepthGate``), so the level's measured time is drafting alone."""
        if gate is None:
            return None

        def ask(scores: list[float], frontier: list[float], level: int) -> bool:
            allowed = gate(scores, frontier, level)
            if allowed and level == 0 and self.pending_tokens:
                self.catch_up()
                if isinstance(gate, DepthGate):
                    gate.restart_level()
            return allowed

        return ask

    def expander(self, context: DraftContext) -> Callable[[Tree, list[int]], list[Candidates]]:
        """The tree builder's expand(tree, nodes): one layer pass per call over the given nodes
        (all of one depth), then each node's top children."""
        layer = self.layer
        count = 1 if context.tree_kind == "chain" else context.width
        outputs: dict[int, torch.Tensor] = {}  # node -> its row's output [h]
        slots: dict[int, int] = {}  # node -> its cache row
        written = 0
        root_position = len(context.tokens) - 1

        def expand(tree: Tree, nodes: list[int]) -> list[Candidates]:
            nonlocal written
            if 0 not in outputs:  # the first expansion: the last prefix row (run by ``catch_up``) is the root's
                self.catch_up()  # without a gate (fixed trees) the queued rows run here
                assert self.root_out is not None
                outputs[0], slots[0], written = self.root_out, self.committed - 1, self.committed
            fresh = [node for node in nodes if node not in outputs]
            depths = tree.depths
            if fresh:
                self.ensure_rows(written + len(fresh) + 1)
                rows = torch.arange(written, written + len(fresh))
                mask = torch.zeros(len(fresh), written + len(fresh), dtype=torch.bool)
                mask[:, : self.committed] = True
                for row, node in enumerate(fresh):
                    slots[node] = written + row
                    ancestor = node
                    while ancestor != 0:
                        mask[row, slots[ancestor]] = True
                        ancestor = tree.parents[ancestor]
                tokens = torch.tensor([tree.tokens[node] for node in fresh], dtype=torch.long)
                hidden = torch.stack([outputs[tree.parents[node]] for node in fresh])  # [m, h]
                positions = torch.tensor([self.committed - 1 + depths[node] for node in fresh])
                embeds = self.backend.embed(tokens).to(layer.dtype)
                out = layer.step(embeds, hidden, positions, mask, self.keys, self.values, rows)
                for row, node in enumerate(fresh):
                    outputs[node] = out[row]
                written += len(fresh)
            states = torch.stack([outputs[node] for node in nodes])  # [m, h]
            logits = self.project(layer.norm(states)).float()  # [m, V']
            children_at = [root_position + depths[node] + 1 for node in nodes]
            c = layer.config
            temperatures = (c.score_temperature, c.sampling_temperature_scale, c.noise_score_temperature)
            return rank_children(logits, layer.vocab_ids, c.vocab_size, count, context, children_at, *temperatures)

        return expand

    def observe(self, result: StepResult) -> None:
        if result.features is not None:
            self.queue(result.acceptance.tokens, result.features)
            if len(self.pending_tokens) >= CATCH_UP_ROWS:
                # a long fallback stretch: run its rows now, in one pass (~0.1 ms a row), so the next
                # speculative step's drafting time is drafting, not the stretch's bookkeeping
                with torch.inference_mode():
                    self.catch_up()
        if self.lookup is not None:
            self.lookup.observe(result)


class RootRecorder:
    """An eagle3 drafter that also keeps, at each step drafted from an up-to-date draft cache, the output of the
    row that proposes the root's children (``root_out``), keyed by the sequence's length at that step: what the
    decode loop fed the layer, to compare with ``teacher_forced_rows`` (tests, ``bench/eagle3_replay.py``)."""

    def __init__(self, inner: Eagle3Drafter) -> None:
        self.inner = inner
        self.name = inner.name
        self.feature_layers = inner.feature_layers
        self.roots: dict[int, torch.Tensor] = {}  # sequence length n -> [h] output of draft row n - 2

    def start(self, prompt: tuple[int, ...], features: torch.Tensor | None) -> None:
        self.roots = {}
        self.inner.start(prompt, features)

    def propose(self, context: DraftContext) -> Draft:
        draft = self.inner.propose(context)
        caught_up = not self.inner.pending_tokens and self.inner.committed == len(context.tokens) - 1
        if caught_up and self.inner.root_out is not None:
            self.roots[len(context.tokens)] = self.inner.root_out.clone()
        return draft

    def observe(self, result: StepResult) -> None:
        self.inner.observe(result)

    def fork(self) -> RootRecorder:
        return RootRecorder(self.inner.fork())


def teacher_forced_rows(drafter: Eagle3Drafter, tokens: list[int]) -> torch.Tensor:
    """The layer's outputs [len(tokens) - 1, h] over a whole sequence at once, as training computes them: one
    plain target pass gives the features, and draft row p (token x_{p+1}, features of position p) predicts
    x_{p+2}."""
    layer, backend, length = drafter.layer, drafter.backend, len(tokens)
    with torch.inference_mode():
        out = backend.forward(torch.tensor(tokens), torch.arange(length),
                              torch.ones(length, length, dtype=torch.bool).tril(), backend.new_cache(length),
                              aux_layers=layer.config.aux_layers)  # fmt: skip
        if out.aux is None:
            raise CausalDraftError("the target returned no features for the eagle3 layer")
        rows = torch.arange(length - 1)
        keys = torch.zeros(layer.config.kv_heads, length, layer.config.head_dim, dtype=layer.dtype)
        embeds = backend.embed(torch.tensor(tokens[1:])).to(layer.dtype)
        causal = torch.ones(length - 1, length - 1, dtype=torch.bool).tril()
        return layer.step(embeds, layer.fc(out.aux[:-1].to(layer.dtype)), rows, causal, keys,
                          torch.zeros_like(keys), rows)  # fmt: skip


def default_eagle3_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "heads" / "default" / "eagle3"


def shipped_eagle3_fits(target: LoadedModel) -> bool:
    """Whether the package ships an eagle3 layer for ``target`` (the default model)."""
    directory = default_eagle3_dir()
    return (directory / CONFIG_FILE).is_file() and read_config(directory)[0].fingerprint == target.base_fingerprint


def load_eagle3_drafter(target, options, store: NgramStore | None = None) -> Eagle3Drafter:  # type: ignore[no-untyped-def]
    """The registry's constructor: options.heads, or the shipped layer for the default model."""
    fingerprint = target.base_fingerprint
    if options.heads is not None:
        directory = trained_directory(options.heads, "eagle3 directory")
    else:
        directory = default_eagle3_dir()
        if not shipped_eagle3_fits(target):
            raise CausalDraftError(
                "no trained eagle3 drafter for this model; pass --heads DIR (see causaldraft train-heads "
                "--heads eagle3) or use --drafter lookup"
            )
    shape = target.backend.shape
    layer = load_layer(directory, fingerprint, shape.vocab_size, shape.hidden_size)
    if max(layer.config.aux_layers) > shape.num_layers:
        raise CausalDraftError(f"eagle3 aux layers {layer.config.aux_layers} exceed the target's {shape.num_layers}")
    quantized = target.backend.quantized
    layer = layer.cast(torch.bfloat16 if quantized else target.backend.dtype)
    packed = pack_linears(layer)  # bf16: DraftLinear products (int8, oneDNN reordered weights)
    return Eagle3Drafter(layer, target.backend, options.lookup_merge, int8=quantized and not packed, store=store)
