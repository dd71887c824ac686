"""Gemma 1, 2 and 3 (text): scaled embeddings, (1 + w) norms, GeGLU; Gemma 2/3 add four norms per layer and
per-layer sliding windows.

* Gemma 1 (and CodeGemma) is the Llama layer with these norms, embeddings and
  GeGLU; its configs' legacy `hidden_act: gelu` means the tanh approximation.

* RMSNorm scales by (1 + weight); the checkpoint stores `weight`, pagedkv adds
  the 1 when loading so the fused norm kernels serve it unchanged.
* Embeddings are multiplied by sqrt(hidden_size), rounded to the model dtype
  first, as HF does.
* Each layer normalizes its input, its attention output, the MLP input and
  the MLP output (`post_*` norms before the residual add).
* Layers alternate sliding-window and full attention (`layer_types`); the
  full-attention layers read the whole context, so no block is freed.
* Gemma 2: attention logits soft-capped (tanh, cap 50) in the kernels, final
  logits soft-capped (cap 30); softmax scale query_pre_attn_scalar^-1/2.
* Gemma 3: an RMSNorm over each q and k head; sliding layers rotate with
  their own base (rope_local_base_freq), full layers with rope_theta and
  its scaling. The multimodal checkpoints (Gemma3ForConditionalGeneration)
  run their text model.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.model.decoder import DecoderForCausalLM, SandwichNormLayer, TextOfMultimodal
from pagedkv.model.layers import RMSNorm, one_plus_weight_loader
from pagedkv.model.llama import LlamaDecoderLayer
from pagedkv.model_config import ModelConfig


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w): loads the checkpoint's w as 1 + w (in float32, then the parameter's dtype)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = one_plus_weight_loader  # type: ignore[attr-defined]


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Gemma 1: norms before attention and before the MLP only."""

    NORM_CLS = GemmaRMSNorm


class Gemma2DecoderLayer(SandwichNormLayer):
    NORM_CLS = GemmaRMSNorm


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    QK_NORM = "head"


class Gemma2ForCausalLM(DecoderForCausalLM):
    norm_cls = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, layer_cls: type[nn.Module] = Gemma2DecoderLayer) -> None:
        super().__init__(cfg, layer_cls)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # HF multiplies by sqrt(hidden_size) held in the model dtype: round it the same way.
        scale = torch.tensor(self.config.hidden_size ** 0.5, dtype=hidden.dtype).item()
        return hidden.mul_(scale)


class GemmaForCausalLM(Gemma2ForCausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, GemmaDecoderLayer)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, Gemma3DecoderLayer)


class Gemma3ForConditionalGeneration(TextOfMultimodal, Gemma3ForCausalLM):
    """The text model of a multimodal Gemma 3 checkpoint (4B and up), for text prompts; the vision tower and the
    projector are not loaded (pagedkv takes no image inputs)."""
