"""The prefix cache below the pool: a host-memory tier and a disk tier.

A cached block lives in the device pool as long as the pool can keep it.
Two tiers keep it longer:

- **Host tier** (`kv_offloading_size` GiB, vLLM's name): a second pool of
  block slots in host memory (pinned on CUDA; on a CPU-only engine simply a
  second pool). When allocation evicts a cached device block, the block
  manager journals (block, key) (`set_record_evictions`) and the step copies
  the block's bytes into a host slot before anything in the step writes over
  them. The slots' LRU order and key index are a `BlockPool` of their own
  (the C++ one with the C++ manager): every slot is free-and-cached
  (evictable) except while a restore reads it, when it is held (pinned) so
  that no offload in the same step takes it.
- **Disk tier** (`kv_cache_dir`, pagedkv.core.kv_disk_store): files keyed by
  the chain hash under a directory per model fingerprint, written through:
  every block a step computes for a cached prefix is queued for writing as
  soon as the step succeeds, so a restart finds it.

A prompt's lookup walks the chain: device hits first, then host slots for
the next keys, then disk files, stopping at the first miss. Restored blocks
are new device blocks (they cost a block like any other), cached in the
device index under their keys, and filled before the step's forward.

Order of a step's block moves (pagedkv.engine.model_runner): offload
(device -> host) first, since the evicted blocks are this step's newly
allocated ones and everything later writes into them; then swap out; then
restores (host -> device, disk -> device) into blocks the swap out may have
just read; then swap in and copy-on-write.

Not thread-safe: the scheduler's thread owns the tiers (the disk store's
writer thread only touches its own state).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedkv.core.kv_disk_store import DiskKVStore

BlockPair = tuple[int, int]


@dataclass(slots=True)
class TierStats:
    """Counters of the tiers below the pool (cumulative since start).

    queries: prompt tokens looked up beyond the device pool (vLLM's
    external_prefix_cache_queries); hits_host / hits_disk: prompt tokens
    restored from each tier; offloaded_blocks: device blocks copied to the
    host tier on eviction; host_evictions: host slots reused (LRU);
    restored_blocks_*: blocks brought back per tier.
    """

    queries: int = 0
    hits_host: int = 0
    hits_disk: int = 0
    offloaded_blocks: int = 0
    host_evictions: int = 0
    restored_blocks_host: int = 0
    restored_blocks_disk: int = 0


@dataclass(slots=True)
class TierMatch:
    """What the tiers hold of a prompt's chain after its device hits: host slots, then disk keys (unverified)."""

    host_slots: list[int] = field(default_factory=list)
    disk_keys: list[bytes] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.host_slots) + len(self.disk_keys)


@dataclass(slots=True)
class DiskRestore:
    """Disk blocks to write into device blocks: payload[i] holds blocks[i]'s bytes (pagedkv.kv_cache layout)."""

    blocks: list[int]
    payload: list[memoryview]


@dataclass(slots=True)
class TierMoves:
    """A step's block moves between the pool and its tiers, in the order they run."""

    offload: list[BlockPair] = field(default_factory=list)  # (device block, host slot)
    restore_host: list[BlockPair] = field(default_factory=list)  # (host slot, device block)
    restore_disk: DiskRestore | None = None

    def __bool__(self) -> bool:
        return bool(self.offload or self.restore_host or self.restore_disk is not None)


class HostTier:
    """LRU index of host slots: key -> slot, least recently used reused first.

    `pool` is a BlockPool (C++ or the pure-Python twin) of `num_slots` blocks.
    A stored slot is cached and free (evictable, at the back of the free
    list); allocation takes uncached slots first, then the least recently
    stored or used one.
    """

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        pool.set_record_evictions(True)  # `store` reports the key a reused slot held (KV events)
        self._pinned: list[int] = []
        self._stored: list[int] = []  # slots stored this step (dropped if the step fails)

    @property
    def num_slots(self) -> int:
        return self.pool.num_blocks

    @property
    def num_cached(self) -> int:
        return self.pool.num_cached

    def lookup(self, keys: list[bytes]) -> list[int]:
        """Slots of keys[0], keys[1], ... up to the first miss."""
        slots = []
        for key in keys:
            slot = self.pool.lookup(key)
            if slot < 0:
                break
            slots.append(slot)
        return slots

    def pin(self, slots: list[int]) -> None:
        """Holds slots a restore reads this step (no offload may take them) and marks them recently used."""
        for slot in slots:
            self.pool.incref(slot)
        self._pinned.extend(slots)

    def store(self, key: bytes) -> tuple[int | None, bytes | None]:
        """A slot for an evicted block's bytes: (slot, the key the slot held before, if any), or (None, None)
        when the key is already held (it is marked recently used) or every slot is pinned."""
        slot = self.pool.lookup(key)
        if slot >= 0:
            if self.pool.ref_count(slot) == 0:  # move it to the back of the LRU order
                self.pool.incref(slot)
                self.pool.decref(slot)
            return None, None
        if self.pool.num_free == 0:
            return None, None
        slot = self.pool.allocate()
        replaced = self.pool.take_evictions()
        self.pool.cache_block(slot, key)
        self.pool.decref(slot)
        self._stored.append(slot)
        return slot, replaced[0][1] if replaced else None

    def end_of_step(self) -> None:
        """The step's copies ran: pinned slots become evictable again (most recently used)."""
        for slot in self._pinned:
            self.pool.decref(slot)
        self._pinned.clear()
        self._stored.clear()

    def fail_step(self) -> list[bytes]:
        """The step failed before its copies surely ran: forget the slots it stored (their bytes may be stale).
        Returns their keys."""
        keys = [self.pool.key(slot) for slot in self._stored]
        for slot in self._stored:
            self.pool.uncache(slot)
        self._stored.clear()
        self.end_of_step()
        return keys

    def clear(self) -> None:
        self.pool.clear_cache()


