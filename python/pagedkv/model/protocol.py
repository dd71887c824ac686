"""The small surface every model class offers the loader and the model runner.

A model runs one flat batch per step (no padding): `forward` takes the step's
token ids and positions [num_tokens] and this rank's paged KV caches, one
`KVCache` per layer (pagedkv.kv_cache: key and value tensors, which it
unpacks to, plus the format and scales the ops take), and returns hidden
states [num_tokens, hidden_size]; `compute_logits` turns the rows to sample
into float32 logits (rank 0 only under tensor parallelism). `load_weights`
takes checkpoint tensors by their HF names; `checkpoint_kv_scales` gives the
fp8 KV-cache scales the checkpoint had, per layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch

from pagedkv.config import ModelConfig
from pagedkv.kv_cache import KVCache
from pagedkv.model.attention import AttentionMetadata

__all__ = ["CausalLM", "KVCache"]


@runtime_checkable
class CausalLM(Protocol):
    config: ModelConfig

    @property
    def num_kv_heads(self) -> int:
        """KV heads held by this rank (what its cache stores per layer)."""
        ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None: ...

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rows of `forward`'s output -> the final hidden states (after the last norm), for pooling."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...

    def checkpoint_kv_scales(self) -> list[tuple[float | None, float | None]]:
        """Per layer, the (k_scale, v_scale) the checkpoint gave an fp8 KV cache (None where it gave none)."""
        ...
