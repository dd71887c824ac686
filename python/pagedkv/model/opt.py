"""OPT (OPTForCausalLM: facebook/opt-125m ... opt-66b, and their fine-tunes): learned absolute positions.

No rotary positions: a learned position embedding, indexed by the position
plus 2 (OPT's offset), is added to the token embedding. The layer is GPT-2's:
pre-norm LayerNorm attention, then a LayerNorm and an ungated MLP (ReLU),
biases everywhere (`LayerNormDecoderLayer`); a final LayerNorm; the LM head
is the token embedding. Checkpoint names sit under `model.decoder.`:
`embed_tokens`, `embed_positions`, `layers.{i}.self_attn.{q,k,v,out}_proj`,
`self_attn_layer_norm`, `fc1` / `fc2`, `final_layer_norm` (the layer's
second norm), and the decoder's own `final_layer_norm`. The post-norm layout
of opt-350m (`do_layer_norm_before: false`, with its embedding projections)
is refused at load (pagedkv.model_config).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedkv.model.decoder import DecoderForCausalLM
from pagedkv.model.layers import LayerNorm, VocabParallelEmbedding
from pagedkv.model.starcoder2 import LayerNormDecoderLayer
from pagedkv.model_config import ModelConfig

POSITION_OFFSET = 2  # OPT's position embedding has 2 rows before position 0 (fairseq's padding offset)
_RENAMES = ((".self_attn.out_proj.", ".self_attn.o_proj."), (".self_attn_layer_norm.", ".input_layernorm."),
            (".final_layer_norm.", ".post_attention_layernorm."), (".fc1.", ".mlp.fc1."), (".fc2.", ".mlp.fc2."))


class OPTForCausalLM(DecoderForCausalLM):
    norm_cls = LayerNorm

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, LayerNormDecoderLayer)
        self.embed_positions = VocabParallelEmbedding(cfg.max_position_embeddings + POSITION_OFFSET,
                                                      cfg.hidden_size)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids, positions).add_(self.embed_positions(positions + POSITION_OFFSET))

    def split_checkpoint_tensor(self, name: str, tensor) -> Iterable[tuple[str, object, object]]:
        name = name.removeprefix("model.").removeprefix("decoder.")
        if name.startswith("final_layer_norm."):
            name = "norm." + name.removeprefix("final_layer_norm.")
        elif name.startswith("layers."):
            for old, new in _RENAMES:
                name = name.replace(old, new)
        return super().split_checkpoint_tensor(name, tensor)
