"""Mixtral: the Llama decoder with a top-2 mixture of SwiGLU experts in place of the MLP.

The experts run in `pagedkv.model.moe.FusedMoE` (the fused grouped-GEMM op on
the CPU), sharded over tensor-parallel ranks along each expert's width. The
checkpoint names the block `block_sparse_moe` (per-expert `w1`/`w3`/`w2`);
pagedkv calls it `mlp` like every layer's feed-forward block.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedkv.model.decoder import DecoderForCausalLM
from pagedkv.model.llama import LlamaDecoderLayer
from pagedkv.model.moe import FusedMoE, SharedExpertMoE, expert_params_mapping
from pagedkv.model_config import ModelConfig


class MoEDecoderLayer(LlamaDecoderLayer):
    """A Llama layer whose feed-forward block is a mixture of experts where the config says so, with an
    always-on shared expert beside them where it sets `shared_expert_intermediate_size`."""

    SHARED_EXPERT_GATED = False  # Qwen2-MoE scales its shared expert by a sigmoid gate; Granite-MoE does not

    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        if not cfg.is_moe_layer(layer):
            return super().make_mlp(cfg, layer)
        if cfg.shared_expert_intermediate_size:
            return SharedExpertMoE(cfg, gated=self.SHARED_EXPERT_GATED)
        return FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                        cfg.moe_intermediate_size or cfg.intermediate_size, renormalize=cfg.norm_topk_prob)


class MoEForCausalLM(DecoderForCausalLM):
    """The shell for MoE families: routes every expert tensor of the checkpoint to its layer's FusedMoE."""

    BLOCK_NAME = "mlp"  # the checkpoint's name of the feed-forward block

    def __init__(self, cfg: ModelConfig, layer_cls: type[nn.Module] = MoEDecoderLayer) -> None:
        if cfg.num_experts < 1:
            raise ValueError(f"{cfg.architecture} needs num_experts >= 1 in config.json, got {cfg.num_experts}")
        super().__init__(cfg, layer_cls)
        self._expert_names = {name: (param, shard) for name, param, shard in expert_params_mapping(cfg.num_experts)}

    def split_checkpoint_tensor(self, name: str, tensor) -> Iterable[tuple[str, object, object]]:
        """`layers.{i}.<block>.experts.{e}.w1.weight` -> (`layers.{i}.mlp.w13`, (e, "gate"), tensor), etc."""
        name = name.replace(f".{self.BLOCK_NAME}.", ".mlp.")
        if ".mlp.experts." in name:
            block, rest = name.split(".mlp.experts.", 1)
            target = self._expert_names.get("experts." + rest)
            if target is None:
                raise ValueError(f"checkpoint tensor {name!r} is not an expert weight pagedkv knows")
            self._parts_seen.add((block, target[1]))
            return ((f"{block}.mlp.{target[0]}", target[1], tensor),)
        return super().split_checkpoint_tensor(name, tensor)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As the shell's, and every expert of every MoE layer must be loaded: the stacked parameters count as
        loaded at their first expert, so a missing one would otherwise run on uninitialized memory."""
        self._parts_seen: set[tuple[str, tuple[int | None, str]]] = set()
        loaded = super().load_weights(weights)
        for i in range(self.config.num_hidden_layers):
            if self.config.is_moe_layer(i):
                self._check_experts_complete(f"layers.{i}")
        return loaded

    def _check_experts_complete(self, block: str) -> None:
        seen = {shard for b, shard in self._parts_seen if b == block}
        for e in range(self.config.num_experts):
            for param, parts in (("w13", (("gate", "up"), ("gate_up",))), ("w2", (("down",), ("down",)))):
                per_expert, stacked = parts
                if not (all((e, p) in seen for p in per_expert) or all((None, p) in seen for p in stacked)):
                    raise ValueError(f"checkpoint lacks expert {e}'s {'/'.join(per_expert)} weights of {block} "
                                     f"({param}): every expert must be in the checkpoint")


class MixtralForCausalLM(MoEForCausalLM):
    BLOCK_NAME = "block_sparse_moe"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
