"""The runtime toggle of the ops' index-value checks, and the host-side metadata validators.

The toggle is process-wide; every test that changes it restores it (the
`index_checks` context manager, or the fixture below).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from pagedkv import ops


@pytest.fixture(autouse=True)
def _restore_checks():
    previous = ops.index_checks_enabled()
    yield
    ops.set_index_checks(previous)


# ---- the toggle -----------------------------------------------------------------------------------


def test_set_index_checks_returns_previous_value():
    ops.set_index_checks(True)
    assert ops.set_index_checks(False) is True
    assert ops.index_checks_enabled() is False
    assert ops.set_index_checks(True) is False
    assert ops.index_checks_enabled() is True


def test_context_manager_restores_even_on_error():
    ops.set_index_checks(True)
    with pytest.raises(KeyError), ops.index_checks(False):
        assert not ops.index_checks_enabled()
        raise KeyError("boom")
    assert ops.index_checks_enabled()


def test_env_var_sets_the_initial_value():
    code = "import pagedkv; print(pagedkv.ops.index_checks_enabled())"
    for value, expected in (("1", "False"), ("0", "True")):
        env = dict(os.environ, PAGEDKV_SKIP_INDEX_CHECKS=value)
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                                check=False)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip().splitlines()[-1] == expected


def _decode_inputs():
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(2, 2, 64, generator=gen)
    key_cache = torch.randn(4, 16, 1, 64, generator=gen)
    value_cache = torch.randn(4, 16, 1, 64, generator=gen)
    block_tables = torch.tensor([[3, 0], [1, 2]], dtype=torch.int32)
    seq_lens = torch.tensor([5, 20], dtype=torch.int32)
    return query, key_cache, value_cache, block_tables, seq_lens, 1.0 / math.sqrt(64)


def test_checks_off_skip_the_value_scan_on_cpu_tensors_too():
    """seq_lens above max_seq_len (but inside the table, so harmless) is refused only with the checks on."""
    q, kc, vc, bt, lens, scale = _decode_inputs()
    out = torch.empty_like(q)
    with ops.index_checks(True), pytest.raises(RuntimeError, match=r"seq_lens\[1\] = 20 exceeds max_seq_len = 16"):
        ops.paged_attention_v1(out, q, kc, vc, bt, lens, scale, 16)
    with ops.index_checks(False):
        ops.paged_attention_v1(out, q, kc, vc, bt, lens, scale, 16)
    from pagedkv import reference

    torch.testing.assert_close(out, reference.paged_attention(q, kc, vc, bt, lens, scale), atol=1e-4, rtol=1e-4)


def test_checks_off_keep_shape_and_dtype_checks():
    q, kc, vc, bt, lens, scale = _decode_inputs()
    with ops.index_checks(False), pytest.raises(RuntimeError, match=r"seq_lens must be Int, got Long"):
        ops.paged_attention(q, kc, vc, bt, lens.long(), scale, max_seq_len=20)


def test_checks_off_slot_mapping_scan_is_skipped():
    key = torch.randn(2, 1, 64)
    cache = torch.zeros(4, 16, 1, 64)
    with ops.index_checks(True), pytest.raises(RuntimeError, match=r"slot_mapping\[1\] = 64 is outside the cache"):
        ops.reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([0, 64]))


# ---- validate_decode_metadata ---------------------------------------------------------------------


def _good_decode():
    return np.array([[3, 0], [1, 2]], dtype=np.int32), np.array([5, 20], dtype=np.int32)


def test_valid_decode_metadata_passes_numpy_and_torch():
    tables, lens = _good_decode()
    ops.validate_decode_metadata(tables, lens, num_blocks=4, block_size=16, max_seq_len=20,
                                 slot_mapping=np.array([4, -1], dtype=np.int64))
    ops.validate_decode_metadata(torch.from_numpy(tables), torch.from_numpy(lens), num_blocks=4, block_size=16)


def test_unused_table_entries_may_hold_anything():
    """A 5-token sequence uses one block: the padding after it is never read."""
    tables = np.array([[3, -1], [1, 2]], dtype=np.int32)
    ops.validate_decode_metadata(tables, np.array([5, 20], dtype=np.int32), num_blocks=4, block_size=16)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda t, s: s.__setitem__(1, -3), r"seq_lens\[1\] = -3 is negative"),
        (lambda t, s: s.__setitem__(0, 33), r"seq_lens\[0\] = 33 needs more blocks than block_tables holds "
                                            r"\(2 blocks x block_size 16 = 32 tokens\)"),
        (lambda t, s: t.__setitem__((1, 1), 4), r"block_tables\[1\]\[1\] = 4 is outside the cache \(num_blocks = 4\)"),
        (lambda t, s: t.__setitem__((0, 0), -1), r"block_tables\[0\]\[0\] = -1 is outside the cache"),
    ],
)
def test_bad_decode_metadata_names_field_index_and_value(edit, message):
    tables, lens = _good_decode()
    edit(tables, lens)
    with pytest.raises(ValueError, match=message):
        ops.validate_decode_metadata(tables, lens, num_blocks=4, block_size=16)


def test_seq_len_above_max_seq_len():
    tables, lens = _good_decode()
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 20 exceeds max_seq_len = 19"):
        ops.validate_decode_metadata(tables, lens, num_blocks=4, block_size=16, max_seq_len=19)


def test_bad_slot_mapping():
    tables, lens = _good_decode()
    message = r"slot_mapping\[2\] = 64 is outside the cache \(num_blocks \* block_size = 64\)"
    with pytest.raises(ValueError, match=message):
        ops.validate_decode_metadata(tables, lens, num_blocks=4, block_size=16,
                                     slot_mapping=np.array([0, -1, 64], dtype=np.int64))


@pytest.mark.parametrize(
    "tables,lens,message",
    [
        (np.zeros((2, 2), dtype=np.int32), np.zeros(3, dtype=np.int32), r"block_tables has 2 rows but seq_lens has 3"),
        (np.zeros(4, dtype=np.int32), np.zeros(4, dtype=np.int32), r"block_tables must be 2-D, got shape \(4,\)"),
        (np.zeros((1, 2), dtype=np.float32), np.zeros(1, dtype=np.int32), r"block_tables must hold integers"),
    ],
)
def test_malformed_decode_metadata(tables, lens, message):
    with pytest.raises(ValueError, match=message):
        ops.validate_decode_metadata(tables, lens, num_blocks=4, block_size=16)


def test_device_tensors_are_refused():
    tables, lens = _good_decode()
    with pytest.raises(ValueError, match=r"block_tables must be on the CPU"):
        ops.validate_decode_metadata(torch.from_numpy(tables).to("meta"), lens, num_blocks=4, block_size=16)


# ---- validate_prefill_metadata --------------------------------------------------------------------


def _good_prefill():
    tables = np.array([[3, 0], [1, 2]], dtype=np.int32)
    lens = np.array([5, 20], dtype=np.int32)
    qsl = np.array([0, 5, 9], dtype=np.int32)  # 5 new tokens, then 4 (16 cached)
    return tables, lens, qsl


def test_valid_prefill_metadata_passes():
    tables, lens, qsl = _good_prefill()
    ops.validate_prefill_metadata(tables, lens, qsl, num_blocks=4, block_size=16, num_tokens=9, max_query_len=5,
                                  max_seq_len=20, slot_mapping=np.arange(9))


@pytest.mark.parametrize(
    "qsl,kwargs,message",
    [
        ([1, 5, 9], {}, r"query_start_loc\[0\] must be 0, got 1"),
        ([0, 5, 8], {}, r"query_start_loc\[-1\] = 8 must equal the number of query tokens 9"),
        ([0, 10, 9], {}, r"non-decreasing: query_start_loc\[1\] = 10, query_start_loc\[2\] = 9"),
        ([0, 5, 9], {"max_query_len": 4}, r"sequence 0 has 5 query tokens .* more than max_query_len = 4"),
        ([0, 6, 9], {}, r"sequence 0 has 6 query tokens but seq_lens\[0\] = 5"),
        ([0, 5], {}, r"query_start_loc must have num_seqs\+1=3 entries, got 2"),
    ],
)
def test_bad_query_start_loc(qsl, kwargs, message):
    tables, lens, _ = _good_prefill()
    with pytest.raises(ValueError, match=message):
        ops.validate_prefill_metadata(tables, lens, np.array(qsl, dtype=np.int32), num_blocks=4, block_size=16,
                                      num_tokens=9, **kwargs)


def test_prefill_checks_the_tables_and_slot_count():
    tables, lens, qsl = _good_prefill()
    tables[1, 1] = 9
    with pytest.raises(ValueError, match=r"block_tables\[1\]\[1\] = 9 is outside the cache"):
        ops.validate_prefill_metadata(tables, lens, qsl, num_blocks=4, block_size=16, num_tokens=9)
    tables, lens, qsl = _good_prefill()
    with pytest.raises(ValueError, match=r"slot_mapping has 8 entries but the batch has 9 tokens"):
        ops.validate_prefill_metadata(tables, lens, qsl, num_blocks=4, block_size=16, num_tokens=9,
                                      slot_mapping=np.arange(8))


def test_validator_agrees_with_the_op_checks():
    """A table the validator refuses is one the op (checks on) refuses, with the same field and index."""
    q, kc, vc, bt, lens, scale = _decode_inputs()
    bt[1, 1] = 7
    with pytest.raises(ValueError, match=r"block_tables\[1\]\[1\] = 7"):
        ops.validate_decode_metadata(bt, lens, num_blocks=4, block_size=16)
    with ops.index_checks(True), pytest.raises(RuntimeError, match=r"block_tables\[1\]\[1\] = 7"):
        ops.paged_attention(q, kc, vc, bt, lens, scale, max_seq_len=20)


# ---- sliding window: entries of blocks wholly before the window are not in use ------------------


def test_window_skips_the_blocks_before_it_in_decode():
    """seq_len 40, block 8, window 10: keys 30..39, so blocks 0-2 (keys 0..23) are never read."""
    tables = np.array([[-1, 99, -5, 1, 2, 3]], dtype=np.int32)
    lens = np.array([40], dtype=np.int32)
    ops.validate_decode_metadata(tables, lens, num_blocks=4, block_size=8, sliding_window=10)
    # Block 3 (keys 24..31) holds keys 30 and 31 of the window: it is checked.
    tables[0, 3] = -1
    with pytest.raises(ValueError, match=r"block_tables\[0\]\[3\] = -1 is outside the cache"):
        ops.validate_decode_metadata(tables, lens, num_blocks=4, block_size=8, sliding_window=10)
    tables[0, 3] = 1
    with pytest.raises(ValueError, match=r"block_tables\[0\]\[0\] = -1 is outside the cache"):
        ops.validate_decode_metadata(tables, lens, num_blocks=4, block_size=8)  # no window: all in use
    with pytest.raises(ValueError, match=r"sliding_window must be >= 0 \(0: no window\), got -2"):
        ops.validate_decode_metadata(tables, lens, num_blocks=4, block_size=8, sliding_window=-2)


def test_window_skips_the_blocks_before_the_first_new_token_in_prefill():
    """seq_len 40 with 6 new tokens (positions 34..39), window 10: the first sees keys 25..34, so
    blocks 0-2 are unused; a window of 12 reaches key 23 in block 2."""
    tables = np.array([[-1, 99, -5, 1, 2, 3]], dtype=np.int32)
    lens, qsl = np.array([40], dtype=np.int32), np.array([0, 6], dtype=np.int32)
    ops.validate_prefill_metadata(tables, lens, qsl, num_blocks=4, block_size=8, num_tokens=6, sliding_window=10)
    with pytest.raises(ValueError, match=r"block_tables\[0\]\[2\] = -5 is outside the cache"):
        ops.validate_prefill_metadata(tables, lens, qsl, num_blocks=4, block_size=8, num_tokens=6,
                                      sliding_window=12)


def test_window_validator_agrees_with_the_op_checks():
    """The op (checks on) skips exactly the entries the validator skips, for decode and prefill."""
    gen = torch.Generator().manual_seed(5)
    kc, vc = torch.randn(8, 8, 2, 64, generator=gen), torch.randn(8, 8, 2, 64, generator=gen)
    tables = torch.tensor([[-1, 99, -5, 1, 2, 3]], dtype=torch.int32)
    lens = torch.tensor([40], dtype=torch.int32)
    q = torch.randn(1, 4, 64, generator=gen)
    with ops.index_checks(True):
        ops.paged_attention(q, kc, vc, tables, lens, 0.1, max_seq_len=40, sliding_window=10)
        tables[0, 3] = -1
        with pytest.raises(RuntimeError, match=r"block_tables\[0\]\[3\] = -1 is outside the cache"):
            ops.paged_attention(q, kc, vc, tables, lens, 0.1, max_seq_len=40, sliding_window=10)
        tables[0, 3] = 1
        qp = torch.randn(6, 4, 64, generator=gen)
        qsl = torch.tensor([0, 6], dtype=torch.int32)
        out = torch.empty_like(qp)
        ops.paged_prefill_attention(out, qp, kc, vc, tables, qsl, lens, 0.1, 6, 40, sliding_window=10)
        with pytest.raises(RuntimeError, match=r"block_tables\[0\]\[2\] = -5 is outside the cache"):
            ops.paged_prefill_attention(out, qp, kc, vc, tables, qsl, lens, 0.1, 6, 40, sliding_window=12)


# ---- the limits: each edge the cache can hold passes, one step past it is refused --------------


def test_every_decode_limit_is_inclusive():
    """seq_len 0, seq_len == max_seq_len == the table's capacity, block ids 0 and num_blocks - 1 in use,
    the last slot: all valid."""
    tables = np.array([[0, 3, 1], [2, -7, 5]], dtype=np.int32)  # 2 rows x 3 columns: capacity 48 tokens
    lens = np.array([48, 0], dtype=np.int32)  # the empty sequence reads no block
    ops.validate_decode_metadata(tables, lens, num_blocks=4, block_size=16, max_seq_len=48,
                                 slot_mapping=np.array([63, -1], dtype=np.int64))
    ops.validate_decode_metadata(np.zeros((1, 1), dtype=np.int32), np.array([1]), num_blocks=1, block_size=1)
    lens[0] = 49
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 49 exceeds max_seq_len = 48"):
        ops.validate_decode_metadata(tables, lens, num_blocks=4, block_size=16, max_seq_len=48)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 49 needs more blocks than block_tables holds "
                                         r"\(3 blocks x block_size 16 = 48 tokens\)"):
        ops.validate_decode_metadata(tables, lens, num_blocks=4, block_size=16)


def test_the_first_bad_entry_is_named_after_good_ones_at_the_edge():
    """Entries right at a limit come before the bad one: the message names the bad one's index."""
    tables = np.zeros((3, 2), dtype=np.int32)
    for lens, message in (([0, 0, -1], r"seq_lens\[2\] = -1 is negative"),
                          ([32, 33, 1], r"seq_lens\[1\] = 33 needs more blocks"),
                          ([20, 21, 1], r"seq_lens\[1\] = 21 exceeds max_seq_len = 20")):
        with pytest.raises(ValueError, match=message):
            ops.validate_decode_metadata(tables, np.array(lens), num_blocks=4, block_size=16, max_seq_len=20
                                         if "max_seq_len" in message else None)


