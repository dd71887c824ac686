"""Prefix cache: chained hashes, sharing of cached blocks, LRU eviction, counters."""

import hashlib
import importlib.util
import struct

import pytest
from pagedkv.core import (
    BlockManager,
    PrefixCache,
    PrefixCacheStats,
    block_hashes,
    hash_block_tokens,
)
from pagedkv.core.prefix_cache import encode_extra_keys

BS = 4
HAVE_XXHASH = importlib.util.find_spec("xxhash") is not None


@pytest.fixture(params=["cpp", "python"])
def backend(request):
    return request.param


def make(backend, num_gpu=16, **kw):
    return BlockManager(BS, num_gpu, 8, watermark=0.0, enable_caching=True, backend=backend, **kw)


# --- hashing -------------------------------------------------------------------

def test_hash_is_sha256_of_canonical_encoding():
    h = hash_block_tokens(None, [1, 2, 3, 4])
    data = bytes([0]) + struct.pack("<I4q", 4, 1, 2, 3, 4) + struct.pack("<I", 0)
    assert h == hashlib.sha256(data).digest() and len(h) == 32
    assert hash_block_tokens(None, [1, 2, 3, 4]) == h  # deterministic, unlike hash()


def test_hash_depends_on_parent_tokens_and_keys():
    root = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(root, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 5]) != root
    assert hash_block_tokens(None, [1, 2, 3, 4], ("tenant-a",)) != root
    assert hash_block_tokens(None, [1, 2, 3, 4], ("tenant-a",)) != hash_block_tokens(None, [1, 2, 3, 4], ("tenant-b",))
    assert hash_block_tokens(None, [2**40, -1, 0, 7]) != hash_block_tokens(None, [0, -1, 2**40, 7])


def test_extra_key_encoding_is_unambiguous():
    assert encode_extra_keys(("ab", "c")) != encode_extra_keys(("a", "bc"))
    assert encode_extra_keys(("1",)) != encode_extra_keys((1,))
    assert encode_extra_keys((b"x",)) != encode_extra_keys(("x",))
    assert encode_extra_keys((None,)) != encode_extra_keys(())
    with pytest.raises(ValueError, match="extra keys must be"):
        encode_extra_keys((1.5,))
    with pytest.raises(ValueError, match="extra keys must be"):
        encode_extra_keys((True,))


def test_block_hashes_are_the_chain_of_full_blocks():
    tokens = list(range(11))
    hashes = block_hashes(tokens, BS, ("salt",))
    assert len(hashes) == 2  # the partial third block gets no hash
    h0 = hash_block_tokens(None, tokens[0:4], ("salt",))
    assert hashes == [h0, hash_block_tokens(h0, tokens[4:8])]
    assert block_hashes(tokens[:3], BS) == []
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(tokens, 0)
    with pytest.raises(ValueError, match="int64"):
        block_hashes([2**63] * 4, BS)


def test_block_size_one_hashes_every_token_and_zero_is_refused():
    h0 = hash_block_tokens(None, [7])
    assert block_hashes([7, 8], 1) == [h0, hash_block_tokens(h0, [8])]
    assert PrefixCache(block_size=1).prompt_hashes([7, 8]) == block_hashes([7, 8], 1)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        PrefixCache(block_size=0)


def test_kv_events_carry_each_stored_blocks_parent_and_tokens():
    """What KV events report as stored, per step: a prompt's full blocks (each with its parent's key and its
    tokens), a block an append fills, and after a swap-out whose blocks were evicted meanwhile, the blocks the
    swap-in caches again, the first one included."""
    bm = BlockManager(BS, 8, 8, 0.0, enable_caching=True)
    bm.enable_kv_events()
    prompt = list(range(1, 3 * BS + 2))  # three full blocks and one token
    h = block_hashes(prompt + [99, 98, 97], BS)
    bm.begin_step()
    bm.allocate(1, prompt)
    assert bm.take_kv_events().stored == [(h[0], None, prompt[:4]), (h[1], h[0], prompt[4:8]),
                                          (h[2], h[1], prompt[8:12])]
    bm.begin_step()
    bm.append_slots(1, 3, [99, 98, 97])
    assert bm.take_kv_events().stored == [(h[3], h[2], [prompt[12], 99, 98, 97])]
    bm.swap_out(1)
    bm.allocate(2, list(range(100, 100 + 8 * BS)))  # every block of the pool: seq 1's cached ones are evicted
    bm.free(2)
    bm.begin_step()
    bm.swap_in(1)
    stored = bm.take_kv_events().stored
    assert [key for key, _, _ in stored] == h
    assert stored[0] == (h[0], None, prompt[:4]) and stored[3][1] == h[2]


