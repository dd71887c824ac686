"""Qwen3: the Llama decoder with an RMSNorm over each query and key head before the rotation."""

from __future__ import annotations

from pagedkv.model.decoder import DecoderForCausalLM
from pagedkv.model.llama import LlamaDecoderLayer
from pagedkv.model_config import ModelConfig


class Qwen3DecoderLayer(LlamaDecoderLayer):
    QK_NORM = "head"


class Qwen3ForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, Qwen3DecoderLayer)
