"""GLM-4 (GlmForCausalLM: glm-4-9b-chat-hf) and GLM-4-0414 (Glm4ForCausalLM): interleaved partial rotary.

* Rotary positions turn only the first `partial_rotary_factor` of each head,
  and in GPT-J's interleaved order, which the shell's loader turns into the
  kernels' order by permuting each q and k head's rows
  (`ModelConfig.rotary_interleaved`, `rotary.interleaved_to_halves`).
* q/k/v have a bias, the output projection none; gate/up are fused in the
  checkpoint (loaded per part, as Phi-3's).
* GLM-4-0414 normalizes each sublayer's output before the residual add
  (`post_self_attn_layernorm`, `post_mlp_layernorm`) as well as its input:
  the shared `SandwichNormLayer` (Gemma 2's), its norms renamed at load.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from pagedkv.model.decoder import DecoderForCausalLM, SandwichNormLayer, split_gate_up
from pagedkv.model.llama import LlamaDecoderLayer
from pagedkv.model_config import ModelConfig


class GlmForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: ModelConfig, layer_cls: type[nn.Module] = LlamaDecoderLayer) -> None:
        super().__init__(cfg, layer_cls)

    def split_checkpoint_tensor(self, name: str, tensor) -> Iterable[tuple[str, object, object]]:
        cfg = self.config
        if ".gate_up_proj." in name:
            return split_gate_up(name, tensor, cfg.intermediate_size)
        return super().split_checkpoint_tensor(name, tensor)


# GLM-4-0414's norm names -> the sandwich layer's (GLM's post_attention_layernorm is the MLP's input norm).
_GLM4_NORMS = {"post_self_attn_layernorm": "post_attention_layernorm",
               "post_attention_layernorm": "pre_feedforward_layernorm",
               "post_mlp_layernorm": "post_feedforward_layernorm"}


class Glm4ForCausalLM(GlmForCausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, SandwichNormLayer)

    def split_checkpoint_tensor(self, name: str, tensor) -> Iterable[tuple[str, object, object]]:
        name = ".".join(_GLM4_NORMS.get(part, part) for part in name.split("."))
        return super().split_checkpoint_tensor(name, tensor)