def test_blocks_are_recorded_only_when_asked():
    """KV events need each stored block's parent and tokens; without them the cache keeps none."""
    for record in (False, True):
        bm = BlockManager(BS, 8, 0, 0.0, enable_caching=True)
        if record:  # as KV events turn it on; off by default
            bm.prefix_cache.record_blocks = True
        bm.allocate(1, list(range(1, 10)))
        recorded = bm.prefix_cache.take_recorded()
        assert len(recorded) == (2 if record else 0)


def test_hash_algo_flag():
    with pytest.raises(ValueError, match="hash_algo"):
        hash_block_tokens(None, [1], hash_algo="md5")
    with pytest.raises(ValueError, match="hash_algo"):
        PrefixCache(BS, "md5")
    if HAVE_XXHASH:
        h = hash_block_tokens(None, [1, 2, 3, 4], hash_algo="xxhash")
        assert len(h) == 16 and h == hash_block_tokens(None, [1, 2, 3, 4], hash_algo="xxhash")
    else:
        with pytest.raises(ImportError, match="pip install xxhash"):
            PrefixCache(BS, "xxhash")


def test_stats():
    s = PrefixCacheStats()
    assert s.hit_rate == 0.0
    s.record(100, 25)
    s.record(100, 75)
    assert (s.queries, s.hits, s.hit_rate) == (200, 100, 0.5)
    s.reset()
    assert (s.queries, s.hits) == (0, 0)


# --- sharing ---------------------------------------------------------------------

def test_common_prefix_shares_blocks(backend):
    bm = make(backend)
    system = list(range(100, 112))  # 3 full blocks
    assert bm.allocate(1, system + [1, 2]) == 0
    t1 = bm.get_block_table(1)
    assert bm.num_cached_tokens(system + [3, 4, 5]) == 12
    assert bm.num_cached_tokens(system) == 8
    assert bm.allocate(2, system + [3, 4, 5]) == 12
    t2 = bm.get_block_table(2)
    assert t2[:3] == t1[:3] and t2[3] != t1[3]
    assert all(bm.core.gpu_ref_count(b) == 2 for b in t1[:3])
    assert bm.num_used_gpu_blocks == 5  # shared, not copied
    stats = bm.prefix_cache_stats
    assert (stats.queries, stats.hits) == (14 + 15, 12)
    bm.check_invariants()


def test_last_prompt_token_is_always_recomputed(backend):
    bm = make(backend)
    prompt = list(range(8))  # exactly 2 blocks
    bm.allocate(1, prompt)
    assert bm.allocate(2, prompt) == 4  # the block holding the last token is recomputed
    assert bm.get_block_table(2)[0] == bm.get_block_table(1)[0]
    assert bm.get_block_table(2)[1] != bm.get_block_table(1)[1]
    assert bm.allocate(3, prompt + [9]) == 8


def test_prefix_shorter_than_a_block_never_hits(backend):
    bm = make(backend)
    bm.allocate(1, [1, 2, 3])
    bm.free(1)
    assert bm.allocate(2, [1, 2, 3, 9, 9, 9]) == 0
    assert bm.num_evictable_gpu_blocks == 0  # partial blocks are never cached


def test_cache_salt_and_differences_break_sharing(backend):
    bm = make(backend, num_gpu=32)
    prompt = list(range(13))
    bm.allocate(1, prompt, extra_keys=("tenant-a",))
    assert bm.allocate(2, prompt, extra_keys=("tenant-b",)) == 0
    assert bm.allocate(3, prompt) == 0
    assert bm.allocate(4, prompt, extra_keys=("tenant-a",)) == 12
    changed = [99] + prompt[1:]  # one differing token in block 0: no block matches
    assert bm.allocate(5, changed, extra_keys=("tenant-a",)) == 0


def test_freed_blocks_stay_cached_until_needed(backend):
    bm = make(backend, num_gpu=4)
    prompt = list(range(9))
    bm.allocate(1, prompt)
    bm.free(1)
    assert bm.num_free_gpu_blocks == 4 and bm.num_evictable_gpu_blocks == 2
    assert bm.allocate(2, prompt) == 8  # revived from the free list
    assert bm.num_evictable_gpu_blocks == 0
    bm.free(2)
    bm.allocate(3, list(range(50, 66)))  # needs all 4 blocks: evicts both cached ones
    assert bm.num_evictable_gpu_blocks == 0 and bm.core.num_evictions == 2
    bm.free(3)
    assert bm.allocate(4, prompt) == 0
    bm.check_invariants()


