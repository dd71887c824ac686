"""GLM-4 (GlmForCausalLM: glm-4-9b-chat-hf) and GLM-4-0414 (Glm4ForCausalLM): interleaved partial rotary.

* Rotary positions turn only the first `partial_rotary_factor` of each head,
  and in GPT-J's interleaved order, which the shell's loader turns into the
  kernels' order by permuting each q and k head's rows
  (`ModelConfig.rotary_interleaved`, `rotary.interleaved_to_halves`).
* q/k/v have a bias, the output projection none; gate/up are fused in the
  checkpoint (loaded per part, as Phi-3's).
* GLM-4-0414 normalizes each sublayer's output before the residual add
  (`post_self_attn_layernorm`, `post_mlp_layernorm`) as well as its input.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedkv.model.attention import AttentionMetadata
from pagedkv.model.decoder import (
    DecoderAttention,
    DecoderForCausalLM,
    GatedMLP,
    KVCache,
    add_and_norm,
    split_gate_up,
)
from pagedkv.model.layers import RMSNorm
from pagedkv.model.llama import LlamaDecoderLayer
from pagedkv.model.rotary import RotaryEmbedding, StepPositions
from pagedkv.model_config import ModelConfig


class Glm4DecoderLayer(nn.Module):
    """input norm -> attention -> post_self_attn norm -> + residual -> norm -> MLP -> post_mlp norm -> + residual."""

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(cfg, layer, rope)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        eps = cfg.rms_norm_eps
        self.input_layernorm, self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, eps), RMSNorm(
            cfg.hidden_size, eps)
        self.post_attention_layernorm, self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, eps), RMSNorm(
            cfg.hidden_size, eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, pos: StepPositions, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = add_and_norm(self.input_layernorm, hidden, residual)
        hidden = self.post_self_attn_layernorm(self.self_attn(hidden, pos, kv_cache, meta))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.post_mlp_layernorm(self.mlp(hidden)), residual


class GlmForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: ModelConfig, layer_cls: type[nn.Module] = LlamaDecoderLayer) -> None:
        super().__init__(cfg, layer_cls)

    def split_checkpoint_tensor(self, name: str, tensor) -> Iterable[tuple[str, object, object]]:
        cfg = self.config
        if ".gate_up_proj." in name:
            return split_gate_up(name, tensor, cfg.intermediate_size)
        return super().split_checkpoint_tensor(name, tensor)


class Glm4ForCausalLM(GlmForCausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, Glm4DecoderLayer)
