"""Which CPUs the engine core computes on, and which are left to the front end.

`cpu_threads_bind` (`--cpu-threads-bind`, `$PAGEDKV_CPU_THREADS_BIND`) takes
what vLLM's `VLLM_CPU_OMP_THREADS_BIND` takes, plus two words:

    auto     every CPU but one for the core, that one for the front end, on
             machines with 4 CPUs or more; every CPU for the core below that
             (measured on 2 CPUs: see bench/results/serving_cpu.md)
    all      every CPU this process may use, for the core; the front end floats
    nobind   no pinning at all (the OS places every thread)
    0-3,6    these CPUs for the core (one compute thread on each); the rest of
             this process's CPUs for the front end

The core's OpenMP threads are bound one per CPU (`torch.ops.pagedkv.
bind_cpu_threads`), so a front end or a client that takes a core stalls one
known thread instead of moving all of them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

ENV_VAR = "PAGEDKV_CPU_THREADS_BIND"
WORDS = ("auto", "all", "nobind")


@dataclass(frozen=True, slots=True)
class CpuBinding:
    """core: the CPUs of the core's compute threads (None: unpinned); frontend: the CPUs the front end is
    kept on (None: unpinned, it may share the core's)."""

    core: tuple[int, ...] | None
    frontend: tuple[int, ...] | None


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,6' -> [0, 1, 2, 3, 6] (in the order given, no repeats)."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"cpu_threads_bind: {part!r} is not a CPU number or range (e.g. '0-3,6'); the "
                             f"words are {', '.join(WORDS)}") from None
        if first < 0 or last < first:
            raise ValueError(f"cpu_threads_bind: bad range {part!r}")
        cpus.extend(c for c in range(first, last + 1) if c not in cpus)
    return cpus


def plan_cpu_binding(spec: str | None, available: set[int] | None = None) -> CpuBinding:
    """The binding `spec` asks for, checked against the CPUs this process may use."""
    spec = (spec or os.environ.get(ENV_VAR) or "auto").strip().lower()
    cpus = sorted(available if available is not None else os.sched_getaffinity(0))
    if spec == "nobind":
        return CpuBinding(None, None)
    if spec == "all" or (spec == "auto" and len(cpus) < 4):
        return CpuBinding(tuple(cpus), None)
    if spec == "auto":
        return CpuBinding(tuple(cpus[:-1]), (cpus[-1],))
    core = parse_cpu_list(spec)
    missing = [c for c in core if c not in cpus]
    if missing:
        raise ValueError(f"cpu_threads_bind={spec!r}: CPUs {missing} are not available to this process "
                         f"(it may use {cpus})")
    rest = tuple(c for c in cpus if c not in core)
    return CpuBinding(tuple(core), rest or None)


def apply_core_binding(cpus: list[int] | tuple[int, ...]) -> list[int]:
    """In the core process: this process on `cpus`, one compute thread bound to each. Returns where each
    thread runs."""
    os.sched_setaffinity(0, cpus)
    placed = list(torch.ops.pagedkv.bind_cpu_threads(list(cpus)))
    logger.info("engine core compute threads bound to CPUs %s", placed)
    return placed


def apply_frontend_binding(binding: CpuBinding) -> None:
    """In the front end: keep off the core's CPUs when others are left."""
    if binding.frontend:
        os.sched_setaffinity(0, binding.frontend)
        logger.info("front end kept on CPUs %s", list(binding.frontend))
