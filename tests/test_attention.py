"""CPU attention kernels (decode v1/v2, the allocating op, prefill) against pagedkv.reference.

Every case draws fresh random inputs from a generator seeded by the case's own
parameters, so cases differ from each other but each one is reproducible.
Block tables hold shuffled ids from a cache with many more blocks than used.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import pagedkv
import pytest
import torch
from pagedkv import ops, reference

# Kernel vs reference, both accumulating in fp32: fp32 differs by summation order
# only; fp16/bf16 outputs (and v2's tmp_out, kept in the query dtype like vLLM)
# are rounded to the dtype, which costs up to ~1 ulp of values of magnitude ~1-3.
# Measured over this file (every CPU kernel variant): the largest error is one
# ulp (fp16 |diff| <= 9.8e-4, bf16 <= 1.6e-2 at |out| in [2, 4)), so that
# atol = rtol = 4.9e-4 (fp16) or 4.8e-3 (bf16) would just pass; fp32 needs
# 3.6e-6. fp16/bf16 below are twice the need (about two ulps near 1): an fp16
# accumulation or a lost fp32 step fails.
TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-4},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2},
}
DTYPES = list(TOLERANCES)
HEAD_SIZES = [64, 80, 96, 112, 128, 256]
BLOCK_SIZES = [8, 16, 32]


HAS_AVX512_BF16 = ops.cpu_capability_runs("avx512_bf16")
# What the bf16 cases compare the avx512_bf16 kernels with: the variant this process
# started with (PAGEDKV_CPU_CAPABILITY, else the best), or avx512 where that is avx512_bf16.
OLDER_VARIANT = "avx512" if ops.cpu_capability() == "avx512_bf16" else ops.cpu_capability()


AMX_RUNS = ops.cpu_amx_runs()


def use_amx(on: bool):
    """Turns the AMX tiles on or off where the CPU has them; returns what to restore (None: nothing)."""
    return ops.set_cpu_amx(on) if AMX_RUNS else None


def restore_amx(previous) -> None:
    if previous is not None:
        ops.set_cpu_amx(previous)


def skip_unless_amx_case(request) -> None:
    """The "amx" case: the avx512_bf16 kernels with bf16 prefill on AMX tiles (csrc/cpu/attention_amx.cpp)."""
    if not AMX_RUNS:
        pytest.skip("this CPU (or kernel) has no AMX-BF16 tiles")
    if "prefill" not in request.node.name:
        pytest.skip("AMX tiles change bf16 prefill only; the avx512_bf16 case runs this")


@pytest.fixture(params=["avx512_bf16", "bf16_fma", "amx", "older"])
def cpu_variant(request):
    """Runs a test under the avx512_bf16 kernels (bf16 Q.K^T on vdpbf16ps), under them with decode's
    bf16 Q.K^T on fp32 FMAs ("bf16_fma": cpu_bf16_dot off, as on CPUs where vdpbf16ps is slow), under
    them with bf16 prefill on AMX tiles ("amx"), and under OLDER_VARIANT.

    avx512_bf16 changes the bf16 kernels only (fp32/fp16 run the avx512 ones there),
    so its fp32/fp16 cases are skipped: the "older" case runs them.
    """
    if request.param in ("avx512_bf16", "bf16_fma", "amx"):
        if not HAS_AVX512_BF16:
            pytest.skip("this CPU lacks avx512_bf16 (vdpbf16ps)")
        dtype = request.node.callspec.params.get("dtype", torch.bfloat16)
        if dtype != torch.bfloat16:
            pytest.skip("avx512_bf16 changes the bf16 kernels only; the 'older' case runs this dtype")
    if request.param == "amx":
        skip_unless_amx_case(request)
    if request.param == "bf16_fma" and "decode" not in request.node.name:
        pytest.skip("cpu_bf16_dot changes decode only; the avx512_bf16 case runs this")
    name = OLDER_VARIANT if request.param == "older" else "avx512_bf16"
    previous = ops.set_cpu_capability(name)
    previous_amx = use_amx(request.param == "amx")
    previous_dot = ops.set_cpu_bf16_dot(request.param != "bf16_fma")
    yield request.param
    ops.set_cpu_bf16_dot(previous_dot)
    restore_amx(previous_amx)
    ops.set_cpu_capability(previous)


def make_generator(*case) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))


def make_kv_cache(gen, num_blocks, block_size, num_kv_heads, head_size, dtype):
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    return key_cache, value_cache


def draw_scale(gen, head_size):
    """head_size**-0.5 times a random factor in [0.5, 2): a kernel that ignores `scale` fails."""
    return head_size**-0.5 * (0.5 + 1.5 * torch.rand((), generator=gen).item())


def make_block_tables(gen, seq_lens, block_size, spare_blocks=64):
    """Shuffled, non-contiguous block ids; unused table entries hold -1 (never read)."""
    blocks_needed = [(n + block_size - 1) // block_size for n in seq_lens]
    max_blocks = max(max(blocks_needed), 1) + 2
    num_blocks = sum(blocks_needed) + spare_blocks
    ids = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks_needed):
        table[s, :n] = ids[used : used + n].int()
        used += n
    return table, num_blocks


class DecodeCase:
    """Random decode inputs: one query token per sequence."""

    def __init__(self, gen, dtype, num_heads, num_kv_heads, head_size, block_size, seq_lens, alibi=False,
                 query_padding=0):
        self.seq_lens_list = list(seq_lens)
        self.block_tables, num_blocks = make_block_tables(gen, seq_lens, block_size)
        self.key_cache, self.value_cache = make_kv_cache(gen, num_blocks, block_size, num_kv_heads, head_size, dtype)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        num_seqs = len(seq_lens)
        # query_padding > 0: query is a slice of a wider tensor (stride(0) > num_heads * head_size).
        wide = torch.randn(num_seqs, num_heads + query_padding, head_size, generator=gen).to(dtype)
        self.query = wide[:, query_padding:]
        self.max_seq_len = max(seq_lens)
        self.alibi_slopes = torch.rand(num_heads, generator=gen) * 0.5 if alibi else None
        self.scale = draw_scale(gen, head_size)
        self.sliding_window, self.logits_soft_cap = 0, 0.0  # off unless a test sets them

    def reference(self):
        return reference.paged_attention(self.query, self.key_cache, self.value_cache, self.block_tables,
                                         self.seq_lens, self.scale, self.alibi_slopes, self.sliding_window,
                                         self.logits_soft_cap)

    def run_v1(self, out=None):
        # NaN-filled: every row the kernel leaves unwritten shows (seq_len 0 must give zeros).
        out = torch.full_like(self.query, float("nan"), memory_format=torch.contiguous_format) if out is None else out
        ops.paged_attention_v1(out, self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                               self.scale, self.max_seq_len, self.alibi_slopes, sliding_window=self.sliding_window,
                               logits_soft_cap=self.logits_soft_cap)
        return out

    def run_v2(self, partition_size, extra_partitions=0):
        num_seqs, num_heads, head_size = self.query.shape
        parts = (self.max_seq_len + partition_size - 1) // partition_size + extra_partitions
        # NaN-filled scratch: anything the kernel does not write must not reach the output.
        exp_sums = torch.full((num_seqs, num_heads, parts), float("nan"))
        max_logits = torch.full_like(exp_sums, float("nan"))
        tmp_out = torch.full((num_seqs, num_heads, parts, head_size), float("nan")).to(self.query.dtype)
        out = torch.full_like(self.query, float("nan"), memory_format=torch.contiguous_format)
        ops.paged_attention_v2(out, exp_sums, max_logits, tmp_out, self.query, self.key_cache, self.value_cache,
                               self.block_tables, self.seq_lens, self.scale, self.max_seq_len, self.alibi_slopes,
                               partition_size, sliding_window=self.sliding_window,
                               logits_soft_cap=self.logits_soft_cap)
        return out


def assert_close(actual, expected, dtype):
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[dtype])


# ---- decode -----------------------------------------------------------------------


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_v1_every_dtype_head_size_block_size(dtype, head_size, block_size, cpu_variant):
    gen = make_generator("v1", dtype, head_size, block_size)
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 0]
    case = DecodeCase(gen, dtype, num_heads=8, num_kv_heads=2, head_size=head_size, block_size=block_size,
                      seq_lens=seq_lens)
    out = case.run_v1()  # NaN-filled before the call
    assert_close(out, case.reference(), dtype)
    assert torch.equal(out[-1], torch.zeros_like(out[-1])), "seq_len 0 must give zeros"


@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads",
    [(4, 4), (9, 3), (8, 2), (16, 2), (8, 1)],
    ids=["mha", "gqa3", "gqa4", "gqa8", "mqa"],
)
def test_decode_gqa_ratios_and_alibi(num_heads, num_kv_heads, dtype, alibi, cpu_variant):
    gen = make_generator("gqa", num_heads, num_kv_heads, dtype, alibi)
    seq_lens = [1, 15, 16, 17, 200, 613]
    case = DecodeCase(gen, dtype, num_heads, num_kv_heads, head_size=64, block_size=16, seq_lens=seq_lens,
                      alibi=alibi)
    expected = case.reference()
    assert_close(case.run_v1(), expected, dtype)
    assert_close(case.run_v2(partition_size=256), expected, dtype)


@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("partition_size", [256, 512])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_v2_spanning_partitions(dtype, partition_size, alibi, cpu_variant):
    gen = make_generator("v2", dtype, partition_size, alibi)
    p = partition_size
    seq_lens = [1, p - 1, p, p + 1, 2 * p + 37, 3 * p + 200, 0]
    case = DecodeCase(gen, dtype, num_heads=8, num_kv_heads=2, head_size=128, block_size=16, seq_lens=seq_lens,
                      alibi=alibi)
    expected = case.reference()
    out_v2 = case.run_v2(partition_size, extra_partitions=2)
    assert_close(out_v2, expected, dtype)
    assert_close(out_v2, case.run_v1(), dtype)


@pytest.mark.parametrize(
    "dtype,head_size,block_size",
    [(torch.float32, 128, 16), (torch.bfloat16, 128, 32), (torch.float16, 64, 8), (torch.bfloat16, 256, 16)],
)
def test_decode_long_context(dtype, head_size, block_size, cpu_variant):
    gen = make_generator("long", dtype, head_size, block_size)
    case = DecodeCase(gen, dtype, num_heads=8, num_kv_heads=2, head_size=head_size, block_size=block_size,
                      seq_lens=[4096, 2999, 1025], alibi=True)
    expected = case.reference()
    assert_close(case.run_v1(), expected, dtype)
    assert_close(case.run_v2(512), expected, dtype)
    assert_close(case.run_v2(1024), expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_large_batch(dtype, cpu_variant):
    """Many sequences: each task then covers several (or all) kv heads of a sequence."""
    gen = make_generator("batch", dtype)
    seq_lens = torch.randint(0, 300, (33,), generator=gen).tolist()
    case = DecodeCase(gen, dtype, num_heads=16, num_kv_heads=8, head_size=64, block_size=16, seq_lens=seq_lens,
                      alibi=True)
    expected = case.reference()
    assert_close(case.run_v1(), expected, dtype)
    assert_close(case.run_v2(256), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_non_contiguous_query_and_out(dtype, cpu_variant):
    gen = make_generator("strided", dtype)
    case = DecodeCase(gen, dtype, num_heads=6, num_kv_heads=2, head_size=96, block_size=16,
                      seq_lens=[5, 300, 77], query_padding=3)
    assert not case.query.is_contiguous()
    expected = case.reference()
    wide_out = torch.zeros(3, 9, 96, dtype=dtype)
    out = wide_out[:, 2:8]  # stride(0) = 9 * 96
    case.run_v1(out)
    assert_close(out, expected, dtype)
    assert torch.count_nonzero(wide_out[:, :2]) == 0 and torch.count_nonzero(wide_out[:, 8:]) == 0
    assert_close(case.run_v2(256), expected, dtype)


@pytest.mark.parametrize("seq_lens", [[3, 70, 500, 1], [2500]], ids=["many_short", "one_long"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_attention_allocating_op(dtype, seq_lens):
    """The allocating op (v1 on the CPU, which splits the long sequence across threads; v1 or v2 on CUDA)."""
    gen = make_generator("alloc", dtype, seq_lens)
    case = DecodeCase(gen, dtype, num_heads=4, num_kv_heads=1, head_size=64, block_size=16, seq_lens=seq_lens,
                      alibi=True)
    expected = case.reference()
    args = (case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, case.scale)
    assert_close(ops.paged_attention(*args, alibi_slopes=case.alibi_slopes), expected, dtype)
    out = torch.empty_like(case.query)
    result = ops.paged_attention(*args, max_seq_len=case.max_seq_len, alibi_slopes=case.alibi_slopes, out=out)
    assert result is out
    assert_close(out, expected, dtype)


def test_decode_empty_batch():
    """No sequences: every attention op accepts it, returns an empty result and touches no cache."""
    gen = make_generator("empty")
    key_cache, value_cache = make_kv_cache(gen, 4, 16, 2, 64, torch.float32)
    key_before, value_before = key_cache.clone(), value_cache.clone()
    query = torch.empty(0, 4, 64)
    tables, lens = torch.empty(0, 1, dtype=torch.int32), torch.empty(0, dtype=torch.int32)
    out = torch.empty_like(query)
    assert ops.paged_attention_v1(out, query, key_cache, value_cache, tables, lens, 0.125, 0) is None
    assert out.shape == (0, 4, 64)
    exp_sums = torch.empty(0, 4, 1)
    ops.paged_attention_v2(out, exp_sums, torch.empty_like(exp_sums), torch.empty(0, 4, 1, 64), query, key_cache,
                           value_cache, tables, lens, 0.125, 0, None, 512)
    ops.paged_prefill_attention(out, query, key_cache, value_cache, tables, torch.zeros(1, dtype=torch.int32), lens,
                                0.125, 0, 0)
    result = ops.paged_attention(query, key_cache, value_cache, tables, lens, 0.125)
    assert result.shape == (0, 4, 64) and result.dtype == torch.float32
    assert torch.equal(key_cache, key_before) and torch.equal(value_cache, value_before)
    # Still validated: an empty batch is no excuse for a wrong head size.
    with pytest.raises(RuntimeError, match=r"head_size 72 is not supported"):
        cache_72 = torch.zeros(4, 16, 2, 72)
        ops.paged_attention(torch.empty(0, 4, 72), cache_72, cache_72, tables, lens, 0.125)


# ---- decode: work split by KV length (v1 cuts long sequences into pieces, then merges) ----


@pytest.fixture(params=[1, 2, 3], ids=lambda n: f"threads{n}")
def num_threads(request):
    """The v1 plan depends on the thread count (pieces per thread): run it under several."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_decode_v1_split_long_sequence(dtype, block_size, num_threads, cpu_variant):
    """One long sequence beside short ones: v1 cuts it into pieces at block boundaries and merges them."""
    gen = make_generator("split", dtype, block_size, num_threads)
    seq_lens = [3001, 0, 1, block_size, 257, 5 * block_size + 3]
    case = DecodeCase(gen, dtype, num_heads=8, num_kv_heads=2, head_size=128, block_size=block_size,
                      seq_lens=seq_lens, alibi=True)
    out = case.run_v1()
    assert_close(out, case.reference(), dtype)
    assert torch.equal(out[1], torch.zeros_like(out[1])), "seq_len 0 must give zeros"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3, 4, 5, 7, 8], ids=lambda g: f"gqa{g}")
