"""Draft heads on the target's last hidden state: ``markov`` (token-conditioned, recurrent) and
``medusa`` (hidden state only), with a reduced draft vocabulary scored by the target's LM-head rows.

Notation: the verify pass gave h_t, the target's final hidden state that predicted the root
x_{t+1}. Head k drafts x_{t+1+k}.

- markov (an MLPSpeculator-like recurrence): s_0 = h_t and
  s_k = GELU(LN_k(W_s,k s_{k-1} + W_e,k rms(E[x_{t+k}]))), where E is the target's frozen token
  embedding and x_{t+k} the token on the node's own path (x_{t+1} = the root for head 1). So every
  child in the tree is conditioned on its ancestors.
- medusa: s_k = h_t + SiLU(W_k h_t), the same for every node of one depth.

Logits of head k: out(LNo_k(s_k)) over V' draft ids, where ``out`` holds the target's LM-head rows of
those ids (frozen, read from the target at load time; only the id list is saved).

Worked example (K = 2, root "the", tree the -> {cat, dog}, cat -> {sat}): state(root) = s_1 from
(h_t, E["the"]); head 1 on it ranks "cat", "dog". state("cat") = s_2 from (state(root), E["cat"]);
head 2 on it ranks "sat". A node at depth K gets no children.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from causaldraft.drafters.base import Draft, DraftContext, StepResult
from causaldraft.drafters.lookup import LookupMerge
from causaldraft.drafters.ranking import rank_children
from causaldraft.drafters.store import NgramStore
from causaldraft.errors import CausalDraftError
from causaldraft.models.base import Backend
from causaldraft.models.identity import OLD_FINGERPRINTS
from causaldraft.models.loading import LoadedModel
from causaldraft.models.packed import DraftLinear
from causaldraft.models.products import native_bf16_products
from causaldraft.models.quant import Int8Linear, quantize_int8
from causaldraft.paths import trained_directory
from causaldraft.tree import Candidates, Tree, build_tree

HEAD_KINDS = ("markov", "medusa")
CONFIG_FILE = "heads_config.json"
WEIGHTS_FILE = "heads.safetensors"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class HeadsConfig:
    kind: str
    num_heads: int
    hidden_size: int
    vocab_size: int  # the target's full vocabulary
    draft_vocab: int  # V'
    fingerprint: str  # LoadedModel.base_fingerprint of the base model

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise CausalDraftError(f"heads kind must be one of {', '.join(HEAD_KINDS)}, got {self.kind!r}")
        if self.num_heads < 1 or self.hidden_size < 1 or not 1 <= self.draft_vocab <= self.vocab_size:
            raise CausalDraftError(f"invalid heads sizes: {self}")


def rms_normalise(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class DraftHeads(nn.Module):
    """The trainable part of both kinds, plus the frozen output rows and draft-vocabulary ids."""

    vocab_ids: torch.Tensor  # [V'] full-vocabulary id of each draft id
    out_weight: torch.Tensor  # [V', hidden] the target's LM-head rows of those ids
    state_proj: nn.ModuleList
    embed_proj: nn.ModuleList
    norms: nn.ModuleList
    blocks: nn.ModuleList

    def __init__(self, config: HeadsConfig, vocab_ids: torch.Tensor, out_weight: torch.Tensor) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_heads
        self.config = config
        self.register_buffer("vocab_ids", vocab_ids.long(), persistent=False)  # [V']
        self.register_buffer("out_weight", out_weight.detach().clone(), persistent=False)  # [V', hidden]
        self.out_norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(heads))
        markov = heads if config.kind == "markov" else 0
        medusa = heads if config.kind == "medusa" else 0
        self.state_proj = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(markov))
        self.embed_proj = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(markov))
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(markov))
        self.blocks = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(medusa))
        for block in self.blocks:
            assert isinstance(block, nn.Linear)
            nn.init.zeros_(block.weight)  # Medusa's ResBlock starts as the identity
        for proj in self.state_proj:
            assert isinstance(proj, nn.Linear)
            nn.init.eye_(proj.weight)  # markov starts by carrying h_t forward

    def step(self, head: int, state: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """markov: s_{head+1} from s_head [m, hidden] and the path tokens' embeddings [m, hidden]."""
        mixed = self.state_proj[head](state) + self.embed_proj[head](rms_normalise(token_embeds))  # [m, hidden]
        return nn.functional.gelu(self.norms[head](mixed))

    def medusa_state(self, head: int, hidden: torch.Tensor) -> torch.Tensor:
        """medusa: head ``head``'s state from h_t [m, hidden]."""
        return hidden + nn.functional.silu(self.blocks[head](hidden))

    def logits(self, head: int, state: torch.Tensor) -> torch.Tensor:
        """[m, hidden] -> [m, V'] draft-vocabulary logits."""
        return self.out_norms[head](state) @ self.out_weight.t()


