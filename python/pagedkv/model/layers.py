"""Building blocks of the decoder, written for tensor parallelism.

Megatron-style: a column-parallel linear keeps a slice of the output
features (no communication), a row-parallel linear a slice of the input
features and sums the partial outputs (one all-reduce); the embedding and
LM head split the vocabulary. At tensor-parallel size 1 (the default) they
are plain layers. Each parameter has a `weight_loader(param, loaded,
shard_id)` that copies this rank's slice of a checkpoint tensor into it, so a
rank never holds more than its shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv import ops
from pagedkv.model import cpu_linear
from pagedkv.model.parallel_state import all_reduce, gather_last_dim_to_driver, get_tp_rank, get_tp_size


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def _set_loader(param: nn.Parameter, loader) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def _check_dim(loaded: torch.Tensor, dim: int, expected: int, what: str) -> None:
    """A checkpoint tensor must have the full (unsharded) size the config implies, or the config is wrong."""
    if loaded.dim() <= dim or loaded.shape[dim] != expected:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit {what}: expected "
                         f"{expected} along dim {dim} (does config.json match the weights?)")


def read_whole(loaded) -> torch.Tensor:
    """A checkpoint tensor, or a lazy CheckpointSlice read whole now (for loaders that reorder or transpose it)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded.read()


def default_weight_loader(param: nn.Parameter, loaded) -> None:
    """Copies a whole checkpoint tensor (or a CheckpointSlice, read now) into `param`, converting the dtype."""
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter "
                         f"{tuple(param.shape)}")
    param.data.copy_(read_whole(loaded))