def test_decode_every_group_size(dtype, group, num_threads, cpu_variant):
    """Query heads per kv head 1-8: head pairs x 4 tokens, then an odd head x 8 tokens, in every mix."""
    gen = make_generator("group", dtype, group, num_threads)
    seq_lens = [1, 2, 15, 16, 17, 700, 2049]
    num_kv_heads = 2 if group < 8 else 1
    case = DecodeCase(gen, dtype, num_heads=group * num_kv_heads, num_kv_heads=num_kv_heads, head_size=64,
                      block_size=16, seq_lens=seq_lens, alibi=group % 2 == 1)
    expected = case.reference()
    assert_close(case.run_v1(), expected, dtype)
    assert_close(case.run_v2(256), expected, dtype)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size",
    [(16, 16, 128), (80, 16, 128), (48, 16, 256), (32, 32, 80), (32, 8, 128)],
    ids=["mha", "gqa5", "gqa3", "mha80", "gqa4"],
)
def test_decode_wide_rows(num_heads, num_kv_heads, head_size, dtype, block_size, num_threads, cpu_variant):
    """Token rows of 4 KiB and more are streamed in groups of 8 rows (the rest are swept in units of
    blocks): every group size, partial blocks and groups, split sequences, ALiBi, v1 and v2."""
    gen = make_generator("wide", num_heads, num_kv_heads, head_size, dtype, block_size, num_threads)
    seq_lens = [1, 5, block_size, block_size + 3, 300, 1100]
    case = DecodeCase(gen, dtype, num_heads, num_kv_heads, head_size=head_size, block_size=block_size,
                      seq_lens=seq_lens, alibi=num_heads % 3 == 0)
    expected = case.reference()
    assert_close(case.run_v1(), expected, dtype)
    if num_threads == 2:
        assert_close(case.run_v2(256), expected, dtype)


