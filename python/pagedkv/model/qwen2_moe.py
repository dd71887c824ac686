"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention with routed experts plus a gated shared expert.

Each MoE block adds to the top-k routed experts' output one always-on SwiGLU
expert of width `shared_expert_intermediate_size`, scaled per token by
sigmoid(shared_expert_gate(x)):
    out = moe(x) + sigmoid(x @ g^T) * shared_expert(x).
Routing weights are not renormalized unless `norm_topk_prob` says so.
"""

from __future__ import annotations

from pagedkv.model.mixtral import MoEDecoderLayer, MoEForCausalLM
from pagedkv.model_config import ModelConfig


class Qwen2MoeDecoderLayer(MoEDecoderLayer):
    SHARED_EXPERT_GATED = True


class Qwen2MoeForCausalLM(MoEForCausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, Qwen2MoeDecoderLayer)