def test_a_single_sequence_batch_is_checked():
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = -1 is negative"):
        ops.validate_decode_metadata(np.zeros((1, 2), dtype=np.int32), np.array([-1]), num_blocks=4, block_size=16)


@pytest.mark.parametrize("num_blocks,block_size", [(0, 16), (4, 0), (-1, 16), (4, -16)])
def test_an_empty_cache_or_block_is_refused(num_blocks, block_size):
    tables, lens = _good_decode()
    with pytest.raises(ValueError, match=rf"num_blocks and block_size must be positive, got {num_blocks} and "
                                         rf"{block_size}"):
        ops.validate_decode_metadata(tables, lens, num_blocks=num_blocks, block_size=block_size)


@pytest.mark.parametrize("seq_len,used", [(16, 1), (17, 2), (32, 2)])
def test_blocks_in_use_are_exactly_ceil_seq_len_over_block_size(seq_len, used):
    """The block holding the last token is checked (even with one token in it); the next one is not."""
    tables = np.array([[1, 2, 3]], dtype=np.int32)
    tables[0, used:] = -1  # padding
    ops.validate_decode_metadata(tables, np.array([seq_len]), num_blocks=4, block_size=16)
    tables[0, used - 1] = 4
    with pytest.raises(ValueError, match=rf"block_tables\[0\]\[{used - 1}\] = 4 is outside the cache"):
        ops.validate_decode_metadata(tables, np.array([seq_len]), num_blocks=4, block_size=16)


