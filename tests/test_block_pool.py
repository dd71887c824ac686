"""BlockPool: free list order, ref counts, prefix-cache index, errors (C++ pool and its Python twin)."""

import pytest
from pagedkv.core import BlockManager, BlockPool, BlockRefCountError, NoFreeBlocksError, PyBlockPool


@pytest.fixture(params=["cpp", "python"])
def make_pool(request):
    def make(num_blocks: int):
        return BlockPool(num_blocks, "gpu") if request.param == "cpp" else PyBlockPool(num_blocks, "gpu")
    return make


def check(pool) -> None:
    if hasattr(pool, "check_invariants"):
        pool.check_invariants()
    assert pool.num_free + pool.num_used == pool.num_blocks


def test_allocate_in_order_until_empty(make_pool):
    pool = make_pool(3)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    assert pool.num_free == 0 and pool.num_used == 3
    with pytest.raises(NoFreeBlocksError, match="all 3 are in use"):
        pool.allocate()
    check(pool)


def test_zero_blocks_and_negative(make_pool):
    pool = make_pool(0)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()
    with pytest.raises(ValueError, match="num_blocks"):
        make_pool(-1)


def test_free_returns_block_to_front(make_pool):
    pool = make_pool(4)
    a, b = pool.allocate(), pool.allocate()
    pool.free(b)
    assert pool.free_list()[0] == b  # uncached: reused first
    assert pool.allocate() == b
    pool.free(a)
    check(pool)


def test_ref_counts(make_pool):
    pool = make_pool(2)
    b = pool.allocate()
    pool.incref(b)
    assert pool.ref_count(b) == 2
    assert pool.decref(b) == 1
    assert not pool.is_free(b)
    assert pool.decref(b) == 0
    assert pool.is_free(b)
    check(pool)


def test_double_free(make_pool):
    pool = make_pool(2)
    b = pool.allocate()
    pool.free(b)
    with pytest.raises(BlockRefCountError, match=f"double free of gpu block {b}"):
        pool.free(b)
    with pytest.raises(BlockRefCountError, match="already free"):
        pool.decref(b)
    check(pool)


def test_free_still_referenced(make_pool):
    pool = make_pool(2)
    b = pool.allocate()
    pool.incref(b)
    with pytest.raises(BlockRefCountError, match="still referenced by 2"):
        pool.free(b)
    assert pool.ref_count(b) == 2


def test_share_free_uncached_block(make_pool):
    pool = make_pool(2)
    with pytest.raises(BlockRefCountError, match="not cached"):
        pool.incref(1)


def test_out_of_range(make_pool):
    pool = make_pool(2)
    for op in (pool.incref, pool.decref, pool.free, pool.ref_count, pool.is_free, pool.is_cached, pool.uncache):
        with pytest.raises(ValueError, match="out of range"):
            op(2)
        with pytest.raises(ValueError, match="out of range"):
            op(-1)


def test_cached_block_survives_free_and_revives(make_pool):
    pool = make_pool(3)
    b = pool.allocate()
    assert pool.cache_block(b, b"k0")
    pool.free(b)
    assert pool.is_free(b) and pool.num_evictable == 1
    assert pool.lookup(b"k0") == b
    pool.incref(b)  # a prefix hit: unlinked from the middle of the free list
    assert not pool.is_free(b) and pool.num_evictable == 0 and pool.ref_count(b) == 1
    check(pool)


def test_eviction_is_lru_after_uncached(make_pool):
    pool = make_pool(4)
    blocks = [pool.allocate() for _ in range(4)]
    for i, b in enumerate(blocks[:3]):
        pool.cache_block(b, bytes([i + 1]))
    for b in (blocks[1], blocks[0], blocks[3], blocks[2]):
        pool.free(b)
    # uncached 3 first, then cached in the order they were freed
    assert pool.free_list() == [blocks[3], blocks[1], blocks[0], blocks[2]]
    assert pool.allocate() == blocks[3]
    assert pool.num_evictions == 0
    assert pool.allocate() == blocks[1]
    assert pool.lookup(bytes([2])) == -1 and not pool.is_cached(blocks[1])
    assert pool.num_evictions == 1 and pool.num_evictable == 2
    check(pool)


def test_cache_key_rules(make_pool):
    pool = make_pool(3)
    a, b = pool.allocate(), pool.allocate()
    assert pool.cache_block(a, b"x")
    assert not pool.cache_block(b, b"x")  # key taken: b stays uncached
    assert not pool.cache_block(a, b"y")  # a already has a key
    assert pool.num_cached == 1 and pool.lookup(b"y") == -1
    with pytest.raises(ValueError, match="empty"):
        pool.cache_block(b, b"")
    with pytest.raises(BlockRefCountError, match="allocate it first"):
        pool.cache_block(2, b"z")
    pool.clear_cache()
    assert pool.num_cached == 0 and pool.lookup(b"x") == -1
    check(pool)


