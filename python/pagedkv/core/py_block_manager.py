"""Pure-Python twin of the C++ core (`pagedkv._block_manager`), same API and policy.

Kept beside the C++ core for two jobs: the baseline in
bench/bench_block_manager.py, and the model the stateful test checks the C++
core against, block id for block id. It is written to be obviously right, not
fast: plain lists and dicts, an OrderedDict as the free list (O(1) pop front,
push front/back, remove from the middle). Error classes are the C++ module's.

Free-list policy (identical to block_pool.h): front = uncached free blocks,
then cached free blocks least recently freed first; allocate pops the front.

Sliding window (identical to block_manager.h): the leading table entries
wholly before the window of a sequence's earliest new query are released and
become DROPPED_BLOCK; every walk over a table skips them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from pagedkv._block_manager import (
    DROPPED_BLOCK,
    AllocStatus,
    BlockRefCountError,
    InvalidSequenceStateError,
    NoFreeBlocksError,
    SequenceExistsError,
    UnknownSequenceError,
)


class PyBlockPool:
    """Blocks with ref counts, a free list and a digest -> block cache index."""

    def __init__(self, num_blocks: int, name: str = "gpu") -> None:
        if num_blocks < 0:
            raise ValueError(f"BlockPool: num_blocks must be >= 0, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._key: list[bytes | None] = [None] * num_blocks
        self._index: dict[bytes, int] = {}
        self.num_evictions = 0
        self.record_evictions = False
        self._evicted: list[tuple[int, bytes]] = []  # the eviction journal (set_record_evictions)

    def _check(self, block: int, op: str) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"{op}: {self.name} block id {block} out of range [0, {self.num_blocks})")

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeBlocksError(f"out of {self.name} blocks: all {self.num_blocks} are in use")
        block, _ = self._free.popitem(last=False)
        key = self._key[block]
        if key is not None:  # evict its cached contents
            del self._index[key]
            self._key[block] = None
            self.num_evictions += 1
            if self.record_evictions:
                self._evicted.append((block, key))
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        self._check(block, "incref")
        if self.ref_counts[block] == 0:
            if self._key[block] is None:
                raise BlockRefCountError(f"cannot share free {self.name} block {block}: it is not cached")
            del self._free[block]
        self.ref_counts[block] += 1

    def decref(self, block: int) -> int:
        self._check(block, "decref")
        if self.ref_counts[block] == 0:
            raise BlockRefCountError(f"double free of {self.name} block {block}: it is already free")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free[block] = None  # back of the LRU order
            if self._key[block] is None:
                self._free.move_to_end(block, last=False)
        return self.ref_counts[block]

    def free(self, block: int) -> None:
        self._check(block, "free")
        if self.ref_counts[block] > 1:
            raise BlockRefCountError(
                f"cannot free {self.name} block {block}: it is still referenced by {self.ref_counts[block]} holders")
        self.decref(block)

    def cache_block(self, block: int, key: bytes) -> bool:
        self._check(block, "cache_block")
        if not key:
            raise ValueError("cache_block: the cache key must not be empty")
        if self.ref_counts[block] == 0:
            raise BlockRefCountError(f"cannot cache free {self.name} block {block}: allocate it first")
        if self._key[block] is not None or key in self._index:
            return False
        self._index[key] = block
        self._key[block] = key
        return True

    def uncache(self, block: int) -> bool:
        """Drops the block's cache key; a free block moves to the front (uncached). Not an eviction."""
        self._check(block, "uncache")
        key = self._key[block]
        if key is None:
            return False
        del self._index[key]
        self._key[block] = None
        if block in self._free:
            self._free.move_to_end(block, last=False)
        return True

    def lookup(self, key: bytes) -> int:
        return self._index.get(key, -1)

    def is_cached(self, block: int) -> bool:
        self._check(block, "is_cached")
        return self._key[block] is not None

    def clear_cache(self) -> None:
        self._key = [None] * self.num_blocks
        self._index.clear()

    def key(self, block: int) -> bytes:
        """The block's cache key (b"" if it has none)."""
        self._check(block, "key")
        return self._key[block] or b""

    def set_record_evictions(self, on: bool) -> None:
        """While on, allocate() journals each (block, key) it evicts, for a tier below this pool."""
        self.record_evictions = on
        if not on:
            self._evicted.clear()

    def take_evictions(self) -> list[tuple[int, bytes]]:
        """The evictions journaled since the last call, in order; empties the journal."""
        out, self._evicted = self._evicted, []
        return out

    def ref_count(self, block: int) -> int:
        self._check(block, "ref_count")
        return self.ref_counts[block]

    def is_free(self, block: int) -> bool:
        self._check(block, "is_free")
        return block in self._free

    def free_list(self) -> list[int]:
        return list(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_evictable(self) -> int:
        return sum(1 for b in self._free if self._key[b] is not None)

    @property
    def num_cached(self) -> int:
        return len(self._index)


@dataclass(slots=True)
class _Seq:
    table: list[int]  # table[:num_dropped] are DROPPED_BLOCK
    num_tokens: int
    swapped: bool = False
    num_dropped: int = 0

    @property
    def live(self) -> list[int]:
        """The blocks it holds, in table order."""
        return self.table[self.num_dropped:]


@dataclass
class PyBlockManager:
    """Block tables over a GPU pool and a CPU swap pool: see csrc/block_manager/block_manager.h."""

    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    watermark: float
    enable_caching: bool
    sliding_window: int = 0  # tokens, 0 = off
    _seqs: dict[int, _Seq] = field(default_factory=dict)
    # GPU blocks newly cached since the last begin_step(): see block_manager.h.
    _step_cached: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"BlockManager: block_size must be >= 1, got {self.block_size}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"BlockManager: watermark must be in [0, 1), got {self.watermark}")
        if self.sliding_window < 0:
            raise ValueError(f"BlockManager: sliding_window must be >= 0 tokens (0: off), got {self.sliding_window}")
        self.gpu = PyBlockPool(self.num_gpu_blocks, "gpu")
        self.cpu = PyBlockPool(self.num_cpu_blocks, "cpu")
        self.watermark_blocks = int(self.watermark * self.num_gpu_blocks)

    # --- helpers ----------------------------------------------------------
    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _find(self, seq_id: int, op: str) -> _Seq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(f"{op}: unknown sequence {seq_id}")
        return seq

    def _running(self, seq_id: int, op: str) -> _Seq:
        seq = self._find(seq_id, op)
        if seq.swapped:
            raise InvalidSequenceStateError(f"{op}: sequence {seq_id} is swapped out; swap it in first")
        return seq

    # --- sliding window -----------------------------------------------------
    def _before_window(self, first_query: int) -> int:
        """Logical blocks wholly before the window of a query at `first_query` (keys from first_query - W + 1)."""
        if not self.sliding_window:
            return 0
        return max(0, first_query - self.sliding_window + 1) // self.block_size

    def _freed_by_drop(self, seq: _Seq, first_query: int) -> int:
        end = self._before_window(first_query)
        return sum(1 for b in seq.table[seq.num_dropped:end] if self.gpu.ref_count(b) == 1)

    def _drop(self, seq: _Seq, first_query: int) -> None:
        end = self._before_window(first_query)
        for i in range(end - 1, seq.num_dropped - 1, -1):  # deepest first, as in free
            self.gpu.decref(seq.table[i])
            seq.table[i] = DROPPED_BLOCK
        seq.num_dropped = max(seq.num_dropped, end)

    @staticmethod
    def _positive(value: int, op: str, what: str) -> None:
        if value < 1:
            raise ValueError(f"{op}: {what} must be >= 1, got {value}")

    # --- admission --------------------------------------------------------
    def allocate_status(self, num_tokens: int, cached_prefix: list[int]) -> AllocStatus:
        self._positive(num_tokens, "allocate_status", "num_tokens")
        skip = min(len(cached_prefix), self._before_window(len(cached_prefix) * self.block_size))
        total = self._blocks_for(num_tokens) - skip
        if total > self.num_gpu_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        kept = cached_prefix[skip:]
        needed = total - len(kept) + sum(1 for b in kept if self.gpu.ref_count(b) == 0)
        return AllocStatus.OK if self.gpu.num_free - needed >= self.watermark_blocks else AllocStatus.LATER

    def allocate(self, seq_id: int, num_tokens: int, cached_prefix: list[int]) -> None:
        self._positive(num_tokens, "allocate", "num_tokens")
        if seq_id in self._seqs:
            raise SequenceExistsError(f"allocate: sequence {seq_id} already has blocks")
        if len(cached_prefix) * self.block_size > num_tokens - 1:
            raise ValueError(f"allocate: {len(cached_prefix)} cached blocks cover too much of a "
                             f"{num_tokens}-token prompt")
        skip = min(len(cached_prefix), self._before_window(len(cached_prefix) * self.block_size))
        needed = self._blocks_for(num_tokens) - len(cached_prefix)
        for i, b in enumerate(cached_prefix):
            if not self.gpu.is_cached(b):
                raise BlockRefCountError(f"allocate: gpu block {b} is not in the prefix cache")
            needed += i >= skip and self.gpu.ref_count(b) == 0
        if needed > self.gpu.num_free:
            raise NoFreeBlocksError(f"allocate: sequence {seq_id} needs {needed} free gpu blocks, "
                                    f"{self.gpu.num_free} are free")
        kept = cached_prefix[skip:]  # hits before the window are never read: not taken
        for b in kept:
            self.gpu.incref(b)
        fresh = self._blocks_for(num_tokens) - len(cached_prefix)
        table = [DROPPED_BLOCK] * skip + list(kept) + [self.gpu.allocate() for _ in range(fresh)]
        self._seqs[seq_id] = _Seq(table, num_tokens, num_dropped=skip)

    # --- growth -----------------------------------------------------------
    def _needed(self, seq: _Seq, n: int) -> int:
        needed = self._blocks_for(seq.num_tokens + n) - len(seq.table)
        if seq.num_tokens % self.block_size and self.gpu.ref_count(seq.table[-1]) > 1:
            needed += 1
        return needed - self._freed_by_drop(seq, seq.num_tokens)

    def blocks_to_append(self, seq_id: int, num_new_tokens: int) -> int:
        self._positive(num_new_tokens, "blocks_to_append", "num_new_tokens")
        return self._needed(self._running(seq_id, "blocks_to_append"), num_new_tokens)

    def can_append(self, seq_ids: list[int], num_new_tokens: int) -> bool:
        self._positive(num_new_tokens, "can_append", "num_new_tokens")
        return sum(self._needed(self._running(s, "can_append"), num_new_tokens) for s in seq_ids) <= self.gpu.num_free

    def _append(self, seq: _Seq, n: int) -> tuple[int, int] | None:
        self._drop(seq, seq.num_tokens)
        cow = None
        if seq.num_tokens % self.block_size and self.gpu.ref_count(seq.table[-1]) > 1:
            src, dst = seq.table[-1], self.gpu.allocate()
            self.gpu.decref(src)
            seq.table[-1] = dst
            cow = (src, dst)
        seq.num_tokens += n
        while len(seq.table) < self._blocks_for(seq.num_tokens):
            seq.table.append(self.gpu.allocate())
        return cow

    def append_slots(self, seq_id: int, num_new_tokens: int) -> tuple[int, int] | None:
        self._positive(num_new_tokens, "append_slots", "num_new_tokens")
        seq = self._running(seq_id, "append_slots")
        needed = self._needed(seq, num_new_tokens)
        if needed > self.gpu.num_free:
            raise NoFreeBlocksError(f"append_slots: sequence {seq_id} needs {needed} free gpu blocks, "
                                    f"{self.gpu.num_free} are free")
        return self._append(seq, num_new_tokens)

    def append_slots_batch(self, seq_ids: list[int], num_new_tokens: int) -> list[tuple[int, int]]:
        self._positive(num_new_tokens, "append_slots_batch", "num_new_tokens")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"append_slots_batch: a sequence is listed twice in {seq_ids}")
        seqs = [self._running(s, "append_slots_batch") for s in seq_ids]
        needed = sum(self._needed(seq, num_new_tokens) for seq in seqs)
        if needed > self.gpu.num_free:
            raise NoFreeBlocksError(f"append_slots_batch: {len(seqs)} sequences need {needed} free gpu blocks, "
                                    f"{self.gpu.num_free} are free")
        for seq in seqs:  # every drop before any allocation, as the count above assumes
            self._drop(seq, seq.num_tokens)
        cows = [self._append(seq, num_new_tokens) for seq in seqs]
        return [c for c in cows if c is not None]

    def fork(self, parent: int, child: int) -> None:
        p = self._running(parent, "fork")
        if child in self._seqs:
            raise SequenceExistsError(f"fork: child sequence {child} already exists (parent sequence {parent})")
        for b in p.live:
            self.gpu.incref(b)
        self._seqs[child] = _Seq(list(p.table), p.num_tokens, num_dropped=p.num_dropped)

    def free(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise UnknownSequenceError(f"free: unknown sequence {seq_id} (never allocated, or already freed)")
        pool = self.cpu if seq.swapped else self.gpu
        for b in reversed(seq.live):  # deepest first: evicted before the shared roots
            pool.decref(b)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        seq = self._running(seq_id, "truncate")
        if not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"truncate: sequence {seq_id} has {seq.num_tokens} tokens; num_tokens must be in "
                             f"[0, {seq.num_tokens}], got {num_tokens}")
        if seq.num_dropped and seq.num_dropped * self.block_size > num_tokens - self.sliding_window:
            raise InvalidSequenceStateError(
                f"truncate: sequence {seq_id} released its first {seq.num_dropped * self.block_size} positions to "
                f"the sliding window; cut to {num_tokens} tokens its window would reach into them")
        while len(seq.table) > self._blocks_for(num_tokens):  # deepest first, as in free()
            self.gpu.decref(seq.table.pop())
        seq.num_tokens = num_tokens

    # --- swapping ---------------------------------------------------------
    def _distinct(self, seq_ids: list[int], swapped: bool, op: str) -> int:
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"{op}: a sequence is listed twice in {seq_ids}")
        blocks: set[int] = set()
        for s in seq_ids:
            seq = self._find(s, op)
            if seq.swapped != swapped:
                raise InvalidSequenceStateError(f"{op}: sequence {s} is {'not' if swapped else 'already'} swapped out")
            blocks.update(seq.live)
        return len(blocks)

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        return self._distinct(seq_ids, False, "can_swap_out") <= self.cpu.num_free

    def can_swap_in(self, seq_ids: list[int]) -> bool:
        return self.gpu.num_free - self._distinct(seq_ids, True, "can_swap_in") >= self.watermark_blocks

    def _move(self, seq_ids: list[int], src: PyBlockPool, dst: PyBlockPool, now_swapped: bool) -> list[tuple[int, int]]:
        op = "swap_out" if now_swapped else "swap_in"
        needed = self._distinct(seq_ids, not now_swapped, op)
        if needed > dst.num_free:
            raise NoFreeBlocksError(f"{op}: needs {needed} free {dst.name} blocks, {dst.num_free} are free")
        moved: dict[int, int] = {}
        for s in seq_ids:
            seq = self._seqs[s]
            for b in seq.live:
                if b in moved:
                    dst.incref(moved[b])
                else:
                    moved[b] = dst.allocate()
            for b in reversed(seq.live):
                src.decref(b)
            seq.table = seq.table[:seq.num_dropped] + [moved[b] for b in seq.live]
            seq.swapped = now_swapped
        return list(moved.items())

    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        return self._move(seq_ids, self.gpu, self.cpu, True)

    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        return self._move(seq_ids, self.cpu, self.gpu, False)

    # --- prefix cache -----------------------------------------------------
    def lookup_prefix(self, keys: list[bytes], max_blocks: int) -> list[int]:
        hits: list[int] = []
        if not self.enable_caching:
            return hits
        for key in keys[:max(max_blocks, 0)]:
            b = self.gpu.lookup(key)
            if b < 0:
                break
            hits.append(b)
        return hits

    def cache_blocks(self, seq_id: int, first_block: int, keys: list[bytes]) -> int:
        if not self.enable_caching:
            raise ValueError("cache_blocks: prefix caching is disabled for this manager")
        seq = self._running(seq_id, "cache_blocks")
        if first_block < 0 or first_block + len(keys) > seq.num_tokens // self.block_size:
            raise ValueError(f"cache_blocks: blocks [{first_block}, {first_block + len(keys)}) of sequence "
                             f"{seq_id} are not all full")
        added = 0
        for i, key in enumerate(keys):
            block = seq.table[first_block + i]
            if block == DROPPED_BLOCK:  # released by the window: nothing held to offer
                continue
            if self.gpu.cache_block(block, key):
                self._step_cached.append(block)
                added += 1
        return added

    def reset_prefix_cache(self) -> None:
        self.gpu.clear_cache()
        self._step_cached.clear()

    # --- step journal -------------------------------------------------------
    def begin_step(self) -> None:
        self._step_cached.clear()

    def uncache_step_blocks(self) -> int:
        dropped = sum(self.gpu.uncache(b) for b in self._step_cached)
        self._step_cached.clear()
        return dropped

    def step_cached_blocks(self) -> list[int]:
        return list(self._step_cached)

    def step_cached_entries(self) -> list[tuple[int, bytes]]:
        return [(b, self.gpu.key(b)) for b in self._step_cached if self.gpu.is_cached(b)]

    # --- snapshot -------------------------------------------------------------
    def snapshot(self) -> dict[str, np.ndarray]:
        """The C++ manager's bulk view: per GPU block its ref count, cached flag and key prefix (first 8 key bytes,
        little-endian), and every sequence's table in CSR form (by sequence id)."""
        pool = self.gpu
        keys = pool._key
        ids = sorted(self._seqs)
        tables = [self._seqs[i].table for i in ids]
        return {
            "ref_counts": np.asarray(pool.ref_counts, dtype=np.int32),
            "cached": np.asarray([k is not None for k in keys], dtype=np.uint8),
            "key_prefix": np.asarray([int.from_bytes(k[:8], "little") if k else 0 for k in keys], dtype=np.uint64),
            "seq_ids": np.asarray(ids, dtype=np.int64),
            "num_tokens": np.asarray([self._seqs[i].num_tokens for i in ids], dtype=np.int64),
            "swapped": np.asarray([self._seqs[i].swapped for i in ids], dtype=np.uint8),
            "table_offsets": np.cumsum([0] + [len(t) for t in tables], dtype=np.int64),
            "table_blocks": np.asarray([b for t in tables for b in t], dtype=np.int32),
        }

    # --- eviction journal ---------------------------------------------------
    def set_record_evictions(self, on: bool) -> None:
        self.gpu.set_record_evictions(on)

    def take_evicted(self) -> list[tuple[int, bytes]]:
        return self.gpu.take_evictions()

    # --- batch metadata -----------------------------------------------------
    def fill_metadata(self, seq_ids, query_lens, block_tables: np.ndarray, slot_mapping: np.ndarray,
                      seq_lens: np.ndarray, pad_value: int = 0) -> int:
        """The straightforward way: Python lists per sequence, one numpy copy at the end."""
        max_blocks = block_tables.shape[1]
        rows, slots, lens = [], [], []
        for i, s in enumerate(seq_ids):
            seq = self._running(int(s), "fill_metadata")
            q = 1 if query_lens is None else int(query_lens[i])
            max_q = seq.num_tokens - seq.num_dropped * self.block_size  # queries sit in live blocks
            if not 0 <= q <= max_q:
                raise ValueError(f"fill_metadata: query_lens[{i}] = {q} must be in [0, {max_q}]")
            if len(seq.table) > max_blocks:
                raise ValueError(f"fill_metadata: sequence {s} has {len(seq.table)} blocks, room for {max_blocks}")
            rows.append(seq.table + [pad_value] * (max_blocks - len(seq.table)))
            lens.append(seq.num_tokens)
            for pos in range(seq.num_tokens - q, seq.num_tokens):
                slots.append(seq.table[pos // self.block_size] * self.block_size + pos % self.block_size)
        if len(slots) > slot_mapping.shape[0]:
            raise ValueError(f"fill_metadata: {len(slots)} slots to write, slot_mapping holds {slot_mapping.shape[0]}")
        n = len(rows)
        if n:
            block_tables[:n] = rows
            seq_lens[:n] = lens
        slot_mapping[:len(slots)] = slots
        return len(slots)

    # --- introspection ------------------------------------------------------
    def block_table(self, seq_id: int) -> list[int]:
        return list(self._find(seq_id, "seq").table)

    def num_tokens(self, seq_id: int) -> int:
        return self._find(seq_id, "seq").num_tokens

    def is_swapped(self, seq_id: int) -> bool:
        return self._find(seq_id, "seq").swapped

    def num_held_blocks(self, seq_id: int) -> int:
        seq = self._find(seq_id, "num_held_blocks")
        return len(seq.table) - seq.num_dropped

    def num_dropped_blocks(self, seq_id: int) -> int:
        return self._find(seq_id, "seq").num_dropped

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> list[int]:
        return sorted(self._seqs)

    def gpu_ref_count(self, block: int) -> int:
        return self.gpu.ref_count(block)

    def cpu_ref_count(self, block: int) -> int:
        return self.cpu.ref_count(block)

    def gpu_is_cached(self, block: int) -> bool:
        return self.gpu.is_cached(block)

    def gpu_free_list(self) -> list[int]:
        return self.gpu.free_list()

    def cpu_free_list(self) -> list[int]:
        return self.cpu.free_list()

    def check_invariants(self) -> None:
        for seq_id, seq in self._seqs.items():
            self._check_dropped(seq_id, seq)
        for pool, swapped in ((self.gpu, False), (self.cpu, True)):
            holders = [0] * pool.num_blocks
            for seq in self._seqs.values():
                if seq.swapped == swapped:
                    for b in seq.live:
                        holders[b] += 1
            if holders != pool.ref_counts:
                raise AssertionError(f"{pool.name} ref counts {pool.ref_counts} != holders {holders}")
            for b in range(pool.num_blocks):
                if pool.is_free(b) == (pool.ref_counts[b] > 0):
                    raise AssertionError(f"{pool.name} block {b}: free flag disagrees with ref count")

    def _check_dropped(self, seq_id: int, seq: _Seq) -> None:
        """Dropped entries: a marker prefix, only with a window, never reaching the last W tokens."""
        d = seq.num_dropped
        if d and (not self.sliding_window or d * self.block_size > seq.num_tokens - self.sliding_window):
            raise AssertionError(f"sequence {seq_id} dropped {d} blocks of a {seq.num_tokens}-token sequence "
                                 f"with sliding window {self.sliding_window}")
        if seq.table[:d] != [DROPPED_BLOCK] * d or DROPPED_BLOCK in seq.table[d:]:
            raise AssertionError(f"sequence {seq_id}: table {seq.table} should start with exactly {d} markers")

    @property
    def num_free_gpu_blocks(self) -> int:
        return self.gpu.num_free

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu.num_free

    @property
    def num_evictable_gpu_blocks(self) -> int:
        return self.gpu.num_evictable

    @property
    def num_cached_blocks(self) -> int:
        return self.gpu.num_cached

    @property
    def num_evictions(self) -> int:
        return self.gpu.num_evictions