def test_eviction_is_lru_and_deepest_first(backend):
    bm = make(backend, num_gpu=8)
    a = list(range(13))  # blocks a0 a1 a2 (+ partial)
    b = list(range(100, 109))  # blocks b0 b1 (+ partial)
    bm.allocate(1, a)
    bm.allocate(2, b)
    ta, tb = bm.get_block_table(1), bm.get_block_table(2)
    bm.free(1)  # freed first: least recently used
    bm.free(2)
    # Uncached partial blocks go first, then a's chain deepest first, then b's.
    free = bm.core.gpu_free_list()
    assert free[-5:] == [ta[2], ta[1], ta[0], tb[1], tb[0]]
    bm.allocate(3, list(range(200, 200 + 4 * 5)))  # 5 blocks: 3 uncached + 2 evicted
    assert bm.core.num_evictions == 2
    # a0, the root, survived; a1 and a2 were evicted; b untouched
    assert bm.core.lookup_prefix(block_hashes(a, BS), 3) == [ta[0]]
    assert bm.core.lookup_prefix(block_hashes(b, BS), 2) == [tb[0], tb[1]]
    bm.free(3)  # its 5 full blocks are now the most recently used
    assert bm.allocate(4, a) == 4


def test_shared_root_survives_its_branches(backend):
    bm = make(backend, num_gpu=6)
    root = list(range(4))
    bm.allocate(1, root + [10, 11, 12, 13, 14])  # root, x1, partial
    bm.allocate(2, root + [20, 21, 22, 23, 24])  # root (shared), y1, partial
    r, x1, y1 = bm.get_block_table(1)[0], bm.get_block_table(1)[1], bm.get_block_table(2)[1]
    bm.free(1)  # root still held by 2: only x1 becomes evictable
    bm.free(2)
    assert bm.core.gpu_free_list()[-3:] == [x1, y1, r]
    bm.allocate(3, list(range(50, 70)))  # 5 blocks: 3 uncached, then x1 and y1 evicted
    assert bm.core.gpu_is_cached(r)
    bm.free(3)
    assert bm.allocate(4, root + [1]) == 4
    bm.check_invariants()


