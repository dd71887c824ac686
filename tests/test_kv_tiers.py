"""The prefix cache's host tier at the block-manager level (pagedkv.core.kv_tiers), on both manager backends.

A tiny pool and a small tier: evict -> offload -> hit -> restore, LRU order
in the tier, salt isolation, pinning, a failed step, and the manager's
invariants (ref counts, no block both held and free) after every move.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from pagedkv.core import block_hashes
from pagedkv.core.block_manager import BlockManager
from pagedkv.core.kv_disk_store import DiskKVStore
from pagedkv.core.kv_tiers import KVTiers

BS = 4


def manager(backend: str, num_blocks: int = 8, host_slots: int = 6) -> BlockManager:
    bm = BlockManager(BS, num_blocks, 0, watermark=0.0, enable_caching=True, backend=backend)
    bm.attach_tiers(host_slots)
    return bm


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(n)]


def run_prompt(bm: BlockManager, seq_id: int, prompt: list[int], extra=()) -> tuple[int, object]:
    """One scheduling step that admits `prompt` and frees it after its forward: (cached tokens, moves)."""
    bm.begin_step()
    cached = bm.allocate(seq_id, prompt, extra)
    moves = bm.take_tier_moves()
    bm.check_invariants()
    bm.free(seq_id)
    bm.check_invariants()
    return cached, moves


def evict_a_prompt(bm: BlockManager) -> list[int]:
    """Runs a prompt `a` of three full blocks and one token, then two of four blocks that take every free block
    of an 8-block pool, so a's three cached blocks are evicted (into the host tier, if there is one). Returns a."""
    a = tokens(1, 3 * BS + 1)
    run_prompt(bm, 0, a)
    run_prompt(bm, 1, tokens(2, 4 * BS))
    run_prompt(bm, 2, tokens(3, 4 * BS))
    return a


@pytest.fixture(params=["cpp", "python"])
def backend(request) -> str:
    return request.param


def test_evicted_blocks_go_to_the_host_tier_and_come_back(backend):
    bm = manager(backend)
    a = tokens(1, 3 * BS + 1)  # three full blocks and one token
    cached, moves = run_prompt(bm, 0, a)
    assert cached == 0 and not moves.offload
    hashes = bm.prefix_cache.prompt_hashes(a)
    # Two other prompts of four blocks each take every free block: a's three cached blocks are evicted.
    _, m1 = run_prompt(bm, 1, tokens(2, 4 * BS))
    _, m2 = run_prompt(bm, 2, tokens(3, 4 * BS))
    offloaded = m1.offload + m2.offload
    host = bm.tiers.host
    assert sorted(host.pool.lookup(h) for h in hashes) == sorted(slot for _, slot in offloaded[:3])
    assert bm.core.lookup_prefix(hashes, 3) == []  # gone from the pool
    # a again: its chain is found in the tier, restored into three new device blocks.
    match = bm.match_prefix(a)
    assert match.hits == [] and len(match.tier.host_slots) == 3 and match.num_cached_tokens == 3 * BS
    bm.begin_step()
    assert bm.allocate(3, a, match=match) == 3 * BS
    moves = bm.take_tier_moves()
    table = bm.get_block_table(3)
    assert moves.restore_host == list(zip(match.tier.host_slots, table[:3], strict=True))
    # The restored blocks are cached in the pool again, under their keys.
    assert bm.core.lookup_prefix(hashes, 3) == table[:3]
    # While the step runs, the slots it reads are held: no offload can take them.
    assert all(host.pool.ref_count(s) == 1 for s in match.tier.host_slots)
    bm.check_invariants()
    bm.begin_step()
    assert all(host.pool.ref_count(s) == 0 for s in match.tier.host_slots)
    stats = bm.tiers.stats
    assert stats.hits_host == 3 * BS and stats.restored_blocks_host == 3 and stats.offloaded_blocks >= 3


