"""Arcee (AFM-4.5B): the Llama layer with an ungated squared-ReLU MLP, down(relu(up(x))^2).

The checkpoint names the MLP's two projections `up_proj` / `down_proj`
(pagedkv's `PlainMLP` fc1 / fc2).
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedkv.model.decoder import DecoderForCausalLM
from pagedkv.model.llama import LlamaDecoderLayer
from pagedkv.model_config import ModelConfig


class ArceeDecoderLayer(LlamaDecoderLayer):
    GATED_MLP = False


class ArceeForCausalLM(DecoderForCausalLM):
    LAYER: type[ArceeDecoderLayer] = ArceeDecoderLayer  # Nemotron's has its own norms

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, self.LAYER)

    def split_checkpoint_tensor(self, name: str, tensor) -> Iterable[tuple[str, object, object]]:
        name = name.replace(".mlp.up_proj.", ".mlp.fc1.").replace(".mlp.down_proj.", ".mlp.fc2.")
        return super().split_checkpoint_tensor(name, tensor)
