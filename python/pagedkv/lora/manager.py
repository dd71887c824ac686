"""Which adapters are loaded where: host copies (an LRU of `max_cpu_loras`) and `max_loras` device slots.

vLLM's model: an adapter is read from its folder once and kept on the host;
a step's adapters must sit in device slots, at most `max_loras` of them
(the scheduler never batches more), and a slot whose adapter the step does
not use is given to one it does, least recently used first. The manager also
turns the step's per-sequence adapters into the token-to-slot map the
projections read (`LoRAStep`).

Under tensor parallelism every rank has a manager with the same slots: the
driver decides the slot of each adapter and tells the workers which folder
to load into which slot (`StepChannel.send_lora`), and each reads its shard
itself.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Set

import numpy as np
import torch

from pagedkv.config import LoRAConfig
from pagedkv.lora.adapter import LoRAAdapter, LoRAAdapterError, load_adapter
from pagedkv.lora.layers import LinearLoRA, LoRAStep
from pagedkv.lora.request import LoRARequest
from pagedkv.model.layers import ColumnParallelLinear, RowParallelLinear

logger = logging.getLogger(__name__)

_DECODER_LAYER = re.compile(r"(^|\.)layers\.\d+\.")


def lora_capable_modules(model) -> dict[str, torch.nn.Module]:
    """The projections of the decoder layers, by module path: what an adapter may target."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and _DECODER_LAYER.search(name)}


