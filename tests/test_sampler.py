"""The sampler: filters against a reference, the repetition penalty against HF, draws, seeds, logprobs.

* `filter_logits` (top-k / top-p / min-p) equals a plain per-row reference on
  fixed logits with ties and per-row parameters. The order is vLLM's (v1):
  min-p on the row's distribution, then top-k, then top-p on the distribution
  renormalised over what is left (HF applies min-p last; the two differ only
  when top-p and min-p are both on).
* `apply_repetition_penalty` equals HF's RepetitionPenaltyLogitsProcessor.
* All-greedy (and greedy rows of a mixed batch) pick the argmax.
* Draws follow the filtered, temperature-scaled distribution (chi-square on 20k
  draws with a fixed seed and a bound far in the tail, so it never flakes).
* A row with its own generator draws the same tokens whatever else is in the batch.
* Logprobs: the sampled token with its raw logprob and rank, plus the top-k.
* End to end with the default model: a request seed reproduces its output
  across calls and batches; n=2 gives two samples; SamplingParams validates.
"""

from __future__ import annotations

import math

import pytest
import torch
from pagedkv.model.sampler import (
    Sampler,
    SamplingBatch,
    apply_allowed_tokens,
    apply_logit_biases,
    apply_output_penalties,
    apply_repetition_penalty,
    draw_from_cdf,
    filter_logits,
    greedy_tokens,
)
from pagedkv.sampling_params import SamplingParams

NEG_INF = float("-inf")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: on a small shared CPU, OpenMP barriers of 2+ threads stall for whole time slices
    (measured: 2 s a decode step of the default model with 2 threads under load, 0.16 s with 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- the reference filter ------------------------------------------------------------------------

def reference_keep(row: list[float], top_k: int, top_p: float, min_p: float) -> tuple[set[int], float]:
    """(token ids a row keeps, margin), computed in float64 Python, one filter after the other.

    min-p: drop tokens with prob < min_p * max prob. top-k (0: off): keep the k most likely of the rest.
    top-p: keep the smallest set of the most likely survivors whose renormalised cumulative probability
    reaches top_p (the token that crosses the threshold is kept). Ties are ordered by token id.
    margin: how far the closest min-p / top-p decision is from its threshold (relative to the threshold); a
    case closer than float32 rounding is not a fair test.
    """
    m = max(row)
    exps = [math.exp(x - m) for x in row]
    z = sum(exps)
    probs = [e / z for e in exps]
    order = sorted(range(len(row)), key=lambda i: (-row[i], i))
    pmax = max(probs)
    margin = math.inf
    if min_p > 0:
        floor = min_p * pmax
        margin = min([margin] + [abs(probs[i] - floor) / floor for i in order if row[i] != m])
    kept = [i for i in order if probs[i] >= min_p * pmax]
    if top_k > 0:
        kept = kept[:top_k]
    if top_p < 1.0:
        mass = sum(probs[i] for i in kept)
        out, cum = [], 0.0
        for i in kept:
            out.append(i)
            cum += probs[i] / mass
            margin = min(margin, abs(cum - top_p) / top_p)
            if cum >= top_p:
                break
        kept = out
    return set(kept), margin


def _check_filtered(logits: torch.Tensor, out: torch.Tensor, params: list[tuple[int, float, float]],
                    skip_close: bool = False) -> int:
    """out kept exactly the reference's tokens, up to the choice among tied logits, and left them unchanged.

    Returns the number of rows compared. A row whose reference decision is within 1e-4 (relative) of a
    threshold fails the test data (skip_close: is skipped instead).
    """
    assert out.shape == logits.shape
    checked = 0
    for r, (k, p, mp) in enumerate(params):
        kept = torch.isfinite(out[r])
        assert torch.equal(out[r][kept], logits[r][kept]), f"row {r}: kept logits were changed"
        assert torch.all(out[r][~kept] == NEG_INF), f"row {r}: dropped logits are not -inf"
        ref, margin = reference_keep(logits[r].tolist(), k, p, mp)
        if margin < 1e-4:
            assert skip_close, f"test data: row {r} (k={k}, p={p}, min_p={mp}) is at a threshold ({margin:.2g})"
            continue
        checked += 1
        ours_vals = sorted(logits[r][kept].tolist())
        ref_vals = sorted(logits[r][sorted(ref)].tolist())
        # Equal multisets of kept values: the same tokens, or another choice among equal logits at the boundary.
        assert ours_vals == ref_vals, f"row {r} (k={k}, p={p}, min_p={mp}): kept {kept.nonzero().flatten().tolist()}" \
                                      f", reference {sorted(ref)}"
    return checked


# Fixed logits: a peaked row, a flat row, rows with ties (at the top-k and top-p boundaries), a row where
# min-p and top-p interact, negative values. 8 tokens.
FIXED = torch.tensor([
    [4.0, 3.0, 2.5, 1.0, 0.0, -1.0, -2.0, -5.0],
    [0.1, 0.0, 0.2, -0.1, 0.05, 0.15, -0.05, 0.12],
    [2.0, 2.0, 2.0, 1.0, 1.0, 0.0, 0.0, -1.0],
    [1.0, 3.0, 3.0, 3.0, 0.5, 0.5, 2.0, -3.0],
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    [-1.0, -2.0, -0.5, -3.0, -0.5, -4.0, -0.7, -2.5],
    [10.0, 0.0, -10.0, 9.0, 8.5, 1.0, 2.0, 3.0],
    [math.log(0.42), math.log(0.31), math.log(0.19), math.log(0.08), -30.0, -30.0, -31.0, -40.0],
])

# (top_k, top_p, min_p) combinations: each alone, together, and off.
COMBOS = [
    (0, 1.0, 0.0), (1, 1.0, 0.0), (3, 1.0, 0.0), (5, 1.0, 0.0), (8, 1.0, 0.0), (20, 1.0, 0.0),
    (0, 0.55, 0.0), (0, 0.7, 0.0), (0, 0.9, 0.0), (0, 0.999, 0.0), (0, 0.01, 0.0),
    (0, 1.0, 0.1), (0, 1.0, 0.5), (0, 1.0, 0.95), (0, 1.0, 1.0),
    (3, 0.8, 0.0), (4, 0.9, 0.05), (0, 0.7, 0.3), (2, 0.6, 0.5), (6, 0.95, 0.2), (0, 0.45, 0.15),
]


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: f"k{c[0]}-p{c[1]}-minp{c[2]}")
def test_filter_logits_same_params_every_row(combo):
    k, p, mp = combo
    n = FIXED.shape[0]
    out = filter_logits(FIXED, torch.full((n,), k, dtype=torch.int64), torch.full((n,), p),
                        torch.full((n,), mp))
    _check_filtered(FIXED, out, [combo] * n)


