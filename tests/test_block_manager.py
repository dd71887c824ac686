"""BlockManager operations and errors, on the C++ core and its pure-Python twin."""

import types

import numpy as np
import pytest
import torch
from pagedkv.core import (
    AllocStatus,
    BlockManager,
    BlockManagerError,
    BlockRefCountError,
    InvalidSequenceStateError,
    NoFreeBlocksError,
    SequenceExistsError,
    UnknownSequenceError,
)

BS = 4


@pytest.fixture(params=["cpp", "python"])
def backend(request):
    return request.param


def make(backend, num_gpu=16, num_cpu=8, watermark=0.0, **kw):
    return BlockManager(BS, num_gpu, num_cpu, watermark=watermark, backend=backend, **kw)


def test_allocate_block_table(backend):
    bm = make(backend)
    bm.allocate(7, 9)
    assert bm.get_block_table(7) == [0, 1, 2]
    assert bm.get_num_tokens(7) == 9
    assert bm.num_used_gpu_blocks == 3 and bm.num_free_gpu_blocks == 13
    assert bm.gpu_usage == pytest.approx(3 / 16)
    assert 7 in bm and 8 not in bm
    bm.allocate(8, list(range(4)))  # token ids work too
    assert bm.get_block_table(8) == [3]
    bm.check_invariants()


def test_append_takes_a_block_only_at_boundary(backend):
    bm = make(backend)
    bm.allocate(1, 3)
    assert bm.blocks_to_append(1) == 0
    assert bm.append_slots(1) is None and bm.get_block_table(1) == [0]
    assert bm.blocks_to_append(1) == 1
    bm.append_slots(1)
    assert bm.get_block_table(1) == [0, 1] and bm.get_num_tokens(1) == 5
    bm.append_slots(1, num_new_tokens=7)  # 12 tokens: 3 blocks
    assert bm.get_block_table(1) == [0, 1, 2]
    bm.check_invariants()


def test_out_of_blocks_is_catchable_and_changes_nothing(backend):
    bm = make(backend, num_gpu=4)
    bm.allocate(1, 12)
    with pytest.raises(NoFreeBlocksError, match="sequence 2 needs 2 free gpu blocks"):
        bm.allocate(2, 5)
    assert 2 not in bm and bm.num_free_gpu_blocks == 1
    bm.append_slots(1, num_new_tokens=4)
    with pytest.raises(NoFreeBlocksError, match="sequence 1"):
        bm.append_slots(1)
    assert bm.get_num_tokens(1) == 16
    assert isinstance(NoFreeBlocksError("x"), BlockManagerError)
    bm.check_invariants()


def test_watermark_and_allocate_status(backend):
    bm = make(backend, num_gpu=100, watermark=0.1)  # keeps 10 blocks for appends
    assert bm.allocate_status(4 * 91) == AllocStatus.NEVER
    assert bm.can_allocate(4 * 90)
    bm.allocate(1, 4 * 80)
    assert bm.allocate_status(4 * 10) == AllocStatus.OK
    assert bm.allocate_status(4 * 11) == AllocStatus.LATER
    assert not bm.can_allocate(4 * 11)
    bm.allocate(2, 4 * 11)  # allocate itself only needs free blocks
    assert bm.num_free_gpu_blocks == 9


def test_can_append(backend):
    bm = make(backend, num_gpu=3)
    bm.allocate(1, 4)
    bm.allocate(2, 4)
    assert bm.can_append([1])
    assert not bm.can_append([1, 2])
    assert bm.can_append(2, num_new_tokens=4)
    assert not bm.can_append(2, num_new_tokens=5)


def test_fork_shares_and_copy_on_write(backend):
    bm = make(backend)
    bm.allocate(1, 6)  # blocks [0, 1], last one half full
    bm.fork(1, 2)
    assert bm.get_block_table(2) == [0, 1]
    assert bm.core.gpu_ref_count(0) == 2 and bm.core.gpu_ref_count(1) == 2
    assert bm.blocks_to_append(2) == 1
    cow = bm.append_slots(2)
    assert cow == (1, 2)
    assert bm.get_block_table(2) == [0, 2] and bm.get_block_table(1) == [0, 1]
    assert bm.core.gpu_ref_count(1) == 1 and bm.core.gpu_ref_count(2) == 1
    assert bm.append_slots(1) is None  # the last sharer writes in place
    bm.check_invariants()


