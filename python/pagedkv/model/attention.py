"""Paged attention for a flat batch: decodes first, then prefill chunks.

A step's tokens are one flat batch with no padding. The first
`num_decode_tokens` rows are sequences decoding one token each and go to
`paged_attention` (one query per sequence, the GQA-aware decode kernel); the
rest are prompt chunks (a whole prompt, a chunk of one, or the uncached tail
after a prefix-cache hit) and go to `paged_prefill_attention`. Every layer
first writes the step's new K/V into its paged cache (the fused
`rotary_embedding_and_cache`, or `reshape_and_cache` after an unfused rotation;
see `LlamaAttention`), so a prefill chunk attends to its own tokens and to
everything cached before.

The cache is a `pagedkv.kv_cache.KVCache`: its `op_args` (kv_cache_dtype and
the k/v scales of a quantized format; nothing for "auto") go to every op that
reads or writes it, so an unquantized layer calls the kernels exactly as
before, and a CUDA graph captures the scale tensors by address.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedkv import ops
from pagedkv.kv_cache import KVCache


@dataclass(slots=True)
class AttentionMetadata:
    """Where each new token's K/V goes and what each sequence attends to, for one step.

    slot_mapping: int64 [num_tokens]; slot = block * block_size + offset.
    decode_*: the first num_decode_tokens sequences (one token each);
    prefill_*: the other sequences, their tokens laid out by
    prefill_query_start_loc (int32 [num_prefills + 1], offsets into the
    prefill rows). block_tables int32 [n, max_blocks]; seq_lens int32 [n]
    counts every token of a sequence, this step's included.
    """

    num_decode_tokens: int
    slot_mapping: torch.Tensor
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    decode_max_seq_len: int
    num_prefills: int
    prefill_block_tables: torch.Tensor
    prefill_seq_lens: torch.Tensor
    prefill_query_start_loc: torch.Tensor
    prefill_max_query_len: int
    prefill_max_seq_len: int
    # fp8 caches: this step sets each layer's k/v scales from its keys and values before writing them (the
    # first step with prefill tokens, when calculate_kv_scales asks for it; never a capture or profile forward).
    calibrate_kv_scales: bool = False


class PagedAttention(nn.Module):
    """Attention over this layer's paged KV cache; q already rotated, this step's K/V already cached.

    sliding_window > 0: each query sees only the last `sliding_window` positions (the kernels skip the
    blocks before them); logits_soft_cap > 0: scores become cap * tanh(score / cap) (Gemma 2).
    """

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float, sliding_window: int = 0,
                 logits_soft_cap: float = 0.0) -> None:
        super().__init__()
        self.num_heads, self.head_size, self.num_kv_heads, self.scale = num_heads, head_size, num_kv_heads, scale
        # Only the non-default values are passed, so a full-attention layer calls the kernels as before.
        self.extra = {k: v for k, v in (("sliding_window", sliding_window), ("logits_soft_cap", logits_soft_cap))
                      if v}

    def forward(self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, num_heads, head_size] (a strided view is fine) -> [T, num_heads * head_size]."""
        key_cache, value_cache = kv_cache
        nd = meta.num_decode_tokens
        parts = []
        if nd:
            parts.append(torch.ops.pagedkv.paged_attention(
                q[:nd], key_cache, value_cache, meta.decode_block_tables, meta.decode_seq_lens, self.scale,
                meta.decode_max_seq_len, None, **self.extra, **kv_cache.op_args))
        if meta.num_prefills:
            qp = q[nd:]
            out = torch.empty(qp.shape, dtype=q.dtype, device=q.device)
            ops.paged_prefill_attention(out, qp, key_cache, value_cache, meta.prefill_block_tables,
                                        meta.prefill_query_start_loc, meta.prefill_seq_lens, self.scale,
                                        meta.prefill_max_query_len, meta.prefill_max_seq_len, **self.extra,
                                        **kv_cache.op_args)
            parts.append(out)
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.view(out.shape[0], self.num_heads * self.head_size)