def test_filter_logits_per_row_params():
    """Every row its own parameters, in one call; rows with a filter off are untouched by the others' filters."""
    rows, params = [], []
    for i, combo in enumerate(COMBOS):
        rows.append(FIXED[i % FIXED.shape[0]])
        params.append(combo)
    logits = torch.stack(rows)
    out = filter_logits(logits, torch.tensor([c[0] for c in params]), torch.tensor([c[1] for c in params]),
                        torch.tensor([c[2] for c in params]))
    _check_filtered(logits, out, params)
    assert torch.equal(out[0], logits[0])  # (0, 1.0, 0.0): nothing filtered


def test_filter_logits_flags_skip_filters():
    """use_top_k / use_top_p / use_min_p False: that filter is not applied, whatever the tensors say."""
    n = FIXED.shape[0]
    ks, ps, mps = torch.full((n,), 2), torch.full((n,), 0.55), torch.full((n,), 0.4)
    assert torch.equal(filter_logits(FIXED, ks, ps, mps, False, False, False), FIXED)
    _check_filtered(FIXED, filter_logits(FIXED, ks, ps, mps, True, False, False), [(2, 1.0, 0.0)] * n)
    _check_filtered(FIXED, filter_logits(FIXED, ks, ps, mps, False, True, False), [(0, 0.55, 0.0)] * n)
    _check_filtered(FIXED, filter_logits(FIXED, ks, ps, mps, False, False, True), [(0, 1.0, 0.4)] * n)


def test_filter_logits_random_rows_large_vocab():
    """Random logits over a 1000-token vocabulary, random parameters per row (top_p 1.0 rows among them)."""
    g = torch.Generator().manual_seed(3)
    n, vocab = 32, 1000
    logits = torch.randn(n, vocab, generator=g) * 3
    logits[:4] = logits[:4].round()  # many ties
    ks = torch.randint(0, 50, (n,), generator=g) * (torch.rand(n, generator=g) < 0.6)
    ps = torch.where(torch.rand(n, generator=g) < 0.7, torch.rand(n, generator=g) * 0.98 + 0.01, 1.0)
    mps = torch.where(torch.rand(n, generator=g) < 0.5, torch.rand(n, generator=g) * 0.3, 0.0)
    out = filter_logits(logits, ks, ps, mps)
    checked = _check_filtered(logits, out, list(zip(ks.tolist(), ps.tolist(), mps.tolist(), strict=True)),
                              skip_close=True)
    assert checked >= n - 2


@pytest.mark.parametrize("candidates", [1, 2, 16, 100])
def test_filter_logits_exact_whatever_the_candidate_count(candidates):
    """Top-p looks among a few candidates first and falls back to the full sort for wider nuclei: the result
    equals the reference either way (rows of the random set have nuclei of 1 to hundreds of tokens)."""
    g = torch.Generator().manual_seed(11)
    n, vocab = 24, 1000
    logits = torch.randn(n, vocab, generator=g) * torch.linspace(0.2, 6, n).unsqueeze(1)  # flat to peaked
    ks = torch.randint(0, 60, (n,), generator=g) * (torch.rand(n, generator=g) < 0.4)
    ps = torch.where(torch.rand(n, generator=g) < 0.8, torch.rand(n, generator=g) * 0.98 + 0.01, 1.0)
    mps = torch.where(torch.rand(n, generator=g) < 0.3, torch.rand(n, generator=g) * 0.2, 0.0)
    out = filter_logits(logits, ks, ps, mps, candidates=candidates)
    checked = _check_filtered(logits, out, list(zip(ks.tolist(), ps.tolist(), mps.tolist(), strict=True)),
                              skip_close=True)
    assert checked >= n - 4  # the rest sit within float32 rounding of a threshold
    fixed = filter_logits(FIXED, torch.tensor([0, 3, 0, 2, 0, 0, 1, 0]), torch.tensor([0.9, 0.8, 0.7, 1.0, 0.6,
                                                                                      0.99, 1.0, 1.0]),
                          torch.zeros(8), candidates=candidates)
    _check_filtered(FIXED, fixed, [(0, 0.9, 0.0), (3, 0.8, 0.0), (0, 0.7, 0.0), (2, 1.0, 0.0), (0, 0.6, 0.0),
                                   (0, 0.99, 0.0), (1, 1.0, 0.0), (0, 1.0, 0.0)])
    assert torch.equal(fixed[7], FIXED[7])  # a row with every filter off is left as it was


