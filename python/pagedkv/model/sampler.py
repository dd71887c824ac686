"""Picking the next token of every sampled row at once.

Rows are sequences whose next token is due this step. Greedy batches take
one argmax. Otherwise, per row: repetition penalty, temperature, then the
top-k / top-p / min-p filters, then a draw. The draw inverts each row's
cumulative distribution at one uniform number (the first token whose running
sum of exp(logit - max) passes u times the total), which samples from p
exactly and costs one random number per row: drawing a random number per
vocabulary entry (the exponential race, or Gumbel-max) took 18x the time of a
greedy step on the CPU (48 rows x 49k: 48 ms against 2.6 ms). A row with its
own seed draws its u from its own generator, so its tokens do not depend on
what else is in the batch. On the CPU one fused op (`ops.sample_from_logits`)
does the draw in two passes over the (filtered) logits.
Log-probabilities are of the model's raw distribution (before penalties,
temperature and filters), as in vLLM.

Before the pick, in vLLM's order: the structured-outputs grammar's token
mask (pagedkv.structured_outputs), the allow-list (allowed_token_ids), the
logit biases, the repetition penalty, the presence / frequency penalties
over the output's token counts (one scatter for all penalized rows), and the
min_tokens ban. Each is skipped unless some row of the step asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedkv import ops
from pagedkv.outputs import Logprob, SamplerOutput
from pagedkv.structured_outputs import apply_token_masks


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters of one step, built by the model runner.

    temperatures, top_ps, min_ps: float32 [n]; top_ks: int64 [n] (0 = off);
    generators[i]: a row's own generator or None (the engine's);
    penalties[i]: (repetition_penalty, token ids seen so far) or None;
    num_logprobs[i]: top logprobs wanted (None: none);
    banned[i]: token ids row i may not sample now (those completing a bad word; EOS and stop tokens before
    min_tokens), or None;
    allowed[i]: int64 token ids row i may sample (the others are masked), or None;
    biases[i]: (int64 ids, float32 values) added to row i's logits, or None;
    output_penalties[i]: (presence, frequency, the row's output token ids) or None;
    grammars[i]: row i's structured-outputs grammar matcher (only the tokens it allows may be sampled), or None.
    """

    all_greedy: bool
    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    min_ps: torch.Tensor
    generators: list[torch.Generator | None]
    penalties: list[tuple[float, list[int]] | None]
    num_logprobs: list[int | None]
    banned: list[list[int] | None] | None = None
    allowed: list[torch.Tensor | None] | None = None
    biases: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None
    output_penalties: list[tuple[float, float, list[int]] | None] | None = None
    grammars: list[Any | None] | None = None

    @property
    def needs_filters(self) -> tuple[bool, bool, bool]:
        return (bool((self.top_ks > 0).any()), bool((self.top_ps < 1.0).any()), bool((self.min_ps > 0.0).any()))


def apply_repetition_penalty(logits: torch.Tensor, penalties: list[tuple[float, list[int]] | None]) -> None:
    """In place: a seen token's logit is divided by the penalty if positive, multiplied if negative (HF's rule)."""
    for row, item in enumerate(penalties):
        if item is None or item[0] == 1.0:
            continue
        penalty, seen = item
        idx = torch.tensor(sorted(set(seen)), dtype=torch.long, device=logits.device)
        vals = logits[row, idx]
        logits[row, idx] = torch.where(vals > 0, vals / penalty, vals * penalty)


def apply_allowed_tokens(logits: torch.Tensor, allowed: list[torch.Tensor | None]) -> None:
    """In place: every token outside a row's allow-list gets -inf."""
    for row, ids in enumerate(allowed):
        if ids is not None:
            keep = logits[row, ids]
            logits[row].fill_(float("-inf"))
            logits[row, ids] = keep


