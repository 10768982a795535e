"""The EAGLE-3 draft layer: one Llama decoder layer over fused target features (see docs/eagle3.md).

Notation: at position p the target was fed x_p; its auxiliary features a_p are the inputs of three
of its layers (low, middle, high), concatenated. Draft row p (rope position p) reads the token
x_{p+1} and a hidden state g_p and predicts x_{p+2}:

    g_p   = fc(a_p)                         (rows of the accepted prefix: target features)
    g_p   = draft output of the parent row  (rows of drafted tokens)
    e     = input_layernorm(E[x_{p+1}]),  u = hidden_norm(g_p)
    y     = g_p + o_proj(attention(qkv_proj([e, u])))      (rope at position p)
    out_p = y + mlp(post_attention_layernorm(y))           (fed to the row's children)
    logits_p = lm_head(norm(out_p))  over the draft vocabulary; target id = vocab_ids[draft id]

This is vLLM's ``llama_eagle3`` layer (norm after the residual) and the ``speculators`` package's
EAGLE-3 first layer, so an exported checkpoint is served unchanged (``causaldraft export-heads``).
E is the target's frozen token embedding.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig

from causaldraft.errors import CausalDraftError
from causaldraft.models import attention_kernel
from causaldraft.models.identity import OLD_FINGERPRINTS
from causaldraft.models.native import RMSNorm, apply_rope, attend, rope_inverse_frequencies
from causaldraft.models.packed import DraftLinear

CONFIG_FILE = "eagle3_config.json"
WEIGHTS_FILE = "eagle3.safetensors"
FORMAT_VERSION = 1
CALIBRATION_FIELDS = ("score_temperature", "sampling_temperature_scale", "noise_score_temperature")  # optional
# ropes whose frequencies do not change with the sequence length, as vLLM and speculators run them too
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def check_rope_type(rope_type: str) -> None:
    if rope_type not in ROPE_TYPES:
        raise CausalDraftError(f"the eagle3 layer takes the {', '.join(ROPE_TYPES)} ropes, not {rope_type!r}")


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    vocab_size: int  # the target's
    draft_vocab: int
    aux_layers: tuple[int, ...]  # target layers whose inputs are the features
    target_layers: int
    rope_theta: float
    max_positions: int
    fingerprint: str  # LoadedModel.base_fingerprint of the target
    # calibration (train/calibration.py; 1.0 in configs written before it): node scores are
    # softmax(logits / score_temperature); Gumbel sampling ranks at T * sampling_temperature_scale
    # and scores softmax((log q + g) / noise_score_temperature) (drafters/ranking.noise_scores)
    score_temperature: float = 1.0
    sampling_temperature_scale: float = 1.0
    noise_score_temperature: float = 1.0
    # the target's scaled rope (transformers' ``rope_parameters``: rope_type, rope_theta, factor, ...);
    # None (configs written before it, and targets with the default rope): the default rope at rope_theta
    rope_parameters: dict[str, object] | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.draft_vocab <= self.vocab_size or self.num_heads % self.kv_heads:
            raise CausalDraftError(f"invalid eagle3 sizes: {self}")
        temperatures = (self.score_temperature, self.sampling_temperature_scale, self.noise_score_temperature)
        if not all(math.isfinite(value) and value > 0 for value in temperatures):
            raise CausalDraftError(f"eagle3 calibration temperatures must be positive and finite: {self}")
        if not self.aux_layers or any(not 0 <= layer <= self.target_layers for layer in self.aux_layers):
            raise CausalDraftError(f"eagle3 aux layers {self.aux_layers} outside [0, {self.target_layers}]")
        check_rope_type(str(self.rope["rope_type"]))

    @property
    def rope(self) -> dict[str, object]:
        """The layer's rope in transformers' ``rope_parameters`` form (the default rope at rope_theta if none)."""
        return dict(self.rope_parameters or {"rope_type": "default", "rope_theta": self.rope_theta})

    @property
    def feature_size(self) -> int:
        return len(self.aux_layers) * self.hidden_size

    def part_rows(self) -> tuple[int, int, int]:
        kv = self.kv_heads * self.head_dim
        return (self.num_heads * self.head_dim, kv, kv)


class DraftNorm(RMSNorm):
    """The layer's RMSNorm, its weight in the input's dtype: under training's bf16 autocast the input is bf16 and
    the weight fp32, which ``F.rms_norm`` cannot fuse (it warned and took its slow path). Where the dtypes agree
    (drafting, the export check) this is ``RMSNorm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)