def test_top_p_one_keeps_the_whole_vocabulary():
    """top_p = 1.0 on a row of a batch where another row uses top-p: the row keeps every token, even ones of
    tiny probability (a float32 cumulative sum reaching 1.0 early must not cut the tail)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 50000, generator=g) * 4
    out = filter_logits(logits, torch.zeros(2, dtype=torch.int64), torch.tensor([1.0, 0.9]), torch.zeros(2))
    assert torch.isfinite(out[0]).all(), f"{int((~torch.isfinite(out[0])).sum())} tokens dropped with top_p=1"


def test_top_p_reached_exactly_keeps_no_more_tokens():
    """Four equally likely tokens (0.25 each, exact in float32) and top_p 0.5: the first two reach it, so the
    nucleus is those two (the smallest set whose mass is at least top_p)."""
    out = filter_logits(torch.zeros(1, 4), torch.zeros(1, dtype=torch.int64), torch.tensor([0.5]), torch.zeros(1))
    assert int(torch.isfinite(out).sum()) == 2


# --- repetition penalty ----------------------------------------------------------------------------

def test_repetition_penalty_matches_hf():
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 30, generator=g) * 2
    logits[0, 5] = 0.0  # a zero logit stays zero
    seen = [[5, 1, 1, 7, 20, 3], [2, 9, 9, 9], [], [0, 29, 14]]
    penalties = [1.3, 1.8, 1.5, 0.7]  # < 1 rewards repetition
    ours = logits.clone()
    apply_repetition_penalty(ours, [(p, s) for p, s in zip(penalties, seen, strict=True)])
    for r, (p, s) in enumerate(zip(penalties, seen, strict=True)):
        if not s:
            assert torch.equal(ours[r], logits[r])
            continue
        ref = RepetitionPenaltyLogitsProcessor(p)(torch.tensor([s]), logits[r:r + 1].clone())[0]
        torch.testing.assert_close(ours[r], ref, rtol=0, atol=0)
    # None and 1.0: untouched.
    other = logits.clone()
    apply_repetition_penalty(other, [None, (1.0, [1, 2, 3]), None, None])
    assert torch.equal(other, logits)


def _output_penalties_reference(logits, penalties):
    out = logits.clone()
    for row, item in enumerate(penalties):
        if item is None:
            continue
        presence, frequency, tokens = item
        for t in set(tokens):
            out[row, t] -= frequency * tokens.count(t) + presence
    return out


def test_output_penalties_match_the_per_token_rule():
    """OpenAI's presence / frequency rule over each row's output tokens (repeats counted), rows without
    penalties or without output untouched, an odd vocabulary."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(5, 1003, generator=g)
    penalties = [(0.5, 0.25, [3, 3, 3, 1002, 7]), None, (-1.0, 0.0, [0, 0]), (0.0, 2.0, []), (2.0, -2.0, [999, 4, 999])]
    out = logits.clone()
    apply_output_penalties(out, penalties)
    torch.testing.assert_close(out, _output_penalties_reference(logits, penalties))
    assert torch.equal(out[1], logits[1]) and torch.equal(out[3], logits[3])
    assert out[0, 3].item() == pytest.approx(logits[0, 3].item() - 0.5 - 3 * 0.25)


def test_logit_biases_and_allowed_tokens_apply_to_their_rows():
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(3, 517, generator=g)
    out = logits.clone()
    apply_logit_biases(out, [None, (torch.tensor([0, 516, 7]), torch.tensor([100.0, -100.0, 0.5])), None])
    expected = logits.clone()
    expected[1, 0] += 100.0
    expected[1, 516] -= 100.0
    expected[1, 7] += 0.5
    torch.testing.assert_close(out, expected)
    out = logits.clone()
    apply_allowed_tokens(out, [torch.tensor([5, 9, 516]), None, torch.tensor([0])])
    assert torch.isinf(out[0]).sum() == 517 - 3 and torch.equal(out[0, [5, 9, 516]], logits[0, [5, 9, 516]])
    assert torch.equal(out[1], logits[1])
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [0]