def test_uncache_free_block_moves_it_to_the_front(make_pool):
    pool = make_pool(4)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert pool.cache_block(a, b"a") and pool.cache_block(b, b"b")
    for blk in (a, b, c):
        pool.free(blk)
    assert pool.free_list() == [c, 3, a, b] and pool.num_evictable == 2
    assert pool.uncache(b)
    # b's contents are worthless now: it is handed out before everything else
    assert pool.free_list() == [b, c, 3, a]
    assert pool.num_evictable == 1 and pool.num_cached == 1
    assert pool.lookup(b"b") == -1 and not pool.is_cached(b) and pool.is_free(b)
    assert not pool.uncache(b) and not pool.uncache(c)  # nothing (left) to drop
    assert pool.free_list() == [b, c, 3, a]
    check(pool)
    assert pool.allocate() == b
    assert pool.num_evictions == 0  # uncaching is not an eviction, nor is reusing the block
    check(pool)


def test_uncache_held_block_frees_it_as_uncached(make_pool):
    pool = make_pool(3)
    a = pool.allocate()
    pool.incref(a)
    assert pool.cache_block(a, b"a")
    assert pool.uncache(a)
    assert pool.ref_count(a) == 2 and not pool.is_free(a) and pool.lookup(b"a") == -1
    assert pool.num_free == 2 and pool.num_evictable == 0
    pool.decref(a)
    pool.free(a)
    assert pool.free_list()[0] == a and pool.num_evictable == 0
    with pytest.raises(BlockRefCountError, match="not cached"):
        pool.incref(a)  # no longer shareable once free
    assert pool.num_evictions == 0
    check(pool)


def _assert_consistent(pool) -> None:
    """The C++ checker passes, and what it vouches for holds when read through the API."""
    assert pool.check_invariants() is None
    free = pool.free_list()
    assert len(free) == len(set(free)) == pool.num_free == pool.num_blocks - pool.num_used
    for b in range(pool.num_blocks):
        assert pool.is_free(b) == (b in free) == (pool.ref_count(b) == 0)
    assert pool.num_evictable == sum(1 for b in free if pool.is_cached(b))
    assert pool.num_cached == sum(1 for b in range(pool.num_blocks) if pool.is_cached(b))


def test_cpp_invariant_checker_passes_after_every_operation():
    """Every public operation, refused ones included (they change nothing), keeps the pool consistent."""
    pool = BlockPool(8)
    _assert_consistent(pool)
    blocks = [pool.allocate() for _ in range(6)]
    _assert_consistent(pool)
    pool.incref(blocks[0])
    assert pool.cache_block(blocks[0], b"a") and pool.cache_block(blocks[1], b"b")
    _assert_consistent(pool)
    pool.decref(blocks[0])
    for b in blocks[1:4]:
        pool.free(b)  # blocks[1] stays cached: evictable
    _assert_consistent(pool)
    assert pool.num_evictable == 1
    pool.incref(blocks[1])  # revived from the middle of the free list
    _assert_consistent(pool)
    pool.free(blocks[1])
    state = (pool.free_list(), [pool.ref_count(b) for b in range(8)], pool.num_cached)
    for refused in (lambda: pool.free(blocks[2]), lambda: pool.incref(blocks[3]),
                    lambda: pool.cache_block(blocks[2], b"c")):
        with pytest.raises(BlockRefCountError):
            refused()
        _assert_consistent(pool)
        assert (pool.free_list(), [pool.ref_count(b) for b in range(8)], pool.num_cached) == state
    while pool.num_free:
        pool.allocate()  # the last one evicts blocks[1]
    _assert_consistent(pool)
    assert pool.num_evictions == 1 and pool.lookup(b"b") == -1
    pool.clear_cache()
    for b in range(8):
        pool.free(b)
    _assert_consistent(pool)
    assert pool.num_free == 8


# The C++ pool and manager keep their state private, and no binding can put
# them into an inconsistent state (every mutating call validates first), so a
# corrupted C++ pool cannot be built from Python: its checker is shown to pass
# above, and the detection side is shown on the Python twin, which checks the
# same invariants (ref counts == table holders, free flag <=> ref count 0).


def _twin_with_shared_blocks() -> BlockManager:
    bm = BlockManager(4, 8, 4, watermark=0.0, backend="python")
    bm.allocate(1, 6)
    bm.fork(1, 2)  # blocks 0 and 1 held twice
    bm.allocate(3, 3)
    bm.check_invariants()
    return bm


