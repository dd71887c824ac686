"""Phi-3: the Llama decoder, with q/k/v and gate/up stored fused in the checkpoint.

pagedkv fuses them too, but loads per part (`q`/`k`/`v`, gate/up) so that each
tensor-parallel rank takes its own heads and its own MLP columns; the fused
checkpoint tensors are split into those parts first. A partial rotary factor
(Phi-4-mini) rotates only the first dims of each head; the long-context
checkpoints (Phi-3-mini-128k, Phi-3.5, Phi-4-mini) use LongRoPE
(`pagedkv.model.rotary.longrope_factors`).
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedkv.model.decoder import DecoderForCausalLM, split_gate_up
from pagedkv.model.llama import LlamaDecoderLayer
from pagedkv.model_config import ModelConfig


class Phi3ForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, LlamaDecoderLayer)

    def split_checkpoint_tensor(self, name: str, tensor) -> Iterable[tuple[str, object, object]]:
        """qkv_proj [(H + 2 Hkv) * D, hidden] -> its q, k, v rows; gate_up_proj [2 I, hidden] -> gate, up rows."""
        cfg = self.config
        if ".qkv_proj." in name:
            q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            return ((name, "q", tensor.narrow(0, 0, q)), (name, "k", tensor.narrow(0, q, kv)),
                    (name, "v", tensor.narrow(0, q + kv, kv)))
        if ".gate_up_proj." in name:
            return split_gate_up(name, tensor, cfg.intermediate_size)
        return super().split_checkpoint_tensor(name, tensor)
