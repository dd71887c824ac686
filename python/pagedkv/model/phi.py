"""Phi-1 / Phi-1.5 / Phi-2: attention and an ungated MLP in parallel on one LayerNorm of the input.

    out = x + attn(ln(x)) + fc2(gelu_new(fc1(ln(x))))
Every projection has a bias, the LM head too; a partial rotary factor (0.4 of
each head in Phi-2). The checkpoint calls the output projection `dense` and
the final norm `final_layernorm`.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from pagedkv.model.decoder import DecoderForCausalLM, ParallelResidualLayer, PlainMLP
from pagedkv.model.layers import LayerNorm
from pagedkv.model.rotary import NoRotation, RotaryEmbedding
from pagedkv.model_config import ModelConfig


def phi_layer(cfg: ModelConfig, layer: int, rope: RotaryEmbedding | NoRotation) -> nn.Module:
    mlp = PlainMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=cfg.mlp_bias)
    return ParallelResidualLayer(cfg, layer, rope, mlp, LayerNorm, shared_norm=True)


class PhiForCausalLM(DecoderForCausalLM):
    norm_cls = LayerNorm
    LM_HEAD_BIAS = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, phi_layer)

    def split_checkpoint_tensor(self, name: str, tensor) -> Iterable[tuple[str, object, object]]:
        name = name.replace(".self_attn.dense.", ".self_attn.o_proj.")
        if name.startswith("final_layernorm."):
            name = "norm." + name.removeprefix("final_layernorm.")
        return super().split_checkpoint_tensor(name, tensor)