def test_fork_at_block_boundary_needs_no_copy(backend):
    bm = make(backend)
    bm.allocate(1, 8)
    bm.fork(1, 2)
    assert bm.append_slots(2) is None
    assert bm.get_block_table(2) == [0, 1, 2]
    assert bm.core.gpu_ref_count(1) == 2


def test_copy_on_write_without_free_block(backend):
    bm = make(backend, num_gpu=2)
    bm.allocate(1, 6)
    bm.fork(1, 2)
    with pytest.raises(NoFreeBlocksError):
        bm.append_slots(2)
    assert bm.get_block_table(2) == [0, 1] and bm.get_num_tokens(2) == 6


def test_free_returns_everything(backend):
    bm = make(backend)
    bm.allocate(1, 10)
    bm.fork(1, 2)
    bm.append_slots(2, num_new_tokens=5)
    bm.allocate(3, 1)
    for seq in (2, 1, 3):
        bm.free(seq)
    assert bm.num_free_gpu_blocks == 16 and bm.num_used_gpu_blocks == 0
    bm.check_invariants()


def test_misuse_errors(backend):
    bm = make(backend)
    bm.allocate(1, 5)
    with pytest.raises(UnknownSequenceError, match="unknown sequence 9") as e:
        bm.free(9)
    assert isinstance(e.value, KeyError)
    bm.free(1)
    with pytest.raises(UnknownSequenceError, match="free: unknown sequence 1"):
        bm.free(1)  # double free of a sequence
    bm.allocate(1, 5)
    with pytest.raises(SequenceExistsError, match="sequence 1 already has blocks"):
        bm.allocate(1, 5)
    bm.allocate(2, 5)
    with pytest.raises(SequenceExistsError, match="child sequence 2 already exists") as e:
        bm.fork(1, 2)
    assert isinstance(e.value, ValueError)
    with pytest.raises(UnknownSequenceError):
        bm.fork(5, 6)
    with pytest.raises(UnknownSequenceError):
        bm.append_slots(5)
    with pytest.raises(UnknownSequenceError):
        bm.get_block_table(5)
    with pytest.raises(ValueError, match="num_tokens must be >= 1"):
        bm.allocate(3, 0)
    with pytest.raises(ValueError, match="num_new_tokens must be >= 1"):
        bm.append_slots(1, num_new_tokens=0)
    bm.check_invariants()


def test_constructor_errors(backend):
    with pytest.raises(ValueError, match="watermark"):
        BlockManager(BS, 8, watermark=1.0, backend=backend)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(0, 8, backend=backend)
    with pytest.raises(ValueError, match="backend"):
        BlockManager(BS, 8, backend="rust")
    for kwargs, name in ((dict(num_gpu_blocks=-1), "num_gpu_blocks"), (dict(num_cpu_blocks=2.5), "num_cpu_blocks"),
                         (dict(num_cpu_blocks=-1), "num_cpu_blocks"), (dict(block_size=0), "block_size")):
        args = dict(block_size=BS, num_gpu_blocks=8) | kwargs
        with pytest.raises(ValueError, match=f"{name} must be a non-negative int"):
            BlockManager(**args, backend=backend)
    for window in (True, -1, "8", 2.0):
        with pytest.raises(ValueError, match="sliding_window must be None or an int >= 0"):
            BlockManager(BS, 8, sliding_window=window, backend=backend)


def test_the_smallest_legal_values(backend):
    """block_size 1, an empty pool, and a window of 0 (no window)."""
    one = BlockManager(1, 2, backend=backend)
    one.allocate(1, 2)
    assert sorted(one.get_block_table(1)) == [0, 1] and one.num_free_gpu_blocks == 0
    assert BlockManager(BS, 0, backend=backend).num_free_gpu_blocks == 0
    assert BlockManager(BS, 8, backend=backend).num_free_cpu_blocks == 0  # no swap space unless asked
    assert BlockManager(BS, 8, sliding_window=0, backend=backend).sliding_window is None


