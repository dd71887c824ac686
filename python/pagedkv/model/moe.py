"""A mixture-of-experts block with SwiGLU experts (Mixtral, Qwen3-MoE), tensor-parallel.

    FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize=True)
    forward(hidden [T, H]) -> [T, H]

Parameters (names as a model's state dict shows them, under the block):
  gate.weight  [E, H]             the router, replicated on every rank
  w13          [E, 2 * I_rank, H] each expert's gate rows, then its up rows
  w2           [E, H, I_rank]     each expert's down projection
with I_rank = intermediate_size / tp: every rank holds a slice of every expert's
intermediate dimension (gate and up sliced alike, w2 along its input dim), so
each rank's output is a partial sum, all-reduced once per block (as
RowParallelLinear does). The routing is recomputed on every rank from the same
(replicated) hidden states, so the ranks agree on it without communicating.

Checkpoint names `load_expert_weight(name, tensor)` accepts, relative to the
block (a model strips `model.layers.{i}.mlp.` or `...block_sparse_moe.` first):
  gate.weight                                   the router [E, H]
  experts.{e}.w1.weight / w3.weight / w2.weight     Mixtral's per-expert gate / up / down
  experts.{e}.gate_proj.weight / up_proj.weight / down_proj.weight   Qwen3-MoE's
  experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]   transformers 5's
      in-memory stacked form (its save_pretrained writes the per-expert names above)
`expert_params_mapping(num_experts)` lists them all with their target.

Routing: softmax of the router logits in float32 over all experts, top_k,
renormalized to sum 1 when `renormalize` (Mixtral: always; Qwen3-MoE:
config.norm_topk_prob). The routing weights stay float32 (Qwen3-MoE's HF code
rounds them to the model dtype first: a difference of one bf16 rounding).
On the CPU the experts run in `torch.ops.pagedkv.fused_moe` (grouped GEMMs);
elsewhere in a PyTorch loop over the experts that have tokens. `pack_for_cpu()`
(the loader calls it after loading) swaps each expert's float32 or bfloat16
weights for packed ones, which the op uses for every expert with rows: for
pagedkv's own GEMM or oneDNN's, whichever the linear layers use on this CPU
(`cpu_linear.linear_kernel`, PAGEDKV_CPU_LINEAR_KERNEL). An expert's few rows
in decode are the small-M products where packing gains most: against at::mm
(MKL's sgemm, or oneDNN without prepacking) and between the two packings, see
bench/results/moe_avx2_cpu.md. The plain parameters keep their shapes as zero-stride
placeholders, so the experts' memory is not doubled; PAGEDKV_CPU_PACKED_MOE=0
(or PAGEDKV_CPU_PACKED_LINEAR=0) turns it off.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv import ops
from pagedkv.model.cpu_linear import pack_expert_weight
from pagedkv.model.decoder import GatedMLP
from pagedkv.model.layers import _check_dim, _divide, _set_loader, default_weight_loader
from pagedkv.model.parallel_state import all_reduce, get_tp_rank, get_tp_size
from pagedkv.model_config import ModelConfig

# Per-expert checkpoint names -> the part of the stacked parameters they fill.
_PER_EXPERT_PARTS = {"w1": "gate", "w3": "up", "w2": "down",
                     "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_STACKED_PARTS = {"experts.gate_up_proj": "gate_up", "experts.down_proj": "down"}

# PAGEDKV_FUSED_MOE=0 sends the CPU back to the PyTorch loop (to compare).
_fused_moe = os.environ.get("PAGEDKV_FUSED_MOE", "1") != "0"


def expert_params_mapping(num_experts: int) -> list[tuple[str, str, tuple[int | None, str]]]:
    """Every expert checkpoint name FusedMoE loads: (name relative to the block, parameter, shard_id).

    shard_id is (expert, part): expert an id, or None for a tensor stacked over all
    experts; part "gate", "up", "gate_up" (w13) or "down" (w2).
    """
    mapping = []
    for e in range(num_experts):
        for name, part in _PER_EXPERT_PARTS.items():
            mapping.append((f"experts.{e}.{name}.weight", "w2" if part == "down" else "w13", (e, part)))
    for name, part in _STACKED_PARTS.items():
        mapping.append((name, "w2" if part == "down" else "w13", (None, part)))
    return mapping


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (float32 weights [T, top_k], int64 ids [T, top_k]): softmax in fp32, top-k."""
    weights, ids = torch.topk(torch.softmax(router_logits, dim=-1, dtype=torch.float32), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def looped_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> torch.Tensor:
    """The experts as a PyTorch loop over those that have tokens (HF's scheme; any device).

    Shapes as `ops.fused_moe`. One host sync (which experts are hit), then per
    expert: index its tokens, two GEMMs, scale, index_add in float32.
    """
    inter = w13.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.reshape(-1)
    for e in torch.unique(flat_ids).tolist():
        pairs = (flat_ids == e).nonzero().squeeze(1)
        tokens = pairs // topk_ids.shape[1]
        gate_up = F.linear(hidden[tokens], w13[e])
        y = F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w2[e])
        out.index_add_(0, tokens, y.float() * topk_weights.reshape(-1)[pairs, None].float())
    return out.to(hidden.dtype)


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
                  ) -> torch.Tensor:
    """The grouped-GEMM op where it has a kernel (CPU), else `looped_experts`. Shapes as `ops.fused_moe`."""
    if _fused_moe and hidden.device.type == "cpu":
        return ops.fused_moe(hidden, w13, w2, topk_weights, topk_ids, *(packed or (None, None)))
    return looped_experts(hidden, w13, w2, topk_weights, topk_ids)


