"""Tensor-parallel state of this process: its rank, the world size, the group.

Every parallel layer reads it when it is built. A single-device engine never
calls `init_tensor_parallel`, so the size is 1 and the layers are plain ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(slots=True)
class _TPState:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None


_STATE = _TPState()


@dataclass(slots=True)
class CommStats:
    """This rank's collectives so far: how many, the bytes it contributed, and the seconds it spent in them
    (waiting for the slowest rank included: that is what a step pays)."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


_COMM = CommStats()


def comm_stats() -> CommStats:
    """A snapshot of this process's collective counters (benchmarks difference two of them)."""
    return CommStats(_COMM.calls, _COMM.bytes, _COMM.seconds)


def record_collective(x: torch.Tensor, start: float) -> None:
    """Adds one collective on `x` that began at perf_counter() `start` to the counters."""
    _COMM.calls += 1
    _COMM.bytes += x.numel() * x.element_size()
    _COMM.seconds += time.perf_counter() - start


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
        start = time.perf_counter()
        dist.all_reduce(x, group=_STATE.group)
        record_collective(x, start)
    return x


def gather_last_dim_to_driver(x: torch.Tensor) -> torch.Tensor | None:
    """Every rank's `x` concatenated along the last dim on rank 0 (None elsewhere; the identity at size 1).

    The logits: only the driver samples, so the other ranks need not receive them.
    """
    if _STATE.size == 1:
        return x
    start = time.perf_counter()
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_STATE.size)] if _STATE.rank == 0 else None
    dist.gather(x, parts, dst=0, group=_STATE.group)
    record_collective(x, start)
    return torch.cat(parts, dim=-1) if parts is not None else None


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` [*, n] concatenated along the last dim on every rank [*, n * size] (identity at size 1)."""
    if _STATE.size == 1:
        return x
    start = time.perf_counter()
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_STATE.size)]
    dist.all_gather(parts, x, group=_STATE.group)
    record_collective(x, start)
    return torch.cat(parts, dim=-1)


def reset_tensor_parallel() -> None:
    """Back to size 1 (after the group is destroyed): later models are built unsharded."""
    _STATE.rank, _STATE.size, _STATE.group = 0, 1, None
