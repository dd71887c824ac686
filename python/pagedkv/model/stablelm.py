"""StableLM (StableLM-2 1.6B / 12B, StableLM-3B-4E1T): the Llama layer with LayerNorms (with bias).

A partial rotary factor (a quarter of each head rotates); q/k/v have a bias
where `use_qkv_bias` says (the output projection never); with
`use_parallel_residual` (12B) attention and MLP read one shared norm of the
same input. `qk_layernorm` (12B): a LayerNorm over each q and k head, each
head with its own weight (`PerHeadLayerNorm`; the checkpoint keeps one
LayerNorm module per head, `q_layernorm.norms.{h}`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn

from pagedkv.model.decoder import DecoderForCausalLM, ParallelResidualLayer
from pagedkv.model.layers import LayerNorm
from pagedkv.model.llama import LlamaDecoderLayer
from pagedkv.model.rotary import NoRotation, RotaryEmbedding
from pagedkv.model_config import ModelConfig

_PER_HEAD_NORM = re.compile(r"\.self_attn\.(?P<which>[qk])_layernorm\.norms\.(?P<head>\d+)\.weight$")


class StableLmDecoderLayer(LlamaDecoderLayer):
    NORM_CLS = LayerNorm


class StableLmQkNormLayer(StableLmDecoderLayer):
    QK_NORM = "per_head"


def stablelm_layer(cfg: ModelConfig, layer: int, rope: RotaryEmbedding | NoRotation) -> nn.Module:
    if not cfg.parallel_residual:
        return (StableLmQkNormLayer if cfg.qk_layernorm else StableLmDecoderLayer)(cfg, layer, rope)
    return ParallelResidualLayer(cfg, layer, rope, norm_cls=LayerNorm, shared_norm=True, gated=True,
                                 qk_norm="per_head" if cfg.qk_layernorm else None)


class StableLmForCausalLM(DecoderForCausalLM):
    norm_cls = LayerNorm

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, stablelm_layer)

    def split_checkpoint_tensor(self, name: str, tensor) -> Iterable[tuple[str, object, object]]:
        match = _PER_HEAD_NORM.search(name)
        if match:  # one LayerNorm per head: its row of our per-head norm
            target = f"{name[:match.start()]}.self_attn.{match['which']}_norm.weight"
            return ((target, int(match["head"]), tensor),)
        return super().split_checkpoint_tensor(name, tensor)
