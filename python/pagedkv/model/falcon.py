"""Falcon (FalconForCausalLM: Falcon-7B / 40B / 180B, Falcon 2 11B, and their fine-tunes).

Three layouts, from the config:
* `parallel_attn` (7B): attention and the MLP in parallel on one LayerNorm;
  with `new_decoder_architecture` (40B, 180B, 11B) each on its own LayerNorm
  (`ln_attn`, `ln_mlp`) unless `num_ln_in_parallel_attn` is 1;
* otherwise attention, then a LayerNorm and the MLP, one after the other.
The fused `query_key_value` holds, per layout: grouped per KV head, each
group's query heads then its key and value (new decoder architecture);
every query head then one shared key and value (`multi_query`, 7B); or
per head [q | k | v] (GPT-NeoX's). The loader splits it into pagedkv's q, k, v
shards. Rotary over the whole head in the kernels' halves order; an ungated
gelu MLP (`dense_h_to_4h`, `dense_4h_to_h`); biases where `bias` says; the LM
head is the word embedding. ALiBi (Falcon-RW) is refused at load.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedkv.model.decoder import DecoderForCausalLM, ParallelResidualLayer
from pagedkv.model.gpt2 import gpt2_style_name
from pagedkv.model.gpt_neox import split_heads_qkv
from pagedkv.model.layers import LayerNorm, read_whole
from pagedkv.model.rotary import NoRotation, RotaryEmbedding
from pagedkv.model.starcoder2 import LayerNormDecoderLayer
from pagedkv.model_config import ModelConfig

_RENAMES = ((".self_attention.query_key_value.", ".self_attn.qkv_proj."),
            (".self_attention.dense.", ".self_attn.o_proj."), (".mlp.dense_h_to_4h.", ".mlp.fc1."),
            (".mlp.dense_4h_to_h.", ".mlp.fc2."), (".ln_attn.", ".input_layernorm."),
            (".ln_mlp.", ".post_attention_layernorm."))


def falcon_layer(cfg: ModelConfig, layer: int, rope: RotaryEmbedding | NoRotation) -> nn.Module:
    if not cfg.parallel_residual:
        return LayerNormDecoderLayer(cfg, layer, rope)
    return ParallelResidualLayer(cfg, layer, rope, norm_cls=LayerNorm, shared_norm=cfg.parallel_norms == 1,
                                 gated=False)


def split_falcon_qkv(tensor: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, ...]:
    """query_key_value rows (weight or bias) -> (q, k, v) rows, each in head order."""
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rest = tensor.shape[1:]
    if cfg.fused_qkv_layout == "grouped":  # [kv head][its query heads..., k, v][dim]
        groups = tensor.reshape(kv_heads, heads // kv_heads + 2, d, *rest)
        return (groups[:, :-2].reshape(heads * d, *rest), groups[:, -2].reshape(kv_heads * d, *rest),
                groups[:, -1].reshape(kv_heads * d, *rest))
    if cfg.fused_qkv_layout == "multi_query":  # every query head, then the one key and value
        q, k, v = tensor.split([heads * d, d, d])
        return q, k, v
    return split_heads_qkv(tensor, heads, d)  # "per_head"


class FalconForCausalLM(DecoderForCausalLM):
    norm_cls = LayerNorm

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, falcon_layer)

    def split_checkpoint_tensor(self, name: str, tensor) -> Iterable[tuple[str, object, object]]:
        name = gpt2_style_name(name, embeddings="word_embeddings")
        for old, new in _RENAMES:
            name = name.replace(old, new)
        if ".self_attn.qkv_proj." in name:
            q, k, v = split_falcon_qkv(read_whole(tensor), self.config)
            return (name, "q", q), (name, "k", k), (name, "v", v)
        return super().split_checkpoint_tensor(name, tensor)