def test_a_tier_hit_leaves_the_prompts_last_token_to_compute(backend):
    """A prompt of exactly three blocks whose blocks all sit in the host tier: its last block holds its last
    token, which must be computed, so only two blocks come from the tier."""
    bm = manager(backend)
    a = evict_a_prompt(bm)  # a's three blocks are in the tier now
    whole = bm.match_prefix(a[:3 * BS])
    assert whole.hits == [] and len(whole.tier.host_slots) == 2 and whole.num_cached_tokens == 2 * BS
    assert bm.match_prefix(a).num_cached_tokens == 3 * BS  # one token more: all three


@pytest.mark.parametrize("events_first", [True, False], ids=["events-then-tier", "tier-then-events"])
def test_host_tier_stores_are_kv_events_whichever_is_set_up_first(backend, events_first):
    bm = BlockManager(BS, 8, 0, watermark=0.0, enable_caching=True, backend=backend)
    if events_first:
        bm.enable_kv_events()
    bm.attach_tiers(6)
    if not events_first:
        bm.enable_kv_events()
    a = evict_a_prompt(bm)  # a's three blocks go to the host tier
    log = bm.take_kv_events()
    assert set(block_hashes(a, BS)) <= set(log.stored_host)


def test_tier_stats_count_lookups_hits_offloads_evictions_and_restores(backend):
    """A 2-slot tier under a's three evicted blocks (leaf first: the third replaces a's last block, so a's first
    two remain); a again restores those two."""
    bm = manager(backend, num_blocks=8, host_slots=2)
    a = evict_a_prompt(bm)
    s = bm.tiers.stats
    assert (s.queries, s.offloaded_blocks, s.host_evictions, s.hits_host, s.restored_blocks_host) == (45, 3, 1, 0, 0)
    assert run_prompt(bm, 3, a)[0] == 2 * BS
    assert (s.queries, s.hits_host, s.restored_blocks_host, s.hits_disk, s.restored_blocks_disk) == (58, 8, 2, 0, 0)


def test_tier_is_lru_and_never_offloads_a_key_twice(backend):
    bm = manager(backend, num_blocks=4, host_slots=2)
    prompts = [tokens(10 + i, BS + 1) for i in range(4)]  # one full block each
    keys = [bm.prefix_cache.prompt_hashes(p)[0] for p in prompts]
    for i, p in enumerate(prompts):
        run_prompt(bm, i, p)
        # a fourth and fifth fill evict the older cached blocks from the 4-block pool
        run_prompt(bm, 100 + i, tokens(50 + i, 3 * BS + 1))
    host = bm.tiers.host
    present = [host.pool.lookup(k) >= 0 for k in keys]
    # Two slots: only the most recently offloaded keys are left, the older ones were reused LRU.
    assert sum(present) <= 2
    assert not present[0]
    offloads = bm.tiers.stats.offloaded_blocks
    bm.tiers.offload([(0, keys[3])] if present[3] else [])
    assert bm.tiers.stats.offloaded_blocks == offloads  # a key the tier holds is not copied again
    assert bm.tiers.take_moves().offload == []


def test_salt_isolates_tiers(backend):
    bm = manager(backend)
    a = tokens(4, 2 * BS + 1)
    run_prompt(bm, 0, a, extra=("tenant-a",))
    run_prompt(bm, 1, tokens(5, 4 * BS))
    run_prompt(bm, 2, tokens(6, 4 * BS))
    assert bm.match_prefix(a, ("tenant-a",)).tier.host_slots  # its own tenant finds it
    assert bm.match_prefix(a, ("tenant-b",)).num_cached_tokens == 0
    assert bm.match_prefix(a).num_cached_tokens == 0


def test_failed_step_forgets_the_slots_it_stored(backend):
    bm = manager(backend)
    a = tokens(7, 2 * BS + 1)
    run_prompt(bm, 0, a)
    bm.begin_step()
    bm.allocate(1, tokens(8, 4 * BS))
    bm.allocate(2, tokens(9, 4 * BS))  # evicts a's blocks: their bytes would be copied in this step
    moves = bm.take_tier_moves()
    assert moves.offload
    bm.uncache_step_blocks()  # the step failed before its copies surely ran
    assert bm.match_prefix(a).num_cached_tokens == 0
    assert bm.tiers.host.num_cached == 0
    bm.free(1)
    bm.free(2)
    bm.check_invariants()


