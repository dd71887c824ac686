"""A rank's membership in a tensor-parallel group: joining, the plan's collectives, watching, leaving.

`pagedkv.distributed.launch` starts the ranks (spawned on one machine, or
by torchrun) and hands each its TPRuntime.

Backends: gloo on the CPU; on CUDA, NCCL for the model's collectives and a
gloo group for the per-step metadata, which is built on the host.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist

from pagedkv.config import resolve_device
from pagedkv.distributed.step_channel import StepChannel
from pagedkv.errors import EngineDeadError
from pagedkv.model.parallel_state import init_tensor_parallel, reset_tensor_parallel

logger = logging.getLogger(__name__)

# Rendezvous and the model's collectives: a rank missing for this long is gone.
STARTUP_TIMEOUT = timedelta(seconds=int(os.environ.get("PAGEDKV_DIST_TIMEOUT", "300")))
# Workers wait on the step channel for as long as the engine is idle (a server with no traffic).
IDLE_TIMEOUT = timedelta(days=30)
# How long a dying worker gets to show its exit code once a collective failed.
_DEATH_GRACE_S = 5.0
_JOIN_TIMEOUT_S = 15.0


class WorkerDiedError(EngineDeadError):
    """A tensor-parallel rank stopped: the engine cannot run another step (the server answers 503)."""


def torchrun_env() -> tuple[int, int, int, int] | None:
    """(rank, world_size, local_rank, local_world_size) when started by torchrun with several ranks, else None."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    world = int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")), local_world


def rank_device(device: str, local_rank: int) -> torch.device:
    """This rank's device: its own GPU on CUDA (by local rank), the CPU otherwise."""
    dev = resolve_device(device)
    if dev.type != "cuda":
        return dev
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"local rank {local_rank} has no GPU: this machine sees {torch.cuda.device_count()}")
    return torch.device("cuda", local_rank)


