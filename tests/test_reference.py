"""pagedkv.reference against torch.nn.functional.scaled_dot_product_attention.

Every kernel test trusts pagedkv.reference, so the reference itself is checked
here against PyTorch's attention on contiguous K/V, with the masks written out
in this file: decode (the query sits at the last position and sees all of
them), causal prefill with a cached prefix (new token i of a sequence with
seq_len tokens sits at seq_len - q_len + i: a bottom-right aligned mask), GQA
(SDPA's enable_gqa: query head h reads kv head h // group), ALiBi as an
additive float mask, and scales other than head_size**-0.5.

The paged cache is built here by plain indexing (not by reference.reshape_and_cache),
from shuffled block ids in a cache with unused random blocks, and the block
table rows are padded with -1 past each sequence's last block. SDPA runs in
float64 on the same (dtype-rounded) values.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pagedkv import reference

# The reference accumulates in fp32 and rounds its output to the query dtype;
# SDPA here runs in fp64. Measured: fp32 |diff| <= 9.5e-7 (summation order;
# atol = rtol = 7e-7 would pass), fp16 <= 9.4e-4 and bf16 <= 7.3e-3 (one ulp of
# the output; 3.1e-4 and 2.4e-3 would pass). Below: about 3x that.
TOLERANCES = {
    torch.float32: {"atol": 2e-6, "rtol": 2e-6},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2},
}
BLOCK_SIZE = 8


def make_paged(gen, seq_lens, num_kv_heads, head_size, dtype, spare_blocks=5):
    """Contiguous K/V per sequence, and the same data in a paged cache.

    Returns (ks, vs, key_cache, value_cache, block_tables, seq_lens tensor).
    """
    blocks_needed = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_needed) + spare_blocks
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_size)
    key_cache = torch.randn(shape, generator=gen).to(dtype)  # unused blocks hold noise, not zeros
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(seq_lens), max(blocks_needed) + 2), -1, dtype=torch.int32)
    ks, vs = [], []
    for s, n in enumerate(seq_lens):
        k = torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype)
        for pos in range(n):
            if pos % BLOCK_SIZE == 0:
                table[s, pos // BLOCK_SIZE] = ids.pop()
            block = int(table[s, pos // BLOCK_SIZE])
            key_cache[block, pos % BLOCK_SIZE] = k[pos]
            value_cache[block, pos % BLOCK_SIZE] = v[pos]
        ks.append(k)
        vs.append(v)
    return ks, vs, key_cache, value_cache, table, torch.tensor(seq_lens, dtype=torch.int32)


def sdpa(q, k, v, scale, attn_mask=None, is_causal=False):
    """q [n, H, d] over k/v [L, H_kv, d] -> [n, H, d], in float64."""
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1)[None], k.double().transpose(0, 1)[None], v.double().transpose(0, 1)[None],
        attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def alibi_slopes(num_heads):
    """The ALiBi paper's geometric slopes 2^(-8 (h+1) / H)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)])


def assert_close(actual, expected, dtype):
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.double(), expected.double(), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa4", "mqa"])
@pytest.mark.parametrize("scale_factor", [1.0, 0.1, 3.0])
def test_decode_matches_sdpa(num_heads, num_kv_heads, dtype, scale_factor):
    gen = torch.Generator().manual_seed(num_heads * 100 + num_kv_heads + int(scale_factor * 10))
    head_size = 64
    seq_lens = [1, 7, BLOCK_SIZE, 2 * BLOCK_SIZE + 3, 0, 45]
    ks, vs, key_cache, value_cache, table, lens = make_paged(gen, seq_lens, num_kv_heads, head_size, dtype)
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=gen).to(dtype)
    scale = scale_factor * head_size**-0.5
    out = reference.paged_attention(query, key_cache, value_cache, table, lens, scale)
    for s, n in enumerate(seq_lens):
        if n == 0:
            assert torch.equal(out[s], torch.zeros_like(out[s])), "a sequence with no tokens gives zeros"
        else:
            assert_close(out[s : s + 1], sdpa(query[s : s + 1], ks[s], vs[s], scale), dtype)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_decode_alibi_matches_sdpa_with_additive_mask(num_heads, num_kv_heads):
    gen = torch.Generator().manual_seed(7 + num_kv_heads)
    head_size = 64
    seq_lens = [1, 13, 40]
    ks, vs, key_cache, value_cache, table, lens = make_paged(gen, seq_lens, num_kv_heads, head_size, torch.float32)
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=gen)
    slopes = alibi_slopes(num_heads)
    scale = 0.3
    out = reference.paged_attention(query, key_cache, value_cache, table, lens, scale, slopes)
    no_alibi = reference.paged_attention(query, key_cache, value_cache, table, lens, scale)
    assert (out[1:] - no_alibi[1:]).abs().max() > 1e-2, "ALiBi must change the result"
    for s, n in enumerate(seq_lens):
        # bias[h, 0, j] = slope_h * (j - (n - 1)): zero on the query's own position, negative before it.
        bias = slopes.double()[:, None, None] * (torch.arange(n).double() - (n - 1))[None, None, :]
        assert_close(out[s : s + 1], sdpa(query[s : s + 1], ks[s], vs[s], scale, attn_mask=bias), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3)], ids=["mha", "gqa3"])
