"""The rows of a step that pooling requests read (pagedkv.pooler), and handing them their hidden states.

A pooling request's prefill chunk is laid in the flat batch like any other
but samples nothing: the model runner gathers the chunk's rows its pooling
type reads (every row for MEAN, the first prompt position for CLS, the last
for LAST) after the forward, applies the model's final norm to those rows
only, and adds them to the request's `PoolingState` in float32. The gather
is one index_select for the whole step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedkv.core.sequence import Sequence


@dataclass(slots=True)
class PoolChunk:
    """A pooling chunk: `count` rows from batch row `first` are its rows to pool; it starts at prompt `start`."""

    seq: Sequence
    start: int
    first: int
    count: int


@dataclass(slots=True)
class PoolRows:
    """A step's pooling chunks, in batch order."""

    chunks: list[PoolChunk] = field(default_factory=list)

    def add_chunk(self, seq: Sequence, start: int, n: int, row: int) -> None:
        """The chunk of `seq` computing prompt positions [start, start + n) from batch row `row`."""
        offset, count = seq.request.pooling.rows_of_chunk(start, n)
        self.chunks.append(PoolChunk(seq, start, row + offset, count))

    def __bool__(self) -> bool:
        return bool(self.chunks)

    def indices(self, device: torch.device) -> torch.Tensor:
        """int64 [R]: every chunk's rows, in order."""
        rows = [r for c in self.chunks for r in range(c.first, c.first + c.count)]
        return torch.tensor(rows, dtype=torch.int64, device=device)

    def take(self, states: torch.Tensor) -> None:
        """states: the final hidden states of `indices()`' rows [R, hidden_size]: each chunk's slice goes to its
        request (float32)."""
        states = states.float()
        at = 0
        for c in self.chunks:
            c.seq.request.pooling.add(c.start, states[at:at + c.count])
            at += c.count