def test_allocate_a_first_chunk_within_the_prompt(backend):
    """num_tokens (a first chunk) must leave the cached prefix behind and stay within the prompt."""
    bm = make(backend, enable_caching=True)
    bm.allocate(1, list(range(1, 10)))  # 9 tokens: 2 full blocks cached
    prompt = list(range(1, 10)) + [50, 51, 52]  # 12 tokens, the first 8 cached
    for bad in (8, 13):
        with pytest.raises(ValueError, match=r"num_tokens must be in \(8, 12\]"):
            bm.allocate(2, prompt, num_tokens=bad)
    assert 2 not in bm
    assert bm.allocate(2, prompt, num_tokens=9) == 8
    assert bm.allocate(3, prompt, num_tokens=12) == 8


def test_can_append_one_token_by_default(backend):
    bm = make(backend, num_gpu=1)
    bm.allocate(1, BS - 1)  # one slot left in its block, no free block
    assert bm.can_append(1) and not bm.can_append(1, num_new_tokens=2)


def test_num_prefix_cache_seqs_counts_the_tracked_sequences(backend):
    assert make(backend).num_prefix_cache_seqs == 0
    bm = make(backend, enable_caching=True)
    bm.allocate(1, [1, 2, 3])
    bm.allocate(2, [4, 5])
    assert bm.num_prefix_cache_seqs == 2
    bm.free(1)
    assert bm.num_prefix_cache_seqs == 1


def test_swap_out_and_in_keeps_sharing(backend):
    bm = make(backend)
    bm.allocate(1, 6)
    bm.fork(1, 2)
    bm.append_slots(2)  # CoW: 1 -> [0, 1], 2 -> [0, 2]
    bm.allocate(3, 4)  # [3]
    assert bm.can_swap_out([1, 2])
    out = bm.swap_out([1, 2])
    assert out == [(0, 0), (1, 1), (2, 2)]  # block 0 copied once
    assert bm.is_swapped(1) and bm.get_block_table(1) == [0, 1] and bm.get_block_table(2) == [0, 2]
    assert bm.core.cpu_ref_count(0) == 2
    assert bm.num_free_gpu_blocks == 15 and bm.num_free_cpu_blocks == 5
    with pytest.raises(InvalidSequenceStateError, match="swapped out"):
        bm.append_slots(1)
    with pytest.raises(InvalidSequenceStateError):
        bm.fork(1, 9)
    with pytest.raises(InvalidSequenceStateError, match="already swapped out"):
        bm.swap_out(1)
    with pytest.raises(InvalidSequenceStateError, match="not swapped out"):
        bm.swap_in(3)
    with pytest.raises(ValueError, match="listed twice"):
        bm.swap_in([1, 1])
    assert bm.can_swap_in([1, 2])
    back = bm.swap_in([1, 2])
    assert [cpu for cpu, _ in back] == [0, 1, 2]
    t1, t2 = bm.get_block_table(1), bm.get_block_table(2)
    assert t1[0] == t2[0] and bm.core.gpu_ref_count(t1[0]) == 2
    assert bm.num_free_cpu_blocks == 8
    bm.check_invariants()


def test_swap_out_without_cpu_space(backend):
    bm = make(backend, num_cpu=1)
    bm.allocate(1, 8)
    assert not bm.can_swap_out(1)
    with pytest.raises(NoFreeBlocksError, match="free cpu blocks"):
        bm.swap_out(1)
    assert not bm.is_swapped(1)
    bm.check_invariants()


def test_free_swapped_sequence(backend):
    bm = make(backend)
    bm.allocate(1, 8)
    bm.swap_out(1)
    bm.free(1)
    assert bm.num_free_cpu_blocks == 8 and bm.num_free_gpu_blocks == 16