def test_sampler_shapes_logits_before_the_pick_and_reports_raw_logprobs():
    """Greedy and sampled rows: a +100 bias wins, an allow-list bounds every draw, a frequency penalty moves the
    argmax off a repeated token; the logprobs are of the raw logits, as vLLM reports them."""
    g = torch.Generator().manual_seed(13)
    logits = torch.randn(4, 300, generator=g)
    favourite = int(logits[0].argmax())
    batch = _batch(4, temperature=[0.0, 1.0, 0.0, 1.0], num_logprobs=[1, None, None, None])
    batch.biases = [(torch.tensor([17]), torch.tensor([100.0])), None, None, None]
    batch.allowed = [None, torch.tensor([4, 8, 15]), None, torch.tensor([16, 23, 42])]
    top = int(logits[2].argmax())
    batch.output_penalties = [None, None, (0.0, 2.0, [top] * 20), None]
    sampler = Sampler(torch.Generator().manual_seed(0))
    for _ in range(20):
        out = sampler(logits, batch)
        assert out.token_ids[0] == 17 and out.token_ids[1] in (4, 8, 15) and out.token_ids[3] in (16, 23, 42)
        assert out.token_ids[2] != top
    raw = logits.log_softmax(-1)
    assert out.logprobs[0][17].logprob == pytest.approx(raw[0, 17].item())
    assert out.logprobs[0][favourite].rank == 1  # the unbiased favourite is still rank 1 among raw logprobs


# --- greedy --------------------------------------------------------------------------------------------

def _batch(n: int, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, generators=None, penalties=None,
           num_logprobs=None, all_greedy=False, banned=None) -> SamplingBatch:
    def col(v, dtype):
        return torch.tensor(v if isinstance(v, list) else [v] * n, dtype=dtype)

    return SamplingBatch(all_greedy=all_greedy, temperatures=col(temperature, torch.float32),
                         top_ps=col(top_p, torch.float32), top_ks=col(top_k, torch.int64),
                         min_ps=col(min_p, torch.float32), generators=generators or [None] * n,
                         penalties=penalties or [None] * n, num_logprobs=num_logprobs or [None] * n,
                         banned=banned)


def test_all_greedy_is_argmax():
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(1))
    empty = torch.empty(0)
    batch = SamplingBatch(True, empty, empty, empty, empty, [None] * 16, [None] * 16, [None] * 16)
    out = Sampler(torch.Generator().manual_seed(0))(logits, batch)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 16


def test_greedy_rows_in_a_sampled_batch_are_argmax():
    """temperature 0 rows among sampled ones: argmax (of the penalised logits), whatever the draws."""
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(2))
    temps = [0.0, 1.0, 0.0, 2.0, 0.0, 0.7]
    penalties = [None, None, (2.0, [int(logits[2].argmax())]), None, None, None]
    expected = logits.clone()
    apply_repetition_penalty(expected, penalties)
    for seed in range(3):
        out = Sampler(torch.Generator().manual_seed(seed))(logits, _batch(6, temperature=temps, top_k=5,
                                                                           penalties=penalties))
        for r in (0, 2, 4):
            assert out.token_ids[r] == int(expected[r].argmax())
    assert int(expected[2].argmax()) != int(logits[2].argmax())  # the penalty changed the greedy pick


@pytest.mark.parametrize("filt", [dict(top_k=1), dict(top_p=0.01), dict(min_p=0.99)], ids=lambda f: next(iter(f)))
def test_a_filter_on_one_row_of_a_batch_applies_to_that_row(filt):
    """One row of 8 keeps only its most likely token (top_k 1, a tiny top_p, a min_p near 1); the others draw
    unfiltered from the same nearly flat logits, so they spread over the vocabulary."""
    n, vocab = 8, 50
    logits = torch.zeros(n, vocab)
    logits[:, 17] = 0.5  # the most likely token, with e^0.5 / (49 + e^0.5), about 3%, of the mass
    name, value = next(iter(filt.items()))
    off = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}[name]
    batch = _batch(n, **{name: [off] * 3 + [value] + [off] * 4})
    sampler = Sampler(torch.Generator().manual_seed(5))
    draws = [sampler(logits, batch).token_ids for _ in range(40)]
    assert all(d[3] == 17 for d in draws)
    assert len({d[r] for d in draws for r in (0, 1, 2, 4, 5, 6, 7)}) > 20


# --- the draw follows the distribution -----------------------------------------------------------------

LOGITS5 = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
DRAWS = 20000
# chi-square with <= 4 degrees of freedom exceeds 35 with probability < 1e-6; the seed is fixed anyway.
CHI2_BOUND = 35.0


@pytest.mark.parametrize("params", [
    dict(temperature=1.0), dict(temperature=0.5), dict(temperature=1.7, top_k=3), dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.0, min_p=0.2), dict(temperature=1.3, top_k=4, top_p=0.9, min_p=0.05),
], ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fused", "torch"])
def test_draws_follow_the_filtered_distribution(params, dtype):
    """float32 on the CPU draws in the fused op; other dtypes (and CUDA) take the torch path (softmax, cumsum,
    draw_from_cdf), here in float64."""
    t = params["temperature"]
    k, p, mp = params.get("top_k", 0), params.get("top_p", 1.0), params.get("min_p", 0.0)
    scaled = (LOGITS5 / t).tolist()
    keep, margin = reference_keep(scaled, k, p, mp)
    assert margin > 1e-3 and len(keep) >= 2
    weights = torch.tensor([math.exp(x) if i in keep else 0.0 for i, x in enumerate(scaled)], dtype=torch.float64)
    expected = weights / weights.sum() * DRAWS
    logits = LOGITS5.expand(DRAWS, 5).contiguous().to(dtype)
    out = Sampler(torch.Generator().manual_seed(1234))(logits, _batch(DRAWS, **params))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=5).double()
    assert counts[expected == 0].sum() == 0, f"filtered tokens were drawn: {counts.tolist()}"
    inside = expected > 0
    assert expected.sum().item() == pytest.approx(DRAWS) and counts.sum().item() == DRAWS
    chi2 = (((counts - expected) ** 2)[inside] / expected[inside]).sum().item()
    assert chi2 < CHI2_BOUND, f"chi2 {chi2:.1f}: counts {counts.tolist()}, expected {expected.tolist()}"