def new_heads(config: HeadsConfig, vocab_ids: torch.Tensor, lm_head: torch.Tensor, seed: int = 0) -> DraftHeads:
    """Freshly initialised heads; ``lm_head`` [vocab, hidden] is the target's output matrix."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return DraftHeads(config, vocab_ids, lm_head.detach().float().index_select(0, vocab_ids.long()))


def save_heads(heads: DraftHeads, directory: Path, extra: dict[str, object] | None = None) -> None:
    """heads.safetensors (bf16 weights + vocab ids) and heads_config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: value.detach().to(torch.bfloat16).contiguous() for name, value in heads.state_dict().items()}
    tensors["vocab_ids"] = heads.vocab_ids.to(torch.int32).contiguous()
    save_file(tensors, str(directory / WEIGHTS_FILE))
    record: dict[str, object] = {"format": FORMAT_VERSION, **heads.config.__dict__, **(extra or {})}
    (directory / CONFIG_FILE).write_text(json.dumps(record, indent=2) + "\n")


def read_config(directory: Path) -> tuple[HeadsConfig, dict[str, object]]:
    path = directory / CONFIG_FILE
    if not path.is_file():
        from causaldraft.drafters import eagle3_model

        if (directory / eagle3_model.CONFIG_FILE).is_file():
            raise CausalDraftError(f"{directory} holds an eagle3 layer, not markov/medusa heads: use --drafter eagle3")
        raise CausalDraftError(f"no trained heads in {directory}: {CONFIG_FILE} is missing")
    try:
        record = json.loads(path.read_text())
        fields = {name: record[name] for name in HeadsConfig.__dataclass_fields__}
        if record.get("format") != FORMAT_VERSION:
            raise CausalDraftError(f"{path}: unsupported heads format {record.get('format')!r}")
        return HeadsConfig(**fields), record
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise CausalDraftError(f"corrupt heads config {path}: {error}") from error


def load_heads(directory: Path, target: LoadedModel, kind: str | None = None) -> DraftHeads:
    """Load trained heads for ``target``; fail clearly on a kind or base-model mismatch."""
    config, _ = read_config(directory)
    fingerprint = target.base_fingerprint
    if kind is not None and config.kind != kind:
        raise CausalDraftError(f"{directory} holds {config.kind} heads, not {kind} heads")
    if config.fingerprint != fingerprint or config.hidden_size != target.backend.shape.hidden_size:
        raise CausalDraftError(
            f"heads in {directory} were trained for another base model (fingerprint {config.fingerprint}, "
            f"this model {fingerprint}); train heads for it with causaldraft train-heads ({OLD_FINGERPRINTS})"
        )
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise CausalDraftError(f"no trained heads in {directory}: {WEIGHTS_FILE} is missing")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as error:
        raise CausalDraftError(f"corrupt heads weights {path}: {error}") from error
    vocab_ids = tensors.pop("vocab_ids", None)
    if vocab_ids is None or vocab_ids.numel() != config.draft_vocab:
        raise CausalDraftError(f"corrupt heads weights {path}: missing or wrong-sized vocab_ids")
    if int(vocab_ids.min()) < 0 or int(vocab_ids.max()) >= target.backend.shape.vocab_size:
        raise CausalDraftError(f"corrupt heads weights {path}: draft ids outside the vocabulary")
    heads = new_heads(config, vocab_ids, target.backend.lm_head_weight())
    try:
        heads.load_state_dict({name: value.float() for name, value in tensors.items()})
    except RuntimeError as error:
        raise CausalDraftError(f"corrupt heads weights {path}: {error}") from error
    return heads.eval()


