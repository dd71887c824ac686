"""GPT-NeoX (Pythia, GPT-NeoX-20B, and their fine-tunes): LayerNorms, an ungated MLP, parallel residual.

    out = x + attn(ln1(x)) + mlp(ln2(x))       (use_parallel_residual, the default)
    h = x + attn(ln1(x)); out = h + mlp(ln2(h))  (otherwise)
A quarter of each head rotates (`rotary_pct`) in GPT-NeoX's halves order,
which is the kernels' own. The checkpoint fuses q, k and v per head
(`query_key_value` rows are [head][q | k | v][head_dim]); the loader splits
each head's three parts into pagedkv's q / k / v shards. Names: `gpt_neox.`
prefix, `embed_in`, `final_layer_norm`, `embed_out` (the LM head),
`attention.dense`, `mlp.dense_h_to_4h` / `dense_4h_to_h`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedkv.model.decoder import DecoderForCausalLM, ParallelResidualLayer
from pagedkv.model.layers import LayerNorm, read_whole
from pagedkv.model.rotary import NoRotation, RotaryEmbedding
from pagedkv.model.starcoder2 import LayerNormDecoderLayer
from pagedkv.model_config import ModelConfig

_RENAMES = (("embed_in.", "embed_tokens."), ("final_layer_norm.", "norm."), ("embed_out.", "lm_head."),
            (".attention.dense.", ".self_attn.o_proj."), (".mlp.dense_h_to_4h.", ".mlp.fc1."),
            (".mlp.dense_4h_to_h.", ".mlp.fc2."))
# Buffers some checkpoints carry: the causal mask and the rotary table, which pagedkv builds itself.
_BUFFERS = (".attention.bias", ".attention.masked_bias", ".attention.rotary_emb.inv_freq")


def gpt_neox_layer(cfg: ModelConfig, layer: int, rope: RotaryEmbedding | NoRotation) -> nn.Module:
    if not cfg.parallel_residual:
        return LayerNormDecoderLayer(cfg, layer, rope)
    return ParallelResidualLayer(cfg, layer, rope, norm_cls=LayerNorm, shared_norm=False, gated=False)


def split_heads_qkv(tensor: torch.Tensor, num_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """query_key_value rows [num_heads * 3 * head_dim, ...] ([head][q | k | v][dim]) -> (q, k, v) rows, each
    [num_heads * head_dim, ...] in head order."""
    if tensor.shape[0] != 3 * num_heads * head_dim:
        raise ValueError(f"query_key_value of shape {tuple(tensor.shape)} does not hold {num_heads} heads of "
                         f"3 x {head_dim}")
    parts = tensor.reshape(num_heads, 3, head_dim, *tensor.shape[1:])
    return tuple(parts[:, i].reshape(num_heads * head_dim, *tensor.shape[1:]) for i in range(3))


class GPTNeoXForCausalLM(DecoderForCausalLM):
    norm_cls = LayerNorm

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, gpt_neox_layer)

    def split_checkpoint_tensor(self, name: str, tensor) -> Iterable[tuple[str, object, object]]:
        name = name.removeprefix("gpt_neox.")
        if name.endswith(_BUFFERS):
            return ()
        for old, new in _RENAMES:
            name = name.replace(old, new)
        if ".attention.query_key_value." in name:
            target = name.replace(".attention.query_key_value.", ".self_attn.qkv_proj.")
            q, k, v = split_heads_qkv(read_whole(tensor), self.config.num_attention_heads, self.config.head_dim)
            return (target, "q", q), (target, "k", k), (target, "v", v)
        return super().split_checkpoint_tensor(name, tensor)