_SPLIT_VARIANT_SCRIPT = """
import torch
from pagedkv import ops, reference
torch.set_num_threads(2)
g = torch.Generator().manual_seed(11)
for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-3)):
    for heads, kv_heads, d in ((7, 1, 80), (9, 3, 64), (8, 8, 112)):
        lens = torch.tensor([1500, 0, 33, 1], dtype=torch.int32)
        table = torch.randperm(420, generator=g)[:4 * 100].view(4, 100).int()
        kc = torch.randn(420, 16, kv_heads, d, generator=g).to(dtype)
        vc = torch.randn(420, 16, kv_heads, d, generator=g).to(dtype)
        q = torch.randn(4, heads, d, generator=g).to(dtype)
        out = torch.empty_like(q)
        ops.paged_attention_v1(out, q, kc, vc, table, lens, 0.1, 1500)
        ref = reference.paged_attention(q, kc, vc, table, lens, 0.1)
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
print(torch.ops.pagedkv.cpu_capability())
"""


def test_default_variant_split_and_half_types():
    """The portable variant on the new decode paths: split sequences, odd groups, bf16/fp16, head sizes 80/112."""
    env = dict(os.environ, PAGEDKV_CPU_CAPABILITY="default")
    result = subprocess.run([sys.executable, "-c", _SPLIT_VARIANT_SCRIPT], env=env, capture_output=True, text=True,
                            check=False, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "default"


# ---- prefill ----------------------------------------------------------------------


class PrefillCase:
    """New tokens of several sequences concatenated; K/V of all positions already cached."""

    def __init__(self, gen, dtype, num_heads, num_kv_heads, head_size, block_size, q_lens, seq_lens,
                 query_padding=0):
        self.block_tables, num_blocks = make_block_tables(gen, seq_lens, block_size)
        self.key_cache, self.value_cache = make_kv_cache(gen, num_blocks, block_size, num_kv_heads, head_size, dtype)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        num_tokens = sum(q_lens)
        wide = torch.randn(num_tokens, num_heads + query_padding, head_size, generator=gen).to(dtype)
        self.query = wide[:, :num_heads]
        self.max_query_len = max(q_lens)
        self.max_seq_len = max(seq_lens)
        self.scale = draw_scale(gen, head_size)
        self.sliding_window, self.logits_soft_cap = 0, 0.0  # off unless a test sets them

    def reference(self):
        return reference.paged_prefill_attention(self.query, self.key_cache, self.value_cache, self.block_tables,
                                                 self.query_start_loc, self.seq_lens, self.scale,
                                                 self.sliding_window, self.logits_soft_cap)

    def run(self, out=None):
        out = torch.full_like(self.query, float("nan"), memory_format=torch.contiguous_format) if out is None else out
        ops.paged_prefill_attention(out, self.query, self.key_cache, self.value_cache, self.block_tables,
                                    self.query_start_loc, self.seq_lens, self.scale, self.max_query_len,
                                    self.max_seq_len, sliding_window=self.sliding_window,
                                    logits_soft_cap=self.logits_soft_cap)
        return out


# (q_len, seq_len) per sequence: plain prefill (q_len == seq_len), chunked prefill /
# prefix-cache hits (seq_len > q_len), single tokens, and a sequence with no new tokens.
PREFILL_MIX = [(37, 37), (1, 1), (5, 29), (0, 12), (64, 100), (17, 17), (1, 40)]


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_every_dtype_head_size_block_size(dtype, head_size, block_size, cpu_variant):
    gen = make_generator("prefill", dtype, head_size, block_size)
    q_lens, seq_lens = zip(*PREFILL_MIX, strict=True)
    case = PrefillCase(gen, dtype, num_heads=6, num_kv_heads=2, head_size=head_size, block_size=block_size,
                       q_lens=q_lens, seq_lens=seq_lens)
    assert_close(case.run(), case.reference(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads",
    [(4, 4), (9, 3), (8, 2), (16, 2), (8, 1), (40, 1)],
    ids=["mha", "gqa3", "gqa4", "gqa8", "mqa", "mqa40"],
)
def test_prefill_gqa_ratios(num_heads, num_kv_heads, dtype, cpu_variant):
    gen = make_generator("prefill_gqa", num_heads, num_kv_heads, dtype)
    q_lens, seq_lens = [101, 3, 33, 250], [101, 40, 300, 250]
    case = PrefillCase(gen, dtype, num_heads, num_kv_heads, head_size=64, block_size=16, q_lens=q_lens,
                       seq_lens=seq_lens)
    assert_close(case.run(), case.reference(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3], ids=["mha", "gqa3"])
def test_prefill_every_row_vector_count(dtype, group, cpu_variant):
    """Query tiles of 1-8 row vectors (rows = tokens x group, 8 per vector): groups of three, then two or one."""
    gen = make_generator("rowvec", dtype, group)
    q_lens = [1, 9, 17, 25, 33, 41, 49, 57, 64, 70] if group == 1 else [1, 3, 6, 8, 11, 14, 16, 19, 21, 30]
    case = PrefillCase(gen, dtype, num_heads=2 * group, num_kv_heads=2, head_size=64, block_size=16, q_lens=q_lens,
                       seq_lens=[n + 5 for n in q_lens])
    assert_close(case.run(), case.reference(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_long_prompt_and_chunk(dtype):
    gen = make_generator("prefill_long", dtype)
    case = PrefillCase(gen, dtype, num_heads=9, num_kv_heads=3, head_size=64, block_size=16,
                       q_lens=[513, 128], seq_lens=[513, 1500])
    assert_close(case.run(), case.reference(), dtype)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(9, 3, 64), (6, 2, 80), (32, 8, 128), (4, 1, 256)],
                         ids=["gqa3-64", "gqa3-80", "gqa4-128", "mqa-256"])
def test_prefill_amx_long_prompts_and_chunks(num_heads, num_kv_heads, head_size):
    """bf16 prefill on AMX tiles over many key tiles of 64: whole prompts, chunks after long cached
    context, row tiles of 128 rows and the last, partial ones; against the reference and the
    vdpbf16ps kernel (tiles off)."""
    if not AMX_RUNS:
        pytest.skip("this CPU (or kernel) has no AMX-BF16 tiles")
    gen = make_generator("prefill_amx", num_heads, num_kv_heads, head_size)
    case = PrefillCase(gen, torch.bfloat16, num_heads, num_kv_heads, head_size, block_size=16,
                       q_lens=[513, 130, 1, 67, 200], seq_lens=[513, 1000, 300, 67, 263])
    previous = ops.set_cpu_capability("avx512_bf16")
    try:
        use_amx(True)
        tiles = case.run()
        use_amx(False)
        registers = case.run()
    finally:
        use_amx(True)
        ops.set_cpu_capability(previous)
    expected = case.reference()
    assert_close(tiles, expected, torch.bfloat16)
    assert_close(tiles, registers, torch.bfloat16)


@pytest.mark.parametrize("rising", [True, False], ids=["rising", "falling"])
def test_prefill_amx_running_max_moves(rising, cpu_variant):
    """Keys whose scores grow (or shrink) by far more than the AMX path's lag of the running max
    (e^8) along the sequence: the accumulators are rescaled mid-sequence, or never."""
    gen = make_generator("prefill_max_moves", rising)
    case = PrefillCase(gen, torch.bfloat16, num_heads=6, num_kv_heads=2, head_size=64, block_size=16,
                       q_lens=[300, 40], seq_lens=[300, 500])
    positions = torch.arange(500, dtype=torch.float32)
    growth = 1 + positions / 25 if rising else 1 + (500 - positions) / 25
    for seq, table in enumerate(case.block_tables):
        length = int(case.seq_lens[seq])
        for pos in range(length):
            block, slot = int(table[pos // 16]), pos % 16
            case.key_cache[block, slot] = (case.key_cache[block, slot].float() * growth[pos]).to(torch.bfloat16)
    case.scale = 0.5
    assert_close(case.run(), case.reference(), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_non_contiguous_query_and_out(dtype, cpu_variant):
    gen = make_generator("prefill_strided", dtype)
    case = PrefillCase(gen, dtype, num_heads=4, num_kv_heads=2, head_size=80, block_size=8, q_lens=[9, 20],
                       seq_lens=[30, 20], query_padding=5)
    assert not case.query.is_contiguous()
    wide_out = torch.zeros(29, 7, 80, dtype=dtype)
    out = wide_out[:, 1:5]
    case.run(out)
    assert_close(out, case.reference(), dtype)
    assert torch.count_nonzero(wide_out[:, 0]) == 0 and torch.count_nonzero(wide_out[:, 5:]) == 0


def test_prefill_single_token_matches_decode():
    """A prefill of one token per sequence is decode: the two kernels must agree."""
    gen = make_generator("prefill_vs_decode")
    seq_lens = [1, 31, 200, 64]
    decode = DecodeCase(gen, torch.float32, num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                        seq_lens=seq_lens)
    out = torch.empty_like(decode.query)
    ops.paged_prefill_attention(out, decode.query, decode.key_cache, decode.value_cache, decode.block_tables,
                                torch.arange(len(seq_lens) + 1, dtype=torch.int32), decode.seq_lens, decode.scale,
                                1, decode.max_seq_len)
    assert_close(out, decode.run_v1(), torch.float32)


# ---- scale --------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["v1", "v2", "prefill"])
def test_scale_is_applied(op):
    """Far from head_size**-0.5, scale changes the result, and each kernel follows it.

    scale 0 makes every logit 0: the output is the plain mean of V over the
    context (causal for prefill), checked without the reference.
    """
    gen = make_generator("scale", op)
    seq_lens = [1, 40, 700]
    if op == "prefill":
        case = PrefillCase(gen, torch.float32, num_heads=6, num_kv_heads=2, head_size=64, block_size=16,
                           q_lens=[1, 40, 9], seq_lens=seq_lens)
    else:
        case = DecodeCase(gen, torch.float32, num_heads=6, num_kv_heads=2, head_size=64, block_size=16,
                          seq_lens=seq_lens)
    outputs = {}
    for scale in (0.0, 0.01, 0.4, 1.0):
        case.scale = scale
        out = case.run() if op == "prefill" else case.run_v1() if op == "v1" else case.run_v2(256)
        assert_close(out, case.reference(), torch.float32)
        outputs[scale] = out
    for a, b in ((0.0, 0.01), (0.01, 0.4), (0.4, 1.0)):
        assert (outputs[a] - outputs[b]).abs().max() > 1e-2, f"scale {a} and {b} give the same output"
    # scale 0: each token's output is the mean of V over the positions it sees.
    rows = []
    for s, seq_len in enumerate(seq_lens):
        _, v = reference.gather_kv(case.key_cache, case.value_cache, case.block_tables[s], seq_len)
        q_len = int(case.query_start_loc[s + 1] - case.query_start_loc[s]) if op == "prefill" else 1
        for pos in range(seq_len - q_len, seq_len):
            rows.append(v[: pos + 1].mean(0).repeat_interleave(3, dim=0))  # 3 query heads per kv head
    torch.testing.assert_close(outputs[0.0], torch.stack(rows), atol=2e-5, rtol=1e-4)


# ---- sliding window and logit soft-capping ------------------------------------------


ALL_CPU_VARIANTS = [*ops.CPU_CAPABILITIES, "amx"]


@pytest.fixture(params=ALL_CPU_VARIANTS)
def every_cpu_variant(request):
    """Runs a test under every CPU kernel variant this machine can run (avx512_bf16: bf16 only,
    its other dtypes are the avx512 kernels), and under avx512_bf16 with bf16 prefill on AMX tiles."""
    name = "avx512_bf16" if request.param == "amx" else request.param
    if request.param == "amx":
        skip_unless_amx_case(request)
    if not ops.cpu_capability_runs(name):
        pytest.skip(f"this CPU cannot run the {name} kernels")
    if name == "avx512_bf16" and request.node.callspec.params.get("dtype", torch.bfloat16) != torch.bfloat16:
        pytest.skip("avx512_bf16 changes the bf16 kernels only; the avx512 case runs this dtype")
    previous = ops.set_cpu_capability(name)
    previous_amx = use_amx(request.param == "amx")
    yield request.param
    restore_amx(previous_amx)
    ops.set_cpu_capability(previous)


def decode_windows(block_size):
    """0 (none), 1, smaller than a block, one block, not a multiple of it, several, longer than any seq_len."""
    return [0, 1, 5, block_size, block_size + 3, 2 * block_size, 100, 10_000]


@pytest.mark.parametrize("soft_cap", [0.0, 2.5], ids=["nocap", "cap"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_sliding_window_and_soft_cap(dtype, block_size, soft_cap, every_cpu_variant):
    """v1 and v2 over odd lengths, every window size class, with ALiBi; soft-capping alone (window 0) and with it."""
    gen = make_generator("window", dtype, block_size, soft_cap)
    seq_lens = [1, 7, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 301, 0]
    case = DecodeCase(gen, dtype, num_heads=8, num_kv_heads=2, head_size=64, block_size=block_size,
                      seq_lens=seq_lens, alibi=True)
    case.logits_soft_cap = soft_cap
    for window in decode_windows(block_size):
        case.sliding_window = window
        expected = case.reference()
        assert_close(case.run_v1(), expected, dtype)
        assert_close(case.run_v2(256, extra_partitions=1), expected, dtype)


@pytest.mark.parametrize("partition_size", [256, 512, 1024])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_v2_window_spanning_partitions(dtype, partition_size, cpu_variant):
    """Windows that start inside, at and across partition boundaries: the partitions wholly before a
    window stay empty (their NaN-filled scratch unread) and the reduce starts at the window's partition."""
    gen = make_generator("v2window", dtype, partition_size)
    p = partition_size
    seq_lens = [1, p - 1, p, p + 1, 2 * p + 37, 3 * p + 200, 0]
    case = DecodeCase(gen, dtype, num_heads=8, num_kv_heads=2, head_size=128, block_size=16, seq_lens=seq_lens,
                      alibi=True)
    for window, soft_cap in ((17, 0.0), (p - 5, 4.0), (p, 0.0), (p + 10, 0.0), (2 * p + 1, 3.0)):
        case.sliding_window, case.logits_soft_cap = window, soft_cap
        expected = case.reference()
        assert_close(case.run_v2(partition_size, extra_partitions=2), expected, dtype)
        assert_close(case.run_v1(), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size", [(8, 2, 128), (9, 3, 64), (16, 16, 128)], ids=["gqa4", "gqa3", "wide_mha"]
)
def test_decode_window_split_sequences(num_heads, num_kv_heads, head_size, dtype, num_threads, cpu_variant):
    """Windows longer than a v1 piece: the window's range is split across threads, the first piece
    starting inside a block; narrow rows (swept) and 4 KiB+ rows (streamed, wide_mha)."""
    gen = make_generator("window_split", num_heads, num_kv_heads, head_size, dtype, num_threads)
    case = DecodeCase(gen, dtype, num_heads, num_kv_heads, head_size=head_size, block_size=16,
                      seq_lens=[3001, 0, 1, 257, 2100], alibi=num_heads % 3 == 0)
    for window in (1, 13, 700, 1999):
        case.sliding_window = window
        expected = case.reference()
        assert_close(case.run_v1(), expected, dtype)
        if num_threads == 2:
            assert_close(case.run_v2(512), expected, dtype)


def test_decode_window_at_least_seq_len_is_no_window(cpu_variant):
    """A window covering the whole context takes the very same path as no window: bit-identical output."""
    gen = make_generator("window_full")
    case = DecodeCase(gen, torch.float32, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                      seq_lens=[1, 40, 613], alibi=True)
    plain = case.run_v1()
    case.sliding_window = 613
    assert torch.equal(case.run_v1(), plain)


def test_soft_cap_is_applied():
    """With large logits, capping changes the result (and follows the reference); a huge cap is no cap."""
    gen = make_generator("soft_cap")
    case = DecodeCase(gen, torch.float32, num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                      seq_lens=[40, 300])
    case.scale = 1.0  # logits of magnitude ~8: tanh bites at a cap of 2
    plain = case.run_v1()
    for cap in (0.5, 2.0, 50.0):
        case.logits_soft_cap = cap
        out = case.run_v1()
        assert_close(out, case.reference(), torch.float32)
        assert (out - plain).abs().max() > 1e-2, f"soft cap {cap} made no difference"
    case.logits_soft_cap = 1e6
    assert_close(case.run_v1(), plain, torch.float32)


@pytest.mark.parametrize("soft_cap", [0.0, 3.0], ids=["nocap", "cap"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_sliding_window_and_soft_cap(dtype, block_size, soft_cap, every_cpu_variant):
    """Chunks after cached context and whole prompts of mixed lengths, every window size class."""
    gen = make_generator("prefill_window", dtype, block_size, soft_cap)
    q_lens, seq_lens = zip(*PREFILL_MIX, strict=True)
    case = PrefillCase(gen, dtype, num_heads=6, num_kv_heads=2, head_size=64, block_size=block_size,
                       q_lens=q_lens, seq_lens=seq_lens)
    case.logits_soft_cap = soft_cap
    for window in [0, 1, 5, block_size, block_size + 3, 37, 100, 10_000]:
        case.sliding_window = window
        assert_close(case.run(), case.reference(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (40, 1)], ids=["mha", "gqa3", "mqa40"])
def test_prefill_window_long_chunks(num_heads, num_kv_heads, dtype, cpu_variant):
    """Query tiles of many tokens whose later rows' windows start past the tile's first key tiles."""
    gen = make_generator("prefill_window_long", num_heads, num_kv_heads, dtype)
    case = PrefillCase(gen, dtype, num_heads, num_kv_heads, head_size=64, block_size=16, q_lens=[130, 200, 3],
                       seq_lens=[130, 900, 50])
    for window, soft_cap in ((1, 0.0), (7, 2.0), (64, 0.0), (100, 5.0), (333, 0.0)):
        case.sliding_window, case.logits_soft_cap = window, soft_cap
        assert_close(case.run(), case.reference(), dtype)


def test_prefill_window_single_token_matches_decode():
    """One new token per sequence is decode, window and cap included: the two kernels agree."""
    gen = make_generator("prefill_vs_decode_window")
    decode = DecodeCase(gen, torch.float32, num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                        seq_lens=[1, 31, 200, 64])
    decode.sliding_window, decode.logits_soft_cap = 45, 4.0
    out = torch.empty_like(decode.query)
    ops.paged_prefill_attention(out, decode.query, decode.key_cache, decode.value_cache, decode.block_tables,
                                torch.arange(5, dtype=torch.int32), decode.seq_lens, decode.scale, 1,
                                decode.max_seq_len, sliding_window=45, logits_soft_cap=4.0)
    assert_close(out, decode.run_v1(), torch.float32)


def _free_blocks_before_window(case, first_keys, freed_id):
    """Fills every block wholly before a sequence's window with NaN and sets its table entry to
    freed_id (-1, or a block past the cache): what a block manager that freed them may leave."""
    block_size = case.key_cache.shape[1]
    num_blocks = case.key_cache.shape[0]
    freed = 0
    for s, first in enumerate(first_keys):
        for b in range(first // block_size):
            block = int(case.block_tables[s, b])
            case.key_cache[block] = float("nan")
            case.value_cache[block] = float("nan")
            case.block_tables[s, b] = -1 if freed_id == "minus_one" else num_blocks + 7 * b
            freed += 1
    assert freed > 0


@pytest.mark.parametrize("freed_id", ["minus_one", "out_of_range"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_window_never_reads_blocks_before_it(dtype, freed_id, every_cpu_variant):
    """Blocks wholly before the window hold NaN and bad table entries: with the index checks on,
    v1, v2 (several partition sizes) and the allocating op give finite outputs equal to the reference's."""
    gen = make_generator("freed", dtype, freed_id)
    window = 50
    case = DecodeCase(gen, dtype, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                      seq_lens=[300, 77, 1100, 5, 51, 0], alibi=True)
    case.sliding_window, case.logits_soft_cap = window, 3.0
    expected = case.reference()  # from the clean cache
    _free_blocks_before_window(case, [max(0, n - window) for n in case.seq_lens_list], freed_id)
    assert ops.index_checks_enabled()
    outputs = [case.run_v1(), case.run_v2(256, extra_partitions=1), case.run_v2(512), case.run_v2(1024)]
    outputs.append(ops.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                       case.seq_lens, case.scale, alibi_slopes=case.alibi_slopes,
                                       sliding_window=window, logits_soft_cap=3.0))
    for out in outputs:
        assert torch.isfinite(out).all()
        assert_close(out, expected, dtype)
    assert_close(case.reference(), expected, dtype)  # the reference does not read them either
    ops.validate_decode_metadata(case.block_tables, case.seq_lens, num_blocks=case.key_cache.shape[0],
                                 block_size=16, sliding_window=window)
    # Without the window those entries are in use, and the checks refuse them.
    case.sliding_window = 0
    with pytest.raises(RuntimeError, match=r"block_tables\[0\]\[0\] = .* is outside the cache"):
        case.run_v1()


@pytest.mark.parametrize("freed_id", ["minus_one", "out_of_range"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_window_never_reads_blocks_before_it(dtype, freed_id, every_cpu_variant):
    """The same for prefill: the blocks wholly before the window of a sequence's first new token."""
    gen = make_generator("freed_prefill", dtype, freed_id)
    window = 40
    q_lens, seq_lens = [20, 1, 64, 3], [300, 500, 200, 3]
    case = PrefillCase(gen, dtype, num_heads=6, num_kv_heads=2, head_size=64, block_size=16, q_lens=q_lens,
                       seq_lens=seq_lens)
    case.sliding_window, case.logits_soft_cap = window, 2.0
    expected = case.reference()
    _free_blocks_before_window(case, [max(0, n - q - window + 1) for q, n in zip(q_lens, seq_lens, strict=True)],
                               freed_id)
    assert ops.index_checks_enabled()
    out = case.run()
    assert torch.isfinite(out).all()
    assert_close(out, expected, dtype)
    ops.validate_prefill_metadata(case.block_tables, case.seq_lens, case.query_start_loc,
                                  num_blocks=case.key_cache.shape[0], block_size=16, num_tokens=sum(q_lens),
                                  sliding_window=window)
    case.sliding_window = 0
    with pytest.raises(RuntimeError, match=r"block_tables\[0\]\[0\] = .* is outside the cache"):
        case.run()


BAD_WINDOW_OR_CAP = {
    "negative_window": ({"sliding_window": -1}, r"sliding_window must be >= 0 \(0: no window\), got -1"),
    "negative_cap": ({"logits_soft_cap": -0.5}, r"logits_soft_cap must be finite and >= 0 .*got -0.5"),
    "nan_cap": ({"logits_soft_cap": float("nan")}, r"logits_soft_cap must be finite and >= 0 .*got nan"),
}


@pytest.mark.parametrize("op", ["v1", "v2", "paged_attention", "prefill"])
@pytest.mark.parametrize("bad", list(BAD_WINDOW_OR_CAP))
def test_bad_window_or_soft_cap_is_refused(op, bad):
    kwargs, pattern = BAD_WINDOW_OR_CAP[bad]
    gen = make_generator("bad_window", op, bad)
    if op == "prefill":
        case = PrefillCase(gen, torch.float32, num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                           q_lens=[5, 3], seq_lens=[5, 10])
    else:
        case = DecodeCase(gen, torch.float32, num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                          seq_lens=[20, 5])
    case.sliding_window = kwargs.get("sliding_window", 0)
    case.logits_soft_cap = kwargs.get("logits_soft_cap", 0.0)
    run = {"v1": lambda: case.run_v1(), "v2": lambda: case.run_v2(512),
           "paged_attention": lambda: ops.paged_attention(case.query, case.key_cache, case.value_cache,
                                                          case.block_tables, case.seq_lens, case.scale, **kwargs),
           "prefill": lambda: case.run()}[op]
    with pytest.raises(RuntimeError, match=pattern):
        run()
    with pytest.raises(ValueError, match=pattern):
        case.reference()



# ---- bad inputs -------------------------------------------------------------------


def _decode_args(head_size=64, block_size=16, num_heads=4, num_kv_heads=2, seq_lens=(20, 5)):
    gen = make_generator("bad", head_size, block_size, num_heads, num_kv_heads)
    shape = (16, block_size, num_kv_heads, head_size)
    key_cache, value_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=gen)
    table = torch.arange(len(seq_lens) * 4, dtype=torch.int32).view(len(seq_lens), 4) % 16
    return {
        "out": torch.empty_like(query),
        "query": query,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_tables": table,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "scale": 0.1,
        "max_seq_len": max(seq_lens),
    }


def _v1(a):
    ops.paged_attention_v1(a["out"], a["query"], a["key_cache"], a["value_cache"], a["block_tables"],
                           a["seq_lens"], a["scale"], a["max_seq_len"], a.get("alibi_slopes"))


def _v2(a, parts=1, partition_size=512):
    num_seqs, num_heads, head_size = a["query"].shape
    exp_sums = torch.empty(num_seqs, num_heads, parts)
    tmp_out = torch.empty(num_seqs, num_heads, parts, head_size)
    ops.paged_attention_v2(a["out"], exp_sums, torch.empty_like(exp_sums), tmp_out, a["query"], a["key_cache"],
                           a["value_cache"], a["block_tables"], a["seq_lens"], a["scale"], a["max_seq_len"],
                           None, partition_size)


def _with(**changes):
    def make():
        a = _decode_args(**{k: v for k, v in changes.items() if k in ("head_size", "block_size", "num_heads",
                                                                         "num_kv_heads", "seq_lens")})
        for key, fn in changes.items():
            if callable(fn):
                a[key] = fn(a)
        return a

    return make


BAD_DECODE_INPUTS = {
    "head_size_72": (_with(head_size=72), r"head_size 72 is not supported"),
    "block_size_12": (_with(block_size=12), r"block_size 12 is not supported"),
    "block_tables_int64": (_with(block_tables=lambda a: a["block_tables"].long()), r"block_tables must be Int"),
    "block_id_outside_cache": (
        _with(block_tables=lambda a: a["block_tables"].index_fill(1, torch.tensor([0]), 16)),
        r"block_tables\[0\]\[0\] = 16 is outside the cache",
    ),
    "seq_len_beyond_table": (_with(seq_lens=(65, 5)), r"needs more blocks than block_tables holds"),
    "seq_len_above_max_seq_len": (_with(max_seq_len=lambda a: 10), r"exceeds max_seq_len"),
    "heads_not_multiple_of_kv_heads": (_with(num_heads=5, num_kv_heads=2), r"must be a positive multiple"),
    "query_dtype_differs": (_with(query=lambda a: a["query"].half(), out=lambda a: a["out"].half()),
                            r"query dtype .* differs from key_cache dtype"),
    "alibi_wrong_shape": (_with(alibi_slopes=lambda a: torch.ones(3)), r"alibi_slopes must be \[num_heads=4\]"),
}


@pytest.mark.parametrize("name", list(BAD_DECODE_INPUTS))
def test_decode_rejects_bad_input(name):
    make, pattern = BAD_DECODE_INPUTS[name]
    with pytest.raises(RuntimeError, match=pattern):
        _v1(make())


def test_v2_rejects_small_scratch_and_bad_partition_size():
    a = _decode_args()
    a["max_seq_len"] = 600  # scratch is sized by max_seq_len: 2 partitions of 512
    with pytest.raises(RuntimeError, match=r"partitions>=2"):
        _v2(a, parts=1, partition_size=512)
    with pytest.raises(RuntimeError, match=r"partition_size 100 is not supported"):
        _v2(a, parts=6, partition_size=100)


def test_prefill_rejects_bad_query_start_loc():
    case = PrefillCase(make_generator("bad_prefill"), torch.float32, num_heads=4, num_kv_heads=2, head_size=64,
                       block_size=16, q_lens=[5, 3], seq_lens=[5, 10])
    case.query_start_loc = torch.tensor([0, 6, 8], dtype=torch.int32)  # sequence 0 claims 6 tokens, seq_len 5
    case.max_query_len = 6
    with pytest.raises(RuntimeError, match=r"sequence 0 has 6 query tokens but seq_lens\[0\] = 5"):
        case.run()
    case.query_start_loc = torch.tensor([0, 5, 7], dtype=torch.int32)  # ends before the last token
    case.max_query_len = 5
    with pytest.raises(RuntimeError, match=r"sequence 0 has 6 query tokens, more than max_query_len = 5"):
        case.query_start_loc = torch.tensor([0, 6, 8], dtype=torch.int32)
        case.run()
    case.query_start_loc = torch.tensor([0, 5, 7], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"query_start_loc\[-1\] = 7 must equal the number of query tokens 8"):
        case.run()
    case.query_start_loc = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"query_start_loc must have num_seqs\+1=3 entries"):
        case.run()


# ---- instruction-set variants -----------------------------------------------------


def test_cpu_capability_is_reported():
    assert ops.cpu_capability() in ops.CPU_CAPABILITIES


def test_set_cpu_capability_checks_the_name():
    with pytest.raises(RuntimeError, match=r"set_cpu_capability must be one of default, avx2, avx512, avx512_bf16"):
        ops.set_cpu_capability("sse9")
    assert ops.set_cpu_capability(ops.cpu_capability()) == ops.cpu_capability()


_VARIANT_SCRIPT = """
import torch, pagedkv
from pagedkv import ops, reference
g = torch.Generator().manual_seed(7)
kc, vc = torch.randn(40, 16, 2, 80, generator=g), torch.randn(40, 16, 2, 80, generator=g)
table = torch.randperm(40, generator=g)[:30].view(3, 10).int()
lens = torch.tensor([150, 1, 33], dtype=torch.int32)
q = torch.randn(3, 6, 80, generator=g)
alibi = torch.rand(6, generator=g)
out = torch.empty_like(q)
ops.paged_attention_v1(out, q, kc, vc, table, lens, 0.1, 150, alibi)
torch.testing.assert_close(out, reference.paged_attention(q, kc, vc, table, lens, 0.1, alibi), atol=2e-5, rtol=1e-4)
qsl = torch.tensor([0, 40, 41, 50], dtype=torch.int32)
qp = torch.randn(50, 6, 80, generator=g)
out = torch.empty_like(qp)
ops.paged_prefill_attention(out, qp, kc, vc, table, qsl, lens, 0.1, 40, 150)
torch.testing.assert_close(out, reference.paged_prefill_attention(qp, kc, vc, table, qsl, lens, 0.1),
                           atol=2e-5, rtol=1e-4)
print(torch.ops.pagedkv.cpu_capability())
"""


def _run_with_capability(value):
    env = dict(os.environ, PAGEDKV_CPU_CAPABILITY=value)
    return subprocess.run([sys.executable, "-c", _VARIANT_SCRIPT], env=env, capture_output=True, text=True, check=False,
                          timeout=120)


def test_default_variant_matches_reference():
    """The portable variant (forced through the environment) computes the same results."""
    result = _run_with_capability("default")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "default"


def test_unknown_capability_is_an_error():
    result = _run_with_capability("sse9")
    assert result.returncode != 0
    assert "PAGEDKV_CPU_CAPABILITY must be one of default, avx2, avx512, avx512_bf16; got 'sse9'" in result.stderr


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


@pytest.mark.skipif("avx512_bf16" not in _cpu_flags(), reason="this CPU lacks avx512_bf16 (or has no /proc/cpuinfo)")
def test_avx512_bf16_is_picked_and_can_be_forced_off():
    """A CPU with avx512_bf16 runs that variant by default; PAGEDKV_CPU_CAPABILITY=avx512 gives the older kernels."""
    script = "import pagedkv, torch; print(torch.ops.pagedkv.cpu_capability())"
    env = {k: v for k, v in os.environ.items() if k != "PAGEDKV_CPU_CAPABILITY"}
    for forced, expected in ((None, "avx512_bf16"), ("avx512", "avx512")):
        run_env = dict(env, PAGEDKV_CPU_CAPABILITY=forced) if forced else env
        result = subprocess.run([sys.executable, "-c", script], env=run_env, capture_output=True, text=True,
                                check=False, timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip().splitlines()[-1] == expected


def test_package_exposes_ops():
    assert hasattr(pagedkv, "ops") and hasattr(torch.ops.pagedkv, "paged_attention_v1")
