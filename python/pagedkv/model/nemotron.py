"""Nemotron (NemotronForCausalLM: Nemotron-4, Minitron, Mistral-NeMo-Minitron): the Llama layer with
LayerNorm1P norms and an ungated squared-ReLU MLP.

LayerNorm1P is a LayerNorm (with bias) that scales by 1 + weight: the
loader stores 1 + w, as Gemma's RMSNorm does. The MLP is down(relu(up(x))^2)
(Arcee's); a share of each head rotates (`partial_rotary_factor`, 0.5 in the
published checkpoints) in the kernels' own halves order. No biases on the
projections; the norms' eps is `norm_eps`.
"""

from __future__ import annotations

from pagedkv.model.arcee import ArceeDecoderLayer, ArceeForCausalLM
from pagedkv.model.layers import LayerNorm, one_plus_weight_loader


class LayerNorm1P(LayerNorm):
    """LayerNorm scaling by (1 + w): loads the checkpoint's w as 1 + w (in float32, then the parameter's dtype)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = one_plus_weight_loader  # type: ignore[attr-defined]


class NemotronDecoderLayer(ArceeDecoderLayer):
    NORM_CLS = LayerNorm1P


class NemotronForCausalLM(ArceeForCausalLM):
    norm_cls = LayerNorm1P
    LAYER = NemotronDecoderLayer
