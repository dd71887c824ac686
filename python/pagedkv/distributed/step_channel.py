"""The per-step broadcast from the driver to the workers: one header, one payload, both int64.

    header  [cmd, T, S, W, P, L, n_swap_out, n_swap_in, n_copy, D, max lens x 3, M, n_lora_starts]
    payload input_ids | positions | slot_mapping | block_tables | seq_lens |
            query_start_loc | logits_indices | swap_out | swap_in | copy pairs |
            lora_rows | lora_starts

A LoRA adapter the driver puts into a slot is announced before the step that
needs it: header [LORA, slot, lora_int_id, payload bytes, 0...], then the
JSON of its LoRARequest as bytes (each worker reads its own shard).

Two broadcasts a step on a gloo group, whatever the batch: packing
everything into one tensor keeps the message count (each a network round
trip) independent of the number of fields.
"""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import torch
import torch.distributed as dist

from pagedkv.core.step_batch import BlockOps, StepBatch
from pagedkv.lora.request import LoRARequest
from pagedkv.model.parallel_state import record_collective

_STEP, _SHUTDOWN, _LORA = 1, 2, 3
_HEADER_LEN = 15


def _pairs(a: np.ndarray) -> list[tuple[int, int]]:
    return [(int(s), int(d)) for s, d in a.reshape(-1, 2)]


class StepChannel:
    """Driver: send_step / send_shutdown. Workers: recv (blocks until the driver sends)."""

    def __init__(self, group) -> None:
        self.group = group

    def _broadcast(self, t: torch.Tensor) -> None:
        start = time.perf_counter()
        dist.broadcast(t, src=0, group=self.group)
        record_collective(t, start)

    def send_step(self, ops: BlockOps, batch: StepBatch) -> None:
        s, w = batch.block_tables.shape
        header = np.array([_STEP, batch.num_tokens, s, w, batch.num_prefills, len(batch.logits_indices),
                           len(ops.swap_out), len(ops.swap_in), len(ops.copy), batch.num_decode_tokens,
                           batch.decode_max_seq_len, batch.prefill_max_query_len, batch.prefill_max_seq_len,
                           0 if batch.lora_rows is None else len(batch.lora_rows),
                           0 if batch.lora_starts is None else len(batch.lora_starts)],
                          dtype=np.int64)
        parts = [batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables.reshape(-1),
                 batch.seq_lens, batch.query_start_loc, batch.logits_indices]
        parts += [np.asarray(p, dtype=np.int64).reshape(-1) for p in (ops.swap_out, ops.swap_in, ops.copy)]
        if batch.lora_rows is not None:
            parts += [batch.lora_rows, batch.lora_starts]
        payload = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
        self._broadcast(torch.from_numpy(header))
        self._broadcast(torch.from_numpy(payload))

    def send_lora(self, slot: int, request: LoRARequest) -> None:
        """Tells the workers to load `request`'s adapter into `slot` (before the step that uses it)."""
        data = np.frombuffer(json.dumps(dataclasses.asdict(request)).encode(), dtype=np.uint8)
        header = np.zeros(_HEADER_LEN, dtype=np.int64)
        header[:4] = (_LORA, slot, request.lora_int_id, len(data))
        self._broadcast(torch.from_numpy(header))
        self._broadcast(torch.from_numpy(data.copy()))

    def send_shutdown(self) -> None:
        header = np.zeros(_HEADER_LEN, dtype=np.int64)
        header[0] = _SHUTDOWN
        self._broadcast(torch.from_numpy(header))

    def recv(self) -> tuple[BlockOps, StepBatch] | tuple[int, LoRARequest] | None:
        """The next step's (block ops, batch), a LoRA load's (slot, request), or None when the driver shuts down."""
        header_t = torch.empty(_HEADER_LEN, dtype=torch.int64)
        self._broadcast(header_t)
        header = header_t.tolist()
        if header[0] == _SHUTDOWN:
            return None
        if header[0] == _LORA:
            data_t = torch.empty(header[3], dtype=torch.uint8)
            self._broadcast(data_t)
            return header[1], LoRARequest(**json.loads(data_t.numpy().tobytes()))
        _, t, s, w, p, n_logits, n_out, n_in, n_copy, nd, dmax, pqmax, psmax, m, n_starts = header
        sizes = [t, t, t, s * w, s, p + 1, n_logits, 2 * n_out, 2 * n_in, 2 * n_copy, m, n_starts]
        payload_t = torch.empty(sum(sizes), dtype=torch.int64)
        self._broadcast(payload_t)
        ids, pos, slots, tables, lens, qsl, logits, out, inn, copy, lora_rows, lora_starts = np.split(
            payload_t.numpy(), np.cumsum(sizes)[:-1])
        lora = (lora_rows, lora_starts) if n_starts else (None, None)
        batch = StepBatch(ids, pos, slots, tables.astype(np.int32).reshape(s, w), lens.astype(np.int32),
                          qsl.astype(np.int32), logits, nd, dmax, pqmax, psmax, *lora)
        return BlockOps(_pairs(out), _pairs(inn), _pairs(copy)), batch
