"""Adapter over transformers ``AutoModelForCausalLM`` using public APIs only.

A 4-D boolean attention mask, explicit position ids and a ``DynamicCache``; commit and rollback
act on the cache's per-layer key/value tensors. Used for architectures the native backend lacks
and as the parity reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from causaldraft.errors import CausalDraftError
from causaldraft.models.base import Cache, CalibrationStore, ForwardOutput, ModelShape, Scores


class HFCache:
    """A transformers DynamicCache with the KVCache operations (commit, rollback)."""

    def __init__(self, model: PreTrainedModel, max_len: int) -> None:
        # full-attention layers even for a model with a sliding window: commit and rollback index every
        # entry, and the context is capped at the window (loading.capped_to_window)
        self.inner = DynamicCache()
        self.max_len = max_len
        self.length = 0

    def check_room(self, new_tokens: int) -> None:
        if self.length + new_tokens > self.max_len:
            raise CausalDraftError(
                f"context overflow: {self.length} cached + {new_tokens} new tokens exceed the "
                f"context of {self.max_len} tokens"
            )

    def append(self, new_tokens: int) -> None:
        self.check_room(new_tokens)
        self.length += new_tokens

    def commit(self, slots: list[int], start: int) -> None:
        index = torch.tensor(list(range(start)) + slots, dtype=torch.long)
        for cache_layer in self.inner.layers:
            layer = cast(Any, cache_layer)  # a full-attention DynamicLayer with keys/values
            if layer.keys is None or layer.values is None:
                continue
            layer.keys = layer.keys.index_select(-2, index)  # [1, kvh, length, hd]
            layer.values = layer.values.index_select(-2, index)
        self.length = start + len(slots)

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` entries (sliced here rather than by ``DynamicCache.crop``,
        whose meaning changed between transformers releases)."""
        if length < 0 or length > self.length:
            raise ValueError(f"cannot roll back to {length} from {self.length}")
        for cache_layer in self.inner.layers:
            layer = cast(Any, cache_layer)
            if layer.keys is None or layer.values is None:
                continue
            layer.keys = layer.keys[..., :length, :]  # [1, kvh, length, hd]
            layer.values = layer.values[..., :length, :]
        self.length = length


class HFBackend:
    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval().requires_grad_(False)
        config = model.config
        self.shape = ModelShape(
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            num_layers=int(config.num_hidden_layers),
            max_positions=int(
                getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 2048
            ),
        )
        self.dtype = next(model.parameters()).dtype
        self.buckets: tuple[int, ...] = ()  # eager only
        self.quantized = False

    @property
    def calibration(self) -> CalibrationStore | None:
        return None

    @classmethod
    def from_pretrained(cls, model_dir: Path, dtype: torch.dtype) -> HFBackend:
        try:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
        except (OSError, ValueError) as error:
            raise CausalDraftError(f"cannot load {model_dir} with transformers: {error}") from error
        return cls(model)

    def new_cache(self, max_len: int) -> HFCache:
        return HFCache(self.model, max_len)

    def pass_room(self, length: int) -> int:
        """No limit: transformers' passes are not row-invariant whatever their size (the hf
        backend is exact in fp32 up to rounding, not bit for bit)."""
        return self.shape.max_positions

    def pass_rows(self) -> int:
        """No limit, as for ``pass_room``."""
        return self.shape.max_positions

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(tokens)

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    def forward(
        self,
        tokens: torch.Tensor,  # [n]
        positions: torch.Tensor,  # [n]
        mask: torch.Tensor,  # [n, cache.length + n] bool
        cache: Cache,
        logits_rows: torch.Tensor | None = None,
        aux_layers: tuple[int, ...] = (),
    ) -> ForwardOutput:
        if not isinstance(cache, HFCache):
            raise TypeError("the hf backend needs its own HFCache (new_cache)")
        n = tokens.shape[0]
        cache.check_room(n)
        out = self.model(
            input_ids=tokens[None],
            position_ids=positions[None],
            attention_mask=mask[None, None],
            past_key_values=cache.inner,
            use_cache=True,
            output_hidden_states=True,
        )
        cache.append(n)
        hidden = out.hidden_states[-1][0]  # [n, hidden]
        logits = out.logits[0].float()  # [n, vocab]
        if logits_rows is not None:
            logits = logits.index_select(0, logits_rows)
        # hidden_states[i] is the input of layer i (the last one is after the final norm)
        states = out.hidden_states
        aux = torch.cat([states[i][0] for i in aux_layers], dim=-1) if aux_layers else None
        return ForwardOutput(Scores.of(logits), hidden, aux)
