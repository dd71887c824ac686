"""OLMoE: the Llama layer with OLMo's q/k RMSNorm over all heads and a top-8 mixture of SwiGLU experts.

Routing weights are not renormalized (`norm_topk_prob` false in the published
config); `clip_qkv`, where set, clamps q, k and v after the norms.
"""

from __future__ import annotations

from pagedkv.model.mixtral import MoEDecoderLayer, MoEForCausalLM
from pagedkv.model_config import ModelConfig


class OlmoeDecoderLayer(MoEDecoderLayer):
    QK_NORM = "full"


class OlmoeForCausalLM(MoEForCausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, OlmoeDecoderLayer)