def test_draw_never_picks_a_filtered_token_at_the_extremes_of_u():
    weights = torch.tensor([[0.0, 0.0, 3.0, 0.0, 1.0, 0.0, 0.0]] * 4)  # zeros before, between and after
    cdf = weights.cumsum(-1)
    u = torch.tensor([[0.0], [0.75], [0.7501], [1.0 - 2.0 ** -24]])  # token 2 owns (0, 3], token 4 (3, 4]
    assert draw_from_cdf(cdf, u).tolist() == [2, 2, 4, 4]


def test_draw_of_a_nan_row_stays_in_the_vocabulary():
    cdf = torch.tensor([[1.0, 2.0, 3.0], [float("nan")] * 3])
    assert draw_from_cdf(cdf, torch.tensor([[0.5], [0.5]])).tolist() == [1, 2]


def test_penalties_and_bans_apply_to_the_rows_that_have_them():
    """Greedy rows: a penalty on every row (not only some) moves each argmax; a ban on one row of three moves
    that row's alone."""
    logits = torch.tensor([[3.0, 2.0, 1.0]] * 3)
    sampler = Sampler(torch.Generator().manual_seed(0))
    penalised = _batch(3, temperature=0.0, all_greedy=True, penalties=[(4.0, [0])] * 3)
    assert sampler(logits, penalised).token_ids == [1, 1, 1]
    banned = _batch(3, temperature=0.0, all_greedy=True, banned=[None, [0, 1], None])
    assert sampler(logits, banned).token_ids == [0, 2, 0]


def test_logprobs_of_a_row_after_one_that_wants_none():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(3))
    out = Sampler()(logits, _batch(3, temperature=0.0, num_logprobs=[None, 2, None], all_greedy=True))
    assert out.logprobs[0] is None and out.logprobs[2] is None
    assert len(out.logprobs[1]) == 2 and int(logits[1].argmax()) in out.logprobs[1]


def test_draws_depend_on_the_generator():
    """Sanity for the tests above: another engine seed gives other draws, the same seed the same ones."""
    logits = LOGITS5.expand(200, 5).contiguous()
    a = Sampler(torch.Generator().manual_seed(1))(logits, _batch(200)).token_ids
    b = Sampler(torch.Generator().manual_seed(1))(logits, _batch(200)).token_ids
    c = Sampler(torch.Generator().manual_seed(2))(logits, _batch(200)).token_ids
    assert a == b and a != c


# --- seeded rows ---------------------------------------------------------------------------------------

def test_seeded_row_independent_of_the_batch():
    """A row with its own generator draws the same tokens over many steps, alone or among other rows
    (at another index, with other sizes and parameters), whatever the engine generator."""
    vocab = 64
    g = torch.Generator().manual_seed(9)
    steps = [torch.randn(vocab, generator=g) for _ in range(25)]  # the seeded row's logits at each step

    def run(position: int, others: int, engine_seed: int, row_seed: int = 77) -> list[int]:
        gen = torch.Generator().manual_seed(row_seed)
        sampler = Sampler(torch.Generator().manual_seed(engine_seed))
        tokens = []
        n = others + 1
        for i, row_logits in enumerate(steps):
            logits = torch.randn(n, vocab, generator=g)
            logits[position] = row_logits
            gens = [None] * n
            gens[position] = gen
            temps = [0.5 + (j % 3) * 0.5 for j in range(n)]
            temps[position] = 1.0
            out = sampler(logits, _batch(n, temperature=temps, top_k=[0] * n, generators=gens,
                                         top_p=[0.95 if i % 2 else 1.0] * n))
            tokens.append(out.token_ids[position])
        return tokens

    alone = run(0, 0, engine_seed=0)
    assert run(3, 7, engine_seed=1) == alone
    assert run(0, 2, engine_seed=2) == alone
    assert run(1, 1, engine_seed=0, row_seed=78) != alone  # the row's seed, not chance, fixes the tokens
    assert len(set(alone)) > 5  # it really samples


# --- logprobs ------------------------------------------------------------------------------------------