def test_a_full_tier_of_pinned_slots_skips_the_offload(backend):
    bm = manager(backend, num_blocks=8, host_slots=1)
    a = tokens(11, BS + 1)
    run_prompt(bm, 0, a)
    run_prompt(bm, 1, tokens(12, 4 * BS))
    run_prompt(bm, 2, tokens(13, 4 * BS))
    bm.begin_step()
    m = bm.match_prefix(a)
    assert len(m.tier.host_slots) == 1
    bm.allocate(3, a, match=m)  # pins the only slot
    bm.allocate(4, tokens(14, 6 * BS))  # evicts cached blocks while the slot is pinned
    moves = bm.take_tier_moves()
    assert all(slot != m.tier.host_slots[0] for _, slot in moves.offload)
    bm.check_invariants()


def test_attach_needs_caching_and_no_window():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        BlockManager(BS, 8, enable_caching=False).attach_tiers(4)
    with pytest.raises(ValueError, match="sliding-window"):
        BlockManager(BS, 8, enable_caching=True, sliding_window=8).attach_tiers(4)


def test_tiers_without_host_or_disk_do_nothing():
    assert BlockManager(BS, 8, enable_caching=True).attach_tiers().host is None  # no host slots unless asked
    t = KVTiers(BS)
    assert not t.enabled
    assert t.match([b"x" * 32]).num_blocks == 0
    t.offload([(0, b"x" * 32)])
    assert not t.take_moves()


def test_random_workload_keeps_invariants(backend):
    """Prompts drawn from a few shared prefixes, admitted and freed in random order through a tiny pool: the
    manager's invariants hold after every step, and every restore reads a slot holding its key."""
    rng = random.Random(0)
    bm = manager(backend, num_blocks=10, host_slots=5)
    prefixes = [tokens(100 + i, 3 * BS) for i in range(4)]
    live: list[int] = []
    for step in range(120):
        bm.begin_step()
        if live and (len(live) > 2 or rng.random() < 0.4):
            bm.free(live.pop(rng.randrange(len(live))))
        prompt = prefixes[rng.randrange(4)][:rng.randrange(1, 4) * BS] + tokens(1000 + step, rng.randrange(1, 6))
        m = bm.match_prefix(prompt)
        for slot, key in zip(m.tier.host_slots, m.hashes[len(m.hits):], strict=False):
            assert bm.tiers.host.pool.lookup(key) == slot
        try:
            bm.allocate(step, prompt, match=m)
            live.append(step)
        except Exception as e:  # a full pool is a normal outcome here
            assert type(e).__name__ == "NoFreeBlocksError"
        bm.take_tier_moves()
        bm.check_invariants()
        if backend == "cpp":  # the pure-Python pool has no separate walker
            bm.tiers.host.pool.check_invariants()


def keyed(i: int) -> bytes:
    return bytes([i]) * 32


def test_host_lookup_stops_at_the_first_missing_key(backend):
    host = manager(backend, host_slots=4).tiers.host
    s0, _ = host.store(keyed(0))
    host.store(keyed(2))
    assert host.lookup([keyed(0), keyed(1), keyed(2)]) == [s0]


def test_storing_a_held_key_marks_it_recently_used(backend):
    """A 2-slot tier holding k0, k1: k0 offered again is not stored twice but moves to the back of the LRU
    order, so k2 replaces k1."""
    host = manager(backend, host_slots=2).tiers.host
    s0, _ = host.store(keyed(0))
    s1, _ = host.store(keyed(1))
    assert host.store(keyed(0)) == (None, None)
    assert host.store(keyed(2)) == (s1, keyed(1))
    assert host.lookup([keyed(0)]) == [s0] and host.lookup([keyed(1)]) == []


def test_an_offload_batch_goes_on_past_a_key_the_tier_holds(backend):
    tiers = manager(backend, host_slots=4).tiers
    tiers.offload([(5, keyed(0))])
    tiers.take_moves()
    tiers.offload([(6, keyed(0)), (7, keyed(1))])
    moves = tiers.take_moves()
    assert [block for block, _ in moves.offload] == [7] and tiers.stats.offloaded_blocks == 2