def _cpu_threads_per_rank(local_world_size: int) -> int:
    """The host's cores shared among the ranks on it (an explicit OMP_NUM_THREADS wins)."""
    if "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()
    return max(1, len(os.sched_getaffinity(0)) // local_world_size)


@dataclass
class TPRuntime:
    """This process's membership in a tensor-parallel group, and (on a spawning driver) its workers."""

    rank: int
    world_size: int
    local_world_size: int  # ranks on this host (they share its cores and memory)
    device: torch.device
    meta_group: Any  # gloo group with a long timeout, for the step channel
    channel: StepChannel
    workers: list = field(default_factory=list)  # worker processes this driver spawned
    errors: Any = None  # queue of (rank, traceback) from spawned workers that failed
    threads_before: int = 0
    dead_reason: str | None = None
    closed: bool = False

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # --- joining ---------------------------------------------------------------------------------------------------
    @classmethod
    def join(cls, rank: int, world_size: int, local_rank: int, local_world_size: int, init_method: str,
             device: str) -> TPRuntime:
        """Joins the group as `rank` (every rank calls this, in the same order of collectives afterwards)."""
        dev = rank_device(device, local_rank)
        threads_before = torch.get_num_threads()
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        else:
            torch.set_num_threads(_cpu_threads_per_rank(local_world_size))
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=STARTUP_TIMEOUT)
        meta_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        init_tensor_parallel(rank, world_size)
        logger.info("tensor-parallel rank %d/%d joined (%s, %s, %d threads)", rank, world_size, backend, dev,
                    torch.get_num_threads())
        return cls(rank, world_size, local_world_size, dev, meta_group, StepChannel(meta_group),
                   threads_before=threads_before)

    def adopt_workers(self, workers: list, errors: Any) -> None:
        """The driver keeps the worker processes it spawned: it watches them, and stops them at exit."""
        self.workers, self.errors = workers, errors
        atexit.register(_shutdown_at_exit, weakref.ref(self))
        if self.device.type == "cuda":
            threading.Thread(target=self._watch_workers, name="pagedkv-tp-watch", daemon=True).start()

    def _watch_workers(self) -> None:
        """CUDA: a collective waiting on a dead rank would sit in NCCL until the timeout (gloo notices the closed
        socket at once), so abort the group as soon as a spawned worker exits: the step then raises."""
        wait([w.sentinel for w in self.workers])
        if self.closed:
            return
        logger.error("a tensor-parallel worker exited; aborting the group so that no step waits for it")
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception as e:  # older torch, or already torn down: the collective timeout remains
            logger.warning("could not abort the process group: %s", e)

    # --- collectives of the plan -----------------------------------------------------------------------------------
    def barrier(self) -> None:
        """Waits for every rank (on the long-timeout group: ranks load their shards at different speeds)."""
        dist.barrier(group=self.meta_group)

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.meta_group)
        return int(t.item())

    # --- failures ----------------------------------------------------------------------------------------------------
    def check_workers(self) -> None:
        """Raises WorkerDiedError if a spawned worker has exited (cheap: a waitpid per worker)."""
        if self.dead_reason is None:
            dead = [w for w in self.workers if w.exitcode is not None]
            if dead:
                self.dead_reason = self._describe(dead)
        if self.dead_reason is not None:
            raise WorkerDiedError(self.dead_reason)

    def diagnose(self, error: BaseException) -> WorkerDiedError | None:
        """For an error out of a step: a WorkerDiedError if a rank has stopped (waits briefly for its exit code),
        None if the error is the driver's own (the ranks are still in step: every collective had completed)."""
        comm_error = _is_comm_error(error)
        deadline = time.monotonic() + (_DEATH_GRACE_S if comm_error else 0.2)
        dead = []
        while self.workers and not dead:
            dead = [w for w in self.workers if w.exitcode is not None]
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not dead and not comm_error:
            return None
        self.dead_reason = (self._describe(dead) if dead else
                            f"a tensor-parallel collective failed ({error}); a rank has probably stopped")
        self._kill_workers()  # the survivors cannot finish a step without the dead rank
        return WorkerDiedError(self.dead_reason)

    def _kill_workers(self) -> None:
        for w in self.workers:
            if w.exitcode is None:
                w.kill()
            w.join(_JOIN_TIMEOUT_S)

    def _describe(self, dead: list) -> str:
        failures = {}
        while self.errors is not None and not self.errors.empty():
            rank, tb = self.errors.get()
            failures[rank] = tb.strip().splitlines()[-1]
        parts = []
        for w in dead:
            rank = int(w.name.removeprefix("pagedkv-tp"))
            why = failures.get(rank) or f"exit code {w.exitcode}" + (" (killed by a signal)" if w.exitcode < 0 else "")
            parts.append(f"rank {rank} (pid {w.pid}): {why}")
        return "tensor-parallel worker died: " + "; ".join(parts) + ". The engine cannot run; restart it."

    # --- leaving -----------------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Tells the workers to stop (from the driver), waits for them, then leaves the group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.is_driver and self.dead_reason is None:
            try:
                self.channel.send_shutdown()
            except Exception as e:  # a worker already gone: nothing to tell it
                logger.warning("could not tell the tensor-parallel workers to stop: %s", e)
        for w in self.workers:
            w.join(_JOIN_TIMEOUT_S)
            if w.exitcode is None:
                logger.warning("tensor-parallel worker %s did not stop; killing it", w.name)
        self._leave()

    def abort(self) -> None:
        """Start-up failed on the driver: the workers may sit in any collective, so kill them rather than ask."""
        if not self.closed:
            self.closed = True
            self._leave()  # kills the workers first

    def _leave(self) -> None:
        self._kill_workers()
        if dist.is_initialized():
            dist.destroy_process_group()
        reset_tensor_parallel()
        if self.device.type == "cpu":
            torch.set_num_threads(self.threads_before)


def _is_comm_error(error: BaseException) -> bool:
    """Whether a step failed in a collective (a peer gone) rather than in the driver's own code."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error).lower()
    return any(word in text for word in ("gloo", "nccl", "connection reset", "connection closed", "broken pipe"))


def _shutdown_at_exit(ref: weakref.ref) -> None:
    runtime = ref()
    if runtime is not None and not runtime.closed:
        runtime.shutdown()
