"""Sliding-window block release (BlockManager(sliding_window=W)), on the C++ core and its pure-Python twin.

Convention (HF's): a query at position p reads keys p - W < k <= p. When a
sequence gets slots for tokens whose earliest query is at p0, every block
whose positions all lie below p0 - W + 1 is released and its entry becomes
DROPPED_BLOCK. The stateful comparison of the twins with a window is in
test_block_manager_stateful.py; these tests pin each rule down by hand.
"""

import math

import numpy as np
import pytest
from pagedkv.core import DROPPED_BLOCK, AllocStatus, BlockManager, NoFreeBlocksError

BS = 4
D = DROPPED_BLOCK


@pytest.fixture(params=["cpp", "python"])
def backend(request):
    return request.param


def make(backend, window, num_gpu=16, num_cpu=8, **kw):
    return BlockManager(BS, num_gpu, num_cpu, watermark=0.0, backend=backend, sliding_window=window, **kw)


def decode(bm, seq_id, steps, token_ids=None):
    """`steps` one-token appends (token ids 0, 1, ... when caching), checking the invariants after each."""
    for i in range(steps):
        bm.append_slots(seq_id, 1, None if token_ids is None else [token_ids[i]])
        bm.check_invariants()


@pytest.mark.parametrize("window", [4, 7, 8, 13])
def test_a_sequence_grown_to_8x_its_window_holds_about_a_window_of_blocks(backend, window):
    bm = make(backend, window)
    bound = math.ceil(window / BS) + 1
    bm.allocate(1, 3)
    peak = 0
    for _ in range(8 * window - 3):
        bm.append_slots(1)
        peak = max(peak, bm.num_held_blocks(1))
        assert bm.num_used_gpu_blocks == bm.num_held_blocks(1) <= bound
    bm.check_invariants()
    n = bm.get_num_tokens(1)
    assert n == 8 * window
    table = bm.get_block_table(1)
    assert len(table) == math.ceil(n / BS)  # the table keeps its logical length: markers, then live blocks
    dropped = bm.num_dropped_blocks(1)
    assert table[:dropped] == [D] * dropped and D not in table[dropped:]
    assert peak == bound or window % BS == 1  # a window of k*BS + 1 never needs the extra block
    bm.free(1)
    assert bm.num_free_gpu_blocks == 16


def test_the_drop_bound_follows_the_hf_window(backend):
    """W = 8: block 0 (positions 0-3) goes once the earliest new query p0 has p0 - 7 >= 4, i.e. p0 = 11."""
    bm = make(backend, 8)
    bm.allocate(1, 11)  # positions 0-10 (the allocate's queries start at 0)
    assert bm.num_dropped_blocks(1) == 0
    bm.append_slots(1)  # query at 11 reads keys 4..11
    assert bm.num_dropped_blocks(1) == 1 and bm.get_block_table(1)[0] == D
    bm.append_slots(1)  # query at 12 reads keys 5..12: block 1 (4-7) is still needed
    assert bm.num_dropped_blocks(1) == 1
    bm.check_invariants()


def test_a_prefill_chunk_keeps_the_window_of_its_earliest_query(backend):
    bm = make(backend, 8)
    bm.allocate(1, 16)  # first chunk: positions 0-15
    assert bm.blocks_to_append(1, 16) == 4 - 2  # 4 new blocks, blocks 0 and 1 (held only here) freed
    bm.append_slots(1, 16)  # second chunk, queries 16..31: the earliest reads keys 9..16
    assert bm.get_block_table(1)[:3] == [D, D, 2]  # block 2 (positions 8-11) holds key 9..11
    assert bm.num_held_blocks(1) == 8 - 2
    bm.check_invariants()


