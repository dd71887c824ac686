"""StableLM (StableLM-2 1.6B / 12B, StableLM-3B-4E1T): the Llama layer with LayerNorms (with bias).

A partial rotary factor (a quarter of each head rotates); q/k/v have a bias
where `use_qkv_bias` says (the output projection never); with
`use_parallel_residual` (12B) attention and MLP read one shared norm of the
same input. `qk_layernorm` (a LayerNorm per head) is refused at load.
"""

from __future__ import annotations

from torch import nn

from pagedkv.model.decoder import DecoderForCausalLM, ParallelResidualLayer
from pagedkv.model.layers import LayerNorm
from pagedkv.model.llama import LlamaDecoderLayer
from pagedkv.model.rotary import NoRotation, RotaryEmbedding
from pagedkv.model_config import ModelConfig


class StableLmDecoderLayer(LlamaDecoderLayer):
    NORM_CLS = LayerNorm


def stablelm_layer(cfg: ModelConfig, layer: int, rope: RotaryEmbedding | NoRotation) -> nn.Module:
    if not cfg.parallel_residual:
        return StableLmDecoderLayer(cfg, layer, rope)
    return ParallelResidualLayer(cfg, layer, rope, norm_cls=LayerNorm, shared_norm=True, gated=True)


class StableLmForCausalLM(DecoderForCausalLM):
    norm_cls = LayerNorm

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, stablelm_layer)
