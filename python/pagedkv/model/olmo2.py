"""OLMo 2, OLMo 3 and EXAONE 4: norms after attention and after the MLP (none before), and a q/k RMSNorm over all heads.

Each sublayer's output is normalized before it joins the residual stream:
    h = x + post_attention_layernorm(attn(x)); out = h + post_feedforward_layernorm(mlp(h)).
The q and k norms span every head of the projection, so under tensor
parallelism the heads are gathered for them (DecoderAttention, qk_norm "full").
OLMo 3 is the same layer with sliding-window attention on three layers of
every four (`layer_types`); its sliding layers keep their own rope settings.
EXAONE 4 is the same layer with an RMSNorm over each q and k head; where it
has a window, three layers in four slide and the full-attention layers use
no rotary positions (NoPE, from `no_rope_layers`).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.model.attention import AttentionMetadata
from pagedkv.model.decoder import DecoderAttention, DecoderForCausalLM, GatedMLP, KVCache
from pagedkv.model.layers import RMSNorm
from pagedkv.model.rotary import RotaryEmbedding, StepPositions
from pagedkv.model_config import ModelConfig


class Olmo2DecoderLayer(nn.Module):
    QK_NORM = "full"  # over all heads; EXAONE 4's is per head

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(cfg, layer, rope, qk_norm=self.QK_NORM)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, pos: StepPositions, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        stream = hidden if residual is None else residual.add_(hidden)
        stream = stream.add_(self.post_attention_layernorm(self.self_attn(stream, pos, kv_cache, meta)))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Exaone4DecoderLayer(Olmo2DecoderLayer):
    QK_NORM = "head"


class Olmo2ForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, Olmo2DecoderLayer)


class Exaone4ForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, Exaone4DecoderLayer)
