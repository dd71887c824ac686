"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with a top-k mixture of experts in most layers.

`mlp_only_layers` and `decoder_sparse_step` say which layers keep a dense MLP;
`norm_topk_prob` whether the top-k routing weights are renormalized.
"""

from __future__ import annotations

from pagedkv.model.mixtral import MoEDecoderLayer, MoEForCausalLM
from pagedkv.model_config import ModelConfig


class Qwen3MoeDecoderLayer(MoEDecoderLayer):
    QK_NORM = "head"


class Qwen3MoeForCausalLM(MoEForCausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, Qwen3MoeDecoderLayer)
