"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over the paged KV cache.

One forward runs a flat batch: `input_ids` and `positions` [num_tokens] from
many sequences, prefill chunks and decode tokens mixed, no padding. Logits
are computed separately (`compute_logits`) and only for the rows that are
sampled: the LM head is the largest GEMM of a small model.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedkv import ops
from pagedkv.config import ModelConfig
from pagedkv.model.attention import AttentionMetadata, PagedAttention
from pagedkv.model.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    silu_and_mul,
)
from pagedkv.model.rotary import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=cfg.attention_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size,
                                        bias=cfg.attention_bias and cfg.architecture != "Qwen2ForCausalLM")
        self.attn = PagedAttention(self.num_heads, cfg.head_dim, self.num_kv_heads, cfg.head_dim ** -0.5)

    def forward(self, hidden: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor,
                cos_sin: tuple[torch.Tensor, torch.Tensor] | None, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """cos_sin None: the fused rotary + cache-write kernel; else the unfused path's cos/sin."""
        t, d = hidden.shape[0], self.head_dim
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 Hkv) * D]: q and k heads are adjacent, so one rotation does both
        qk_heads = self.num_heads + self.num_kv_heads
        v = qkv[:, qk_heads * d:].view(t, self.num_kv_heads, d)
        if cos_sin is None:
            q = qkv[:, :self.num_heads * d].view(t, self.num_heads, d)
            k = qkv[:, self.num_heads * d:qk_heads * d].view(t, self.num_kv_heads, d)
            rope.rotate_and_cache(positions, q, k, v, kv_cache, meta.slot_mapping)
        else:
            qk = rope(qkv[:, :qk_heads * d].view(t, qk_heads, d), *cos_sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
            ops.reshape_and_cache(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        return self.o_proj(self.attn(q, kv_cache, meta))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2,
                                                       bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: RotaryEmbedding,
                positions: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, positions, cos_sin, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. Parameter names follow HF's, with q/k/v and gate/up fused."""

    # (our parameter, checkpoint name, shard) for the fused projections.
    STACKED_PARAMS = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                      ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                          cfg.rope_scaling)
        self.lm_head = (self.embed_tokens if cfg.tie_word_embeddings
                        else ParallelLMHead(cfg.vocab_size, cfg.hidden_size))

    @property
    def num_kv_heads(self) -> int:
        """KV heads held by this rank (what its cache stores)."""
        return self.layers[0].self_attn.num_kv_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: int64 [num_tokens] -> hidden states [num_tokens, hidden_size] (pre-final-norm)."""
        hidden = self.embed_tokens(input_ids)
        # The fused kernel reads the float32 table itself; the unfused rotation looks cos/sin up once per step.
        cos_sin = None if ops.fused_ops_supported(hidden) else self.rotary_emb.lookup(positions, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, self.rotary_emb, positions, cos_sin, kv_cache, meta)
        return residual.add_(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Rows of `forward`'s output to sample from [n, hidden_size] -> float32 logits [n, vocab_size].

        Under tensor parallelism every rank calls it; only rank 0 gets the logits (None elsewhere).
        """
        return self.lm_head.logits(self.norm(hidden))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies checkpoint tensors (HF names) into the parameters; returns the names of those loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            target, shard = name, None
            for fused, part, part_shard in self.STACKED_PARAMS:
                if f".{part}." in name:
                    target, shard = name.replace(f".{part}.", f".{fused}."), part_shard
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in {self.config.architecture}")
            with torch.no_grad():  # the loaders copy_ into the parameter, which converts the dtype
                if shard is None:
                    param.weight_loader(param, tensor)
                else:
                    param.weight_loader(param, tensor, shard)
            loaded.add(target)
        return loaded