def test_metadata_rows_carry_the_markers_and_queries_must_be_live(backend):
    bm = make(backend, 4)
    bm.allocate(1, 8)
    decode(bm, 1, 4)  # 12 tokens; the last query (11) reads keys 8..11: blocks 0 and 1 dropped
    assert bm.get_block_table(1)[:2] == [D, D]
    bt, sm, sl = np.full((1, 4), 99, np.int32), np.zeros(8, np.int64), np.zeros(1, np.int32)
    assert bm.fill_metadata([1], bt, sm, sl, query_lens=[4], pad_value=-5) == 4
    assert list(bt[0]) == [D, D, bm.get_block_table(1)[2], -5]
    assert list(sm[:4]) == [bm.get_block_table(1)[2] * BS + i for i in range(4)]
    with pytest.raises(ValueError, match="query_lens"):
        bm.fill_metadata([1], bt, sm, sl, query_lens=[5])  # position 7 sits in a dropped block


def test_prefix_caching_dropped_blocks_become_evictable_and_hit_again(backend):
    """A hashed block the window drops is a freed cached block: evictable, and a later identical prompt hits it."""
    bm = make(backend, 8, num_gpu=32, enable_caching=True)
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks
    bm.allocate(1, prompt)
    out = list(range(200, 240))
    decode(bm, 1, len(out), out)  # 53 tokens: the window (8) has dropped blocks 0..10
    dropped = bm.num_dropped_blocks(1)
    assert dropped == (52 - 8 + 1) // BS
    assert bm.num_evictable_gpu_blocks == dropped  # each held only here, each hashed when it filled
    assert bm.num_used_gpu_blocks == bm.num_held_blocks(1)
    # A new request repeating the conversation so far: every full block is a hit, though sequence 1 dropped most.
    again = prompt + out[:-1] + [7]
    assert bm.num_cached_tokens(again) == 13 * BS
    cached = bm.allocate(2, again)
    assert cached == 13 * BS
    # Its first query is at 52: the hits before its window (keys 45..) are not taken, the rest are revived.
    table = bm.get_block_table(2)
    skip = (52 - 8 + 1) // BS
    assert table[:skip] == [D] * skip and bm.num_dropped_blocks(2) == skip
    assert table[skip:13] == bm.get_block_table(1)[skip:13]
    bm.check_invariants()
    bm.free(1)
    bm.free(2)
    assert bm.num_free_gpu_blocks == 32 and bm.num_evictable_gpu_blocks > 0


def test_evictable_dropped_hit_inside_the_new_windows_is_revived(backend):
    bm = make(backend, 8, num_gpu=32, enable_caching=True)
    bm.allocate(1, list(range(13)))
    decode(bm, 1, 20, list(range(50, 70)))  # blocks 0..5 dropped, all evictable
    block1 = bm.core.lookup_prefix(bm.prefix_cache.prompt_hashes(list(range(13))), 3)[1]
    assert bm.core.gpu_ref_count(block1) == 0
    bm.allocate(2, list(range(13)))  # hits blocks 0-2; first query 12 reads keys 5..12: block 0 is not taken
    assert bm.get_block_table(2)[0] == D and bm.get_block_table(2)[1] == block1
    assert bm.core.gpu_ref_count(block1) == 1
    bm.check_invariants()


def test_allocate_status_counts_only_the_blocks_of_the_window():
    """16 blocks; a 22-block prompt whose first 16 are cached needs only those inside its window: it fits."""
    for backend in ("cpp", "python"):
        statuses = []
        for window in (None, 8):
            bm = make(backend, window, num_gpu=16, enable_caching=True)
            head = list(range(64))
            bm.allocate(1, head)  # 16 blocks (the allocate's queries start at 0: nothing dropped)
            bm.free(1)  # all evictable
            statuses.append(bm.allocate_status(head + list(range(500, 524))))
            if window:
                bm.allocate(2, head + list(range(500, 524)))
                assert bm.num_held_blocks(2) == 22 - (63 - 8 + 1) // BS
                bm.check_invariants()
        assert statuses == [AllocStatus.NEVER, AllocStatus.OK]


