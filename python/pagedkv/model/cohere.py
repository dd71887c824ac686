"""Cohere Command-R / Aya (CohereForCausalLM) and Command R7B (Cohere2ForCausalLM).

* Attention and the SwiGLU MLP run in parallel on one LayerNorm of the input
  (weight only, no bias), as Phi's layer does.
* Rotary positions in GPT-J's interleaved order over the whole head: the
  shell's loader permutes each q and k head's rows into the kernels' order
  (`ModelConfig.rotary_interleaved`; scores unchanged).
* Logits are multiplied by `logit_scale`; the embeddings are tied.
* Cohere 2: three sliding-window layers, then one full-attention layer that
  uses no rotary positions at all (NoPE), from `layer_types`.
* `use_qk_norm` (Command R+): a bias-free LayerNorm over each q and k head,
  each head with its own weight (`PerHeadLayerNorm`), before the rotation (its
  weights' dims permuted with the q/k rows).
"""

from __future__ import annotations

from functools import partial

from pagedkv.model.decoder import DecoderForCausalLM, ParallelResidualLayer
from pagedkv.model.layers import LayerNorm
from pagedkv.model_config import ModelConfig


class CohereLayerNorm(LayerNorm):
    """LayerNorm with a weight and no bias."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, eps, bias=False)


class CohereForCausalLM(DecoderForCausalLM):
    norm_cls = CohereLayerNorm

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, partial(ParallelResidualLayer, norm_cls=CohereLayerNorm, shared_norm=True, gated=True,
                                      qk_norm="per_head" if cfg.qk_layernorm else None))