def test_tier_moves_are_true_when_any_copy_is_due(backend):
    tiers = manager(backend, host_slots=4).tiers
    assert tiers.enabled and not tiers.take_moves()
    tiers.offload([(5, keyed(0))])
    assert tiers.take_moves()  # an offload alone
    tiers.restore_into(tiers.load(tiers.match([keyed(0)]), BS)[0], [3], None)
    moves = tiers.take_moves()
    assert moves and moves.offload == [] and moves.restore_host  # a restore alone


def test_host_events_report_stores_and_replacements_and_forget_a_failed_steps(backend):
    """With KV events: a stored key, the key its slot held before; a failed step's stores are not reported
    (their slots were dropped). Without KV events nothing is kept."""
    quiet = manager(backend, host_slots=1).tiers
    quiet.offload([(5, keyed(0)), (6, keyed(1))])
    assert quiet.take_events() == ([], [])
    bm = manager(backend, host_slots=1)
    bm.enable_kv_events()
    tiers = bm.tiers
    tiers.offload([(5, keyed(0))])
    tiers.end_of_step()
    tiers.offload([(6, keyed(1))])
    assert tiers.take_events() == ([keyed(0), keyed(1)], [keyed(0)])
    tiers.end_of_step()
    tiers.offload([(7, keyed(2))])
    tiers.end_of_step(failed=True)
    assert tiers.take_events() == ([], [keyed(1)])


def test_reset_prefix_cache_empties_the_host_tier(backend):
    bm = manager(backend)
    a = evict_a_prompt(bm)
    assert bm.match_prefix(a).num_cached_tokens == 3 * BS  # from the host tier
    bm.reset_prefix_cache()
    assert bm.match_prefix(a).num_cached_tokens == 0 and bm.tiers.host.num_cached == 0


# --- the disk tier, through the manager --------------------------------------------------------------------

DISK_FP = {"model": "test", "block_size": BS}


@pytest.fixture
def disk_manager(backend, tmp_path):
    """Factory of managers with a disk-only tier holding `written` (each block's bytes: its key's first 16
    bytes); the store is closed at teardown, whatever the test did."""
    stores = []

    def make(written: list[bytes]) -> BlockManager:
        disk = DiskKVStore(tmp_path / "kv", DISK_FP, 16)
        stores.append(disk)
        if written:
            disk.store(written, np.stack([np.frombuffer(k[:16], np.uint8) for k in written]))
            assert disk.flush(timeout=10)
        bm = BlockManager(BS, 8, 0, watermark=0.0, enable_caching=True, backend=backend)
        bm.attach_tiers(disk=disk)
        return bm

    yield make
    for disk in stores:
        disk.close(timeout=5)


def test_disk_hits_stop_at_the_first_missing_block(disk_manager):
    a = tokens(1, 3 * BS + 1)
    h = block_hashes(a, BS)
    bm = disk_manager([h[0], h[2]])
    m = bm.match_prefix(a)
    assert m.hits == [] and m.tier.disk_keys == [h[0]] and m.num_cached_tokens == BS
    assert bm.tiers.host is None and m.tier.host_slots == []


def test_disk_blocks_are_restored_into_new_device_blocks_and_counted(disk_manager):
    """Two prompts admitted in one step, 2 and 1 disk blocks: the step's restore lists all three device blocks
    with their bytes, in admission order."""
    a, b = tokens(1, 3 * BS + 1), tokens(2, 2 * BS + 1)
    ha, hb = block_hashes(a, BS), block_hashes(b, BS)
    bm = disk_manager(ha[:2] + hb[:1])
    bm.begin_step()
    assert bm.allocate(0, a) == 2 * BS
    assert bm.allocate(1, b) == BS
    restore = bm.take_tier_moves().restore_disk
    assert restore.blocks == bm.get_block_table(0)[:2] + bm.get_block_table(1)[:1]
    assert [bytes(p) for p in restore.payload] == [ha[0][:16], ha[1][:16], hb[0][:16]]
    s = bm.tiers.stats
    assert (s.queries, s.hits_disk, s.restored_blocks_disk, s.hits_host) == (len(a) + len(b), 3 * BS, 3, 0)
    bm.check_invariants()
