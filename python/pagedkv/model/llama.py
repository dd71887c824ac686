"""The Llama family over the paged KV cache: Llama 2/3, Mistral, Qwen2, SmolLM2, and Granite.

They share one decoder: RMSNorm before attention and before the MLP, RoPE,
GQA attention, a SwiGLU MLP. Qwen2 has a bias on q/k/v (not on o_proj);
Mistral's window (every layer slides) goes to the attention kernels; Granite
scales the embeddings, each layer's outputs before they join the residual,
the attention scores and the logits by constants of its config.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.model.attention import AttentionMetadata
from pagedkv.model.decoder import DecoderAttention, DecoderForCausalLM, KVCache, add_and_norm, decoder_mlp
from pagedkv.model.layers import RMSNorm
from pagedkv.model.rotary import RotaryEmbedding, StepPositions
from pagedkv.model_config import ModelConfig


class LlamaDecoderLayer(nn.Module):
    QK_NORM: str | None = None  # Qwen3 normalizes each q and k head; OLMoE all heads at once
    NORM_CLS: type[nn.Module] = RMSNorm  # Gemma's (1 + w), LayerNorm
    GATED_MLP = True  # False: an ungated MLP (StarCoder2, GPT-NeoX's sequential layer, GPT-2, Arcee)

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(cfg, layer, rope, qk_norm=self.QK_NORM, norm_cls=self.NORM_CLS)
        self.mlp = self.make_mlp(cfg, layer)
        self.input_layernorm = self.NORM_CLS(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = self.NORM_CLS(cfg.hidden_size, cfg.rms_norm_eps)
        self.residual_multiplier = cfg.residual_multiplier  # Granite; 1.0 elsewhere

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, pos: StepPositions, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = add_and_norm(self.input_layernorm, hidden, residual)
        hidden = self._scaled(self.self_attn(hidden, pos, kv_cache, meta))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self._scaled(self.mlp(hidden)), residual

    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        """The layer's feed-forward block: a dense MLP here, a mixture of experts in the MoE families."""
        return decoder_mlp(cfg, self.GATED_MLP)

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.residual_multiplier == 1.0 else x.mul_(self.residual_multiplier)


class LlamaForCausalLM(DecoderForCausalLM):
    """Decoder + LM head. Parameter names follow HF's, with q/k/v and gate/up fused."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, LlamaDecoderLayer)