@pytest.mark.parametrize("corruption", ["extra_ref", "lost_ref", "free_but_held", "free_block_lost",
                                        "table_points_elsewhere"])
def test_python_invariant_checker_catches_corruption(corruption):
    bm = _twin_with_shared_blocks()
    core = bm.core
    if corruption == "extra_ref":  # a ref count with no table behind it (a leak)
        core.gpu.ref_counts[2] += 1
        match = "ref counts"
    elif corruption == "lost_ref":  # a holder the count forgot (a later double free)
        core.gpu.ref_counts[0] -= 1
        match = "ref counts"
    elif corruption == "free_but_held":  # referenced, yet handed out again by allocate
        core.gpu._free[1] = None
        match = "free flag disagrees"
    elif corruption == "free_block_lost":
        del core.gpu._free[5]  # a free block vanishes from the free list
        match = "free flag disagrees"
    else:
        core._seqs[3].table[0] = 4  # the table names a block nobody allocated
        match = "ref counts"
    with pytest.raises(AssertionError, match=match):
        bm.check_invariants()


def test_eviction_journal_records_block_and_key_only_while_on(make_pool):
    p = make_pool(3)
    blocks = [p.allocate() for _ in range(3)]
    for b, key in zip(blocks, (b"k0", b"k1", b"k2"), strict=True):
        assert p.cache_block(b, key)
        assert p.key(b) == key
    for b in blocks:
        p.decref(b)  # all three free and cached, k0 least recently freed
    assert p.take_evictions() == []
    p.allocate()  # evicts k0 while the journal is off: nothing recorded
    assert p.take_evictions() == []
    p.set_record_evictions(True)
    b1 = p.allocate()
    assert p.key(b1) == b"" and p.take_evictions() == [(blocks[1], b"k1")]
    assert p.take_evictions() == []  # taking empties the journal
    p.allocate()
    p.set_record_evictions(False)  # turning it off drops what was recorded
    assert p.take_evictions() == []
    with pytest.raises(ValueError, match="out of range"):
        p.key(7)


def test_manager_journals_evictions_and_step_cached_entries():
    bm = BlockManager(4, 4, enable_caching=True)
    bm.core.set_record_evictions(True)
    prompt = list(range(1, 10))  # two full blocks and one token
    bm.begin_step()
    bm.allocate(0, prompt)
    entries = bm.step_cached_entries()
    assert [b for b, _ in entries] == bm.get_block_table(0)[:2]
    assert [k for _, k in entries] == bm.prefix_cache.prompt_hashes(prompt)
    bm.free(0)
    bm.begin_step()
    assert bm.step_cached_entries() == []
    bm.allocate(1, list(range(100, 116)))  # four blocks: both cached blocks evicted
    evicted = bm.core.take_evicted()
    assert sorted(k for _, k in evicted) == sorted(k for _, k in entries)


def test_snapshot_is_the_same_bulk_view_in_both_cores():
    """One call gives every block's ref count, cached flag and key prefix and every table; the pure-Python twin
    answers the same after the same random workload."""
    import random

    import numpy as np

    rng = random.Random(5)
    managers = [BlockManager(4, 24, 8, enable_caching=True, backend=b) for b in ("cpp", "python")]
    prefixes = [[rng.randrange(1, 999) for _ in range(12)] for _ in range(3)]
    live: list[int] = []
    for seq_id in range(40):
        prompt = prefixes[rng.randrange(3)][:rng.randrange(4, 13)] + [rng.randrange(1, 999)]
        if live and (len(live) > 4 or rng.random() < 0.3):
            victim = live.pop(rng.randrange(len(live)))
            for bm in managers:
                bm.free(victim)
        if all(bm.can_allocate(prompt) for bm in managers):
            for bm in managers:
                bm.allocate(seq_id, prompt)
            live.append(seq_id)
    if live:
        for bm in managers:
            bm.fork(live[0], 1000)
    cpp, py = (bm.core.snapshot() for bm in managers)
    assert cpp.keys() == py.keys()
    for name in cpp:
        assert cpp[name].dtype == py[name].dtype, name
        np.testing.assert_array_equal(cpp[name], py[name], err_msg=name)
    bm = managers[0]
    for i, seq_id in enumerate(cpp["seq_ids"].tolist()):
        lo, hi = cpp["table_offsets"][i], cpp["table_offsets"][i + 1]
        assert cpp["table_blocks"][lo:hi].tolist() == bm.get_block_table(seq_id)
    held = np.bincount(cpp["table_blocks"], minlength=24)
    np.testing.assert_array_equal(held, cpp["ref_counts"])
    assert (cpp["key_prefix"][cpp["cached"] == 0] == 0).all()