def test_prefill_with_cached_prefix_matches_sdpa(num_heads, num_kv_heads, dtype):
    gen = torch.Generator().manual_seed(31 * num_heads + num_kv_heads)
    head_size = 80
    # (q_len, seq_len): whole prompts, chunks after a cached prefix, one token, none.
    q_lens, seq_lens = [5, 3, 1, 0, 16, 17], [5, 20, 9, 4, 40, 17]
    ks, vs, key_cache, value_cache, table, lens = make_paged(gen, seq_lens, num_kv_heads, head_size, dtype)
    query = torch.randn(sum(q_lens), num_heads, head_size, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = 0.07
    out = reference.paged_prefill_attention(query, key_cache, value_cache, table, query_start_loc, lens, scale)
    assert out.shape == query.shape
    for s, (q_len, n) in enumerate(zip(q_lens, seq_lens, strict=True)):
        if q_len == 0:
            continue
        rows = slice(int(query_start_loc[s]), int(query_start_loc[s + 1]))
        query_pos = torch.arange(n - q_len, n)
        visible = torch.arange(n)[None, :] <= query_pos[:, None]  # [q_len, n], bottom-right aligned
        expected = sdpa(query[rows], ks[s], vs[s], scale, attn_mask=visible)
        assert_close(out[rows], expected, dtype)
        if q_len == n:  # a whole prompt: PyTorch's own causal mask agrees
            assert_close(out[rows], sdpa(query[rows], ks[s], vs[s], scale, is_causal=True), dtype)
        if q_len < n:  # the cached prefix is attended to: dropping it changes the result
            alone = sdpa(query[rows], ks[s][n - q_len:], vs[s][n - q_len:], scale, is_causal=True)
            assert (out[rows].double() - alone).abs().max() > 0.05



def naive_attention(q, k, v, scale, query_pos, sliding_window=0, soft_cap=0.0, slopes=None):
    """Dense masked softmax attention written out in float64, one query row at a time:
    q [n, H, d] at positions query_pos over keys 0..L-1 (k/v [L, H_kv, d]). Key j is visible
    to a query at p when j <= p and, with a window W, j > p - W; soft cap c: c * tanh(s / c),
    then ALiBi slope * (j - p)."""
    num_heads, group = q.shape[1], q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, p in enumerate(query_pos.tolist()):
        for h in range(num_heads):
            scores = (k[:, h // group].double() @ q[i, h].double()) * scale  # [L]
            if soft_cap > 0:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            j = torch.arange(k.shape[0])
            if slopes is not None:
                scores = scores + slopes[h].double() * (j - p)
            visible = (j <= p) & ((j > p - sliding_window) if sliding_window > 0 else True)
            weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=0)
            out[i, h] = weights @ v[:, h // group].double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,soft_cap", [(1, 0.0), (5, 0.0), (8, 2.0), (11, 0.0), (0, 1.5), (30, 4.0), (500, 0.0)])
def test_decode_window_and_soft_cap_match_naive_attention(window, soft_cap, dtype):
    gen = torch.Generator().manual_seed(window * 10 + int(soft_cap * 3))
    num_heads, num_kv_heads, head_size = 6, 2, 64
    seq_lens = [1, 7, BLOCK_SIZE, 2 * BLOCK_SIZE + 3, 0, 45]
    ks, vs, key_cache, value_cache, table, lens = make_paged(gen, seq_lens, num_kv_heads, head_size, dtype)
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=gen).to(dtype)
    slopes = alibi_slopes(num_heads)
    scale = 0.4  # logits of magnitude ~3: the caps above bite
    out = reference.paged_attention(query, key_cache, value_cache, table, lens, scale, slopes, window, soft_cap)
    for s, n in enumerate(seq_lens):
        if n == 0:
            assert torch.equal(out[s], torch.zeros_like(out[s]))
            continue
        expected = naive_attention(query[s : s + 1], ks[s], vs[s], scale, torch.tensor([n - 1]), window, soft_cap,
                                   slopes)
        assert_close(out[s : s + 1], expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,soft_cap", [(1, 0.0), (4, 3.0), (8, 0.0), (13, 0.0), (0, 2.0), (100, 1.0)])
def test_prefill_window_and_soft_cap_match_naive_attention(window, soft_cap, dtype):
    gen = torch.Generator().manual_seed(window * 7 + int(soft_cap * 5))
    num_heads, num_kv_heads, head_size = 9, 3, 64
    q_lens, seq_lens = [5, 3, 1, 0, 16, 17], [5, 20, 9, 4, 40, 17]
    ks, vs, key_cache, value_cache, table, lens = make_paged(gen, seq_lens, num_kv_heads, head_size, dtype)
    query = torch.randn(sum(q_lens), num_heads, head_size, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = 0.3
    out = reference.paged_prefill_attention(query, key_cache, value_cache, table, query_start_loc, lens, scale,
                                            window, soft_cap)
    for s, (q_len, n) in enumerate(zip(q_lens, seq_lens, strict=True)):
        if q_len == 0:
            continue
        rows = slice(int(query_start_loc[s]), int(query_start_loc[s + 1]))
        expected = naive_attention(query[rows], ks[s], vs[s], scale, torch.arange(n - q_len, n), window, soft_cap)
        assert_close(out[rows], expected, dtype)


def test_window_reference_skips_blocks_before_the_window():
    """The reference gathers only the blocks its queries' windows reach: NaN and -1 entries before them are harmless."""
    gen = torch.Generator().manual_seed(3)
    seq_lens = [40]
    ks, vs, key_cache, value_cache, table, lens = make_paged(gen, seq_lens, 2, 64, torch.float32)
    query = torch.randn(1, 4, 64, generator=gen)
    clean = reference.paged_attention(query, key_cache, value_cache, table, lens, 0.2, None, 10)
    for b in range(30 // BLOCK_SIZE):  # keys 30..39 are the window; blocks 0-2 lie wholly before it
        key_cache[int(table[0, b])] = float("nan")
        value_cache[int(table[0, b])] = float("nan")
        table[0, b] = -1
    out = reference.paged_attention(query, key_cache, value_cache, table, lens, 0.2, None, 10)
    assert torch.equal(out, clean)
