"""StarCoder2: the Llama layer with LayerNorms (with bias) and an ungated MLP.

Every projection has a bias (`use_bias`); the MLP is c_fc -> gelu (tanh) ->
c_proj (`PlainMLP`'s fc1 / fc2); every layer slides where the config sets
`sliding_window` (4096 in the published checkpoints). The embeddings are tied.
`LayerNormDecoderLayer` is also GPT-NeoX's layer when its residual is sequential.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedkv.model.decoder import DecoderForCausalLM
from pagedkv.model.layers import LayerNorm
from pagedkv.model.llama import LlamaDecoderLayer
from pagedkv.model_config import ModelConfig


class LayerNormDecoderLayer(LlamaDecoderLayer):
    """Pre-norm attention then pre-norm MLP, LayerNorms and an ungated MLP."""

    NORM_CLS = LayerNorm
    GATED_MLP = False


class Starcoder2ForCausalLM(DecoderForCausalLM):
    norm_cls = LayerNorm

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, LayerNormDecoderLayer)

    def split_checkpoint_tensor(self, name: str, tensor) -> Iterable[tuple[str, object, object]]:
        name = name.replace(".mlp.c_fc.", ".mlp.fc1.").replace(".mlp.c_proj.", ".mlp.fc2.")
        return super().split_checkpoint_tensor(name, tensor)