def test_logprobs_sampled_token_rank_and_top():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 40, generator=g) * 2
    raw = logits.log_softmax(-1)
    top = int(logits[1].argmax())
    # Row 1: greedy with a penalty on its top token, so the sampled token is not the most likely one (rank 2).
    penalties = [None, (100.0, [top]) if logits[1, top] > 0 else (0.01, [top]), None, None]
    batch = _batch(4, temperature=[1.0, 0.0, 0.7, 1.0], penalties=penalties, num_logprobs=[3, 1, 0, None])
    out = Sampler(torch.Generator().manual_seed(0))(logits, batch)
    assert out.logprobs[3] is None
    for r, k in enumerate([3, 1, 0]):
        tok = out.token_ids[r]
        d = out.logprobs[r]
        rank = int((raw[r] > raw[r, tok]).sum()) + 1
        assert d[tok].rank == rank
        assert d[tok].logprob == pytest.approx(raw[r, tok].item(), abs=1e-6)
        vals, ids = raw[r].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        for i, (t, v) in enumerate(zip(ids.tolist(), vals.tolist(), strict=True), start=1):
            assert d[t].rank == i and d[t].logprob == pytest.approx(v, abs=1e-6)
        assert set(d) == set(ids.tolist()) | {tok}
    assert out.token_ids[1] != top and out.logprobs[1][out.token_ids[1]].rank == 2
    assert len(out.logprobs[1]) == 2  # the top-1 token and the sampled one


# --- end to end with the default model -------------------------------------------------------------------

PROMPT = "The capital of France is"
OTHERS = ["Once upon a time", "def fibonacci(n):", "List three colours: red,"]


@pytest.fixture(scope="session")
def sampler_llm():
    from pagedkv import LLM

    return LLM(dtype="float32", kv_cache_memory=256 << 20, max_model_len=512)


def _tokens(outputs) -> list[list[int]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_seed_reproducible_across_calls_and_batches(sampler_llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=8, ignore_eos=True)
    first = sampler_llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    again = sampler_llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(first) == 8 and first == again
    unseeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    batched = sampler_llm.generate([OTHERS[0], PROMPT, OTHERS[1], OTHERS[2]], [unseeded, params, unseeded, unseeded],
                                   use_tqdm=False)
    assert batched[1].outputs[0].token_ids == first
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=8, ignore_eos=True)
    assert sampler_llm.generate(PROMPT, other_seed, use_tqdm=False)[0].outputs[0].token_ids != first


def test_n2_gives_two_samples(sampler_llm):
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    out = sampler_llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert out.outputs[0].token_ids != out.outputs[1].token_ids  # seeds 7 and 8: different samples
    assert _tokens(sampler_llm.generate(PROMPT, params, use_tqdm=False)) == _tokens([out])
    greedy = sampler_llm.generate(PROMPT, SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True),
                                  use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_logit_bias_allowed_ids_and_penalties_end_to_end(sampler_llm):
    """On the default model: a +100 bias makes greedy pick that token every step; allowed_token_ids bounds a
    sampled output; with a presence penalty every greedy token is the argmax of (raw logprob - penalty if
    already in the output) among the top-20 raw candidates returned."""
    biased = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logit_bias={"42": 100.0})
    assert sampler_llm.generate(PROMPT, biased, use_tqdm=False)[0].outputs[0].token_ids == [42] * 4
    allowed = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, allowed_token_ids=[11, 12, 13])
    assert set(sampler_llm.generate(PROMPT, allowed, use_tqdm=False)[0].outputs[0].token_ids) <= {11, 12, 13}
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    penalized = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, presence_penalty=2.0, logprobs=20)
    base, out = (sampler_llm.generate(OTHERS[2], p, use_tqdm=False)[0].outputs[0] for p in (plain, penalized))
    assert out.token_ids != base.token_ids
    for i, (tok, lps) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        seen = set(out.token_ids[:i])
        scores = {t: lp.logprob - (2.0 if t in seen else 0.0) for t, lp in lps.items()}
        assert tok == max(scores, key=scores.get), i


def test_logprobs_end_to_end(sampler_llm):
    out = sampler_llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=4, logprobs=2),
                               use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, d in zip(out.token_ids, out.logprobs, strict=True):
        assert d[tok].rank == 1 and d[tok].logprob <= 0.0  # greedy: the sampled token is the most likely
        assert sorted(lp.rank for lp in d.values()) == [1, 2]
    assert out.cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(out.token_ids, out.logprobs,
                                                                                     strict=True)))


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(n=0), dict(top_k=-2), dict(min_p=1.5),
    dict(min_p=-0.1), dict(max_tokens=0), dict(logprobs=-1), dict(repetition_penalty=0.0), dict(seed=1.5),
    dict(min_tokens=5, max_tokens=2), dict(stop=[""]), dict(presence_penalty=2.01), dict(frequency_penalty=-2.5),
    dict(frequency_penalty=float("nan")), dict(logit_bias={5: 100.5}), dict(logit_bias={"-1": 1.0}),
    dict(logit_bias={"x": 1.0}), dict(logit_bias={1.5: 1.0}), dict(logit_bias=[1, 2]),
    dict(logit_bias={i: 1.0 for i in range(1025)}), dict(allowed_token_ids=[]), dict(allowed_token_ids=[-1]),
], ids=lambda k: "-".join(f"{a}={str(b)[:20]}" for a, b in k.items()))
def test_sampling_params_validation(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_sampling_params_valid_edges():
    assert SamplingParams(top_k=-1).top_k == 0
    edges = SamplingParams(presence_penalty=-2, frequency_penalty=2.0, logit_bias={"7": -100, 8: 100.0},
                           allowed_token_ids=[0])
    assert edges.logit_bias == {7: -100.0, 8: 100.0} and edges.presence_penalty == -2.0 and edges.shapes_logits
    assert SamplingParams(logit_bias={}).logit_bias is None and not SamplingParams().shapes_logits
    assert len(SamplingParams(logit_bias={i: 1.0 for i in range(1024)}).logit_bias) == 1024
    assert SamplingParams(temperature=0.0).greedy
    SamplingParams(top_p=1.0, min_p=1.0, top_k=5, n=3, max_tokens=None, logprobs=0, seed=0)  # all valid


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_is_argmax_with_the_first_index_on_ties(dtype):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(7, 1001, generator=g).to(dtype)
    logits[2, [10, 500, 999]] = 50.0  # a three-way tie: the first index wins
    logits[4, :] = -3.0               # every entry tied
    logits[5, 77] = float("inf")
    logits[6, [3, 700]] = float("nan")  # a broken row: the first NaN, as torch's max and argmax give
    tokens = greedy_tokens(logits)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(-1))
    assert tokens[2] == 10 and tokens[4] == 0 and tokens[5] == 77 and tokens[6] == 3