class KVTiers:
    """Host and disk tiers of one block manager's prefix cache (either may be absent).

    The block manager asks `match` for the chain beyond its device hits,
    `take` at admission (loading disk blocks, pinning host slots), and hands
    the pool's evictions to `offload`; the scheduler collects the step's
    `TierMoves` with `take_moves`.
    """

    def __init__(self, block_size: int, host: HostTier | None = None, disk: DiskKVStore | None = None) -> None:
        self.block_size = block_size
        self.host = host
        self.disk = disk
        self.stats = TierStats()
        self._moves = TierMoves()
        # KV events (record_events): keys the host tier took and dropped since the last take_events.
        self.record_events = False
        self._stored_keys: list[bytes] = []
        self._removed_keys: list[bytes] = []

    @property
    def enabled(self) -> bool:
        return self.host is not None or self.disk is not None

    def match(self, keys: list[bytes]) -> TierMatch:
        """Host slots for the first keys, then disk keys that exist, up to the first miss (nothing is loaded)."""
        m = TierMatch()
        if self.host is not None:
            m.host_slots = self.host.lookup(keys)
        if self.disk is not None:
            for key in keys[len(m.host_slots):]:
                if not self.disk.contains(key):
                    break
                m.disk_keys.append(key)
        return m

    def load(self, m: TierMatch, num_queried: int) -> tuple[TierMatch, list[memoryview] | None]:
        """At admission: loads (and verifies) the disk blocks, pins the host slots, counts the lookup.

        Returns the match as taken, with the disk payload (one buffer per disk block) or None: the
        disk part may be shorter than asked, a file that failed its checks ends the chain there.
        """
        payload = None
        if m.disk_keys:
            payload = self.disk.load_blocks(m.disk_keys)
            m = TierMatch(m.host_slots, m.disk_keys[:len(payload)])
            payload = payload if len(payload) else None
        if self.host is not None:
            self.host.pin(m.host_slots)
        self.stats.queries += num_queried
        self.stats.hits_host += len(m.host_slots) * self.block_size
        self.stats.hits_disk += len(m.disk_keys) * self.block_size
        return m, payload

    def restore_into(self, m: TierMatch, blocks: list[int], payload: list[memoryview] | None) -> None:
        """Records the copies that fill device `blocks` (the sequence's new blocks after its device hits)."""
        nh = len(m.host_slots)
        self._moves.restore_host.extend(zip(m.host_slots, blocks[:nh], strict=True))
        self.stats.restored_blocks_host += nh
        if payload is not None:
            disk_blocks = list(blocks[nh:nh + len(payload)])
            prev = self._moves.restore_disk
            self._moves.restore_disk = (DiskRestore(disk_blocks, payload) if prev is None else
                                        DiskRestore(prev.blocks + disk_blocks, prev.payload + payload))
            self.stats.restored_blocks_disk += len(disk_blocks)

    def offload(self, evicted: list[tuple[int, bytes]]) -> None:
        """Device blocks the pool just evicted: copy each into a host slot (unless the tier has its key)."""
        if self.host is None:
            return
        for block, key in evicted:
            slot, replaced = self.host.store(key)
            if slot is None:
                continue
            self._moves.offload.append((block, slot))
            self.stats.offloaded_blocks += 1
            self.stats.host_evictions += int(replaced is not None)
            if self.record_events:
                if replaced is not None:
                    self._removed_keys.append(replaced)
                self._stored_keys.append(key)

    def take_events(self) -> tuple[list[bytes], list[bytes]]:
        """(keys the host tier stored, keys it dropped) since the last call, for KV events (medium "CPU")."""
        out = (self._stored_keys, self._removed_keys)
        self._stored_keys, self._removed_keys = [], []
        return out

    def take_moves(self) -> TierMoves:
        """The moves recorded since the last call (one step's), for the model runner."""
        moves, self._moves = self._moves, TierMoves()
        return moves

    def end_of_step(self, failed: bool = False) -> None:
        """After the step ran (or failed: the host slots it stored are forgotten)."""
        if self.host is not None:
            if failed:
                forgotten = set(self.host.fail_step())
                self._stored_keys = [k for k in self._stored_keys if k not in forgotten]
            else:
                self.host.end_of_step()
        self._moves = TierMoves()

    def clear(self) -> None:
        """reset_prefix_cache: the host tier forgets every block (disk files stay: another server may use them)."""
        if self.host is not None:
            self.host.clear()
