"""Phi-1 / Phi-1.5 / Phi-2: attention and an ungated MLP in parallel on one LayerNorm of the input.

    out = x + attn(ln(x)) + fc2(gelu_new(fc1(ln(x))))
Every projection has a bias, the LM head too; a partial rotary factor (0.4 of
each head in Phi-2); with `qk_layernorm`, one LayerNorm (with bias) over each
q and k head, shared by the heads. The checkpoint calls the output projection
`dense` and the final norm `final_layernorm`.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

from pagedkv.model.decoder import DecoderForCausalLM, ParallelResidualLayer
from pagedkv.model.layers import LayerNorm
from pagedkv.model_config import ModelConfig


class PhiForCausalLM(DecoderForCausalLM):
    norm_cls = LayerNorm
    LM_HEAD_BIAS = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, partial(ParallelResidualLayer, norm_cls=LayerNorm, shared_norm=True, gated=False,
                                      qk_norm="head" if cfg.qk_layernorm else None))

    def split_checkpoint_tensor(self, name: str, tensor) -> Iterable[tuple[str, object, object]]:
        name = name.replace(".self_attn.dense.", ".self_attn.o_proj.")
        name = name.replace(".self_attn.q_layernorm.", ".self_attn.q_norm.").replace(".self_attn.k_layernorm.",
                                                                                    ".self_attn.k_norm.")
        if name.startswith("final_layernorm."):
            name = "norm." + name.removeprefix("final_layernorm.")
        return super().split_checkpoint_tensor(name, tensor)