def test_append_slots_batch(backend):
    bm = make(backend, num_gpu=7)
    bm.allocate(1, 6)
    bm.fork(1, 2)
    bm.allocate(3, 4)
    cows = bm.append_slots_batch([1, 2, 3])
    assert cows == [(1, 3)]  # 1 copies its shared block; 2 then writes in place
    assert [bm.get_num_tokens(s) for s in (1, 2, 3)] == [7, 7, 5]
    with pytest.raises(ValueError, match="listed twice"):
        bm.append_slots_batch([1, 1])
    bm.allocate(4, 6)  # no free block left
    assert bm.append_slots_batch([1, 2]) == []  # 8 tokens each: fills their blocks
    with pytest.raises(NoFreeBlocksError):
        bm.append_slots_batch([3, 1, 2])  # 2 blocks needed, 0 free: nothing changes
    assert bm.get_num_tokens(3) == 5
    assert bm.get_num_tokens(1) == 8 and bm.get_num_tokens(2) == 8
    bm.check_invariants()


def expected_metadata(bm, seq_ids, query_lens, max_blocks):
    tables = np.zeros((len(seq_ids), max_blocks), np.int32)
    slots, lens = [], []
    for i, s in enumerate(seq_ids):
        table, n = bm.get_block_table(s), bm.get_num_tokens(s)
        tables[i, :len(table)] = table
        lens.append(n)
        slots += [table[p // BS] * BS + p % BS for p in range(n - query_lens[i], n)]
    return tables, np.array(slots, np.int64), np.array(lens, np.int32)


@pytest.mark.parametrize("use_torch", [False, True])
def test_fill_metadata_matches_block_tables(backend, use_torch):
    bm = make(backend, num_gpu=64)
    lengths = {10: 1, 11: 17, 12: 8, 13: 33}
    for s, n in lengths.items():
        bm.allocate(s, n)
    bm.fork(11, 14)
    bm.append_slots(14, 3)
    seq_ids = [13, 10, 14, 12]
    query_lens = [5, 1, 3, 8]
    max_blocks = 10
    if use_torch:
        bt = torch.full((6, max_blocks), -7, dtype=torch.int32)
        sm = torch.full((20,), -7, dtype=torch.int64)
        sl = torch.zeros(6, dtype=torch.int32)
    else:
        bt, sm, sl = np.full((6, max_blocks), -7, np.int32), np.full(20, -7, np.int64), np.zeros(6, np.int32)
    n = bm.fill_metadata(seq_ids, bt, sm, sl, query_lens=query_lens)
    assert n == sum(query_lens)
    tables, slots, lens = expected_metadata(bm, seq_ids, query_lens, max_blocks)
    bt, sm, sl = (np.asarray(x) for x in (bt, sm, sl))
    np.testing.assert_array_equal(bt[:4], tables)
    np.testing.assert_array_equal(sm[:n], slots)
    np.testing.assert_array_equal(sl[:4], lens)
    assert (sm[n:] == -7).all() and (bt[4:] == -7).all()
    # decode step: one slot per sequence, the last position
    n = bm.fill_metadata(seq_ids, bt, sm, sl, pad_value=-1)
    assert n == 4 and (bt[0, 9:] == -1).all()
    np.testing.assert_array_equal(sm[:4], expected_metadata(bm, seq_ids, [1] * 4, max_blocks)[1])


def test_fill_metadata_errors(backend):
    bm = make(backend)
    bm.allocate(1, 9)
    bm.allocate(2, 2)
    bt, sm, sl = np.zeros((2, 3), np.int32), np.zeros(4, np.int64), np.zeros(2, np.int32)
    before = bt.copy()
    with pytest.raises(ValueError, match="room for 2"):
        bm.fill_metadata([2, 1], np.zeros((2, 2), np.int32), sm, sl)
    with pytest.raises(ValueError, match="query_lens"):
        bm.fill_metadata([1, 2], bt, sm, sl, query_lens=[1, 3])
    with pytest.raises(ValueError, match="slot_mapping holds 4"):
        bm.fill_metadata([1, 2], bt, sm, sl, query_lens=[4, 1])
    with pytest.raises(UnknownSequenceError):
        bm.fill_metadata([1, 5], bt, sm, sl)
    np.testing.assert_array_equal(bt, before)  # nothing written by a failed call
    bm.swap_out(2)
    with pytest.raises(InvalidSequenceStateError):
        bm.fill_metadata([2], bt, sm, sl)
    with pytest.raises(ValueError, match="numpy array or a CPU torch tensor"):
        bm.fill_metadata([1], [[0, 0, 0]], sm, sl)
    with pytest.raises(ValueError, match="must be a CPU tensor"):
        bm.fill_metadata([1], torch.empty((2, 3), dtype=torch.int32, device="meta"), sm, sl)


def test_fill_metadata_rejects_buffers_it_cannot_write():
    bm = make("cpp")
    bm.allocate(1, 9)
    bt, sm, sl = np.zeros((2, 3), np.int32), np.zeros(4, np.int64), np.zeros(2, np.int32)
    with pytest.raises(ValueError, match="block_tables must have dtype int32, got int64"):
        bm.fill_metadata([1], bt.astype(np.int64), sm, sl)
    with pytest.raises(ValueError, match="slot_mapping must have dtype int64"):
        bm.fill_metadata([1], bt, sm.astype(np.int32), sl)
    with pytest.raises(ValueError, match="C-contiguous"):
        bm.fill_metadata([1], np.zeros((3, 2), np.int32).T, sm, sl)
    ro = bt.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        bm.fill_metadata([1], ro, sm, sl)
    with pytest.raises(ValueError, match="2-D"):
        bm.fill_metadata([1], np.zeros(6, np.int32), sm, sl)
    with pytest.raises(ValueError, match="rows"):
        bm.fill_metadata([1, 1, 1], bt, sm, sl)
    for not_a_buffer in ([0] * 6, types.SimpleNamespace(device="cpu")):  # a device alone is not a tensor
        with pytest.raises(ValueError, match="block_tables must be a numpy array or a CPU torch tensor"):
            bm.fill_metadata([1], not_a_buffer, sm, sl)


@pytest.mark.parametrize("backend", ["cpp", "python"])
def test_caching_off_pool_returns_to_full(backend):
    rng = np.random.default_rng(0)
    bm = make(backend, num_gpu=64, num_cpu=32)
    live: list[int] = []
    for step in range(400):
        op = rng.integers(4)
        try:
            if op == 0 or not live:
                bm.allocate(step, int(rng.integers(1, 40)))
                live.append(step)
            elif op == 1:
                bm.append_slots(live[int(rng.integers(len(live)))], int(rng.integers(1, 6)))
            elif op == 2:
                bm.fork(live[int(rng.integers(len(live)))], step)
                live.append(step)
            else:
                bm.free(live.pop(int(rng.integers(len(live)))))
        except NoFreeBlocksError:
            pass
    for s in live:
        bm.free(s)
    assert bm.num_free_gpu_blocks == 64 and bm.num_evictable_gpu_blocks == 0
    bm.check_invariants()


def test_block_ref_count_error_for_foreign_prefix_block():
    bm = BlockManager(BS, 8, enable_caching=True)
    bm.core.allocate(1, 9, [])
    with pytest.raises(BlockRefCountError, match="not in the prefix cache"):
        bm.core.allocate(2, 9, [0])
    with pytest.raises(ValueError, match="at most 7"):
        bm.core.allocate(2, 8, [0, 1])


# --- step journal: what a failed engine step takes back from the prefix cache ---

EARLIER = list(range(100, 108)) + [1]  # 2 full blocks, cached in an earlier step
PROMPT = list(range(100, 108)) + list(range(200, 208)) + [2]  # EARLIER's blocks, then 2 new full blocks


def test_uncache_step_blocks_drops_only_this_steps_blocks(backend):
    bm = make(backend, enable_caching=True)
    bm.begin_step()
    bm.allocate(1, EARLIER)
    bm.begin_step()  # the step that fails
    assert bm.core.step_cached_blocks() == []
    assert bm.allocate(2, PROMPT) == 8  # hits EARLIER's blocks: shared, not newly cached
    table = bm.get_block_table(2)
    assert bm.core.step_cached_blocks() == table[2:4]
    assert bm.num_cached_tokens(PROMPT) == 16
    assert bm.uncache_step_blocks() == 2
    assert bm.core.step_cached_blocks() == []
    assert bm.num_cached_tokens(PROMPT) == 8  # a retry recomputes what the failed step was to write
    assert bm.num_cached_tokens(EARLIER) == 8  # the earlier step's blocks stay
    assert bm.core.num_cached_blocks == 2
    assert bm.uncache_step_blocks() == 0  # the journal is empty now
    assert bm.get_block_table(2) == table  # the sequence keeps its blocks
    bm.check_invariants()


def test_uncached_blocks_are_plain_free_blocks_after_free(backend):
    bm = make(backend, enable_caching=True)
    bm.allocate(1, EARLIER)
    bm.begin_step()
    bm.allocate(2, PROMPT)
    table = bm.get_block_table(2)
    bm.uncache_step_blocks()
    bm.free(2)
    # only EARLIER's blocks are still held (by sequence 1): nothing is evictable
    assert bm.num_evictable_gpu_blocks == 0
    assert bm.core.gpu_free_list()[:3] == table[2:]  # uncached: handed out first
    bm.check_invariants()
    assert bm.allocate(3, PROMPT) == 8
    assert bm.core.num_evictions == 0
    bm.check_invariants()


def test_uncache_step_blocks_of_a_freed_sequence(backend):
    """Blocks of a sequence freed in the failed step are evictable: uncaching makes them plain free blocks."""
    bm = make(backend, enable_caching=True)
    bm.begin_step()
    bm.allocate(1, PROMPT)
    table = bm.get_block_table(1)
    bm.free(1)
    assert bm.num_evictable_gpu_blocks == 4
    assert bm.uncache_step_blocks() == 4
    assert bm.num_evictable_gpu_blocks == 0 and bm.core.num_cached_blocks == 0
    assert bm.num_cached_tokens(PROMPT) == 0 and bm.num_cached_tokens(EARLIER) == 0
    free = bm.core.gpu_free_list()
    assert sorted(free[:5]) == sorted(table) and len(free) == 16
    assert bm.core.num_evictions == 0
    bm.check_invariants()


def test_step_journal_records_blocks_filled_by_appends(backend):
    bm = make(backend, enable_caching=True)
    bm.allocate(1, [5, 6])
    bm.begin_step()
    bm.append_slots(1, 3, token_ids=[7, 8, 9])  # fills block 0
    bm.append_slots_batch([1], 1, token_ids=[[10]])
    assert bm.core.step_cached_blocks() == [bm.get_block_table(1)[0]]
    assert bm.num_cached_tokens([5, 6, 7, 8, 9]) == 4
    assert bm.uncache_step_blocks() == 1
    assert bm.num_cached_tokens([5, 6, 7, 8, 9]) == 0
    bm.check_invariants()


def test_begin_step_and_reset_clear_the_journal(backend):
    bm = make(backend, enable_caching=True)
    bm.begin_step()
    bm.allocate(1, EARLIER)
    bm.begin_step()  # that step succeeded
    assert bm.uncache_step_blocks() == 0 and bm.num_cached_tokens(EARLIER) == 8
    bm.allocate(2, PROMPT)
    assert len(bm.core.step_cached_blocks()) == 2
    bm.reset_prefix_cache()
    assert bm.core.step_cached_blocks() == []
    assert bm.uncache_step_blocks() == 0
    bm.check_invariants()


def test_step_journal_is_a_no_op_without_caching(backend):
    bm = make(backend)
    bm.begin_step()
    bm.allocate(1, 9)
    bm.append_slots(1, 7)
    free_list = bm.core.gpu_free_list()
    assert bm.core.step_cached_blocks() == []
    assert bm.uncache_step_blocks() == 0
    assert bm.core.gpu_free_list() == free_list and bm.get_block_table(1) == [0, 1, 2, 3]
    assert bm.num_evictable_gpu_blocks == 0 and bm.core.num_cached_blocks == 0
    bm.check_invariants()
