"""The adapter slots of one projection, and the step's token-to-slot map they all read.

Each LoRA-capable projection (a column- or row-parallel linear of a decoder
layer) gets a `LinearLoRA`: stacked A [max_loras, n_slices * R, in] and B
[max_loras, out, R] of this rank (R = max_lora_rank, smaller ranks padded
with zeros), one slot per adapter the engine has active. A fused projection
has one slice per part (q, k, v; gate, up), each with its own A and its own
rows of B. Sharding follows the base weight: a column-parallel layer keeps
A whole and its rows of B, a row-parallel one its columns of A and B whole
(its share is added before the all-reduce).

Per step, `LoRAStep` holds the rows of the flat batch that run an adapter,
grouped by slot; every layer's `torch.ops.pagedkv.lora_linear_add` reads the
same map (one host-side grouping per step, not per layer).
"""

from __future__ import annotations

import torch

from pagedkv import ops
from pagedkv.model.layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

_QKV_SLICES = {"q": 0, "k": 1, "v": 2}


class LoRAStep:
    """The step's rows that run an adapter: `token_rows` int64 [M] grouped by slot, slot s owning
    token_rows[slot_starts[s]:slot_starts[s + 1]] (`slot_starts` int64 [max_loras + 1])."""

    def __init__(self) -> None:
        self.token_rows: torch.Tensor | None = None
        self.slot_starts: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return self.token_rows is not None

    def set(self, token_rows: torch.Tensor, slot_starts: torch.Tensor) -> None:
        self.token_rows, self.slot_starts = token_rows, slot_starts

    def clear(self) -> None:
        self.token_rows = self.slot_starts = None


class LinearLoRA:
    """Adapter slots of one projection `layer` (this rank's shard)."""

    def __init__(self, layer, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 step: LoRAStep) -> None:
        self.layer, self.rank, self.step = layer, max_rank, step
        self.row_parallel = isinstance(layer, RowParallelLinear)
        if self.row_parallel:
            in_local, out_local = layer.in_per_rank, layer.out_features
            sizes = [out_local]
        elif isinstance(layer, QKVParallelLinear):
            in_local, out_local = layer.in_features, layer.out_per_rank
            q, kv = layer.num_heads * layer.head_size, layer.num_kv_heads * layer.head_size
            sizes = [q, kv, kv]
        elif isinstance(layer, MergedColumnParallelLinear):
            in_local, out_local = layer.in_features, layer.out_per_rank
            sizes = [s // layer.tp_size for s in layer.output_sizes]
        else:
            in_local, out_local = layer.in_features, layer.out_per_rank
            sizes = [out_local]
        self.slice_offsets = [0]
        for s in sizes:
            self.slice_offsets.append(self.slice_offsets[-1] + s)
        self.lora_a = torch.zeros(max_loras, len(sizes) * max_rank, in_local, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, out_local, max_rank, dtype=dtype, device=device)

    def _slice(self, shard) -> int:
        if isinstance(self.layer, QKVParallelLinear):
            return _QKV_SLICES[shard]
        return 0 if shard is None else int(shard)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def set_part(self, slot: int, shard, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        """Writes one adapted part (A [r, in], B [out of the part, r], whole checkpoint sizes) into `slot`,
        keeping this rank's shard through the layer's own weight loader (which checks the sizes)."""
        self._write(self.lora_a[slot], self.lora_b[slot], shard, lora_a, lora_b)

    def check_part(self, shard, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        """Raises ValueError if the part does not fit this projection (written into scratch, no slot touched):
        run when an adapter is read, so that a misfit never fails a step."""
        self._write(torch.zeros_like(self.lora_a[0]), torch.zeros_like(self.lora_b[0]), shard, lora_a, lora_b)

    def _write(self, dst_a: torch.Tensor, dst_b: torch.Tensor, shard, lora_a: torch.Tensor,
               lora_b: torch.Tensor) -> None:
        r, big = lora_a.shape[0], self.rank
        a = lora_a.new_zeros(big, lora_a.shape[1])
        a[:r] = lora_a
        b = lora_b.new_zeros(lora_b.shape[0], big)
        b[:, :r] = lora_b
        if self.row_parallel:
            self.layer.weight_loader(dst_a, a)
            if tuple(b.shape) != tuple(dst_b.shape):
                raise ValueError(f"lora_B of shape {tuple(lora_b.shape)} does not fit a projection of "
                                 f"{dst_b.shape[0]} outputs")
            dst_b.copy_(b)
            return
        j = self._slice(shard)
        if a.shape[1] != dst_a.shape[1]:
            raise ValueError(f"lora_A of shape {tuple(lora_a.shape)} does not fit a projection of "
                             f"{dst_a.shape[1]} inputs")
        dst_a[j * big:(j + 1) * big].copy_(a)
        if shard is None:
            self.layer.weight_loader(dst_b, b)
        else:
            self.layer.weight_loader(dst_b, b, shard)

    def apply(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """y [T, out] += each adapter's x A^T B^T on its rows (x [T, in])."""
        step = self.step
        ops.lora_linear_add(y, x, self.lora_a, self.lora_b, step.token_rows, step.slot_starts, self.slice_offsets)