class Router(nn.Module):
    """The replicated router linear: hidden [T, H] -> logits [T, E] (the model dtype, as HF's)."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = _set_loader(nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False),
                                  default_weight_loader)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)


class FusedMoE(nn.Module):
    """Router + E SwiGLU experts, each token sent to its top_k; see the module docstring for names."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool = True) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k (num_experts_per_tok) must be in [1, num_experts={num_experts}], got {top_k}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.inter_per_rank = _divide(intermediate_size, self.tp_size, "the experts' intermediate size")
        self.gate = Router(hidden_size, num_experts)
        self.w13 = _set_loader(
            nn.Parameter(torch.empty(num_experts, 2 * self.inter_per_rank, hidden_size), requires_grad=False),
            self.weight_loader)
        self.w2 = _set_loader(
            nn.Parameter(torch.empty(num_experts, hidden_size, self.inter_per_rank), requires_grad=False),
            self.weight_loader)
        self._checkpoint_names = {name: (param, shard) for name, param, shard in expert_params_mapping(num_experts)}
        self.packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> [T, H] (all-reduced over the tensor-parallel group)."""
        topk_weights, topk_ids = select_experts(self.gate(hidden), self.top_k, self.renormalize)
        return all_reduce(fused_experts(hidden, self.w13, self.w2, topk_weights, topk_ids, self.packed))

    def pack_for_cpu(self) -> None:
        """Swaps each expert's weights for packed ones (module docstring); call after loading.

        float32 and bfloat16, for the GEMM `cpu_linear.pack_expert_weight` picks (a bf16 expert
        meant for oneDNN stays plain where the CPU lacks oneDNN's bf16 path). The plain w13 / w2
        then become zero-stride placeholders of the same shape (the op reads only the packed
        weights), so packing does not double the experts' memory.
        """
        if (self.w13.dtype not in (torch.float32, torch.bfloat16) or self.w13.device.type != "cpu"
                or os.environ.get("PAGEDKV_CPU_PACKED_MOE", "1") == "0" or not _fused_moe):
            return
        w13 = [pack_expert_weight(w) for w in self.w13.data]
        w2 = [pack_expert_weight(w) for w in self.w2.data]
        if any(p is None for p in w13 + w2):
            return
        self.packed = (w13, w2)
        for param in (self.w13, self.w2):
            param.data = param.data.new_zeros(()).expand(param.shape)

    # ---- loading ------------------------------------------------------------------------------

    def load_expert_weight(self, name: str, loaded) -> bool:
        """Loads one checkpoint tensor named relative to the block (module docstring); False if not ours."""
        if name == "gate.weight":
            self.gate.weight.weight_loader(self.gate.weight, loaded)
            return True
        target = self._checkpoint_names.get(name)
        if target is None:
            return False
        param = getattr(self, target[0])
        with torch.no_grad():
            param.weight_loader(param, loaded, target[1])
        return True

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: tuple[int | None, str]) -> None:
        """Copies this rank's slice of a checkpoint tensor into w13 or w2.

        shard_id (expert, part) as in `expert_params_mapping`: a per-expert tensor
        ([I, H] gate/up, [H, I] down) when expert is an id, a stacked one
        ([E, 2I, H] gate_up, [E, H, I] down) when it is None.
        """
        expert, part = shard_id
        if part not in ("gate", "up", "gate_up", "down"):
            raise ValueError(f"FusedMoE shard part must be 'gate', 'up', 'gate_up' or 'down', got {part!r}")
        if (part == "down") != (param is self.w2):
            raise ValueError(f"part {part!r} belongs to {'w2' if part == 'down' else 'w13'}")
        if expert is not None and not 0 <= expert < self.num_experts:
            raise ValueError(f"expert id {expert} is outside [0, num_experts={self.num_experts})")
        lead = 0 if expert is not None else 1  # the stacked tensors have a leading expert dim
        if loaded.dim() != 2 + lead:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
                             f"{'a stacked [E, ., .]' if lead else 'a per-expert 2-D'} {part} projection")
        if expert is None:
            _check_dim(loaded, 0, self.num_experts, "the stacked experts (num_experts)")
        dest = param.data if expert is None else param.data[expert]
        inter, mine = self.intermediate_size, self.inter_per_rank
        if part == "down":
            self._load_down(dest, loaded, lead)
        elif part == "gate_up":
            self._load_rows(dest, loaded, lead, 2 * inter, src_offset=0, dest_offset=0)
            self._load_rows(dest, loaded, lead, 2 * inter, src_offset=inter, dest_offset=mine)
        else:
            self._load_rows(dest, loaded, lead, inter, src_offset=0, dest_offset=0 if part == "gate" else mine)

    def _load_rows(self, dest: torch.Tensor, loaded, lead: int, full: int, src_offset: int, dest_offset: int) -> None:
        """Gate or up rows: this rank's I_rank rows, from src_offset of `loaded`'s dim `lead` (size `full`)."""
        _check_dim(loaded, lead, full, "an expert's gate/up projection (intermediate_size)")
        _check_dim(loaded, lead + 1, self.hidden_size, "an expert's gate/up projection (hidden_size)")
        rows = loaded.narrow(lead, src_offset + self.tp_rank * self.inter_per_rank, self.inter_per_rank)
        dest.narrow(lead, dest_offset, self.inter_per_rank).copy_(rows)

    def _load_down(self, dest: torch.Tensor, loaded, lead: int) -> None:
        """Down projection [.., H, I]: this rank's I_rank input columns."""
        _check_dim(loaded, lead, self.hidden_size, "an expert's down projection (hidden_size)")
        _check_dim(loaded, lead + 1, self.intermediate_size, "an expert's down projection (intermediate_size)")
        dest.copy_(loaded.narrow(lead + 1, self.tp_rank * self.inter_per_rank, self.inter_per_rank))


class SharedExpertMoE(FusedMoE):
    """FusedMoE plus one always-on SwiGLU expert of width `shared_expert_intermediate_size` (Qwen2-MoE,
    Granite-MoE-shared), optionally scaled per token by sigmoid(shared_expert_gate(x)) (Qwen2-MoE):
        out = moe(x) + [sigmoid(x @ g^T) *] shared_expert(x).
    Parameters are named as Qwen2-MoE's block: `gate`, `experts.*`, `shared_expert.*`, `shared_expert_gate`.
    """

    def __init__(self, cfg: ModelConfig, gated: bool) -> None:
        super().__init__(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                         cfg.moe_intermediate_size or cfg.intermediate_size, renormalize=cfg.norm_topk_prob)
        self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, cfg.hidden_act)
        # Replicated [1, hidden]: one gate value per token.
        self.shared_expert_gate = Router(cfg.hidden_size, 1) if gated else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> [T, H] (all-reduced over the tensor-parallel group)."""
        shared = self.shared_expert(hidden)
        if self.shared_expert_gate is not None:
            shared = shared.mul_(torch.sigmoid(self.shared_expert_gate(hidden)))
        return super().forward(hidden).add_(shared)