def test_appended_blocks_get_registered(backend):
    bm = make(backend)
    bm.allocate(1, [1, 2, 3, 4, 5, 6])
    bm.append_slots(1, 2, token_ids=[7, 8])  # block 1 now full
    bm.append_slots(1, 1, token_ids=[9])
    assert bm.core.num_cached_blocks == 2
    assert bm.allocate(2, [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
    with pytest.raises(ValueError, match="token ids"):
        bm.append_slots(1)
    with pytest.raises(ValueError, match="token ids"):
        bm.allocate(3, 12)


def test_batch_append_registers_and_fork_keeps_hash_state(backend):
    bm = make(backend)
    bm.allocate(1, [1, 2, 3])
    bm.fork(1, 2)
    cows = bm.append_slots_batch([1, 2], token_ids=[[4], [5]])
    assert len(cows) == 1
    assert bm.core.num_cached_blocks == 2
    assert bm.allocate(3, [1, 2, 3, 5, 0]) == 4
    assert bm.allocate(4, [1, 2, 3, 4, 0]) == 4
    assert bm.get_block_table(3)[0] == bm.get_block_table(2)[0]
    assert bm.get_block_table(4)[0] == bm.get_block_table(1)[0]
    with pytest.raises(ValueError, match="one token list per sequence"):
        bm.append_slots_batch([1, 2])


def _append(bm, via, seq_ids, token_ids):
    if via == "append_slots":
        for seq_id, toks in zip(seq_ids, token_ids, strict=True):
            bm.append_slots(seq_id, len(toks), token_ids=toks)
    else:
        bm.append_slots_batch(seq_ids, len(token_ids[0]), token_ids=token_ids)


SALT_A, SALT_B = ("tenant-a",), ("tenant-b",)


@pytest.mark.parametrize("via", ["append_slots", "append_slots_batch"])
def test_blocks_filled_by_append_keep_the_salt(backend, via):
    """A salted prompt shorter than a block: its first block fills through an append, under the salt."""
    bm = make(backend, num_gpu=32)
    bm.allocate(1, [1, 2, 3], extra_keys=SALT_A)  # no full block yet: nothing cached
    assert bm.core.num_cached_blocks == 0
    _append(bm, via, [1], [[4]])  # block 0 fills
    _append(bm, via, [1], [[5]])
    _append(bm, via, [1], [[6]])
    _append(bm, via, [1], [[7]])
    _append(bm, via, [1], [[8]])  # block 1 fills (chained to block 0)
    table = bm.get_block_table(1)
    assert bm.core.lookup_prefix(block_hashes(list(range(1, 9)), BS, SALT_A), 2) == table[:2]
    assert bm.core.lookup_prefix(block_hashes(list(range(1, 9)), BS), 2) == []
    assert bm.core.lookup_prefix(block_hashes(list(range(1, 9)), BS, SALT_B), 2) == []
    prompt = list(range(1, 10))
    assert bm.allocate(2, prompt) == 0  # unsalted request: the tenant's blocks stay private
    assert bm.allocate(3, prompt, extra_keys=SALT_B) == 0
    assert bm.allocate(4, prompt, extra_keys=SALT_A) == 8
    assert bm.get_block_table(4)[:2] == table[:2]
    assert not set(bm.get_block_table(2)) & set(table) and not set(bm.get_block_table(3)) & set(table)
    bm.check_invariants()


@pytest.mark.parametrize("via", ["append_slots", "append_slots_batch"])
def test_forked_children_keep_the_salt(backend, via):
    """Parent and child fill their first block after a fork (copy-on-write): both under the parent's salt."""
    bm = make(backend, num_gpu=32)
    bm.allocate(1, [1, 2, 3], extra_keys=SALT_A)
    bm.fork(1, 2)
    _append(bm, via, [2, 1], [[5], [4]])  # the child copies the shared block, then both fill
    parent_block, child_block = bm.get_block_table(1)[0], bm.get_block_table(2)[0]
    assert parent_block != child_block
    assert bm.core.lookup_prefix(block_hashes([1, 2, 3, 4], BS, SALT_A), 1) == [parent_block]
    assert bm.core.lookup_prefix(block_hashes([1, 2, 3, 5], BS, SALT_A), 1) == [child_block]
    for tokens in ([1, 2, 3, 4], [1, 2, 3, 5]):
        assert bm.core.lookup_prefix(block_hashes(tokens, BS), 1) == []
        assert bm.core.lookup_prefix(block_hashes(tokens, BS, SALT_B), 1) == []
    bm.free(1)
    bm.free(2)  # both blocks now only cached (evictable)
    assert bm.allocate(3, [1, 2, 3, 5, 0]) == 0
    assert bm.allocate(4, [1, 2, 3, 5, 0], extra_keys=SALT_B) == 0
    assert bm.allocate(5, [1, 2, 3, 5, 0], extra_keys=SALT_A) == 4
    assert bm.get_block_table(5)[0] == child_block
    assert bm.allocate(6, [1, 2, 3, 4, 0], extra_keys=SALT_A) == 4
    assert bm.get_block_table(6)[0] == parent_block
    bm.check_invariants()


def test_swap_in_registers_again(backend):
    bm = make(backend)
    prompt = list(range(9))
    bm.allocate(1, prompt)
    bm.swap_out(1)
    bm.reset_prefix_cache()  # forget the old GPU copies
    assert bm.allocate(2, prompt) == 0
    bm.free(2)
    bm.reset_prefix_cache()
    bm.swap_in(1)
    assert bm.allocate(3, prompt) == 8
    assert bm.get_block_table(3)[:2] == bm.get_block_table(1)[:2]


def test_reset_prefix_cache_and_counters(backend):
    bm = make(backend)
    prompt = list(range(9))
    bm.allocate(1, prompt)
    bm.allocate(2, prompt)
    assert bm.prefix_cache_stats.hit_rate == pytest.approx(8 / 18)
    bm.free(1)
    bm.free(2)
    bm.reset_prefix_cache()
    assert bm.prefix_cache_stats.queries == 0
    assert bm.num_evictable_gpu_blocks == 0 and bm.num_free_gpu_blocks == 16
    assert bm.allocate(3, prompt) == 0
    bm.check_invariants()


def test_can_allocate_counts_revived_blocks(backend):
    bm = make(backend, num_gpu=4)
    prompt = list(range(13))  # 4 blocks, 3 cacheable
    bm.allocate(1, prompt)
    bm.free(1)
    assert bm.can_allocate(prompt)
    bm.allocate(2, [50])  # takes the uncached block; 3 evictable left
    assert not bm.can_allocate(prompt)  # reviving 3 still costs 3 free blocks, plus 1 new


def test_caching_off_ignores_tokens():
    bm = BlockManager(BS, 8, enable_caching=False)
    bm.allocate(1, list(range(8)))
    bm.free(1)
    assert bm.allocate(2, list(range(8))) == 0
    assert bm.num_evictable_gpu_blocks == 0
    assert bm.prefix_cache_stats.queries == 0