def one_plus_weight_loader(param: nn.Parameter, loaded) -> None:
    """A norm weight the checkpoint stores as w for a norm that scales by 1 + w (Gemma's RMSNorm, Nemotron's
    LayerNorm1P): loaded as 1 + w, added in float32, then the parameter's dtype."""
    default_weight_loader(param, read_whole(loaded).float() + 1.0)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split across ranks: y [*, out_features / tp]."""

    lora = None  # a pagedkv.lora.layers.LinearLoRA when the engine serves LoRA adapters

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.in_features = in_features
        self.out_per_rank = _divide(out_features, self.tp_size, "output features")
        self.weight = _set_loader(nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False),
                                  self.weight_loader)
        self.bias = (_set_loader(nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False),
                                 self.weight_loader) if bias else None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _check_dim(loaded, 0, self.out_per_rank * self.tp_size, "a column-parallel linear")
        rows = loaded.narrow(0, self.tp_rank * self.out_per_rank, self.out_per_rank)
        default_weight_loader(param, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self, x, self.bias)

    def pack_for_cpu(self) -> None:
        _pack(self)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one GEMM (gate and up of the MLP).

    The checkpoint has them apart; shard_id i loads projection i.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            raise ValueError("a merged projection loads one part at a time (shard_id)")
        _check_dim(loaded, 0, self.output_sizes[shard_id], f"part {shard_id} of a merged projection")
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        rows = loaded.narrow(0, self.tp_rank * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), rows)


class QKVParallelLinear(ColumnParallelLinear):
    """The fused Q, K, V projection: [q heads | k heads | v heads] of this rank in one GEMM.

    Query heads are split across ranks. KV heads are split too, or, when the
    tensor-parallel size exceeds their number, each rank keeps the one KV
    head its query heads use (replicated, as vLLM does).
    """

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        tp = get_tp_size()
        self.head_size = head_size
        self.num_heads = _divide(num_heads, tp, "num_attention_heads")
        if tp >= num_kv_heads:
            _divide(tp, num_kv_heads, "the tensor-parallel size must be a multiple of num_key_value_heads, so")
            self.num_kv_heads, self.kv_replicas = 1, tp // num_kv_heads
        else:
            self.num_kv_heads, self.kv_replicas = _divide(num_kv_heads, tp, "num_key_value_heads"), 1
        out = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp
        super().__init__(hidden_size, out, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        if shard_id == "q":
            offset, size, index = 0, q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, index = kv_size, self.tp_rank // self.kv_replicas
        else:
            raise ValueError(f"QKV shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        full = size * (self.tp_size if shard_id == "q" else self.tp_size // self.kv_replicas)
        _check_dim(loaded, 0, full, f"the {shard_id} projection ({full // self.head_size} heads of {self.head_size})")
        default_weight_loader(param.data.narrow(0, offset, size), loaded.narrow(0, index * size, size))


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split across ranks; the partial sums are all-reduced."""

    lora = None  # a pagedkv.lora.layers.LinearLoRA when the engine serves LoRA adapters

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.out_features = out_features
        self.in_per_rank = _divide(in_features, self.tp_size, "input features")
        self.weight = _set_loader(nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False),
                                  self.weight_loader)
        # The bias is added once, on rank 0, so the all-reduce does not count it tp times.
        self.bias = (_set_loader(nn.Parameter(torch.empty(out_features), requires_grad=False),
                                 default_weight_loader) if bias else None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _check_dim(loaded, 1, self.in_per_rank * self.tp_size, "a row-parallel linear")
        default_weight_loader(param, loaded.narrow(1, self.tp_rank * self.in_per_rank, self.in_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        return all_reduce(_linear(self, x, bias))

    def pack_for_cpu(self) -> None:
        _pack(self)


def _pack(layer: nn.Module) -> None:
    """Swaps a linear layer's weight for its packed form (cpu_linear; the plain weight is dropped: no double memory)."""
    packed = cpu_linear.pack_weight(layer.weight)
    if packed is not None:
        layer.packed_weight = packed
        layer.weight = None


def _linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b, plus the step's LoRA adapters on their tokens' rows. A row-parallel layer adds its adapters'
    share before the all-reduce: the sum over ranks of x_r A_r^T B^T is x A^T B^T."""
    packed = getattr(layer, "packed_weight", None)
    y = cpu_linear.packed_linear(x, packed, bias) if packed is not None else F.linear(x, layer.weight, bias)
    lora = layer.lora
    if lora is not None and lora.step.active:
        lora.apply(y, x)
    return y


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across ranks (padded to a multiple of tp)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // self.tp_size)
        self.start = self.tp_rank * self.per_rank
        self.weight = _set_loader(nn.Parameter(torch.zeros(self.per_rank, hidden_size), requires_grad=False),
                                  self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _check_dim(loaded, 0, self.vocab_size, "the vocabulary (vocab_size)")
        rows = loaded[self.start:self.start + self.per_rank]
        if rows.shape[1:] != param.shape[1:]:
            raise ValueError(f"embedding of shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
        param.data[:rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: int64 [num_tokens] -> [num_tokens, hidden_size]."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0.0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """As an LM head (tied embeddings): hidden [n, hidden_size] -> float32 logits [n, vocab_size].

        Each rank computes its slice of the vocabulary; the slices are gathered
        on rank 0, the only one that samples (the others get None).
        """
        packed = getattr(self, "packed_head", None)
        bias = getattr(self, "bias", None)
        local = (cpu_linear.packed_linear(hidden, packed, bias) if packed is not None
                 else F.linear(hidden, self.weight, bias))
        full = gather_last_dim_to_driver(local)
        return None if full is None else full[:, :self.vocab_size].float()

    def pack_for_cpu(self) -> None:
        """Packs a copy for the LM-head GEMM; the plain weight stays for embedding lookups."""
        self.packed_head = cpu_linear.pack_weight(self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """The untied LM head: a vocabulary-parallel [vocab_size, hidden_size] weight used through `logits`, with a
    bias where the checkpoint has one (Phi); the bias is split over ranks as the vocabulary is."""

    def __init__(self, vocab_size: int, hidden_size: int, bias: bool = False) -> None:
        super().__init__(vocab_size, hidden_size)
        self.bias = (_set_loader(nn.Parameter(torch.zeros(self.per_rank), requires_grad=False), self.weight_loader)
                     if bias else None)


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim (GPT-NeoX, Phi, StableLM, StarCoder2), with
    RMSNorm's interface: given a residual it returns (norm(x + residual), x + residual), the sum kept in the
    residual's storage as the decoder loop expects."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _set_loader(nn.Parameter(torch.ones(hidden_size), requires_grad=False), default_weight_loader)
        self.bias = (_set_loader(nn.Parameter(torch.zeros(hidden_size), requires_grad=False), default_weight_loader)
                     if bias else None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = residual.add_(x)
        out = F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        return out if residual is None else (out, x)


class PerHeadLayerNorm(nn.Module):
    """A LayerNorm over each head's dims with each head's own weight (and bias): StableLM-2-12B's and Command
    R+'s q/k norms. [T, heads * head_dim] -> the same shape; statistics in float32.

    Holds this rank's heads (`first_head` on, as QKVParallelLinear splits them); the loader takes the whole
    [num_heads, head_dim] tensor, or one head's [head_dim] row with its index as the shard (StableLM's
    checkpoints keep one LayerNorm per head), and keeps this rank's rows.
    """

    def __init__(self, num_heads: int, head_dim: int, first_head: int, eps: float = 1e-5, bias: bool = False) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.first_head, self.eps = num_heads, head_dim, first_head, eps
        self.weight = _set_loader(nn.Parameter(torch.ones(num_heads, head_dim), requires_grad=False),
                                  self.weight_loader)
        self.bias = (_set_loader(nn.Parameter(torch.zeros(num_heads, head_dim), requires_grad=False),
                                 self.weight_loader) if bias else None)

    def weight_loader(self, param: nn.Parameter, loaded, head: int | None = None) -> None:
        if head is None:
            whole = read_whole(loaded)
            if whole.dim() != 2 or whole.shape[1] != self.head_dim or whole.shape[0] < self.first_head + self.num_heads:
                raise ValueError(f"a per-head norm of shape {tuple(whole.shape)} does not hold heads "
                                 f"[{self.first_head}, {self.first_head + self.num_heads}) of {self.head_dim}")
            default_weight_loader(param, whole.narrow(0, self.first_head, self.num_heads))
        elif self.first_head <= head < self.first_head + self.num_heads:
            default_weight_loader(param.data[head - self.first_head], loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        heads = x.reshape(t, self.num_heads, self.head_dim)
        out = F.layer_norm(heads.float(), (self.head_dim,), eps=self.eps) * self.weight.float()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).reshape(t, self.num_heads * self.head_dim)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, in float32, optionally adding a residual first (returns both).

    With a residual it is vLLM's fused_add_rms_norm: the residual stream (owned by the
    decoder loop) becomes x + residual and x's storage takes the normalized output.
    The fused kernels serve float32/16/bf16 on CPU and CUDA; elsewhere PyTorch does
    the same arithmetic in the same rounding order.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _set_loader(nn.Parameter(torch.ones(hidden_size), requires_grad=False), default_weight_loader)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self._fused(x, residual):
            if residual is None:
                out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
                ops.rms_norm(out, x, self.weight, self.eps)
                return out
            ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is not None:
            x = residual.add_(x)
            residual = x
        if x.dtype == torch.float32:
            out = F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        else:  # normalise in float32, as HF does, then scale in the model dtype
            out = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype) * self.weight
        return out if residual is None else (out, residual)

    def _fused(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        return (ops.fused_ops_supported(x) and x.dim() == 2 and x.stride(-1) == 1 and self.weight.dtype == x.dtype
                and (residual is None or residual.stride(-1) == 1))

