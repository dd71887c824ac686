"""ops.lora_linear_add (multi-LoRA shrink then expand, segmented by adapter slot) vs
pagedkv.reference.lora_linear_add, on the CPU (and on CUDA when a device and a CUDA build are
present); its refusals; torch.library.opcheck.

Tolerances, stated per dtype: both compute xa = input[rows] @ lora_a[s]^T with the same GEMM;
the kernel then adds each slice's product into out with addmm_ (one rounding, fast path) or
index_add_ (the product rounded, then the sum), the reference always the latter. float32
differs by the order of the GEMM's sums (1e-5); 16-bit results may land an ulp or two apart
(bf16: 2^-8 relative, fp16: 2^-11 relative, of values of size ~3).
"""

from __future__ import annotations

import pagedkv
import pytest
import torch
from pagedkv import ops, reference

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and pagedkv.built_with_cuda else [])
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 5e-2, "rtol": 2e-2},  # two bf16 ulps
    torch.float16: {"atol": 5e-3, "rtol": 2e-3},  # two fp16 ulps
}
# (in_features, out_features, slice_offsets): a plain linear, gate/up-like, QKV-like; uneven slices.
SHAPES = [
    (13, 29, [0, 29]),
    (64, 96, [0, 40, 96]),
    (13, 29, [0, 5, 17, 29]),
    (64, 96, [0, 64, 80, 96]),
]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weights(num_slots: int, in_features: int, out_features: int, n_slices: int, rank: int, dtype, device,
             gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """lora_a [S, n_slices * R, K] and lora_b [S, N, R], scaled so each product is of size ~1."""
    lora_a = torch.randn(num_slots, n_slices * rank, in_features, generator=gen) / in_features ** 0.5
    lora_b = torch.randn(num_slots, out_features, rank, generator=gen) / rank ** 0.5
    return lora_a.to(dtype).to(device), lora_b.to(dtype).to(device)


def _random_rows(num_tokens: int, num_slots: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_rows, slot_starts): about 3/4 of the rows on a random slot each, one slot left empty when
    there are several; rows grouped by slot, in random order within a group."""
    num_lora = max(1, (3 * num_tokens) // 4)
    rows = torch.randperm(num_tokens, generator=gen)[:num_lora]
    used = list(range(num_slots))
    if num_slots > 1:
        used.pop(int(torch.randint(num_slots, (1,), generator=gen)))
    slots = torch.tensor(used)[torch.randint(len(used), (num_lora,), generator=gen)]
    order = torch.sort(slots, stable=True).indices
    counts = torch.bincount(slots, minlength=num_slots)
    slot_starts = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    return rows[order], slot_starts


def _check_against_reference(out, input, lora_a, lora_b, token_rows, slot_starts, slice_offsets):
    """Runs the op and the reference on copies of out; rows that use no adapter must stay bit-equal."""
    got = ops.lora_linear_add(out.clone(), input, lora_a, lora_b, token_rows, slot_starts, slice_offsets)
    want = reference.lora_linear_add(out.clone(), input, lora_a, lora_b, token_rows, slot_starts, slice_offsets)
    torch.testing.assert_close(got, want, **TOL[out.dtype])
    untouched = torch.ones(out.shape[0], dtype=torch.bool, device=out.device)
    untouched[token_rows] = False
    assert torch.equal(got[untouched], out[untouched])
    return got


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_slots", [1, 2, 4])
@pytest.mark.parametrize("rank", [1, 3, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"K{s[0]}-N{s[1]}-slices{len(s[2]) - 1}")
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_lora_linear_add_matches_reference(device, dtype, num_slots, rank, shape, num_tokens):
    in_features, out_features, slice_offsets = shape
    gen = _gen(num_tokens * 1000 + rank * 100 + num_slots * 10 + len(slice_offsets))
    lora_a, lora_b = _weights(num_slots, in_features, out_features, len(slice_offsets) - 1, rank, dtype, device, gen)
    input = torch.randn(num_tokens, in_features, generator=gen).to(dtype).to(device)
    out = torch.randn(num_tokens, out_features, generator=gen).to(dtype).to(device)
    token_rows, slot_starts = _random_rows(num_tokens, num_slots, gen)
    _check_against_reference(out, input, lora_a, lora_b, token_rows.to(device), slot_starts.to(device),
                             slice_offsets)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_linear_add_contiguous_and_scattered_groups(device, dtype):
    """Slots whose rows are consecutive and increasing (the narrow() fast path) beside slots that
    are not: out of order, sorted with a gap, a row listed twice (both updates land)."""
    gen = _gen(7)
    num_tokens, in_features, out_features, rank, slice_offsets = 16, 64, 96, 8, [0, 64, 80, 96]
    lora_a, lora_b = _weights(6, in_features, out_features, 3, rank, dtype, device, gen)
    input = torch.randn(num_tokens, in_features, generator=gen).to(dtype).to(device)
    out = torch.randn(num_tokens, out_features, generator=gen).to(dtype).to(device)
    groups = [[2, 3, 4, 5, 6], [9, 8], [11, 13], [], [0, 1], [15, 15]]
    token_rows = torch.tensor([r for g in groups for r in g], device=device)
    slot_starts = torch.tensor([0] + [len(g) for g in groups], device=device).cumsum(0)
    _check_against_reference(out, input, lora_a, lora_b, token_rows, slot_starts, slice_offsets)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_tokens", [1, 33])
def test_lora_linear_add_whole_batch_on_one_adapter(device, num_tokens):
    """A decode batch all on one adapter (slot 1 of 3): every row, in order, the fast path; float32
    matches the plain product to rounding."""
    gen = _gen(num_tokens)
    lora_a, lora_b = _weights(3, 13, 29, 2, 3, torch.float32, device, gen)
    input = torch.randn(num_tokens, 13, generator=gen).to(device)
    out = torch.randn(num_tokens, 29, generator=gen).to(device)
    token_rows = torch.arange(num_tokens, device=device)
    slot_starts = torch.tensor([0, 0, num_tokens, num_tokens], device=device)
    got = _check_against_reference(out, input, lora_a, lora_b, token_rows, slot_starts, [0, 10, 29])
    xa = input @ lora_a[1].T
    expect = out.clone()
    expect[:, :10] += xa[:, :3] @ lora_b[1, :10].T
    expect[:, 10:] += xa[:, 3:] @ lora_b[1, 10:].T
    torch.testing.assert_close(got, expect, **TOL[torch.float32])


def _aten_ops_called(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.key for event in prof.key_averages()}


def test_lora_linear_add_consecutive_rows_take_views():
    """The fast path is taken: consecutive increasing rows gather and scatter nothing; the same rows
    out of order (or with a gap) are gathered (the CPU adds the rows back itself, not with index_add_)."""
    gen = _gen(2)
    lora_a, lora_b = _weights(1, 13, 29, 1, 3, torch.float32, "cpu", gen)
    input, out = torch.randn(8, 13, generator=gen), torch.randn(8, 29, generator=gen)

    def called(rows: list[int]) -> set[str]:
        token_rows, slot_starts = torch.tensor(rows), torch.tensor([0, len(rows)])
        return _aten_ops_called(lambda: ops.lora_linear_add(out, input, lora_a, lora_b, token_rows, slot_starts,
                                                            [0, 29]))

    consecutive = called([2, 3, 4, 5])
    assert "aten::addmm_" in consecutive
    assert not {"aten::index_select", "aten::index_add_"} & consecutive
    for rows in ([3, 2, 4, 5], [2, 3, 5, 6]):
        assert "aten::index_select" in called(rows)


@pytest.mark.parametrize("device", DEVICES)
def test_lora_linear_add_strided_tensors(device):
    """out and input as column ranges of wider buffers, lora_b a transposed view: written where they
    lie, the buffer's other columns untouched."""
    gen = _gen(11)
    num_tokens, in_features, out_features, rank = 9, 13, 29, 3
    lora_a, _ = _weights(2, in_features, out_features, 3, rank, torch.float32, device, gen)
    lora_b = (torch.randn(2, rank, out_features, generator=gen) / rank ** 0.5).to(device).transpose(1, 2)
    input = torch.randn(num_tokens, in_features + 4, generator=gen).to(device)[:, 2:2 + in_features]
    wide = torch.randn(num_tokens, out_features + 7, generator=gen).to(device)
    original = wide.clone()
    out = wide[:, 3:3 + out_features]
    token_rows = torch.tensor([3, 4, 5, 8, 0, 6], device=device)  # slot 0 consecutive, slot 1 not
    slot_starts = torch.tensor([0, 3, 6], device=device)
    slice_offsets = [0, 5, 17, 29]
    want = reference.lora_linear_add(out.clone(), input, lora_a, lora_b, token_rows, slot_starts, slice_offsets)
    ops.lora_linear_add(out, input, lora_a, lora_b, token_rows, slot_starts, slice_offsets)
    torch.testing.assert_close(out, want, **TOL[torch.float32])
    assert torch.equal(wide[:, :3], original[:, :3]) and torch.equal(wide[:, 3 + out_features:],
                                                                      original[:, 3 + out_features:])


def test_lora_linear_add_no_rows_is_a_no_op():
    gen = _gen(3)
    lora_a, lora_b = _weights(2, 13, 29, 1, 3, torch.float32, "cpu", gen)
    out = torch.randn(5, 29, generator=gen)
    before = out.clone()
    ops.lora_linear_add(out, torch.randn(5, 13, generator=gen), lora_a, lora_b, torch.empty(0, dtype=torch.int64),
                        torch.zeros(3, dtype=torch.int64), [0, 29])
    assert torch.equal(out, before)


# ---- refusals --------------------------------------------------------------------------------

# The base case: T = 5, K = 6, N = 7, R = 2, two slices [0, 3, 7], S = 2 slots; rows [4, 1 | 2].
def _bad_case_inputs():
    gen = _gen(5)
    return {
        "out": torch.randn(5, 7, generator=gen),
        "input": torch.randn(5, 6, generator=gen),
        "lora_a": torch.randn(2, 4, 6, generator=gen),
        "lora_b": torch.randn(2, 7, 2, generator=gen),
        "token_rows": torch.tensor([4, 1, 2]),
        "slot_starts": torch.tensor([0, 2, 3]),
        "slice_offsets": [0, 3, 7],
    }


BAD_CASES = {
    "out-dim": ("out", lambda t: t[0], r"lora_linear_add: out must be 2-D \[num_tokens, out_features\]"),
    "input-dim": ("input", lambda t: t[0], r"input must be 2-D \[num_tokens, in_features\], got shape \[6\]"),
    "input-rows": ("input", lambda t: t[:4], r"input must have out's 5 rows \(num_tokens\), got shape \[4, 6\]"),
    "lora_a-dim": ("lora_a", lambda t: t[0], r"lora_a must be 3-D \[num_slots, n_slices \* max_rank, in_features\]"),
    "lora_a-K": ("lora_a", lambda t: t[:, :, :5], r"lora_a must be \[num_slots, n_slices \* max_rank, in_features = "
                 r"6\] \(input's columns\), got shape \[2, 4, 5\]"),
    "lora_a-rank": ("lora_a", lambda t: t[:, :3], r"lora_a.size\(1\) must be n_slices \* max_rank = 2 \* 2 "
                    r"\(slice_offsets and lora_b.size\(2\)\) = 4, got shape \[2, 3, 6\]"),
    "lora_b-dim": ("lora_b", lambda t: t[0], r"lora_b must be 3-D \[num_slots, out_features, max_rank\]"),
    "lora_b-slots": ("lora_b", lambda t: t[:1], r"lora_b must be \[num_slots = 2 \(lora_a's\), out_features = 7 "
                     r"\(out's columns\), max_rank\], got shape \[1, 7, 2\]"),
    "lora_b-N": ("lora_b", lambda t: t[:, :6], r"lora_b must be \[num_slots = 2 .*got shape \[2, 6, 2\]"),
    "lora_b-rank": ("lora_b", lambda t: t[:, :, :1], r"lora_a.size\(1\) must be n_slices \* max_rank = 2 \* 1"),
    "out-dtype": ("out", lambda t: t.double(), "out must be float32, bfloat16 or float16, got Double"),
    "input-dtype": ("input", lambda t: t.bfloat16(), "input must have out's dtype Float, got BFloat16"),
    "lora_a-dtype": ("lora_a", lambda t: t.half(), "lora_a must have out's dtype Float, got Half"),
    "lora_b-dtype": ("lora_b", lambda t: t.bfloat16(), "lora_b must have out's dtype Float, got BFloat16"),
    "rows-dim": ("token_rows", lambda t: t[None], r"token_rows must be 1-D \[num_lora_rows\], got shape \[1, 3\]"),
    "rows-dtype": ("token_rows", lambda t: t.int(), "token_rows must be int64, got Int"),
    "starts-shape": ("slot_starts", lambda t: t[:2],
                     r"slot_starts must be 1-D \[num_slots \+ 1 = 3\], got shape \[2\]"),
    "starts-dtype": ("slot_starts", lambda t: t.int(), "slot_starts must be int64, got Int"),
    "row-high": ("token_rows", lambda t: torch.tensor([4, 5, 2]),
                 r"token_rows\[1\] = 5 is outside the 5 rows of input and out"),
    "row-negative": ("token_rows", lambda t: torch.tensor([4, 1, -1]), r"token_rows\[2\] = -1 is outside the 5 rows"),
    "starts-first": ("slot_starts", lambda t: torch.tensor([1, 2, 3]), r"slot_starts\[0\] must be 0, got 1"),
    "starts-decreasing": ("slot_starts", lambda t: torch.tensor([0, 3, 2]),
                          r"slot_starts must be nondecreasing, got slot_starts\[1\] = 3 > slot_starts\[2\] = 2"),
    "starts-end": ("slot_starts", lambda t: torch.tensor([0, 1, 2]),
                   r"slot_starts\[2\] \(the last\) must be the 3 token_rows, got 2"),
    "slices-one": ("slice_offsets", lambda o: [7], r"slice_offsets must hold n_slices \+ 1 >= 2 column offsets"),
    "slices-start": ("slice_offsets", lambda o: [1, 3, 7], "slice_offsets must start at 0 and end at out_features = 7"),
    "slices-end": ("slice_offsets", lambda o: [0, 3, 8], "slice_offsets must start at 0 and end at out_features = 7"),
    "slices-order": ("slice_offsets", lambda o: [0, 5, 3, 7], "slice_offsets must be strictly increasing"),
    "slices-empty": ("slice_offsets", lambda o: [0, 3, 3, 7], "slice_offsets must be strictly increasing"),
    "slices-count": ("slice_offsets", lambda o: [0, 2, 4, 7], r"lora_a.size\(1\) must be n_slices \* max_rank = 3"),
}


@pytest.mark.parametrize("name", list(BAD_CASES))
def test_lora_linear_add_rejects_bad_input(name):
    arg, change, match = BAD_CASES[name]
    args = _bad_case_inputs()
    args[arg] = change(args[arg])
    out = args["out"]
    before = out.clone()
    with ops.index_checks(True), pytest.raises(RuntimeError, match=match):
        ops.lora_linear_add(**args)
    assert torch.equal(out, before)  # refused before anything was written


@pytest.mark.parametrize("arg,value", [
    ("token_rows", torch.tensor([4, 1, 5])),  # a scattered slot's row out of range: index_select refuses it
    ("token_rows", torch.tensor([4, 1, 7])),  # a consecutive slot's row out of range: narrow refuses it
    ("slot_starts", torch.tensor([0, 3, 2])),
    ("slot_starts", torch.tensor([0, 2, 9])),
    ("slot_starts", torch.tensor([-4, 2, 3])),
], ids=["row-scattered", "row-consecutive", "starts-decreasing", "starts-past-end", "starts-negative"])
def test_lora_linear_add_without_index_checks_still_raises(arg, value):
    """With the value checks off a bad index still stops with an error on the CPU, never a crash."""
    args = _bad_case_inputs()
    args[arg] = value
    with ops.index_checks(False), pytest.raises((RuntimeError, IndexError)):
        ops.lora_linear_add(**args)


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a GPU and a CUDA build")
@pytest.mark.parametrize("arg", ["input", "lora_a", "lora_b", "token_rows", "slot_starts"])
def test_lora_linear_add_rejects_mixed_devices(arg):
    args = _bad_case_inputs()
    for name in ("out", "input", "lora_a", "lora_b", "token_rows", "slot_starts"):
        if name != arg:
            args[name] = args[name].cuda()
    with pytest.raises(RuntimeError, match=f"lora_linear_add: {arg} is on cpu but out is on cuda"):
        ops.lora_linear_add(**args)


def test_opcheck_lora_linear_add():
    args = _bad_case_inputs()
    torch.library.opcheck(torch.ops.pagedkv.lora_linear_add.default,
                          (args["out"], args["input"], args["lora_a"], args["lora_b"], args["token_rows"],
                           args["slot_starts"], args["slice_offsets"]))