def test_a_window_starting_on_a_block_boundary_leaves_the_block_before_it_unread():
    """seq_len 40, block 8, window 8: keys 32..39, all in block 4; block 3 (keys 24..31) is unread.
    Window 1 (the last key alone) likewise reads block 4 only; with block size 1 a window of 40
    reads block 0 too."""
    tables = np.array([[-1, -1, -1, -1, 2]], dtype=np.int32)
    lens = np.array([40], dtype=np.int32)
    for window in (8, 1):
        ops.validate_decode_metadata(tables, lens, num_blocks=4, block_size=8, sliding_window=window)
    with pytest.raises(ValueError, match=r"block_tables\[0\]\[3\] = -1"):
        ops.validate_decode_metadata(tables, lens, num_blocks=4, block_size=8, sliding_window=9)
    ones = np.full((1, 40), 3, dtype=np.int32)
    ones[0, 0] = -1
    with pytest.raises(ValueError, match=r"block_tables\[0\]\[0\] = -1"):
        ops.validate_decode_metadata(ones, lens, num_blocks=4, block_size=1, sliding_window=40)
    ops.validate_decode_metadata(ones, lens, num_blocks=4, block_size=1, sliding_window=39)


def test_a_prefill_sequence_without_new_tokens_under_a_window():
    """q_len 0 (a sequence in the batch with nothing new): its window is counted from position seq_len,
    as the op's check counts it, so a window of 9 from position 40 starts at key 32 (block 4)."""
    tables = np.array([[-1, -1, -1, -1, 2], [0, 0, 0, 0, 0]], dtype=np.int32)
    lens = np.array([40, 1], dtype=np.int32)
    qsl = np.array([0, 0, 1], dtype=np.int32)
    ops.validate_prefill_metadata(tables, lens, qsl, num_blocks=4, block_size=8, num_tokens=1, sliding_window=9)
    with pytest.raises(ValueError, match=r"block_tables\[0\]\[3\] = -1"):
        ops.validate_prefill_metadata(tables, lens, qsl, num_blocks=4, block_size=8, num_tokens=1,
                                      sliding_window=10)


