"""GPT-J (GPTJForCausalLM: GPT-J-6B and its fine-tunes): attention and an ungated MLP in parallel on one LayerNorm.

    out = x + attn(ln(x)) + fc_out(gelu_new(fc_in(ln(x))))
The first `rotary_dim` dims of each head rotate in GPT-J's interleaved order
(dims 2i and 2i + 1 form a pair); the shared loader permutes the q/k rows into
the kernels' halves order (`rotary.interleaved_to_halves`). q/k/v and the
output projection have no bias, the MLP and the LM head do. Phi's layer with
GPT-J's rotation and names: `transformer.` prefix, `wte`, `h.{i}.ln_1`,
`attn.q_proj` / `k_proj` / `v_proj` / `out_proj`, `mlp.fc_in` / `fc_out`,
`ln_f`, `lm_head` (weight and bias).
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedkv.model.gpt2 import gpt2_style_name
from pagedkv.model.phi import PhiForCausalLM

_RENAMES = ((".ln_1.", ".input_layernorm."), (".attn.out_proj.", ".self_attn.o_proj."), (".attn.", ".self_attn."),
            (".mlp.fc_in.", ".mlp.fc1."), (".mlp.fc_out.", ".mlp.fc2."))
# The causal-mask buffers older GPT-J checkpoints carry (pagedkv's kernels mask by themselves).
_BUFFERS = (".attn.bias", ".attn.masked_bias")


class GPTJForCausalLM(PhiForCausalLM):
    def split_checkpoint_tensor(self, name: str, tensor) -> Iterable[tuple[str, object, object]]:
        if name.endswith(_BUFFERS):
            return ()
        name = gpt2_style_name(name)
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return super().split_checkpoint_tensor(name, tensor)