# --- ops.sample_from_logits: the fused draw on the CPU ---------------------------------------------

def _valid_draw(logits_row: torch.Tensor, temperature: float, u: float, token: int) -> bool:
    """Whether token is where the exact (float64) cumulative weights reach u times the total, give or take
    1e-5 of the total (fp32 sums in either order land within that), and the token has weight > 0."""
    s = logits_row.double() / temperature
    w = torch.exp(s - s.max())
    c = w.cumsum(0)
    x = u * c[-1].item()
    tol = 1e-5 * c[-1].item()
    before = c[token - 1].item() if token > 0 else 0.0
    return w[token].item() > 0 and before <= x + tol and c[token].item() >= x - tol


@pytest.mark.parametrize("variant", ["default", "avx2", "avx512"])
@pytest.mark.parametrize("vocab", [1, 7, 255, 256, 257, 1000, 49155])
def test_sample_from_logits_matches_the_reference(vocab, variant):
    from pagedkv import ops, reference

    if not ops.cpu_capability_runs(variant):
        pytest.skip(f"this CPU cannot run the {variant} kernels")
    gen = torch.Generator().manual_seed(vocab)
    rows = 64
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[rows // 2:, ::5] = float("-inf")  # filtered tokens (weight 0) in half the rows
    logits[rows // 2:, -1] = 0.0  # (at least one token stays)
    temps = torch.tensor([0.0, 0.3, 1.0, 2.5] * (rows // 4))
    u = torch.rand(rows, generator=gen)
    previous = ops.set_cpu_capability(variant)
    try:
        tokens = ops.sample_from_logits(logits, temps, u)
    finally:
        ops.set_cpu_capability(previous)
    expected = reference.sample_from_logits(logits, temps, u)
    greedy = temps == 0
    assert torch.equal(tokens[greedy], logits[greedy].max(-1).indices)
    for r in (~greedy).nonzero().flatten().tolist():
        assert _valid_draw(logits[r], temps[r].item(), u[r].item(), int(tokens[r])), (r, int(tokens[r]),
                                                                                      int(expected[r]))
    # The sums differ from torch's in rounding only: a boundary within ~1e-7 of the total is rare.
    assert (tokens == expected).float().mean().item() >= 0.9


def test_sample_from_logits_extremes_and_non_finite_rows():
    from pagedkv import ops

    inf, nan = float("inf"), float("nan")
    weights = [-inf, -inf, math.log(3.0), -inf, 0.0, -inf, -inf]  # token 2 owns 3/4 of the mass, token 4 1/4
    logits = torch.tensor([weights] * 4 + [[0.0, nan, 1.0, nan, 0.0, 0.0, 0.0], [-inf] * 7,
                                            [0.0, nan, 1.0, nan, 0.0, 0.0, 0.0]])
    temps = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    u = torch.tensor([0.0, 0.7, 0.8, 1.0 - 2.0 ** -24, 0.5, 0.5, 0.5])
    tokens = ops.sample_from_logits(logits, temps, u).tolist()
    # u = 0 takes the first token of weight > 0, u -> 1 the last; NaN or all -inf: the last token, as
    # the torch sequence's searchsorted gives; greedy over NaN: the first NaN, as max(-1).indices.
    assert tokens == [2, 2, 4, 4, 6, 6, 1]


@pytest.mark.parametrize("case,match", [
    (lambda x, t, u: (x.bfloat16(), t, u), "logits must be float32"),
    (lambda x, t, u: (x[0], t, u), r"logits must be 2-D"),
    (lambda x, t, u: (x.t().contiguous().t(), t, u), "logits rows must be dense"),
    (lambda x, t, u: (x, t[:2], u), r"temperatures must be 1-D \[3\]"),
    (lambda x, t, u: (x, t.double(), u), "temperatures must be Float"),
    (lambda x, t, u: (x, torch.tensor([1.0, -0.5, 1.0]), u), r"temperatures\[1\] = -0.5 must be finite and >= 0"),
    (lambda x, t, u: (x, torch.tensor([1.0, float("nan"), 1.0]), u), r"temperatures\[1\] = nan"),
    (lambda x, t, u: (x, t, torch.tensor([0.5, 1.0, 0.5])), r"uniforms\[1\] = 1 must be in \[0, 1\)"),
    (lambda x, t, u: (x[:, :0], t, u), "the vocabulary must not be empty"),
], ids=["dtype", "dim", "strided", "temps-shape", "temps-dtype", "temps-negative", "temps-nan", "u-one", "empty"])
def test_sample_from_logits_rejects_bad_input(case, match):
    from pagedkv import ops

    logits, temps, u = case(torch.randn(3, 10), torch.ones(3), torch.full((3,), 0.5))
    with pytest.raises(RuntimeError, match=match):
        ops.sample_from_logits(logits, temps, u)


def test_sampler_draws_with_the_fused_op_after_the_filters(monkeypatch):
    """On the CPU every draw goes through ops.sample_from_logits: temperature-only batches straight from the
    logits, top-k / top-p / min-p batches from the filtered, temperature-scaled logits (at temperature 1)."""
    import pagedkv.model.sampler as sampler_module
    from pagedkv import ops

    calls, filtered = [], []
    real_op, real_filter = ops.sample_from_logits, sampler_module.filter_logits
    monkeypatch.setattr(ops, "sample_from_logits", lambda *a, **k: calls.append(a[1].tolist()) or real_op(*a, **k))
    monkeypatch.setattr(sampler_module, "filter_logits", lambda *a, **k: filtered.append(1) or real_filter(*a, **k))
    logits = torch.randn(4, 50)
    Sampler(torch.Generator().manual_seed(0))(logits, _batch(4, temperature=0.7))
    assert len(calls) == 1 and calls[0] == pytest.approx([0.7] * 4) and not filtered
    Sampler(torch.Generator().manual_seed(0))(logits, _batch(4, temperature=0.7, top_p=0.9))
    assert len(calls) == 2 and calls[1] == [1.0] * 4 and filtered == [1]


# --- ops.apply_token_bitmask: structured outputs' token masks on the CPU ---------------------------------------

@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1003, 49152])
def test_apply_token_bitmask_matches_the_reference(vocab):
    """Random words, and the special ones (all allowed, all forbidden, only bit 31), on a subset of the rows in
    any order; the last word's padding bits never reach past the vocabulary."""
    from pagedkv import ops, reference

    gen = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (5, words), dtype=torch.int32, generator=gen)
    bitmask[0], bitmask[1] = -1, 0
    bitmask[2, 0] = -2 ** 31  # only token 31 allowed in the first word
    logits = torch.randn(7, vocab, generator=gen)
    rows = torch.tensor([6, 0, 3, 2, 5])
    got = ops.apply_token_bitmask(logits.clone(), bitmask, rows)
    want = reference.apply_token_bitmask(logits.clone(), bitmask, rows)
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 4]], logits[[1, 4]])  # rows without a mask untouched
    assert torch.equal(got[6], logits[6]) and bool(torch.isneginf(got[0]).all())
    # A strided batch of logits (rows of a wider buffer) is masked where it lies.
    wide = torch.randn(7, vocab + 5, generator=gen)
    view = wide[:, :vocab]
    expect = reference.apply_token_bitmask(view.clone(), bitmask, rows)
    ops.apply_token_bitmask(view, bitmask, rows)
    assert torch.equal(view, expect)