def test_prefill_without_a_window_checks_every_block_in_use():
    tables, lens, qsl = _good_prefill()
    tables[1, 0] = -2  # sequence 1's first block: its 16 cached tokens
    with pytest.raises(ValueError, match=r"block_tables\[1\]\[0\] = -2 is outside the cache"):
        ops.validate_prefill_metadata(tables, lens, qsl, num_blocks=4, block_size=16, num_tokens=9)


def test_every_prefill_limit_is_inclusive():
    """q_len 0, q_len == max_query_len, q_len == seq_len: valid; the first bad sequence is the one named."""
    tables = np.array([[3, 0], [1, 2], [0, 0]], dtype=np.int32)
    lens = np.array([5, 20, 4], dtype=np.int32)
    ops.validate_prefill_metadata(tables, lens, np.array([0, 5, 5, 9]), num_blocks=4, block_size=16, num_tokens=9,
                                  max_query_len=5)
    with pytest.raises(ValueError, match=r"query_start_loc\[2\] = 6, query_start_loc\[3\] = 5"):
        ops.validate_prefill_metadata(tables, lens, np.array([0, 0, 6, 5]), num_blocks=4, block_size=16,
                                      num_tokens=5)
    with pytest.raises(ValueError, match=r"sequence 1 has 6 query tokens .* more than max_query_len = 5"):
        ops.validate_prefill_metadata(tables, lens, np.array([0, 5, 11, 11]), num_blocks=4, block_size=16,
                                      num_tokens=11, max_query_len=5)
    with pytest.raises(ValueError, match=r"sequence 2 has 5 query tokens but seq_lens\[2\] = 4"):
        ops.validate_prefill_metadata(tables, lens, np.array([0, 5, 5, 10]), num_blocks=4, block_size=16,
                                      num_tokens=10)