def apply_logit_biases(logits: torch.Tensor, biases: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
    """In place: each row's (ids, values) added to those logits."""
    for row, item in enumerate(biases):
        if item is not None:
            logits[row].index_add_(0, item[0], item[1])


def apply_output_penalties(logits: torch.Tensor, penalties: list[tuple[float, float, list[int]] | None]) -> None:
    """In place, OpenAI's rule: logit -= frequency x (times the token is in the output) + presence x (it is).

    The counts of every penalized row come from one scatter-add of its output tokens into [rows, vocab].
    """
    rows = [i for i, item in enumerate(penalties) if item is not None and item[2]]
    if not rows:
        return
    device = logits.device
    index = torch.tensor(rows, dtype=torch.long, device=device)
    lengths = torch.tensor([len(penalties[i][2]) for i in rows], device=device)
    tokens = torch.tensor([t for i in rows for t in penalties[i][2]], dtype=torch.long, device=device)
    counts = torch.zeros(len(rows), logits.shape[1], dtype=logits.dtype, device=device)
    counts.index_put_((torch.arange(len(rows), device=device).repeat_interleave(lengths), tokens),
                      torch.ones_like(tokens, dtype=logits.dtype), accumulate=True)
    presence = torch.tensor([penalties[i][0] for i in rows], dtype=logits.dtype, device=device).unsqueeze(1)
    frequency = torch.tensor([penalties[i][1] for i in rows], dtype=logits.dtype, device=device).unsqueeze(1)
    logits.index_copy_(0, index, logits.index_select(0, index) - frequency * counts - presence * (counts > 0))


def apply_bans(logits: torch.Tensor, banned: list[list[int] | None]) -> None:
    """In place: each row's banned token ids get -inf."""
    for row, ids in enumerate(banned):
        if ids:
            logits[row, ids] = float("-inf")


def _any_row(rows: list | None) -> bool:
    """Whether some row has an entry (a per-row list counts only when not empty)."""
    return bool(rows) and any(r is not None and (not isinstance(r, list) or r) for r in rows)


# Top-p looks for its nucleus among this many most likely tokens first (a partial top-k, not a sort of the
# vocabulary: a full sort of 48 rows x 49k took ~100 ms on the CPU); a row whose nucleus is wider falls back
# to the full sort, so the result is exact either way.
TOP_P_CANDIDATES = 1024


def filter_logits(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor,
                  use_top_k: bool = True, use_top_p: bool = True, use_min_p: bool = True,
                  candidates: int = TOP_P_CANDIDATES) -> torch.Tensor:
    """Masks (-inf) every token outside each row's top-k, top-p nucleus and min-p floor. logits: [n, vocab].

    Rows whose top-k and top-p are off are returned unchanged.
    """
    if use_min_p:
        probs = logits.softmax(-1)
        floor = probs.amax(-1, keepdim=True) * min_ps.unsqueeze(1)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if not (use_top_k or use_top_p):
        return logits
    vocab = logits.shape[-1]
    ks = torch.where(top_ks > 0, top_ks, vocab).clamp(max=vocab) if use_top_k else torch.full_like(top_ks, vocab)
    ps = top_ps if use_top_p else torch.ones_like(top_ps)
    active = (ks < vocab) | (ps < 1.0)
    if not bool(active.any()):
        return logits
    rows = active.nonzero().squeeze(1)
    sub, k, p = logits.index_select(0, rows), ks.index_select(0, rows), ps.index_select(0, rows)
    widest_k = int(k.masked_fill(k >= vocab, 0).max())
    width = widest_k if bool((p >= 1.0).all()) else max(widest_k, candidates)
    kept, exact = _keep_top(sub, k, p, min(width, vocab))
    if not bool(exact.all()):  # nuclei wider than the candidates: the full sort for those rows
        wide = (~exact).nonzero().squeeze(1)
        kept[wide] = _keep_top(sub[wide], k[wide], p[wide], vocab)[0]
    out = logits.clone()
    out[rows] = kept
    return out


def _keep_top(logits: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor,
              width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k then top-p among each row's `width` most likely tokens (width >= every row's k below vocab).

    Returns the filtered rows and, per row, whether that is exact: the top-k survivors all lie among the
    candidates, and so does the top-p nucleus (its cut came before the last candidate).
    """
    vocab = logits.shape[-1]
    vals, order = logits.topk(width, dim=-1)  # sorted, most likely first
    has_k = (ks < vocab).unsqueeze(1)
    drop = torch.arange(width, device=logits.device).unsqueeze(0) >= ks.unsqueeze(1)
    # Top-p's probabilities are over the top-k survivors, or over the whole row without top-k.
    norm = vals.masked_fill(drop, float("-inf")).logsumexp(-1, keepdim=True)
    if not bool(has_k.all()):  # the whole-row normalizer only where some row needs it
        norm = torch.where(has_k, norm, logits.logsumexp(-1, keepdim=True))
    probs = (vals - norm).exp().masked_fill(drop, 0.0)
    before = probs.cumsum(-1) - probs  # mass strictly before each token: keep while it is under top_p
    # top_p = 1 is off: a float32 cumulative sum can reach 1.0 before the tail, which must stay.
    cut = (before >= ps.unsqueeze(1)) & (ps < 1.0).unsqueeze(1)
    exact = has_k.squeeze(1) | cut.any(-1) | (width == vocab)
    drop |= cut
    drop[:, 0] = False  # the most likely token always stays
    out = torch.full_like(logits, float("-inf"))
    return out.scatter(-1, order, vals.masked_fill(drop, float("-inf"))), exact


def draw_from_cdf(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the token at which the cumulative weights `cdf` [n, vocab] reach u [n, 1] in [0, 1) of the total.

    The first j with cdf[j] >= x for x = u * total, with 0 < x <= total (u < 1, and x kept off 0): then
    cdf[j-1] < x <= cdf[j], so token j has weight > 0 and a filtered-out token is never picked, whatever u is.
    """
    x = (u * cdf[:, -1:]).clamp_(min=torch.finfo(cdf.dtype).tiny)
    return torch.searchsorted(cdf, x).squeeze(1).clamp_(max=cdf.shape[1] - 1)  # the clamp: NaN rows only


def _logprob_dicts(raw_logprobs: torch.Tensor, tokens: torch.Tensor, wanted: list[int | None]):
    out: list[dict[int, Logprob] | None] = []
    for row, k in enumerate(wanted):
        if k is None:
            out.append(None)
            continue
        lp = raw_logprobs[row]
        tok = int(tokens[row])
        tok_lp = float(lp[tok])
        entry = {tok: Logprob(tok_lp, int((lp > tok_lp).sum()) + 1)}
        if k:
            top_vals, top_ids = lp.topk(k)
            for rank, (t, v) in enumerate(zip(top_ids.tolist(), top_vals.tolist(), strict=True), start=1):
                entry.setdefault(t, Logprob(v, rank))
        out.append(entry)
    return out


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[num_rows, vocab] -> [num_rows] int64: each row's argmax, the first index on ties.

    `max(-1).indices` is the same index (torch returns the first maximal one for both) at a
    fraction of the cost on the CPU: 0.55 ms against 3.2 ms for `argmax` on 27 x 49152 bf16
    logits, 1.7 ms of every greedy step of the offline benchmark (Xeon, 2026-12-05).
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous() and logits.numel():
        # The fused op's temperature-0 rows: the same first maximum from one vectorized pass over each
        # row, rows split over the threads (max(-1) ran on one: 0.73 ms of each 27-row greedy step).
        # A row holding NaN gives its first NaN's index, as max(-1) does.
        zeros = logits.new_zeros(logits.shape[0])
        return ops.sample_from_logits(logits, zeros, zeros)
    return logits.max(-1).indices


class Sampler:
    """Turns float32 logits [n, vocab] and a SamplingBatch into one token per row."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        want_logprobs = any(k is not None for k in batch.num_logprobs)
        raw_logprobs = logits.log_softmax(-1) if want_logprobs else None
        logits = self._shape(logits, batch)
        if batch.all_greedy:
            tokens = greedy_tokens(logits)
        else:
            tokens = self._sample(logits, batch)
        logprobs = (_logprob_dicts(raw_logprobs, tokens, batch.num_logprobs) if want_logprobs
                    else [None] * len(batch.num_logprobs))
        return SamplerOutput(tokens.tolist(), logprobs)

    @staticmethod
    def _shape(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The grammar masks, allow-lists, logit biases, repetition and presence / frequency penalties and
        min_tokens bans of the rows that ask, in that order, on one copy of the logits (the caller's are left as
        they are); the logits themselves when no row asks."""
        steps = [(apply, rows) for apply, rows in (
            (apply_token_masks, batch.grammars), (apply_allowed_tokens, batch.allowed),
            (apply_logit_biases, batch.biases),
            (apply_repetition_penalty, batch.penalties), (apply_output_penalties, batch.output_penalties),
            (apply_bans, batch.banned)) if _any_row(rows)]
        if not steps:
            return logits
        logits = logits.clone()
        for apply, rows in steps:
            apply(logits, rows)
        return logits

    def _uniforms(self, batch: SamplingBatch, device: torch.device) -> torch.Tensor:
        """One uniform in [0, 1) per row: [n, 1]; a seeded request draws from its own generator."""
        u = torch.rand(len(batch.generators), 1, generator=self.generator, device=device)
        for row, gen in enumerate(batch.generators):
            if gen is not None:  # a seeded request: its own stream of draws
                u[row] = torch.rand(1, generator=gen, device=device)
        return u

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        use_k, use_p, use_min = batch.needs_filters
        # On the CPU one fused op draws (ops.sample_from_logits): two passes over the logits against five
        # for the torch sequence (1.1 ms against 8-9 on 48 x 49k).
        fused = logits.device.type == "cpu" and logits.dtype == torch.float32
        if fused and not (use_k or use_p or use_min):
            # Temperature only: the op divides by it, and greedy rows take their first maximum.
            u = self._uniforms(batch, logits.device).squeeze(1)
            return ops.sample_from_logits(logits, batch.temperatures.contiguous(), u)
        greedy = batch.temperatures == 0.0
        temps = torch.where(greedy, 1.0, batch.temperatures).unsqueeze(1)
        scaled = logits / temps
        if use_k or use_p or use_min:
            scaled = filter_logits(scaled, batch.top_ks, batch.top_ps, batch.min_ps, use_k, use_p, use_min)
        u = self._uniforms(batch, logits.device)
        if fused:
            sampled = ops.sample_from_logits(scaled.contiguous(), torch.ones_like(batch.temperatures), u.squeeze(1))
        else:
            # torch's fused softmax: one parallel pass (2.3x a max, subtract and exp done apart on 48 x 49k). Its
            # rounding leaves totals a hair off 1: draw_from_cdf scales u by each row's own total anyway.
            sampled = draw_from_cdf(scaled.softmax(-1).cumsum_(-1), u)
        if not bool(greedy.any()):  # the argmax is a whole pass over the logits: only for greedy rows
            return sampled
        return torch.where(greedy, greedy_tokens(logits), sampled)
