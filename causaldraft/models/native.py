"""A compact Llama-family forward (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over any tree of new tokens.

RMSNorm, RoPE, grouped-query attention (with Qwen3's per-head query and key norms), SwiGLU, tied or untied LM
head. Weights are read from a Hugging Face checkpoint directory (config.json + *.safetensors) without transformers'
model classes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from causaldraft.cache import CachePool, KVCache
from causaldraft.errors import CausalDraftError
from causaldraft.models.base import Cache, CalibrationStore, ForwardOutput, ModelShape, Scores
from causaldraft.models.blocked import (
    KEY_BLOCK,
    BlockedKeys,
    SequenceKeys,
    attend_blocked,
    blocked_keys,
    pass_room,
    sequence_keys,
    stack_keys,
)
from causaldraft.models.products import at_least_rows, product_dtype
from causaldraft.models.screened_head import ScreenedHead

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# Row counts compiled passes are padded to. No one-row graph in bf16/fp32: a one-row product
# rounds differently from products of two or more rows (the kernels of 2+ rows agree row by row),
# and computing one row as two inside a graph lets inductor fuse the copy into the norm before it,
# which changes that norm's rounding; a padded row costs about nothing there (memory-bound). bf16 models
# whose layers run through causaldraft's bf16 kernel (row-invariant from one row) add a one-row graph
# (compiled.compile_model).
COMPILE_BUCKETS = (2, 4, 8, 16, 32)
# int4/int8 kernels are row-invariant from one row up but cost more per extra row (measured at
# compile, int4, AVX2 build of stop 25, ms per pass over 1/2/4/8/16 new tokens: 5.3/7.5/10.2/17.6/34.1;
# stop 20's torch kernel: 10/15/20/26/42), so trees stay small: finer buckets there, none of 32.
QUANTIZED_BUCKETS = (1, 2, 4, 8, 16)


# Fused projections: one matmul instead of several over the same input (fewer, larger kernel calls;
# measured for int4 at 1 row: q+k+v 41 us -> 23 us per layer). Rows are the parts stacked in order.
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """Feature layers of EAGLE-3-style drafters: a low, a middle and a high one (2, N/2, N-3),
    distinct and increasing (fewer for very shallow models)."""
    return tuple(sorted({min(2, num_layers - 1), num_layers // 2, max(0, num_layers - 3)}))


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    tie_embeddings: bool
    qkv_bias: bool
    max_positions: int
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's query and key, before rope

    def part_rows(self, fused: str) -> tuple[int, ...]:
        """Output rows of each part of a fused projection (``FUSED_PROJECTIONS`` key)."""
        if fused == "self_attn.qkv_proj":
            return (self.num_heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)
        return (self.intermediate_size, self.intermediate_size)

    @staticmethod
    def from_config(config: PretrainedConfig) -> LlamaShape:
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise CausalDraftError(
                f"the native backend does not support model_type {config.model_type!r} "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); use --backend hf"
            )
        activation = getattr(config, "hidden_act", "silu")
        if activation not in ("silu", "swish"):  # the same function under two names
            raise CausalDraftError(f"the native backend's MLP computes SiLU; this checkpoint's hidden_act is "
                                   f"{activation!r}: use --backend hf")  # fmt: skip
        num_heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        head_dim = getattr(config, "head_dim", None) or hidden // num_heads
        qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        return LlamaShape(
            vocab_size=int(config.vocab_size),
            hidden_size=hidden,
            num_layers=int(config.num_hidden_layers),
            num_heads=num_heads,
            kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
            head_dim=int(head_dim),
            intermediate_size=int(config.intermediate_size),
            rms_eps=float(config.rms_norm_eps),
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            max_positions=int(getattr(config, "max_position_embeddings", 4096)),
            qk_norm=config.model_type == "qwen3",
        )


def rope_inverse_frequencies(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] and attention scaling, via transformers' rope registry."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        return (1.0 / theta**exponents).float(), 1.0
    if rope_type == "longrope":  # transformers switches its frequencies past the original length
        raise CausalDraftError("the native backend keeps one set of rope frequencies; longrope changes them with the "
                               "context length: use --backend hf")  # fmt: skip
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise CausalDraftError(f"unsupported rope type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Linear(nn.Linear):
    """nn.Linear computing a one-row input as two rows: the one-row kernel rounds differently from
    the kernels of two or more rows (bf16, in_features 1536: measured), which are row-invariant."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return F.linear(x, self.weight, self.bias)
        return F.linear(at_least_rows(x, 2), self.weight, self.bias)[: x.shape[0]]


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.shape = shape
        hd = shape.head_dim
        self.rows = shape.part_rows("self_attn.qkv_proj")
        self.qkv_proj = Linear(shape.hidden_size, sum(self.rows), bias=shape.qkv_bias)
        self.o_proj = Linear(shape.num_heads * hd, shape.hidden_size, bias=False)
        self.q_norm = RMSNorm(hd, shape.rms_eps) if shape.qk_norm else None
        self.k_norm = RMSNorm(hd, shape.rms_eps) if shape.qk_norm else None

    def split_heads(self, qkv: torch.Tensor, sequences: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection's output [S * n or S, n, q + k + v] -> queries [S, nh, n, hd], keys and values
        [S, kvh, n, hd], before rope; queries and keys through their per-head norms where the model has them."""
        s = self.shape
        q, k, v = qkv.split(self.rows, dim=-1)
        q = q.reshape(sequences, n, s.num_heads, s.head_dim)
        k = k.reshape(sequences, n, s.kv_heads, s.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = v.reshape(sequences, n, s.kv_heads, s.head_dim)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,  # [S * n, hidden]: S sequences of n rows each
        cos: torch.Tensor,  # [S * n, head_dim]
        sin: torch.Tensor,  # [S * n, head_dim]
        keyspec: Keys,  # a [n, span] bool mask over cache slots [0, span) (S = 1), or the blocked layout
        keys_buffer: torch.Tensor,  # [S, kvh, capacity, hd]
        values_buffer: torch.Tensor,  # [S, kvh, capacity, hd]
        slots: torch.Tensor,  # [S, n] cache slots the new entries are written to
    ) -> torch.Tensor:
        sequences, n = slots.shape
        hd = self.shape.head_dim
        q, k, v = self.split_heads(self.qkv_proj(x), sequences, n)  # [S, nh, n, hd], [S, kvh, n, hd] x 2
        cos, sin = cos.view(sequences, 1, n, hd), sin.view(sequences, 1, n, hd)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        sequence = torch.arange(sequences).view(sequences, 1)
        # [S, n, kvh, hd] at (sequence, :, slot), in the cache's dtype (NativeLlama.cache_dtype)
        keys_buffer[sequence, :, slots] = k.transpose(1, 2).to(keys_buffer.dtype)
        values_buffer[sequence, :, slots] = v.transpose(1, 2).to(values_buffer.dtype)
        if isinstance(keyspec, BlockedKeys):
            out = attend_blocked(q, keys_buffer, values_buffer, keyspec)  # [S, nh, n, hd]
        else:
            span = keyspec.shape[1]
            out = attend(q[0], keys_buffer[0, :, :span], values_buffer[0, :, :span], keyspec)[None]
        return self.o_proj(out.transpose(1, 2).reshape(sequences * n, self.shape.num_heads * hd))


Keys = torch.Tensor | BlockedKeys  # what attention reads: a mask over slots, or the blocked layout
LARGE_QUERY_COUNT = 64  # passes of more queries (prefills) use torch's SDPA kernel


def attend(
    q: torch.Tensor,  # [nh, n, hd]
    keys: torch.Tensor,  # [kvh, span, hd]
    values: torch.Tensor,  # [kvh, span, hd]
    mask: torch.Tensor,  # [n, span] bool
) -> torch.Tensor:
    """Grouped-query attention of n queries over ``span`` cache slots: [nh, n, hd] (scores fp32).

    The passes the decode loop runs use the row-invariant ``blocked.attend_blocked``; this serves
    the passes without a blocked layout (a long prefill: SDPA, which never materialises the
    [n, span] scores; a pass crossing a key block: two batched matmuls per kv head group) and the
    eagle3 draft layer.
    """
    heads, n, hd = q.shape
    kv_heads, span, _ = keys.shape
    group = heads // kv_heads
    if keys.dtype != q.dtype:  # a cache held in the dtype products run in: multiply in it
        return attend(q.to(keys.dtype), keys, values, mask).to(q.dtype)
    if n > LARGE_QUERY_COUNT:
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, enable_gqa=True
        )
        return out[0]
    keys, values = keys.contiguous(), values.contiguous()  # dense operands: see blocked.attend_blocked
    scores = torch.matmul(q.reshape(kv_heads, group * n, hd), keys.transpose(1, 2))  # [kvh, g*n, span]
    scores = scores.float().view(kv_heads, group, n, span)
    scores = (scores * hd**-0.5).masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # [kvh, g, n, span] fp32
    weights = weights.to(values.dtype).view(kv_heads, group * n, span)
    return torch.matmul(weights, values).view(heads, n, hd)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [heads, n, hd]; cos, sin: [n, hd] (rotate-half convention of HF Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class MLP(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.gate_up_proj = Linear(shape.hidden_size, 2 * shape.intermediate_size, bias=False)
        self.down_proj = Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_eps)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_eps)
        self.mlp = MLP(shape)


class NativeLlama(nn.Module):
    """The backend: ``forward`` over n new tokens with explicit positions and a boolean mask."""

    inv_freq: torch.Tensor  # [head_dim // 2] fp32 rope frequencies

    def __init__(self, shape: LlamaShape, inv_freq: torch.Tensor, rope_scaling: float) -> None:
        super().__init__()
        self.llama_shape = shape
        self.shape = ModelShape(shape.vocab_size, shape.hidden_size, shape.num_layers, shape.max_positions)
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_eps)
        self.lm_head = Linear(shape.hidden_size, shape.vocab_size, bias=False)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_scaling = rope_scaling
        # set by compiled.compile_model: one compiled pass per bucket of new-token rows
        self.graphs: dict[int, Callable[..., tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self.graph_store: CalibrationStore | None = None
        self.buckets: tuple[int, ...] = ()
        # compiled graphs always return these layers' inputs (one graph per bucket serves plain
        # passes and feature drafters alike); a request outside them runs the eager body
        self.graph_aux_layers: tuple[int, ...] = ()
        self.quantized = False  # set by quant.install_quantized
        # set by compiled.compile_batch: passes over ``batch_sequences`` sequences, by rows per sequence
        self.batch_graphs: dict[int, Callable[..., tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self.batch_sequences = 0

    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]
        return self.norm.weight.dtype

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache's dtype: the one attention multiplies in (``products.product_dtype``), so
        that its products read the cache as it is: fp32 for a bf16 model where bf16 products are not
        native (the keys and values are bf16 numbers, held exactly)."""
        return product_dtype(self.dtype)

    @classmethod
    def from_pretrained(cls, model_dir: Path, dtype: torch.dtype) -> NativeLlama:
        config = AutoConfig.from_pretrained(str(model_dir))
        shape = LlamaShape.from_config(config)
        inv_freq, scaling = rope_inverse_frequencies(config, shape.head_dim)
        with torch.device("meta"):
            model = cls(shape, torch.empty(0), scaling)
        state = read_safetensors(model_dir)
        if shape.tie_embeddings and "model.embed_tokens.weight" in state:  # untied: its own, or refused below
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        renamed = fuse_projections({name.removeprefix("model."): tensor for name, tensor in state.items()})
        expected = set(model.state_dict())
        missing = expected - set(renamed)
        if missing:
            raise CausalDraftError(f"checkpoint {model_dir} lacks weights: {sorted(missing)[:3]}")
        model.load_state_dict({k: renamed[k] for k in expected}, assign=True)
        model.inv_freq = inv_freq
        model = model.to(dtype)
        model.inv_freq = inv_freq  # keep rope frequencies in fp32
        return model.eval().requires_grad_(False)

    def truncated(self, num_layers: int) -> NativeLlama:
        """The self-draft: the first ``num_layers`` layers with the final norm and LM head, sharing
        this model's weights (no copy)."""
        if not 1 <= num_layers < self.llama_shape.num_layers:
            raise CausalDraftError(
                f"self-draft layers must be in [1, {self.llama_shape.num_layers - 1}], got {num_layers}"
            )
        shape = replace(self.llama_shape, num_layers=num_layers)
        with torch.device("meta"):
            draft = NativeLlama(shape, torch.empty(0), self.rope_scaling)
        draft.embed_tokens = self.embed_tokens
        draft.layers = nn.ModuleList(list(self.layers)[:num_layers])
        draft.norm = self.norm
        draft.lm_head = self.lm_head
        draft.inv_freq = self.inv_freq
        draft.quantized = self.quantized
        return draft.eval()

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [n, hd/2]
        angles = torch.cat((angles, angles), dim=-1)  # [n, hd]
        cos = (angles.cos() * self.rope_scaling).to(self.dtype)
        sin = (angles.sin() * self.rope_scaling).to(self.dtype)
        return cos, sin

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)

    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def body(
        self,
        tokens: torch.Tensor,  # [S, n]: S sequences (each with its own cache) of n new tokens
        positions: torch.Tensor,  # [S, n]
        keyspec: Keys,  # [n, span] bool mask over slots (S = 1), or the blocked layout (row-invariant)
        slots: torch.Tensor,  # [S, n]
        keys: list[torch.Tensor],  # per layer [S, kvh, capacity, hd]
        values: list[torch.Tensor],
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embeddings through the layers and the final norm: hidden states [S * n, hidden], and the
        inputs of ``aux_layers`` concatenated [S * n, len(aux_layers) * hidden] (None if none asked).
        Every linear layer runs over the S * n rows at once (row-invariant); attention stays within
        each sequence."""
        x = self.embed_tokens(tokens.reshape(-1))  # [S * n, hidden]
        cos, sin = self.rope(positions.reshape(-1))
        aux: list[torch.Tensor] = []
        for index, module in enumerate(self.layers):
            if index in aux_layers:
                aux.append(x)
            layer = cast(DecoderLayer, module)
            attn_in = layer.input_layernorm(x)
            x = x + layer.self_attn(attn_in, cos, sin, keyspec, keys[index], values[index], slots)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if len(self.layers) in aux_layers:
            aux.append(x)
        return self.norm(x), (torch.cat(aux, dim=-1) if aux else None)

    @property
    def compiled(self) -> bool:
        """Passes of up to max(buckets) rows run compiled graphs (``compiled.compile_model``)."""
        return bool(self.graphs)

    @property
    def calibration(self) -> CalibrationStore | None:
        return self.graph_store

    def new_cache(self, max_len: int) -> KVCache:
        s = self.llama_shape
        # a pass reads the key block [T, T + KEY_BLOCK + rows) and compiled passes write a padded
        # bucket's rows past the real ones: room for both beyond max_len
        capacity = max_len + KEY_BLOCK + max(self.buckets, default=LARGE_QUERY_COUNT)
        return KVCache(s.num_layers, s.kv_heads, s.head_dim, max_len, self.cache_dtype, capacity=capacity)

    def pass_room(self, length: int) -> int:
        """Positions a pass over ``length`` committed entries may reach and stay row-invariant."""
        return pass_room(length)

    def pass_rows(self) -> int:
        """Compiled: the largest bucket. A larger pass runs eagerly, and eager code and a graph may round a
        row differently (inductor fuses some element-wise steps; int4 passes of 17-32 rows differed from
        one-row graphs from layer 2 on, in some rows: stop 34), so the decode loop keeps trees within it.
        Eager: no limit (every pass runs the same code)."""
        return max(self.buckets) if self.graphs else LARGE_QUERY_COUNT

    def new_pool(self, size: int, max_len: int) -> CachePool:
        """Caches for ``size`` concurrent sequences of up to ``max_len`` entries (``forward_batch``)."""
        s = self.llama_shape
        capacity = max_len + KEY_BLOCK + max((*self.buckets, *self.batch_graphs), default=LARGE_QUERY_COUNT)
        return CachePool(size, s.num_layers, s.kv_heads, s.head_dim, max_len, capacity, self.cache_dtype)

    @property
    def batch_rows(self) -> int:
        """The most rows per sequence a pass of ``forward_batch`` takes (its largest graph's)."""
        return max(self.batch_graphs, default=MAX_EAGER_BATCH_ROWS)

    def forward_batch(
        self, pool: CachePool, passes: list[SequencePass], aux_layers: tuple[int, ...] = ()
    ) -> list[ForwardOutput]:
        """One pass over several sequences of ``pool``, each with its own new tokens, positions,
        tree mask and cache: every row computes exactly what the sequence's own ``forward`` would
        (row-invariant linears over all rows, attention within each sequence in the blocked layout,
        heads padded to the longest). Each pass must stay within ``pass_room`` of its cache and
        have at most ``batch_rows`` rows; pool slots without a pass compute padding rows written
        past their own committed entries. Returns one output per pass, in order."""
        rows = max(p.tokens.shape[0] for p in passes)
        if rows > self.batch_rows or len({p.slot for p in passes}) != len(passes):
            raise ValueError(f"a batch pass takes at most {self.batch_rows} rows per sequence, one pass per slot")
        graph = self.batch_graphs if self.batch_sequences == pool.size else {}
        bucket = next((size for size in sorted(graph) if size >= rows), None) if graph else rows
        if bucket is None or not set(aux_layers) <= set(self.graph_aux_layers if graph else aux_layers):
            raise ValueError("no batch graph for this pass")
        layouts = [SequenceKeys.padding(bucket) for _ in range(pool.size)]
        tokens = torch.zeros(pool.size, bucket, dtype=torch.long)
        positions = torch.zeros(pool.size, bucket, dtype=torch.long)
        starts = torch.tensor([cache.length for cache in pool.caches])
        for p in passes:
            cache = pool.caches[p.slot]
            cache.check_room(p.tokens.shape[0])
            layout = sequence_keys(p.mask, p.positions, cache.length, bucket)
            if layout is None:
                raise ValueError(f"slot {p.slot}'s pass leaves its key block (pass_room) or skips committed entries")
            layouts[p.slot] = layout
            n = p.tokens.shape[0]
            tokens[p.slot, :n], positions[p.slot, :n] = p.tokens, p.positions
        slots = starts[:, None] + torch.arange(bucket)[None, :]  # [S, bucket]: past each slot's committed entries
        layout_tensors = stack_keys(layouts)
        with torch.no_grad():
            if graph:
                hidden, aux = graph[bucket](tokens, positions, slots, *layout_tensors.tensors(), pool.keys, pool.values)
                computed = self.graph_aux_layers
            else:
                hidden, aux = self.body(tokens, positions, layout_tensors, slots, pool.keys, pool.values, aux_layers)
                computed = aux_layers
        rows_of = [p.slot * bucket + torch.arange(p.tokens.shape[0]) for p in passes]
        scored = [r if p.logits_rows is None else r[p.logits_rows] for p, r in zip(passes, rows_of, strict=True)]
        logits = self.lm_head(hidden.index_select(0, torch.cat(scored))).float().split([len(r) for r in scored])
        outputs = []
        for p, own, own_logits in zip(passes, rows_of, logits, strict=True):
            pool.caches[p.slot].append(p.tokens.shape[0])
            features = select_aux(aux[own], computed, aux_layers) if aux is not None and aux_layers else None
            outputs.append(ForwardOutput(Scores.of(own_logits), hidden[own], features))
        return outputs

    def forward(  # type: ignore[override]
        self,
        tokens: torch.Tensor,  # [n]
        positions: torch.Tensor,  # [n]
        mask: torch.Tensor,  # [n, cache.length + n] bool
        cache: Cache,
        logits_rows: torch.Tensor | None = None,  # [m]
        aux_layers: tuple[int, ...] = (),
    ) -> ForwardOutput:
        """Passes of up to LARGE_QUERY_COUNT rows that stay within ``pass_room`` run in the blocked,
        row-invariant layout (each row's output bit for bit a one-row pass's); others (long
        prefills) attend over the mask directly and run eagerly."""
        if not isinstance(cache, KVCache):
            raise TypeError("the native backend needs its own KVCache (new_cache)")
        n = tokens.shape[0]
        cache.check_room(n)
        bucket = next((size for size in self.buckets if size >= n), None) if self.graphs else None
        if bucket is not None and not set(aux_layers) <= set(self.graph_aux_layers):
            bucket = None  # features of other layers: the eager body computes them
        layout = blocked_keys(mask, positions, cache.length, bucket or n) if n <= LARGE_QUERY_COUNT else None
        keys, values = [k.unsqueeze(0) for k in cache.keys], [v.unsqueeze(0) for v in cache.values]
        with torch.no_grad():
            if bucket is None or layout is None:
                slots = torch.arange(cache.length, cache.length + n)  # (no layout: none for any row count)
                keyspec: Keys = mask if layout is None else layout
                hidden, aux = self.body(tokens[None], positions[None], keyspec, slots[None], keys, values, aux_layers)
            else:
                padded = (row[None] for row in pad_to_bucket(tokens, positions, cache.length, bucket))
                hidden, aux = self.graphs[bucket](*padded, *layout.tensors(), keys, values)
                hidden = hidden[:n]
                aux = select_aux(aux[:n], self.graph_aux_layers, aux_layers) if aux is not None and aux_layers else None
        cache.append(n)
        scored = hidden if logits_rows is None else hidden.index_select(0, logits_rows)  # [m, hidden]
        screen = self.lm_head if isinstance(self.lm_head, ScreenedHead) else None
        return ForwardOutput(Scores(scored, self.lm_head, screen), hidden, aux)


MAX_EAGER_BATCH_ROWS = 16  # rows per sequence of an eager batch pass


@dataclass(frozen=True)
class SequencePass:
    """One sequence's share of a ``forward_batch`` pass: new tokens [n], positions [n], mask
    [n, length + n] over its pool slot's cache, and optionally the rows to score [m]."""

    slot: int
    tokens: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    logits_rows: torch.Tensor | None = None


def select_aux(aux: torch.Tensor, computed: tuple[int, ...], wanted: tuple[int, ...]) -> torch.Tensor:
    """aux [n, len(computed) * h] (layers in increasing order) -> the ``wanted`` layers' columns,
    also in increasing order (the order ``body`` concatenates them in)."""
    if tuple(sorted(wanted)) == tuple(sorted(computed)):
        return aux
    chunks = aux.chunk(len(computed), dim=-1)
    order = sorted(computed)
    return torch.cat([chunks[order.index(layer)] for layer in sorted(wanted)], dim=-1)


def pad_to_bucket(
    tokens: torch.Tensor, positions: torch.Tensor, length: int, bucket: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad n new tokens to ``bucket`` rows: tokens, positions and the slots they write.

    Padding rows write scratch entries just past the real ones (never committed); their layout
    (``blocked_keys(..., rows=bucket)``) sees one slot, so no row is fully masked. The head length
    T is the one dynamic dimension of the compiled graph, so one graph per bucket serves every
    cache length.
    """
    n = tokens.shape[0]
    padded_tokens = torch.zeros(bucket, dtype=torch.long)
    padded_tokens[:n] = tokens
    padded_positions = torch.zeros(bucket, dtype=torch.long)
    padded_positions[:n] = positions
    slots = torch.arange(length, length + bucket)
    return padded_tokens, padded_positions, slots


def fuse_projections(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names -> ours: each layer's q/k/v (and gate/up) weights and biases stacked by rows.

    ``layers.0.self_attn.{q,k,v}_proj.weight`` -> ``layers.0.self_attn.qkv_proj.weight``. A layer
    missing a part keeps its parts (the caller reports the missing fused weight).
    """
    fused = dict(state)
    for name in state:
        for target, parts in FUSED_PROJECTIONS.items():
            prefix, _, kind = name.partition(f".{parts[0]}.")
            if not kind:
                continue
            names = [f"{prefix}.{part}.{kind}" for part in parts]
            if all(part in state for part in names):
                fused[f"{prefix}.{target}.{kind}"] = torch.cat([state[part] for part in names])
                for part in names:
                    del fused[part]
    return fused


QUANT_CACHE_PREFIX = "quant-"  # quantized weights cached beside a checkpoint (models/quant_load.py)


SAFETENSORS_INDEX = "model.safetensors.index.json"  # a sharded checkpoint's map of tensor -> shard file
SAFETENSORS_FILE = "model.safetensors"  # an unsharded checkpoint's weights


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files, the ones transformers reads: the shards its index names, else
    ``model.safetensors``. Other ``*.safetensors`` files beside them are not read: a stale unsharded file left
    beside newer shards, Mistral's ``consolidated.safetensors`` (another program's names for the same weights),
    the quantized caches kept beside a checkpoint (``QUANT_CACHE_PREFIX``)."""
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted({str(name) for name in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise CausalDraftError(f"corrupt checkpoint index {index}: {error!r}") from None
        missing = [name for name in names if not (model_dir / name).is_file()]
        if missing:
            raise CausalDraftError(f"checkpoint {model_dir} lacks {missing[0]}, a weights file {SAFETENSORS_INDEX} "
                                   f"names ({len(missing)} of {len(names)} missing)")  # fmt: skip
        return [model_dir / name for name in names]
    single = model_dir / SAFETENSORS_FILE
    return [single] if single.is_file() else []


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    files = checkpoint_files(model_dir)
    if not files:
        pickled = "; its PyTorch .bin weights are read by --backend hf" if any(model_dir.glob("*.bin")) else ""
        raise CausalDraftError(f"no safetensors weights in {model_dir} ({SAFETENSORS_FILE} or "
                               f"{SAFETENSORS_INDEX}){pickled}")  # fmt: skip
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    state[name] = handle.get_tensor(name)
        except Exception as error:  # safetensors raises several types for corrupt files
            raise CausalDraftError(f"corrupt weights file {file}: {error}") from error
    return state
