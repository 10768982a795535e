"""A batched forward over the native model's weights: B sequences, each with its own length.

Used for offline jobs (self-distillation data) where many sequences advance together. Each batch row
owns a KV cache row; its tokens are written at explicit slots (row b's n new tokens at
``slots[b]``), and a query at slot s attends to slots [0, s] of its own row, so rows of different
lengths share one pass without padding on the left. Rows never attend to each other.

Worked example (B = 2): row 0 holds 5 cached tokens, row 1 holds 3. A decode step writes row 0's
token at slot 5 and row 1's at slot 3; ``causal_mask`` lets row 1's query see slots 0..3 only, so
row 1's stale slots 4.. (junk from a longer earlier occupant, or padding) are never read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from causaldraft.models import quant
from causaldraft.models.base import Backend
from causaldraft.models.native import DecoderLayer, NativeLlama, apply_rope
from causaldraft.models.products import native_bf16_products


@dataclass
class BatchCache:
    """keys[layer], values[layer]: [B, kv_heads, capacity, head_dim]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @staticmethod
    def empty(model: NativeLlama, batch: int, capacity: int) -> BatchCache:
        s = model.llama_shape
        size = (batch, s.kv_heads, capacity, s.head_dim)
        return BatchCache(
            [torch.zeros(size, dtype=model.dtype) for _ in range(s.num_layers)],
            [torch.zeros(size, dtype=model.dtype) for _ in range(s.num_layers)],
        )

    def copy_rows(self, source: BatchCache, rows: torch.Tensor, length: int) -> None:
        """Copy source rows 0..len(rows)-1, slots [0, length), into this cache's ``rows``."""
        for mine, theirs in zip((*self.keys, *self.values), (*source.keys, *source.values), strict=True):
            mine[rows, :, :length] = theirs[: rows.numel(), :, :length]


def use_batch_products(model: Backend) -> bool:
    """Run a native bf16 model's layer products through oneDNN for offline passes of many rows, where oneDNN takes
    bf16 weights (``products.native_bf16_products``); True where its linears changed.

    A bf16 model loads with its layers on causaldraft's kernel (``quant.Bf16BlockLinear``), which reads the
    weights once at about the memory's speed: the fastest for the few rows of a decoding step, but its work
    grows with every row. Self-distillation data runs 48-row decode steps and prefills of thousands of prompt
    rows. Measured on an Intel Xeon with AMX (default model, one layer's four products): 1.71 ms through the
    kernel against 0.45 through oneDNN at 48 rows, 9.0 against 1.2 at 256 rows. Both are exact products of the
    same bf16 numbers with fp32 sums, in different orders, so greedy data may differ only where two tokens are
    near-tied; decoding never runs these passes (its exactness: docs/exactness.md). Elsewhere (no bf16 oneDNN,
    fp32, int4/int8, the hf backend) nothing changes."""
    if not isinstance(model, NativeLlama) or model.quantized or not native_bf16_products():
        return False
    return quant.use_plain_linears(model)


def causal_mask(slots: torch.Tensor, span: int) -> torch.Tensor:
    """slots [B, n] -> [B, n, span] bool: a query written at slot s sees its row's slots 0..s."""
    return torch.arange(span)[None, None, :] <= slots[:, :, None]


def batched_forward(
    model: NativeLlama,
    tokens: torch.Tensor,  # [B, n]
    slots: torch.Tensor,  # [B, n] cache slot = position of each new token
    cache: BatchCache,
    aux_layers: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Final-normed hidden states [B, n, hidden], and the inputs of ``aux_layers`` concatenated
    [B, n, len(aux_layers) * hidden] (None without aux layers)."""
    s = model.llama_shape
    batch, n = tokens.shape
    span = int(slots.max()) + 1
    mask = causal_mask(slots, span)[:, None]  # [B, 1, n, span]
    cos, sin = model.rope(slots.reshape(-1))
    cos = cos.view(batch, 1, n, s.head_dim)
    sin = sin.view(batch, 1, n, s.head_dim)
    rows = torch.arange(batch)[:, None].expand(batch, n)  # [B, n]
    x = model.embed_tokens(tokens)  # [B, n, hidden]
    aux: list[torch.Tensor] = []
    for index, module in enumerate(model.layers):
        if index in aux_layers:
            aux.append(x)
        layer = cast(DecoderLayer, module)
        attn = layer.self_attn
        q, k, v = attn.split_heads(attn.qkv_proj(layer.input_layernorm(x)), batch, n)  # [B, heads, n, hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.keys[index][rows, :, slots] = k.transpose(1, 2)
        cache.values[index][rows, :, slots] = v.transpose(1, 2)
        out = attend_rows(q, cache.keys[index][:, :, :span], cache.values[index][:, :, :span], mask)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(batch, n, s.num_heads * s.head_dim))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x), (torch.cat(aux, dim=-1) if aux else None)


def attend_rows(
    q: torch.Tensor,  # [B, nh, n, hd]
    keys: torch.Tensor,  # [B, kvh, span, hd]
    values: torch.Tensor,  # [B, kvh, span, hd]
    mask: torch.Tensor,  # [B, 1, n, span] bool
) -> torch.Tensor:
    """Grouped-query attention per row: [B, nh, n, hd]. One query per row (decoding) uses two
    batched matmuls (torch's CPU SDPA kernel is several times slower for a single query);
    longer passes use SDPA. The scores are keys @ queries^T, transposed after: the other order
    (queries @ keys^T) copied every layer's transposed keys: 20 % of a decode step at 48 rows."""
    batch, heads, n, hd = q.shape
    kv_heads = keys.shape[1]
    if n > 1:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    grouped = q.view(batch, kv_heads, heads // kv_heads, hd)  # [B, kvh, g, hd]
    scores = torch.matmul(keys, grouped.transpose(-1, -2)).transpose(-1, -2).float() * hd**-0.5  # [B, kvh, g, span]
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(values.dtype)
    return torch.matmul(weights, values).view(batch, heads, 1, hd)