def test_fork_shares_only_live_blocks_and_copy_on_write(backend):
    bm = make(backend, 8)
    bm.allocate(1, 9)
    decode(bm, 1, 10)  # 19 tokens: blocks 0, 1 dropped; last block (16-18) partial
    parent = bm.get_block_table(1)
    assert parent[:2] == [D, D]
    used = bm.num_used_gpu_blocks
    bm.fork(1, 2)
    assert bm.get_block_table(2) == parent and bm.num_dropped_blocks(2) == 2
    assert bm.num_used_gpu_blocks == used  # nothing new: the child shares
    for b in parent[2:]:
        assert bm.core.gpu_ref_count(b) == 2
    src, dst = bm.append_slots(2)  # partial shared last block: copied first
    assert src == parent[-1] and bm.get_block_table(2)[-1] == dst
    # A shared block the child drops stays with the parent (its count just drops).
    decode(bm, 2, 4)  # the child's window moves past block 2
    assert bm.get_block_table(2)[2] == D and bm.core.gpu_ref_count(parent[2]) == 1
    assert bm.get_block_table(1) == parent
    decode(bm, 1, 5)
    bm.free(1)
    bm.free(2)
    assert bm.num_free_gpu_blocks == 16


def test_swap_moves_only_live_blocks_and_keeps_the_markers(backend):
    bm = make(backend, 8, num_cpu=4, enable_caching=True)
    toks = list(range(30))
    bm.allocate(1, toks[:9])
    decode(bm, 1, 21, toks[9:])  # 30 tokens, 8 logical blocks, 3 live
    table = bm.get_block_table(1)
    held = bm.num_held_blocks(1)
    assert held == 3 and table[:5] == [D] * 5
    bm.fork(1, 2)
    assert bm.can_swap_out([1, 2])  # 3 distinct live blocks fit the 4 CPU blocks (the 8-entry table would not)
    mapping = bm.swap_out([1, 2])
    assert sorted(g for g, _ in mapping) == sorted(table[5:])
    assert bm.get_block_table(1)[:5] == [D] * 5 and bm.get_block_table(1) == bm.get_block_table(2)
    assert bm.num_free_cpu_blocks == 1
    bm.check_invariants()
    assert bm.can_swap_in([1, 2])
    back = bm.swap_in([1, 2])  # re-offers the live blocks to the index, skips the markers
    assert len(back) == 3
    assert bm.get_block_table(1)[:5] == [D] * 5 and bm.num_held_blocks(1) == 3
    bm.check_invariants()
    decode(bm, 1, 3, [1, 2, 3])
    for s in (1, 2):
        bm.free(s)
    assert bm.num_free_gpu_blocks == 16 and bm.num_free_cpu_blocks == 4


def test_batch_append_lends_blocks_one_sequence_frees_to_another(backend):
    """A full pool: A's decode frees a block (net -1), B's takes one (net +1); the batch does both, drops first."""
    bm = make(backend, 4, num_gpu=3)
    bm.allocate(1, 7)  # A: blocks 0-3, 4-6; its next query (7) reads keys 4..7: block 0 goes
    bm.allocate(2, 4)  # B: one full block; its next token needs a new one
    assert bm.num_free_gpu_blocks == 0
    assert bm.blocks_to_append(1) == -1 and bm.blocks_to_append(2) == 1
    assert bm.can_append([2, 1])
    assert not bm.can_append([2])
    with pytest.raises(NoFreeBlocksError):
        bm.append_slots_batch([2], 1)
    assert bm.append_slots_batch([2, 1], 1) == []
    assert bm.get_block_table(1)[0] == D and len(bm.get_block_table(2)) == 2
    bm.check_invariants()


def test_window_off_changes_nothing(backend):
    for window in (None, 0):
        bm = make(backend, window)
        assert bm.sliding_window is None
        bm.allocate(1, 3)
        decode(bm, 1, 40)
        assert bm.num_dropped_blocks(1) == 0 and D not in bm.get_block_table(1)


@pytest.mark.parametrize("bad", [-1, 2.5, True])
def test_sliding_window_must_be_a_non_negative_int(backend, bad):
    with pytest.raises(ValueError, match="sliding_window must be None or an int >= 0"):
        make(backend, bad)