class Eagle3Layer(nn.Module):
    vocab_ids: torch.Tensor  # [V'] target id of each draft id (sorted)
    inv_freq: torch.Tensor  # [head_dim // 2]
    attention_scaling: float  # cos and sin are scaled by it (yarn; 1.0 otherwise)

    def __init__(self, config: Eagle3Config, vocab_ids: torch.Tensor) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.register_buffer("vocab_ids", vocab_ids.long().clone(), persistent=False)
        inv_freq, self.attention_scaling = rope_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.fc = nn.Linear(config.feature_size, hidden, bias=False)
        self.input_layernorm = DraftNorm(hidden, config.rms_eps)
        self.hidden_norm = DraftNorm(hidden, config.rms_eps)
        self.qkv_proj = nn.Linear(2 * hidden, sum(config.part_rows()), bias=False)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, hidden, bias=False)
        self.post_attention_layernorm = DraftNorm(hidden, config.rms_eps)
        self.gate_up_proj = nn.Linear(hidden, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, hidden, bias=False)
        self.norm = DraftNorm(hidden, config.rms_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def cast(self, dtype: torch.dtype) -> Eagle3Layer:
        """Weights in ``dtype``; the rope frequencies stay float32."""
        inv_freq = self.inv_freq.float()
        self.to(dtype)
        self.inv_freq = inv_freq
        return self

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> cos, sin [..., head_dim]."""
        angles = positions.float()[..., None] * self.inv_freq  # [..., hd/2]
        angles = torch.cat((angles, angles), dim=-1)
        scaling = self.attention_scaling
        return (angles.cos() * scaling).to(self.dtype), (angles.sin() * scaling).to(self.dtype)

    def project(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[..., h] token embeddings and hidden states -> q, k, v [..., rows]."""
        mixed = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)  # [..., 2h]
        return tuple(self.qkv_proj(mixed).split(self.config.part_rows(), dim=-1))

    def finish(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Residual over the (un-normed) input hidden, then the MLP block: the row's output."""
        x = hidden + self.o_proj(attended)
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[..., h] layer outputs -> [..., V'] draft-vocabulary logits."""
        return self.lm_head(self.norm(out))

    def step(
        self,
        embeds: torch.Tensor,  # [n, h] embeddings of the rows' tokens
        hidden: torch.Tensor,  # [n, h] fc(features) or the parent rows' outputs
        positions: torch.Tensor,  # [n]
        mask: torch.Tensor,  # [n, span] bool over cache slots
        keys: torch.Tensor,  # [kvh, capacity, hd]
        values: torch.Tensor,  # [kvh, capacity, hd]
        slots: torch.Tensor,  # [n] where the rows' keys/values are written
    ) -> torch.Tensor:
        """One pass of n rows against the draft's KV cache: outputs [n, h]."""
        c = self.config
        n = embeds.shape[0]
        q, k, v = self.project(embeds, hidden)
        cos, sin = self.rope(positions)  # [n, hd]
        q = apply_rope(q.view(n, c.num_heads, c.head_dim).transpose(0, 1), cos, sin)  # [nh, n, hd]
        k = apply_rope(k.view(n, c.kv_heads, c.head_dim).transpose(0, 1), cos, sin)  # [kvh, n, hd]
        keys.index_copy_(1, slots, k)
        values.index_copy_(1, slots, v.view(n, c.kv_heads, c.head_dim).transpose(0, 1))
        if attention_kernel.takes(keys):
            # causaldraft's kernel reads the cache as it is, in one call (fp32 arithmetic): the mask is its
            # layout's ``seen`` with every slot in the head (slot == row) and an empty tail
            tail = torch.empty(1, n, 0, dtype=torch.long)
            out = attention_kernel.attend(q[None], keys[None], values[None], mask[None], tail)[0].to(q.dtype)
        else:
            span = mask.shape[1]
            # float32 products: a bf16 batched product is JIT-compiled by oneDNN for each new shape, and
            # the span grows every step (measured: 1.3 ms per call for a fresh span against 0.14 ms)
            out = attend(q.float(), keys[:, :span].float(), values[:, :span].float(), mask).to(q.dtype)  # [nh, n, hd]
        return self.finish(hidden, out.transpose(0, 1).reshape(n, c.num_heads * c.head_dim))


def rope_frequencies(config: Eagle3Config) -> tuple[torch.Tensor, float]:
    """The layer's rope: inverse frequencies [head_dim // 2] (fp32) and cos/sin scaling, the target's own rope
    (transformers' rope registry, through the native backend's reader)."""
    rope = LlamaConfig(
        hidden_size=config.num_heads * config.head_dim, num_attention_heads=config.num_heads,
        head_dim=config.head_dim, max_position_embeddings=config.max_positions,
        rope_parameters=config.rope,
    )  # fmt: skip
    return rope_inverse_frequencies(rope, config.head_dim)


def new_layer(config: Eagle3Config, vocab_ids: torch.Tensor, lm_head: torch.Tensor, seed: int = 0) -> Eagle3Layer:
    """A freshly initialised layer; its output rows start as the target's LM-head rows of the
    draft vocabulary (``lm_head`` [vocab, hidden])."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        layer = Eagle3Layer(config, vocab_ids)
        for module in layer.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
    with torch.no_grad():
        layer.lm_head.weight.copy_(lm_head.detach().float().index_select(0, vocab_ids.long()))
    return layer


def widen_vocabulary(layer: Eagle3Layer, extra_ids: torch.Tensor, lm_head: torch.Tensor) -> Eagle3Layer:
    """A copy of ``layer`` whose draft vocabulary also holds ``extra_ids`` (target ids not yet in it): the
    trained output rows are kept, each new id's row starts as the target's LM-head row (as ``new_layer``
    starts every row). Draft ids stay in target-id order.

    Example: vocab_ids [3, 7] and extra [5] give [3, 5, 7] with output rows [W3, T5, W7] (W trained,
    T the target's ``lm_head`` [vocab, hidden])."""
    extra_ids = extra_ids.long()
    if bool(torch.isin(extra_ids, layer.vocab_ids).any()) or extra_ids.unique().numel() != extra_ids.numel():
        raise CausalDraftError("the ids added to an eagle3 draft vocabulary must be new and distinct")
    vocab_ids, order = torch.cat((layer.vocab_ids, extra_ids)).sort()
    rows = torch.cat((layer.lm_head.weight.detach().float(), lm_head.detach().float().index_select(0, extra_ids)))
    config = replace(layer.config, draft_vocab=int(vocab_ids.numel()))
    wider = Eagle3Layer(config, vocab_ids)
    state = {name: value for name, value in layer.state_dict().items() if name != "lm_head.weight"}
    wider.load_state_dict({**state, "lm_head.weight": rows.index_select(0, order)})
    return wider.cast(layer.dtype)  # the rope frequencies stay float32


LINEARS = ("fc", "qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


def pack_linears(layer: Eagle3Layer) -> bool:
    """Replace a bf16 layer's linears by DraftLinear (int8 weights for few rows, oneDNN's weights
    reordered once for more, instead of reordered at every call as a bf16 ``F.linear`` does: a
    drafting level ~2x faster, measured); False (nothing changed) where that is not possible. For
    drafting only: a draft need not be bit-exact (the target's verify pass decides the output)."""
    if layer.dtype != torch.bfloat16:
        return False
    for name in LINEARS:
        linear = getattr(layer, name)
        if isinstance(linear, nn.Linear) and isinstance(linear.weight, nn.Parameter):
            setattr(layer, name, DraftLinear(linear.weight))
    return True


def save_layer(layer: Eagle3Layer, directory: Path, extra: dict[str, object] | None = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: value.detach().to(torch.bfloat16).contiguous() for name, value in layer.state_dict().items()}
    tensors["vocab_ids"] = layer.vocab_ids.to(torch.int32).contiguous()
    save_file(tensors, str(directory / WEIGHTS_FILE))
    record = {"format": FORMAT_VERSION, "kind": "eagle3", **asdict(layer.config), **(extra or {})}
    (directory / CONFIG_FILE).write_text(json.dumps(record, indent=2) + "\n")


def read_config(directory: Path) -> tuple[Eagle3Config, dict[str, object]]:
    path = directory / CONFIG_FILE
    if not path.is_file():
        from causaldraft.drafters import heads

        if (directory / heads.CONFIG_FILE).is_file():
            raise CausalDraftError(f"{directory} holds markov/medusa heads, not an eagle3 layer: use --drafter markov "
                                   "or medusa")  # fmt: skip
        raise CausalDraftError(f"no eagle3 drafter in {directory}: {CONFIG_FILE} is missing")
    try:
        record = json.loads(path.read_text())
        if record.get("format") != FORMAT_VERSION:
            raise CausalDraftError(f"{path}: unsupported eagle3 format {record.get('format')!r}")
        optional = (*CALIBRATION_FIELDS, "rope_parameters")
        fields = {name: record[name] for name in Eagle3Config.__dataclass_fields__ if name not in optional}
        fields.update({name: float(record[name]) for name in CALIBRATION_FIELDS if name in record})
        fields["rope_parameters"] = record.get("rope_parameters")
        fields["aux_layers"] = tuple(fields["aux_layers"])
        return Eagle3Config(**fields), record
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise CausalDraftError(f"corrupt eagle3 config {path}: {error}") from error


def load_layer(directory: Path, fingerprint: str, vocab_size: int, hidden_size: int) -> Eagle3Layer:
    """Load a trained layer for the target with this fingerprint and sizes; fail clearly."""
    config, _ = read_config(directory)
    if config.fingerprint != fingerprint or config.hidden_size != hidden_size or config.vocab_size != vocab_size:
        raise CausalDraftError(
            f"the eagle3 drafter in {directory} was trained for another base model (fingerprint "
            f"{config.fingerprint}, this model {fingerprint}); train one with causaldraft train-heads --heads eagle3 "
            f"({OLD_FINGERPRINTS})"
        )
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise CausalDraftError(f"no eagle3 drafter in {directory}: {WEIGHTS_FILE} is missing")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as error:
        raise CausalDraftError(f"corrupt eagle3 weights {path}: {error}") from error
    vocab_ids = tensors.pop("vocab_ids", None)
    if vocab_ids is None or vocab_ids.numel() != config.draft_vocab:
        raise CausalDraftError(f"corrupt eagle3 weights {path}: missing or wrong-sized vocab_ids")
    vocab_ids = vocab_ids.long()
    if int(vocab_ids.min()) < 0 or int(vocab_ids.max()) >= vocab_size or bool((vocab_ids.diff() <= 0).any()):
        raise CausalDraftError(
            f"corrupt eagle3 weights {path}: the draft vocabulary does not fit the target's "
            f"(ids must be sorted, distinct and below {vocab_size})"
        )
    layer = Eagle3Layer(config, vocab_ids)
    try:
        layer.load_state_dict({name: value.float() for name, value in tensors.items()})
    except RuntimeError as error:
        raise CausalDraftError(f"corrupt eagle3 weights {path}: {error}") from error
    return layer.eval().requires_grad_(False)
