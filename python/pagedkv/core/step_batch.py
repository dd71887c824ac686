"""What one step asks of every rank: block copies, then a flat batch, both as host arrays.

The driver builds them from the scheduler's output; under tensor
parallelism the step channel sends them to the workers as they are, so
every rank runs the same copies and the same forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedkv.core.kv_tiers import TierMoves


@dataclass(slots=True)
class BlockOps:
    """Block moves of a step, (src, dst) pairs: swap out, swap in, copy-on-write, and the moves between the pool
    and the prefix cache's tiers (one device only: they never cross the tensor-parallel step channel)."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copy: list[tuple[int, int]] = field(default_factory=list)
    tiers: TierMoves | None = None

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copy or self.tiers)


@dataclass(slots=True)
class StepBatch:
    """A step's flat batch on the host: decode tokens first (one per sequence), then prefill chunks.

    T tokens, S = num_decode_tokens + num_prefills sequences, W block-table columns.
    """

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    block_tables: np.ndarray  # int32 [S, W]
    seq_lens: np.ndarray  # int32 [S]
    query_start_loc: np.ndarray  # int32 [num_prefills + 1]: prefill chunk s is tokens [qsl[s], qsl[s+1]) of the chunks
    logits_indices: np.ndarray  # int64 [L]: rows whose next token is sampled
    num_decode_tokens: int
    decode_max_seq_len: int
    prefill_max_query_len: int
    prefill_max_seq_len: int
    # LoRA (pagedkv.lora): the rows that run an adapter, grouped by slot, and each slot's start in them
    # (int64 [M], int64 [max_loras + 1]); None when no row does.
    lora_rows: np.ndarray | None = None
    lora_starts: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_prefills(self) -> int:
        return len(self.query_start_loc) - 1
