"""GPT-2 (GPT2LMHeadModel) and StarCoder / SantaCoder (GPTBigCodeForCausalLM): learned absolute positions.

No rotary positions: a learned position embedding (`wpe`) is added to the
token embedding, and every layer attends without rotation (`NoRotation`,
from `no_rope_layers` covering all layers). The layer is pre-norm LayerNorm
attention, then a LayerNorm and an ungated gelu MLP, biases everywhere
(`LayerNormDecoderLayer`); the LM head is the token embedding.

Checkpoint names sit under `transformer.`: `wte`, `wpe`, `h.{i}.ln_1` /
`ln_2`, `attn.c_attn` (q, k and v fused: [q | k | v] rows), `attn.c_proj`,
`mlp.c_fc` / `c_proj`, `ln_f`. GPT-2 stores its projections as Conv1D
([in, out], transposed at load); GPTBigCode as Linear, with one shared KV
head under `multi_query` (multi-query attention).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedkv.model.decoder import DecoderForCausalLM
from pagedkv.model.layers import LayerNorm, VocabParallelEmbedding, read_whole
from pagedkv.model.starcoder2 import LayerNormDecoderLayer
from pagedkv.model_config import ModelConfig

_RENAMES = ((".ln_1.", ".input_layernorm."), (".ln_2.", ".post_attention_layernorm."),
            (".attn.c_proj.", ".self_attn.o_proj."), (".mlp.c_fc.", ".mlp.fc1."), (".mlp.c_proj.", ".mlp.fc2."))
# The causal-mask buffers older GPT-2 checkpoints carry (pagedkv's kernels mask by themselves).
_BUFFERS = (".attn.bias", ".attn.masked_bias")


def gpt2_style_name(name: str, embeddings: str = "wte") -> str:
    """A GPT-2-style checkpoint name (GPT-2, GPT-J, Falcon) in the shell's terms: `transformer.` dropped,
    `h.{i}` -> `layers.{i}`, the word embeddings (`embeddings`) -> `embed_tokens`, `ln_f` -> `norm`."""
    name = name.removeprefix("transformer.")
    if name.startswith("h."):
        return "layers." + name.removeprefix("h.")
    return {f"{embeddings}.weight": "embed_tokens.weight", "ln_f.weight": "norm.weight",
            "ln_f.bias": "norm.bias"}.get(name, name)


class GPT2LMHeadModel(DecoderForCausalLM):
    norm_cls = LayerNorm
    CONV1D = True  # projection weights stored [in, out]

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, LayerNormDecoderLayer)
        self.wpe = VocabParallelEmbedding(cfg.max_position_embeddings, cfg.hidden_size)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids, positions).add_(self.wpe(positions))

    def split_checkpoint_tensor(self, name: str, tensor) -> Iterable[tuple[str, object, object]]:
        if name.endswith(_BUFFERS):
            return ()
        name = gpt2_style_name(name)
        for old, new in _RENAMES:
            name = name.replace(old, new)
        projection = any(part in name for part in (".attn.c_attn.", ".self_attn.o_proj.", ".mlp."))
        if self.CONV1D and projection and name.endswith(".weight"):
            tensor = read_whole(tensor).t()
        if ".attn.c_attn." in name:
            return self._split_qkv(name.replace(".attn.c_attn.", ".self_attn.qkv_proj."), tensor)
        return super().split_checkpoint_tensor(name, tensor)

    def _split_qkv(self, target: str, tensor) -> tuple[tuple[str, str, torch.Tensor], ...]:
        """c_attn rows [q | k | v] (after the Conv1D transpose) -> pagedkv's q, k, v shards."""
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        full = read_whole(tensor)
        if full.shape[0] != q + 2 * kv:
            raise ValueError(f"c_attn of shape {tuple(full.shape)} does not hold q ({q}) + k and v ({kv} each)")
        return (target, "q", full[:q]), (target, "k", full[q:q + kv]), (target, "v", full[q + kv:])


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    CONV1D = False
