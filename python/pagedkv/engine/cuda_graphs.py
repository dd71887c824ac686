"""Decode steps replayed from captured CUDA graphs (on CUDA unless `enforce_eager`).

A decode step of a small model is a few hundred short kernels whose launch
cost exceeds their run time; a captured graph replays them with one launch.
One graph per batch-size bucket (1, 2, 4, 8, then every 16 up to
max_num_seqs) is captured at start-up, all sharing one memory pool, over
static input buffers. A step whose batch is all decodes and fits a bucket
copies its metadata into the buffers, pads the rest of the bucket with
inert rows (slot -1: nothing written; seq_len 0: nothing read), replays,
and takes its rows of the logits. Steps with prompt chunks run eagerly.

The kernels run in the graph with their index checks off (the runner checks
each step's metadata on the host first) and `max_seq_len` = max_model_len,
so nothing in a step syncs with the host.

The graphs are given the forward to capture (ids, positions, attention
metadata -> logits, over the runner's KV caches), not the runner itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from pagedkv import ops
from pagedkv.core.step_batch import StepBatch
from pagedkv.model.attention import AttentionMetadata

# input_ids int64 [b], positions int64 [b], metadata of b decodes -> float32 logits [b, vocab]
# (None on a tensor-parallel worker, which gathers nothing).
DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor | None]

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch-size buckets: 1, 2, 4, 8, then multiples of 16, up to max_num_seqs (which is always one)."""
    sizes = [b for b in (1, 2, 4, 8, *range(16, max_num_seqs + 1, 16)) if b <= max_num_seqs]
    return sizes if sizes[-1] == max_num_seqs else [*sizes, max_num_seqs]


class DecodeGraphs:
    """The captured decode graphs of one runner, and the static buffers they read."""

    def __init__(self, forward: DecodeForward, device: torch.device, max_num_seqs: int, max_blocks_per_seq: int,
                 max_model_len: int) -> None:
        self.forward = forward
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        dev, n = device, self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor | None]] = {}
        self.replays = 0  # steps run from a graph (tests and logs read it)

    def _forward(self, b: int) -> torch.Tensor | None:
        meta = AttentionMetadata(
            num_decode_tokens=b, slot_mapping=self.slot_mapping[:b], decode_block_tables=self.block_tables[:b],
            decode_seq_lens=self.seq_lens[:b], decode_max_seq_len=self.max_model_len, num_prefills=0,
            prefill_block_tables=self.block_tables[:0], prefill_seq_lens=self.seq_lens[:0],
            prefill_query_start_loc=self.seq_lens[:1], prefill_max_query_len=0, prefill_max_seq_len=0)
        return self.forward(self.input_ids[:b], self.positions[:b], meta)

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first (the pool then fits the smaller ones). Every tensor-parallel
        rank captures at the same point: the graphs hold the collectives."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        with ops.index_checks(False):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside capture: library handles and workspaces
                self._forward(self.sizes[-1])
            torch.cuda.current_stream().wait_stream(side)
            for b in reversed(self.sizes):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(b)
                self.graphs[b] = (graph, logits)
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %d-%d) in %.1f s", len(self.graphs),
                    self.sizes[0], self.sizes[-1], time.perf_counter() - start)

    def fits(self, batch: StepBatch) -> bool:
        # A step with LoRA rows runs eagerly: the captured graphs hold no adapter map.
        return (batch.num_prefills == 0 and 0 < batch.num_decode_tokens <= self.sizes[-1]
                and batch.lora_rows is None)

    def run(self, batch: StepBatch) -> torch.Tensor | None:
        """Replays the smallest bucket holding the batch: float32 logits [num_decode_tokens, vocab] (a view
        into the graph's output, valid until the next replay), or None on a tensor-parallel worker."""
        nd = batch.num_decode_tokens
        b = next(s for s in self.sizes if s >= nd)
        width = batch.block_tables.shape[1]
        self.input_ids[:nd].copy_(torch.from_numpy(batch.input_ids), non_blocking=True)
        self.positions[:nd].copy_(torch.from_numpy(batch.positions), non_blocking=True)
        self.slot_mapping[:nd].copy_(torch.from_numpy(batch.slot_mapping), non_blocking=True)
        self.seq_lens[:nd].copy_(torch.from_numpy(np.ascontiguousarray(batch.seq_lens)), non_blocking=True)
        self.block_tables[:nd, :width].copy_(torch.from_numpy(batch.block_tables), non_blocking=True)
        if b > nd:  # inert padding rows: they write nothing and read nothing
            self.slot_mapping[nd:b].fill_(-1)
            self.seq_lens[nd:b].fill_(0)
        graph, logits = self.graphs[b]
        graph.replay()
        self.replays += 1
        return None if logits is None else logits[:nd]