class LoRAManager:
    """Adapters of one rank: host LRU, device slots, and the step's map. `on_load(slot, request)`: called when the
    driver puts an adapter into a slot (the tensor-parallel workers are told to do the same)."""

    def __init__(self, model, config: LoRAConfig, dtype: torch.dtype, device: torch.device,
                 on_load: Callable[[int, LoRARequest], None] | None = None) -> None:
        self.model, self.config, self.dtype, self.device, self.on_load = model, config, dtype, device, on_load
        self.step = LoRAStep()
        self.modules = lora_capable_modules(model)
        if not self.modules:
            raise ValueError(f"enable_lora: {model.config.architecture} has no projections pagedkv can adapt")
        # This engine's slots of each projection. Engines can share one loaded model: `set_step` attaches this
        # engine's slots to the modules before its forward (an engine without LoRA never activates a step, and
        # the slots attached then are skipped).
        self.slots_of = {name: LinearLoRA(m, config.max_loras, config.max_lora_rank, dtype, device, self.step)
                         for name, m in self.modules.items()}
        self._attach()
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # by lora_int_id, least recently used first
        self.slots: list[int | None] = [None] * config.max_loras  # lora_int_id in each slot
        self.slot_used: list[int] = [0] * config.max_loras  # step count of each slot's last use
        self._steps = 0

    # --- host copies -----------------------------------------------------------------------------
    def register(self, request: LoRARequest, keep: Callable[[], Set[int]] = frozenset) -> LoRAAdapter:
        """Reads the adapter (unless held) and keeps it on the host; raises LoRAAdapterError if it cannot run
        (every part is checked against its projection here, so a misfit never fails a step). An id already
        held with another folder or name is refused (an id names one adapter). keep: the ids whose host copies
        must stay (adapters of unfinished requests: their steps never read a folder again), asked only when a
        newly read adapter makes the host trim (not on every request of a held one)."""
        held = self.host.get(request.lora_int_id)
        if held is not None:
            if (held.request.lora_path, held.request.lora_name) != (request.lora_path, request.lora_name):
                raise ValueError(f"lora_int_id {request.lora_int_id} is held by adapter {held.request.lora_name!r} "
                                 f"({held.request.lora_path}); give {request.lora_name!r} an id of its own")
            self.host.move_to_end(request.lora_int_id)
            return held
        adapter = load_adapter(request, self.model, self.modules, self.config.max_lora_rank, self.dtype)
        for part in adapter.parts:
            try:
                self.slots_of[part.module].check_part(part.shard, part.lora_a, part.lora_b)
            except ValueError as e:
                raise LoRAAdapterError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): its "
                                       f"{part.module} part does not fit the model: {e}") from None
        self.host[request.lora_int_id] = adapter
        if len(self.host) > self.config.max_cpu_loras:
            self._trim_host(set(keep()) | {request.lora_int_id})
        logger.info("LoRA adapter %r (id %d, rank %d, %d projections, %.1f MiB) read from %s", request.lora_name,
                    request.lora_int_id, adapter.rank, len(adapter.parts), adapter.num_bytes / 2**20,
                    request.lora_path)
        return adapter

    def _trim_host(self, keep: Set[int]) -> None:
        """Drops the least recently used host copies beyond max_cpu_loras (never one in a slot or in `keep`)."""
        excess = len(self.host) - self.config.max_cpu_loras
        for lora_id in list(self.host):
            if excess <= 0:
                break
            if lora_id not in self.slots and lora_id not in keep:
                del self.host[lora_id]
                excess -= 1

    def remove(self, lora_int_id: int) -> bool:
        """Forgets an adapter (its host copy and its slot); False if it was not held."""
        held = self.host.pop(lora_int_id, None) is not None
        if lora_int_id in self.slots:
            slot = self.slots.index(lora_int_id)
            self.slots[slot] = None
            for lora in self._layers():
                lora.clear_slot(slot)
            held = True
        return held

    @property
    def loaded_ids(self) -> list[int]:
        return list(self.host)

    # --- device slots ----------------------------------------------------------------------------
    def _layers(self):
        return self.slots_of.values()

    def _attach(self) -> None:
        for name, module in self.modules.items():
            module.lora = self.slots_of[name]

    def load_into_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Writes `adapter` into device slot `slot` of every projection (the parts it does not adapt: zeros)."""
        for lora in self._layers():
            lora.clear_slot(slot)
        for part in adapter.parts:
            self.slots_of[part.module].set_part(slot, part.shard, part.lora_a, part.lora_b)
        self.slots[slot] = adapter.request.lora_int_id

    def slot_for(self, request: LoRARequest, in_use: set[int]) -> int:
        """The slot holding `request`'s adapter, loading it (from the host copy, else its folder) into a free
        slot or the least recently used one outside `in_use` (slots this step needs)."""
        lora_id = request.lora_int_id
        if lora_id in self.slots:
            slot = self.slots.index(lora_id)
        else:
            free = [s for s in range(len(self.slots)) if s not in in_use]
            if not free:
                raise RuntimeError(f"a step needs more than max_loras={len(self.slots)} adapters (the scheduler "
                                   "batches at most that many)")
            slot = min(free, key=lambda s: (self.slots[s] is not None, self.slot_used[s]))
            adapter = self.register(request)
            self.load_into_slot(slot, adapter)
            if self.on_load is not None:
                self.on_load(slot, request)
        self.slot_used[slot] = self._steps
        return slot

    # --- the step --------------------------------------------------------------------------------
    def step_map(self, requests: list[LoRARequest | None], counts: list[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """The step's (token_rows int64 [M], slot_starts int64 [max_loras + 1]) for sequences in batch order with
        `counts` tokens each, running `requests` (None: the base model); None when no row runs an adapter."""
        if all(r is None for r in requests):
            return None
        self._steps += 1
        in_use: set[int] = set()
        seq_slots = np.full(len(requests), -1, dtype=np.int64)
        for i, req in enumerate(requests):
            if req is not None:
                seq_slots[i] = slot = self.slot_for(req, in_use)
                in_use.add(slot)
        token_slots = np.repeat(seq_slots, counts)
        rows = np.flatnonzero(token_slots >= 0)
        order = np.argsort(token_slots[rows], kind="stable")
        token_rows = rows[order].astype(np.int64)
        starts = np.zeros(len(self.slots) + 1, dtype=np.int64)
        np.cumsum(np.bincount(token_slots[rows], minlength=len(self.slots)), out=starts[1:])
        return token_rows, starts

    def set_step(self, token_rows: np.ndarray | None, slot_starts: np.ndarray | None) -> None:
        """Points the projections at this step's map (None: no adapter runs; the slots are skipped)."""
        if token_rows is None or len(token_rows) == 0:
            self.step.clear()
            return
        first = next(iter(self.modules.values()))
        if first.lora is not self.slots_of[next(iter(self.modules))]:  # another engine on the same model ran last
            self._attach()
        dev = self.device
        self.step.set(torch.from_numpy(token_rows).to(dev), torch.from_numpy(slot_starts).to(dev))
