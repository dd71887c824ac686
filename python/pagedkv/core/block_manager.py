"""BlockManager: the typed Python face of the C++ block manager.

A sequence (`seq_id`, any int64) owns a block table mapping its logical
blocks to physical GPU blocks of `block_size` tokens. The manager allocates
blocks for a prompt, appends slots as the sequence grows (a new block only at
a block boundary), forks sequences that share blocks by reference count
(parallel sampling, beam search), copies a shared last block before a write
(copy-on-write), swaps whole sequences to a CPU pool and back, and fills the
batch metadata tensors (`block_tables`, `slot_mapping`, `seq_lens`) for the
attention ops without per-token Python.

The state lives in a compiled core (`backend="cpp"`, the default) or in its
pure-Python twin (`backend="python"`, pagedkv.core.py_block_manager) with the
same behaviour, used as a baseline and a test model. With
`enable_caching=True`, full blocks are also indexed by a chained hash of
their tokens (pagedkv.core.prefix_cache) and reused by later prompts that
start the same way.

With `sliding_window=W` (a model whose every layer attends only to the last
W positions), blocks that fall wholly before the window of a sequence's
earliest new query are released as it grows: their table entries become
`DROPPED_BLOCK` (-1) and their reference count drops as on `free` (a cached
block nobody else holds stays findable, evictable). A sequence then holds
about ceil(W / block_size) + 1 blocks whatever its length.

Errors: every error is a `BlockManagerError`. Running out of blocks raises
`NoFreeBlocksError`, a normal condition (ask `can_allocate` / `can_append`
first, or catch it and preempt); misuse raises `UnknownSequenceError`
(a KeyError), `SequenceExistsError`, `BlockRefCountError` or
`InvalidSequenceStateError` (ValueErrors). A call that raises changes nothing.

Not thread-safe: one scheduler thread owns a manager.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from pagedkv import _block_manager as _cpp
from pagedkv._block_manager import AllocStatus
from pagedkv.core.kv_tiers import HostTier, KVTiers, TierMatch, TierMoves
from pagedkv.core.prefix_cache import ExtraKey, HashAlgo, PrefixCache, PrefixCacheStats
from pagedkv.core.py_block_manager import PyBlockManager, PyBlockPool

Backend = Literal["cpp", "python"]
BlockPair = tuple[int, int]


def _as_numpy(buf: Any, name: str) -> np.ndarray:
    """A numpy view of a buffer to fill in place (a CPU torch tensor shares its memory)."""
    if isinstance(buf, np.ndarray):
        return buf
    device = getattr(buf, "device", None)
    if device is not None and hasattr(buf, "numpy"):
        if getattr(device, "type", str(device)) != "cpu":
            raise ValueError(f"fill_metadata: {name} must be a CPU tensor (copy it to the device afterwards), "
                             f"got one on {device}")
        return buf.numpy()
    raise ValueError(f"fill_metadata: {name} must be a numpy array or a CPU torch tensor, got {type(buf).__name__}")


def _ids(seq_ids: int | Sequence[int]) -> list[int]:
    return [seq_ids] if isinstance(seq_ids, int) else list(seq_ids)


@dataclass(slots=True)
class BlockEventLog:
    """What changed in the pool's prefix index over a step (KV events): cleared, then removed, then stored."""

    cleared: bool = False
    removed: list[bytes] = field(default_factory=list)
    stored: list[tuple[bytes, bytes | None, list[int]]] = field(default_factory=list)  # (key, parent, tokens)
    stored_extra_keys: dict[bytes, tuple] = field(default_factory=dict)  # key -> its request's extra keys, if any
    # The host tier below the pool (kv_offloading_size): keys it took on eviction and keys it dropped (LRU).
    stored_host: list[bytes] = field(default_factory=list)
    removed_host: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class PrefixMatch:
    """A prompt's prefix-cache lookup: its block hashes, the device blocks that hold its first blocks, and what
    the tiers below the pool hold of the chain after them."""

    num_tokens: int
    block_size: int
    hashes: list[bytes] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)
    tier: TierMatch = field(default_factory=TierMatch)
    read: bool = True  # False: the prompt was hashed (its blocks are offered to the cache) but not looked up

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens that need no prefill: device hits and tier hits (a multiple of block_size)."""
        return (len(self.hits) + self.tier.num_blocks) * self.block_size


class BlockManager:
    """Paged KV-cache block tables for a set of sequences.

    Args:
        block_size: tokens per physical block (vLLM's --block-size).
        num_gpu_blocks: blocks of the KV cache on the device.
        num_cpu_blocks: blocks of the CPU swap space (0: no swapping).
        watermark: fraction of GPU blocks kept free when admitting new prompts
            (`can_allocate`), so running sequences can still append.
        enable_caching: reuse the full blocks of identical prefixes.
        hash_algo: "sha256" (default) or "xxhash" (faster, not collision resistant).
        backend: "cpp" (compiled core) or "python" (reference twin).
        sliding_window: the model's attention window in tokens when every layer slides
            (None or 0: off); blocks wholly before it are released as sequences grow.
    """

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int = 0,
        watermark: float = 0.01,
        enable_caching: bool = False,
        hash_algo: HashAlgo = "sha256",
        backend: Backend = "cpp",
        sliding_window: int | None = None,
    ) -> None:
        for name, value in (("block_size", block_size), ("num_gpu_blocks", num_gpu_blocks),
                            ("num_cpu_blocks", num_cpu_blocks)):
            if not isinstance(value, int) or value < (1 if name == "block_size" else 0):
                raise ValueError(f"BlockManager: {name} must be a non-negative int (block_size >= 1), got {value!r}")
        window = sliding_window or 0
        if not isinstance(window, int) or isinstance(window, bool) or window < 0:
            raise ValueError(f"BlockManager: sliding_window must be None or an int >= 0 (tokens), "
                             f"got {sliding_window!r}")
        args = (block_size, num_gpu_blocks, num_cpu_blocks, float(watermark), enable_caching, window)
        if backend == "cpp":
            core = _cpp.BlockManager(*args)
        elif backend == "python":
            core = PyBlockManager(*args)
        else:
            raise ValueError(f"BlockManager: backend must be 'cpp' or 'python', got {backend!r}")
        self.block_size = block_size
        self.sliding_window: int | None = window or None
        self.backend = backend
        self.core = core
        self.prefix_cache: PrefixCache | None = PrefixCache(block_size, hash_algo) if enable_caching else None
        self.tiers: KVTiers | None = None
        self.kv_events: BlockEventLog | None = None  # enable_kv_events

    def attach_tiers(self, num_host_slots: int = 0, disk: Any = None) -> KVTiers:
        """Adds a host tier of `num_host_slots` block slots and/or a disk tier (a kv_disk_store.DiskKVStore)
        below the pool (pagedkv.core.kv_tiers). Needs prefix caching; not for sliding-window managers."""
        if self.prefix_cache is None:
            raise ValueError("KV offloading (kv_offloading_size / kv_cache_dir) needs enable_prefix_caching=True: "
                             "the tiers keep cached prefix blocks")
        if self.sliding_window:
            raise ValueError("KV offloading (kv_offloading_size / kv_cache_dir) does not support sliding-window "
                             "models yet (their early blocks leave the pool by design)")
        host = None
        if num_host_slots:
            pool_cls = _cpp.BlockPool if self.backend == "cpp" else PyBlockPool
            host = HostTier(pool_cls(num_host_slots, "host"))
        self.tiers = KVTiers(self.block_size, host, disk)
        self.tiers.record_events = self.kv_events is not None
        self._record_evictions()
        return self.tiers

    def enable_kv_events(self) -> None:
        """Starts logging what enters and leaves the prefix index, for KV events (`take_kv_events`)."""
        if self.prefix_cache is None:
            raise ValueError("KV cache events need enable_prefix_caching=True: they report the prefix cache's blocks")
        self.kv_events = BlockEventLog()
        self.prefix_cache.record_blocks = True
        if self.tiers is not None:
            self.tiers.record_events = True
        self._record_evictions()

    def _record_evictions(self) -> None:
        """The core journals evictions while someone takes them: a host tier or KV events."""
        self.core.set_record_evictions(self.kv_events is not None or (self.tiers is not None
                                                                    and self.tiers.host is not None))

    def take_kv_events(self) -> BlockEventLog:
        """After a step (done or failed): whether the cache was cleared, the keys evicted from the pool, and the
        (key, parent key, token ids) of the blocks the step newly cached, in caching order. Empties the log."""
        log = self.kv_events
        recorded = self.prefix_cache.take_recorded()
        log.stored = [(key, *recorded[key]) for _, key in self.core.step_cached_entries() if key in recorded]
        extra = self.prefix_cache.take_recorded_keys()
        log.stored_extra_keys = {key: extra[key] for key, _, _ in log.stored if key in extra}
        if self.tiers is not None:
            log.stored_host, log.removed_host = self.tiers.take_events()
        self.kv_events = BlockEventLog()
        return log

    # --- admission ----------------------------------------------------------
    def match_prefix(self, prompt: Sequence[int] | int, extra_keys: Sequence[ExtraKey] = (),
                     read: bool = True) -> PrefixMatch:
        """The prompt's hashes and cached blocks: device hits, then the tiers' (nothing is loaded or counted).

        The last prompt token is always left to compute. An int prompt (a token count) is for managers
        without caching. read=False: no hits (a prompt that must be computed whole, e.g. for its prompt
        logprobs); its hashes still offer its blocks to the cache, and the lookup counts in no hit-rate stats.
        """
        if isinstance(prompt, int):
            if self.prefix_cache is not None:
                raise ValueError("BlockManager: with enable_caching=True pass the prompt's token ids, not a count")
            return PrefixMatch(prompt, self.block_size)
        n = len(prompt)
        m = PrefixMatch(n, self.block_size, read=read)
        if self.prefix_cache is None or n == 0:
            return m
        m.hashes = self.prefix_cache.prompt_hashes(prompt, extra_keys)
        if not read:
            return m
        m.hits = self.prefix_cache.match(self.core, n, m.hashes)
        if self.tiers is not None:
            m.tier = self.tiers.match(m.hashes[len(m.hits):(n - 1) // self.block_size])
        return m

    def num_cached_tokens(self, prompt: Sequence[int], extra_keys: Sequence[ExtraKey] = ()) -> int:
        """Prompt tokens `allocate` would take from the cache and its tiers now (a multiple of block_size; 0
        without caching). For a scheduler's token budget; counts nothing in the hit-rate stats."""
        return self.match_prefix(prompt, extra_keys).num_cached_tokens

    def allocate_status(self, prompt: Sequence[int] | int, extra_keys: Sequence[ExtraKey] = ()) -> AllocStatus:
        """OK: allocate now; LATER: wait for blocks; NEVER: the prompt can never fit."""
        m = self.match_prefix(prompt, extra_keys)
        return self.core.allocate_status(m.num_tokens, m.hits)

    def can_allocate(self, prompt: Sequence[int] | int, extra_keys: Sequence[ExtraKey] = ()) -> bool:
        """Whether `prompt` (token ids, or a token count without caching) fits now, watermark kept."""
        return self.allocate_status(prompt, extra_keys) == AllocStatus.OK

    def allocate(self, seq_id: int, prompt: Sequence[int] | int, extra_keys: Sequence[ExtraKey] = (),
                 num_tokens: int | None = None, match: PrefixMatch | None = None) -> int:
        """Gives `seq_id` the blocks of its prompt; returns how many prompt tokens are cached.

        With caching, the longest chain of cached full blocks is shared (never
        copied); the cached tokens need no prefill. `extra_keys`: e.g.
        (cache_salt, lora_id); prompts with different keys share nothing.
        num_tokens: give slots to the first `num_tokens` prompt tokens only (a
        chunked prefill's first chunk, cached tokens included); the rest come
        later through `append_slots` with their token ids. Blocks are indexed in
        the prefix cache as they get slots, i.e. in the step that computes them,
        so no other request is handed a block whose KV a later step would write.
        match: this prompt's `match_prefix`, if the caller has it (saves hashing twice).

        With tiers the chain goes on past the device hits into restored blocks:
        new blocks whose bytes the step copies in from the host tier or the disk
        (`take_tier_moves`). A disk file that fails its checks at load ends the
        chain there, so the result may be below `match.num_cached_tokens`.
        """
        m = match if match is not None else self.match_prefix(prompt, extra_keys)
        total, hits = m.num_tokens, m.hits
        n = total
        if num_tokens is not None:  # a first chunk: the core checks the whole-prompt case itself
            if not m.num_cached_tokens < num_tokens <= total:
                raise ValueError(f"allocate: num_tokens must be in ({m.num_cached_tokens}, {total}] "
                                 f"(after the cached prefix, within the prompt), got {num_tokens}")
            n = num_tokens
        self.core.allocate(seq_id, n, hits)
        restored = 0
        if self.tiers is not None:
            tier, payload = self.tiers.load(m.tier, total)
            restored = tier.num_blocks
            if restored:
                table = self.core.block_table(seq_id)
                self.tiers.restore_into(tier, table[len(hits):len(hits) + restored], payload)
        if self.prefix_cache is not None:
            self.prefix_cache.on_allocate(self.core, seq_id, prompt[:n], m.hashes[:n // self.block_size], len(hits),
                                          extra_keys, num_queried=total if m.read else 0)
        return (len(hits) + restored) * self.block_size

    # --- growth -------------------------------------------------------------
    def blocks_to_append(self, seq_id: int, num_new_tokens: int = 1) -> int:
        """Net GPU blocks that appending `num_new_tokens` to `seq_id` would take.

        New blocks and a copy-on-write count +1 each; with a sliding window each
        block the append releases that only this sequence holds counts -1, so the
        result can be negative.
        """
        return self.core.blocks_to_append(seq_id, num_new_tokens)

    def can_append(self, seq_ids: int | Sequence[int], num_new_tokens: int = 1) -> bool:
        """Whether every listed sequence can append `num_new_tokens` now."""
        return self.core.can_append(_ids(seq_ids), num_new_tokens)

    def _check_tokens(self, token_ids: Sequence[int] | None, num_new_tokens: int) -> None:
        if self.prefix_cache is not None and (token_ids is None or len(token_ids) != num_new_tokens):
            raise ValueError(f"append_slots: with enable_caching=True pass the {num_new_tokens} new token ids, "
                             f"got {token_ids!r}")

    def append_slots(self, seq_id: int, num_new_tokens: int = 1,
                     token_ids: Sequence[int] | None = None) -> BlockPair | None:
        """Reserves slots for new tokens; returns the (src, dst) block to copy first, if any.

        A pair comes back when the last block was partly filled and shared
        (after a fork): the sequence now writes into its own copy `dst`, which
        must get src's contents (`copy_blocks`) before the next forward pass.
        token_ids: the new tokens, required with caching (blocks they fill get indexed).
        """
        if self.prefix_cache is None:  # the per-token hot path: straight to the core
            return self.core.append_slots(seq_id, num_new_tokens)
        self._check_tokens(token_ids, num_new_tokens)
        cow = self.core.append_slots(seq_id, num_new_tokens)
        self.prefix_cache.on_append(self.core, seq_id, token_ids)
        return cow

    def append_slots_batch(self, seq_ids: Sequence[int], num_new_tokens: int = 1,
                           token_ids: Sequence[Sequence[int]] | None = None) -> list[BlockPair]:
        """append_slots for every sequence of a decode step in one call, all or nothing.

        Returns the copy-on-write pairs. token_ids[i]: the new tokens of seq_ids[i] (with caching).
        """
        if self.prefix_cache is not None:
            if token_ids is None or len(token_ids) != len(seq_ids):
                raise ValueError("append_slots_batch: with enable_caching=True pass one token list per sequence")
            for toks in token_ids:
                self._check_tokens(toks, num_new_tokens)
        cows = self.core.append_slots_batch(list(seq_ids), num_new_tokens)
        if self.prefix_cache is not None:
            for seq_id, toks in zip(seq_ids, token_ids, strict=True):
                self.prefix_cache.on_append(self.core, seq_id, toks)
        return cows

    # --- speculative decoding ----------------------------------------------------
    def append_drafts(self, seq_id: int, token_id: int, num_drafts: int) -> BlockPair | None:
        """Slots for a sequence's next token `token_id` and `num_drafts` draft tokens after it; returns the
        copy-on-write pair, if any (as append_slots).

        Only `token_id` enters the prefix cache: a block that drafts fill is not indexed, since the model may
        reject them; `settle_drafts` indexes the accepted ones once verified.
        """
        cow = self.core.append_slots(seq_id, 1 + num_drafts)
        if self.prefix_cache is not None:
            self.prefix_cache.on_append(self.core, seq_id, [token_id])
        return cow

    def settle_drafts(self, seq_id: int, num_tokens: int, accepted: Sequence[int]) -> None:
        """After verification: the sequence keeps its first `num_tokens` slots (the rejected drafts' slots go;
        trailing blocks left empty are released) and its `accepted` drafts enter the prefix cache."""
        self.core.truncate(seq_id, num_tokens)
        if self.prefix_cache is not None and accepted:
            self.prefix_cache.on_append(self.core, seq_id, accepted)

    def fork(self, parent_id: int, child_id: int) -> None:
        """`child_id` shares every live block of `parent_id` (dropped entries stay dropped); later writes copy on
        demand."""
        self.core.fork(parent_id, child_id)
        if self.prefix_cache is not None:
            self.prefix_cache.on_fork(parent_id, child_id)

    def free(self, seq_id: int) -> None:
        """Returns the blocks of a finished (or preempted-by-recompute) sequence."""
        self.core.free(seq_id)
        if self.prefix_cache is not None:
            self.prefix_cache.on_free(seq_id)

    # --- swapping -------------------------------------------------------------
    def can_swap_out(self, seq_ids: int | Sequence[int]) -> bool:
        return self.core.can_swap_out(_ids(seq_ids))

    def can_swap_in(self, seq_ids: int | Sequence[int]) -> bool:
        return self.core.can_swap_in(_ids(seq_ids))

    def swap_out(self, seq_ids: int | Sequence[int]) -> list[BlockPair]:
        """Moves sequences (e.g. a forked group, whose sharing is kept) to the CPU pool.

        Returns (gpu_block, cpu_block) pairs for `swap_blocks`, each block once.
        """
        return self.core.swap_out(_ids(seq_ids))

    def swap_in(self, seq_ids: int | Sequence[int]) -> list[BlockPair]:
        """Moves swapped-out sequences back; returns (cpu_block, gpu_block) pairs."""
        ids = _ids(seq_ids)
        mapping = self.core.swap_in(ids)
        if self.prefix_cache is not None:
            for seq_id in ids:
                self.prefix_cache.on_swap_in(self.core, seq_id)
        return mapping

    # --- batch metadata ---------------------------------------------------------
    def fill_metadata(self, seq_ids: Sequence[int] | np.ndarray, block_tables: Any, slot_mapping: Any, seq_lens: Any,
                      query_lens: Sequence[int] | np.ndarray | None = None, pad_value: int = 0) -> int:
        """Writes the attention metadata of scheduled sequences into preallocated buffers.

        block_tables: int32 [>= num_seqs, max_blocks_per_seq], rows padded with `pad_value`; entries the
        sliding window dropped are DROPPED_BLOCK (-1), and queries may only sit in live blocks;
        seq_lens: int32 [>= num_seqs], each sequence's token count;
        slot_mapping: int64 [>= sum(query_lens)], slot = block * block_size + offset of
        each sequence's last query_lens[i] positions (query_lens None: 1 each, a decode step).
        Buffers are numpy arrays or CPU torch tensors (filled in place), C-contiguous.
        Returns the number of slots written.
        """
        return self.core.fill_metadata(
            seq_ids, query_lens, _as_numpy(block_tables, "block_tables"), _as_numpy(slot_mapping, "slot_mapping"),
            _as_numpy(seq_lens, "seq_lens"), pad_value)

    # --- prefix cache -------------------------------------------------------------
    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Queried and hit prompt tokens (zeros without caching)."""
        return self.prefix_cache.stats if self.prefix_cache is not None else PrefixCacheStats()

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block (running sequences keep theirs) and zeroes the counters."""
        self.core.reset_prefix_cache()
        if self.tiers is not None:
            self.tiers.clear()
        if self.kv_events is not None:  # what was logged before is moot: everything is gone
            self.kv_events = BlockEventLog(cleared=True)
        if self.prefix_cache is not None:
            self.prefix_cache.stats.reset()

    def take_tier_moves(self) -> TierMoves | None:
        """At the end of scheduling a step: hands the pool's evictions to the host tier (and to the KV event log),
        returns the step's moves between the pool and its tiers (None without tiers)."""
        evicted = self.core.take_evicted() if (self.tiers is not None or self.kv_events is not None) else []
        if self.kv_events is not None:
            self.kv_events.removed.extend(key for _, key in evicted)
        if self.tiers is None:
            return None
        self.tiers.offload(evicted)
        return self.tiers.take_moves()

    def step_cached_entries(self) -> list[tuple[int, bytes]]:
        """(block, key) of the blocks newly cached since `begin_step` that still carry their key: after a
        successful step, the blocks whose KV it wrote (the disk tier writes them through)."""
        return self.core.step_cached_entries()

    def begin_step(self) -> None:
        """Starts a new step journal: call it before scheduling each engine step.

        Blocks enter the prefix-cache index when they get slots, before the
        forward pass writes their KV; the journal records the ones newly cached
        from here on, so that `uncache_step_blocks` can take them back if the
        step fails. Does nothing useful without caching (the journal stays empty).
        """
        self.core.begin_step()
        if self.tiers is not None:  # the last step's copies ran: its pinned host slots may be reused
            self.tiers.end_of_step()

    def uncache_step_blocks(self) -> int:
        """After a failed step: drops every block newly cached since `begin_step` from the index.

        Their KV was never written, so no later prompt may reuse them. Blocks
        cached in earlier steps stay cached; sequences keep their blocks (free
        ones among the dropped become plain free blocks, reused first). Returns
        how many blocks were still cached and got dropped (0 without caching).
        """
        if self.tiers is not None:  # host slots this step stored may never have been filled
            self.tiers.end_of_step(failed=True)
        return self.core.uncache_step_blocks()

    # --- introspection ------------------------------------------------------------
    def get_block_table(self, seq_id: int) -> list[int]:
        """Logical block i -> physical block, DROPPED_BLOCK where the sliding window released it."""
        return self.core.block_table(seq_id)

    def num_held_blocks(self, seq_id: int) -> int:
        """Blocks the sequence holds (its table less the dropped entries), in its pool (GPU, or CPU if swapped)."""
        return self.core.num_held_blocks(seq_id)

    def num_dropped_blocks(self, seq_id: int) -> int:
        """Leading table entries the sliding window released (0 without a window)."""
        return self.core.num_dropped_blocks(seq_id)

    def get_num_tokens(self, seq_id: int) -> int:
        return self.core.num_tokens(seq_id)

    def is_swapped(self, seq_id: int) -> bool:
        return self.core.is_swapped(seq_id)

    def __contains__(self, seq_id: int) -> bool:
        return self.core.has_seq(seq_id)

    @property
    def num_prefix_cache_seqs(self) -> int:
        """Sequences whose prompt hashes the prefix cache still tracks (0 when caching is off)."""
        return len(self.prefix_cache._seqs) if self.prefix_cache is not None else 0

    def seq_ids(self) -> list[int]:
        return self.core.seq_ids()

    @property
    def num_total_gpu_blocks(self) -> int:
        return self.core.num_gpu_blocks

    @property
    def num_free_gpu_blocks(self) -> int:
        """Free GPU blocks, evictable cached ones included."""
        return self.core.num_free_gpu_blocks

    @property
    def num_used_gpu_blocks(self) -> int:
        return self.core.num_gpu_blocks - self.core.num_free_gpu_blocks

    @property
    def num_evictable_gpu_blocks(self) -> int:
        """Free blocks that still hold cached prefixes (reused on a hit, evicted LRU when needed)."""
        return self.core.num_evictable_gpu_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.core.num_free_cpu_blocks

    @property
    def gpu_usage(self) -> float:
        """Fraction of GPU blocks held by sequences (vLLM's gpu_cache_usage)."""
        total = self.core.num_gpu_blocks
        return self.num_used_gpu_blocks / total if total else 0.0

    def check_invariants(self) -> None:
        """Raises if any internal structure is inconsistent (tests and debugging: O(num_blocks))."""
        self.core.check_invariants()
