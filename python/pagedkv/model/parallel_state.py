"""Tensor-parallel state of this process: its rank, the world size, the group.

Every parallel layer reads it when it is built. A single-device engine never
calls `init_tensor_parallel`, so the size is 1 and the layers are plain ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(slots=True)
class _TPState:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None


_STATE = _TPState()


def init_tensor_parallel(rank: int, size: int, group: dist.ProcessGroup | None = None) -> None:
    """Sets this process's place in a tensor-parallel group (torch.distributed already initialised)."""
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank must be in [0, {size}), got {rank}")
    _STATE.rank, _STATE.size, _STATE.group = rank, size, group


def get_tp_rank() -> int:
    return _STATE.rank


def get_tp_size() -> int:
    return _STATE.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums `x` over the group in place (a no-op at size 1)."""
    if _STATE.size > 1:
        dist.all_reduce(x, group=_STATE.group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenates every rank's `x` along the last dim (the identity at size 1)."""
    if _STATE.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.size)]
    dist.all_gather(parts, x.contiguous(), group=_STATE.group)
    return torch.cat(parts, dim=-1)
