"""Granite-MoE (Granite 3 1B-A400M / 3B-A800M) and Granite-MoE-shared: Granite's multipliers with a top-k
mixture of SwiGLU experts, and in the shared variant one always-on expert beside them.

The checkpoints stack the experts: `block_sparse_moe.input_linear.weight`
[E, 2I, H] (gate rows, then up rows), `output_linear.weight` [E, H, I], the
router at `router.layer.weight`; the shared expert is `shared_mlp.input_linear`
[2S, H] / `output_linear` [H, S] beside the block. Granite routes with a
softmax over the top-k logits, which is the renormalized top-k of the full
softmax (`norm_topk_prob`). Embedding, residual, attention and logit
multipliers are the Llama family's Granite handling.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedkv.model.decoder import split_gate_up
from pagedkv.model.mixtral import MoEForCausalLM

# Checkpoint name parts -> pagedkv's (the MoE shell then routes `mlp.experts.*` to the fused experts).
_RENAMES = ((".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj"),
            (".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj"),
            (".block_sparse_moe.router.layer.weight", ".mlp.gate.weight"),
            (".shared_mlp.output_linear.", ".mlp.shared_expert.down_proj."))


class GraniteMoeForCausalLM(MoEForCausalLM):
    def split_checkpoint_tensor(self, name: str, tensor) -> Iterable[tuple[str, object, object]]:
        for old, new in _RENAMES:
            name = name.replace(old, new)
        if ".shared_mlp.input_linear." in name:  # [2S, H]: the shared expert's gate rows, then its up rows
            target = name.replace(".shared_mlp.input_linear.", ".mlp.shared_expert.gate_up_proj.")
            return split_gate_up(target, tensor, self.config.shared_expert_intermediate_size)
        return super().split_checkpoint_tensor(name, tensor)
