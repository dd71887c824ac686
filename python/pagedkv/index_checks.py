"""The index-value checks of the ops, and a host-side validator for batch metadata.

Every op checks shapes, dtypes and devices, always. It also scans the *values*
of its index tensors (block ids, `seq_lens`, `slot_mapping`, `query_start_loc`):
free for CPU tensors, but for CUDA tensors a device->host copy and a sync, which
also rules out capturing the op in a CUDA graph. `set_index_checks(False)` (or
`with index_checks(False):`) turns those scans off for CPU and CUDA tensors
alike; `PAGEDKV_SKIP_INDEX_CHECKS=1` sets the initial value.

With the scans off, the CUDA kernels still never read outside the cache (they
skip out-of-range block ids and clamp lengths), but the CPU kernels trust the
indices. An engine that builds its metadata on the CPU validates it there, once,
before the host->device copy: `validate_decode_metadata` /
`validate_prefill_metadata` take numpy arrays or CPU tensors and raise a
`ValueError` naming the field, the index and the value.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

_ops = torch.ops.pagedkv


def set_index_checks(enabled: bool) -> bool:
    """Turn the index-value checks of every op on or off; returns the previous setting."""
    return bool(_ops.set_index_checks(bool(enabled)))


def index_checks_enabled() -> bool:
    """Whether the ops scan the values of their index tensors (the default)."""
    return bool(_ops.index_checks_enabled())


@contextlib.contextmanager
def index_checks(enabled: bool) -> Iterator[None]:
    """`with index_checks(False): ...` runs the block with the value checks off, then restores them.

    The setting is process-wide (not per thread): the ops read one flag.
    """
    previous = set_index_checks(enabled)
    try:
        yield
    finally:
        set_index_checks(previous)


# ---- host-side validation of batch metadata ----------------------------------------------------


def _as_int_array(name: str, value, ndim: int) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU (validate before the host->device copy), got {value.device}")
        value = value.numpy()
    array = np.asarray(value)
    if array.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(array.shape)}")
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {array.dtype}")
    return array


def _first(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0])


def _check_seq_lens(seq_lens: np.ndarray, capacity: int, max_blocks: int, block_size: int,
                    max_seq_len: int | None) -> None:
    if seq_lens.size == 0:
        return
    if (seq_lens < 0).any():
        (s,) = _first(seq_lens < 0)
        raise ValueError(f"seq_lens[{s}] = {seq_lens[s]} is negative")
    if max_seq_len is not None and (seq_lens > max_seq_len).any():
        (s,) = _first(seq_lens > max_seq_len)
        raise ValueError(f"seq_lens[{s}] = {seq_lens[s]} exceeds max_seq_len = {max_seq_len}")
    if (seq_lens > capacity).any():
        (s,) = _first(seq_lens > capacity)
        raise ValueError(f"seq_lens[{s}] = {seq_lens[s]} needs more blocks than block_tables holds "
                         f"({max_blocks} blocks x block_size {block_size} = {capacity} tokens)")


def _check_block_tables(block_tables: np.ndarray, seq_lens: np.ndarray, num_blocks: int, block_size: int,
                        sliding_window: int = 0, q_lens: np.ndarray | None = None) -> None:
    # Only the blocks a sequence uses are read; the rest of a row may hold anything (padding),
    # and so may, with a sliding window, the blocks wholly before the window of the
    # sequence's first query (at seq_len - q_len; decode: q_len 1): they may have been freed.
    lens = seq_lens.astype(np.int64)
    used = (lens + block_size - 1) // block_size
    cols = np.arange(block_tables.shape[1])[None, :]
    in_use = cols < used[:, None]
    if sliding_window > 0:
        first_query = lens - (np.ones_like(lens) if q_lens is None else np.maximum(q_lens, 0))
        first_key = np.maximum(first_query - sliding_window + 1, 0)
        in_use &= cols >= (first_key // block_size)[:, None]
    bad = in_use & ((block_tables < 0) | (block_tables >= num_blocks))
    if bad.any():
        s, b = _first(bad)
        raise ValueError(f"block_tables[{s}][{b}] = {block_tables[s, b]} is outside the cache "
                         f"(num_blocks = {num_blocks})")


def _check_slot_mapping(slot_mapping, num_blocks: int, block_size: int, num_tokens: int | None) -> None:
    slots = _as_int_array("slot_mapping", slot_mapping, 1)
    if num_tokens is not None and slots.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slots.shape[0]} entries but the batch has {num_tokens} tokens")
    num_slots = num_blocks * block_size
    if (slots >= num_slots).any():  # negative slots mean "skip this token"
        (i,) = _first(slots >= num_slots)
        raise ValueError(f"slot_mapping[{i}] = {slots[i]} is outside the cache "
                         f"(num_blocks * block_size = {num_slots})")


def _check_sliding_window(sliding_window: int) -> None:
    if sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0 (0: no window), got {sliding_window}")


def validate_decode_metadata(block_tables, seq_lens, *, num_blocks: int, block_size: int,
                             max_seq_len: int | None = None, slot_mapping=None, sliding_window: int = 0) -> None:
    """Check decode metadata on the host, as the ops' index checks would on the device.

    block_tables: int [num_seqs, max_blocks_per_seq]; seq_lens: int [num_seqs];
    slot_mapping (optional): int [num_tokens], negative = skip. numpy arrays or CPU
    tensors. Raises ValueError naming the field, index and value of the first bad entry:
    a negative seq_len, one above max_seq_len or beyond its block-table row, a used
    block id outside [0, num_blocks), a slot outside the cache. With sliding_window
    W > 0 (as passed to the attention op), the entries of blocks wholly before the
    window (positions below seq_len - W) are not checked: the kernels never read them.
    """
    _check_sliding_window(sliding_window)
    tables, lens = _decode_arrays(block_tables, seq_lens, num_blocks, block_size, max_seq_len)
    _check_block_tables(tables, lens, num_blocks, block_size, sliding_window)
    if slot_mapping is not None:
        _check_slot_mapping(slot_mapping, num_blocks, block_size, None)


def _decode_arrays(block_tables, seq_lens, num_blocks: int, block_size: int,
                   max_seq_len: int | None) -> tuple[np.ndarray, np.ndarray]:
    """block_tables and seq_lens as arrays, their shapes and the seq_lens values checked."""
    tables = _as_int_array("block_tables", block_tables, 2)
    lens = _as_int_array("seq_lens", seq_lens, 1)
    if tables.shape[0] != lens.shape[0]:
        raise ValueError(f"block_tables has {tables.shape[0]} rows but seq_lens has {lens.shape[0]} entries")
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
    _check_seq_lens(lens, tables.shape[1] * block_size, tables.shape[1], block_size, max_seq_len)
    return tables, lens


def validate_prefill_metadata(block_tables, seq_lens, query_start_loc, *, num_blocks: int, block_size: int,
                              num_tokens: int, max_query_len: int | None = None, max_seq_len: int | None = None,
                              slot_mapping=None, sliding_window: int = 0) -> None:
    """Check prefill (paged_prefill_attention) metadata on the host.

    Everything `validate_decode_metadata` checks, plus query_start_loc: int [num_seqs + 1],
    starting at 0, non-decreasing, ending at num_tokens, each sequence's query length
    at most max_query_len and at most its seq_len (seq_lens count the new tokens too).
    slot_mapping, if given, must have num_tokens entries. With sliding_window W > 0, the
    entries of blocks wholly before the window of a sequence's first new token (positions
    below seq_len - q_len - W + 1) are not checked.
    """
    _check_sliding_window(sliding_window)
    tables, lens = _decode_arrays(block_tables, seq_lens, num_blocks, block_size, max_seq_len)
    qsl = _as_int_array("query_start_loc", query_start_loc, 1).astype(np.int64)
    if qsl.shape[0] != lens.shape[0] + 1:
        raise ValueError(f"query_start_loc must have num_seqs+1={lens.shape[0] + 1} entries, got {qsl.shape[0]}")
    if qsl[0] != 0:
        raise ValueError(f"query_start_loc[0] must be 0, got {qsl[0]}")
    if qsl[-1] != num_tokens:
        raise ValueError(f"query_start_loc[-1] = {qsl[-1]} must equal the number of query tokens {num_tokens}")
    q_lens = np.diff(qsl)
    if (q_lens < 0).any():
        (s,) = _first(q_lens < 0)
        raise ValueError(f"query_start_loc must be non-decreasing: query_start_loc[{s}] = {qsl[s]}, "
                         f"query_start_loc[{s + 1}] = {qsl[s + 1]}")
    if max_query_len is not None and (q_lens > max_query_len).any():
        (s,) = _first(q_lens > max_query_len)
        raise ValueError(f"sequence {s} has {q_lens[s]} query tokens (query_start_loc[{s}:{s + 2}]), "
                         f"more than max_query_len = {max_query_len}")
    if (q_lens > lens).any():
        (s,) = _first(q_lens > lens)
        raise ValueError(f"sequence {s} has {q_lens[s]} query tokens but seq_lens[{s}] = {lens[s]}; "
                         "seq_lens counts the new tokens too")
    _check_block_tables(tables, lens, num_blocks, block_size, sliding_window, q_lens)
    if slot_mapping is not None:
        _check_slot_mapping(slot_mapping, num_blocks, block_size, num_tokens)