def draft_projection(heads: DraftHeads, int8: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """The heads' output rows as a drafting product, read in bf16 (drafting reads them once per
    tree level: memory-bound): a DraftLinear where oneDNN is available (int8 for one or two rows,
    the reordered weight above); without it, int8 per row for quantized targets, else bf16."""
    out_weight = heads.out_weight.to(torch.bfloat16)  # [V', hidden]
    if native_bf16_products():
        return DraftLinear(out_weight)
    if int8:
        return Int8Linear(quantize_int8(heads.out_weight), None)
    return lambda x: x @ out_weight.t()


class HeadsDrafter:
    """Grows chain/static/dynamic trees from the heads, optionally merged with prompt lookup."""

    feature_layers: tuple[int, ...] = ()

    def __init__(
        self,
        heads: DraftHeads,
        backend: Backend,
        lookup_merge: bool = True,
        int8: bool = False,
        project: Callable[[torch.Tensor], torch.Tensor] | None = None,
        store: NgramStore | None = None,
    ) -> None:
        """``project``: the output projection [m, hidden] bf16 -> [m, V'] logits (a fork shares its
        drafter's); by default ``draft_projection(heads, int8)``. ``store``: the n-gram store the
        merged lookup also walks."""
        self.heads = heads
        self.backend = backend
        self.int8 = int8
        self.name = heads.config.kind
        self.lookup = LookupMerge(store) if lookup_merge else None
        self.project = project if project is not None else draft_projection(heads, int8)

    def fork(self) -> HeadsDrafter:
        store = self.lookup.lookup.store if self.lookup is not None else None
        return HeadsDrafter(self.heads, self.backend, self.lookup is not None, self.int8, self.project, store)

    def start(self, prompt: tuple[int, ...], features: torch.Tensor | None = None) -> None:
        if self.lookup is not None:
            self.lookup.start(prompt)

    def propose(self, context: DraftContext) -> Draft:
        if context.hidden is None:
            return Draft.root_only(context.tokens[-1])
        paths = self.lookup.paths(context) if self.lookup is not None else []
        with torch.inference_mode():
            expand = self.expander(context)
            merged = self.lookup.scores(paths) if self.lookup is not None else {}
            draft = build_tree(context.tree_kind, context.tokens[-1], expand, context.depth, context.width,
                               context.max_nodes, context.gate, merged)  # fmt: skip
        if self.lookup is not None:
            draft = self.lookup.merge(draft, paths, context.max_nodes)
        return Draft.from_tree_draft(draft, "deterministic")

    def expander(self, context: DraftContext):  # type: ignore[no-untyped-def]
        """The tree builder's expand(tree, nodes): each node's top children from head depth + 1."""
        heads = self.heads
        count = 1 if context.tree_kind == "chain" else context.width
        hidden = context.hidden.float().unsqueeze(0)  # type: ignore[union-attr]  # [1, hidden]
        states: dict[int, torch.Tensor] = {}  # node -> its state [hidden] (s_{depth+1})
        medusa_states: dict[int, torch.Tensor] = {}
        root_position = len(context.tokens) - 1

        def expand(tree: Tree, nodes: list[int]) -> list[Candidates]:
            depths = tree.depths
            live = [node for node in nodes if depths[node] < heads.config.num_heads]
            result: dict[int, Candidates] = {node: [] for node in nodes}
            for depth in sorted({depths[node] for node in live}):
                group = [node for node in live if depths[node] == depth]
                state = self.group_states(tree, group, depth, hidden, states, medusa_states)  # [m, hidden]
                if heads.config.kind == "medusa":
                    state = state[:1]  # one distinct row per depth
                normed = heads.out_norms[depth](state).to(torch.bfloat16)  # [m, hidden]
                logits = self.project(normed).float()  # [m, V'] (one row for medusa)
                children_at = [root_position + depth + 1] * logits.shape[0]
                ranked = rank_children(logits, heads.vocab_ids, heads.config.vocab_size, count, context, children_at)
                for row, node in enumerate(group):
                    result[node] = ranked[min(row, len(ranked) - 1)]
            return [result[node] for node in nodes]

        return expand

    def group_states(
        self,
        tree: Tree,
        group: list[int],
        depth: int,
        hidden: torch.Tensor,  # [1, hidden]
        states: dict[int, torch.Tensor],
        medusa_states: dict[int, torch.Tensor],
    ) -> torch.Tensor:
        """States [m, hidden] of same-depth nodes, from their parents' states and their tokens."""
        heads = self.heads
        if heads.config.kind == "medusa":
            if depth not in medusa_states:
                medusa_states[depth] = heads.medusa_state(depth, hidden)
            return medusa_states[depth].expand(len(group), -1)  # every node of a depth: same children
        if depth == 0:
            parents = hidden.expand(len(group), -1)
        else:
            parents = torch.stack([states[tree.parents[node]] for node in group])  # [m, hidden]
        tokens = torch.tensor([tree.tokens[node] for node in group], dtype=torch.long)
        embeds = self.backend.embed(tokens).float()  # [m, hidden]
        state = heads.step(depth, parents, embeds)
        for row, node in enumerate(group):
            states[node] = state[row]
        return state

    def observe(self, result: StepResult) -> None:
        if self.lookup is not None:
            self.lookup.observe(result)


def default_heads_dir(kind: str) -> Path:
    return Path(__file__).resolve().parent.parent / "heads" / "default" / kind


def shipped_heads_fit(kind: str, target: LoadedModel) -> bool:
    """Whether heads of this kind ship with the package for ``target``."""
    directory = default_heads_dir(kind)
    return (directory / CONFIG_FILE).is_file() and read_config(directory)[0].fingerprint == target.base_fingerprint


def load_heads_drafter(kind: str, target, options, store: NgramStore | None = None) -> HeadsDrafter:  # type: ignore[no-untyped-def]
    """The registry's constructor: options.heads, or the shipped heads when the target is the
    default model; otherwise a clear error."""
    if kind not in HEAD_KINDS:
        raise CausalDraftError(f"heads kind must be one of {', '.join(HEAD_KINDS)}, got {kind!r}")
    if options.heads is not None:
        directory = trained_directory(options.heads, "heads directory")
    else:
        directory = default_heads_dir(kind)
        if not shipped_heads_fit(kind, target):
            raise CausalDraftError(
                f"no trained {kind} heads for this model; pass --heads DIR (see causaldraft train-heads) "
                "or use --drafter lookup"
            )
    heads = load_heads(directory, target, kind)
    quantized = target.backend.quantized  # int8/int4 target: int8 drafting too
    return HeadsDrafter(heads, target.backend, lookup_merge=options.lookup_merge, int8=quantized, store=store)