@pytest.mark.parametrize("case,match", [
    (lambda x, b, r: (x.bfloat16(), b, r), "logits must be float32"),
    (lambda x, b, r: (x[0], b, r), "logits must be 2-D"),
    (lambda x, b, r: (x.t().contiguous().t(), b, r), "logits rows must be dense"),
    (lambda x, b, r: (x, b[:, :1], r), r"bitmask must be 2-D \[num_masks, ceil\(vocab / 32\) = 2\]"),
    (lambda x, b, r: (x, b.long(), r), "bitmask must be int32"),
    (lambda x, b, r: (x, b.t().contiguous().t(), r), "bitmask must be a contiguous CPU tensor"),
    (lambda x, b, r: (x, b, r[:1]), r"rows must be 1-D \[2\]"),
    (lambda x, b, r: (x, b, r.int()), "rows must be Long"),
    (lambda x, b, r: (x, b, torch.tensor([0, 3])), r"rows\[1\] = 3 is outside the 3 logits rows"),
    (lambda x, b, r: (x, b, torch.tensor([-1, 0])), r"rows\[0\] = -1 is outside"),
], ids=["dtype", "dim", "strided", "words", "mask-dtype", "mask-strided", "rows-shape", "rows-dtype", "rows-high",
        "rows-negative"])
def test_apply_token_bitmask_rejects_bad_input(case, match):
    from pagedkv import ops

    logits, bitmask, rows = case(torch.randn(3, 40), torch.zeros(2, 2, dtype=torch.int32), torch.tensor([0, 2]))
    before = logits.clone()
    with pytest.raises(RuntimeError, match=match):
        ops.apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, before)  # refused before anything was written
