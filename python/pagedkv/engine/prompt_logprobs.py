"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's log-probability given the tokens before it.

A prefill chunk that computes prompt positions [start, start + n) has, at
the row of position p, the model's distribution of token p + 1. For a
request that asks, the model runner takes the logits of those rows beside
the sampled ones (`PromptRows`: one slice of the step's extra logits rows
per chunk) and reduces them to one {token: Logprob} per position: the prompt
token with its rank, and the top `prompt_logprobs` there (`score_rows`, on
the raw distribution, as `logprobs` are). The first prompt token has no
context: its entry is None, as in vLLM.

Positions are scored once, in order: a cached position has no logits, so
such a request reads nothing from the prefix cache until they are all
scored (`Request.reads_prefix_cache`), and one recomputed after preemption
skips the positions it scored before. The scheduler bounds the prompt tokens
of scoring requests per step (`max_scored_tokens`), so their logits stay
within MAX_SCORED_LOGITS whatever the chunk budget and the vocabulary. The
list is whole when the chunk that samples the first output token is done;
outputs carry it from then on (a DELTA output once: `take_for_output`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.core.sequence import OutputKind, Request, Sequence
from pagedkv.outputs import Logprob

# Rows scored at a time: the log-softmax copy of a slice is all the scoring adds to the logits' memory.
SCORE_SLICE_ROWS = 256
# Logits (float32 elements) the prompt-scoring rows of one step may take: 256 MiB. A long prompt is scored over
# several steps rather than in one [chunk, vocab] block that a large vocabulary would make gigabytes.
MAX_SCORED_LOGITS = 1 << 26


def max_scored_tokens(vocab_size: int, block_size: int) -> int:
    """Prompt tokens of scoring requests one step computes at most (the scheduler's `max_scored_prompt_tokens`):
    what MAX_SCORED_LOGITS allows for this vocabulary, and at least a block."""
    return max(block_size, MAX_SCORED_LOGITS // vocab_size)


@dataclass(slots=True)
class PromptRows:
    """Rows [offset, offset + len(targets)) of a prefill chunk score `targets` (prompt tokens first + 1 ...)."""

    request: Request
    offset: int  # the first scored row within its chunk
    targets: list[int]


def plan_rows(seq: Sequence, start: int, n: int) -> PromptRows | None:
    """The rows of a chunk computing positions [start, start + n) of `seq` that score prompt tokens, or None.

    The chunk's last prompt position predicts the first output token: it is sampled, not scored.
    """
    req = seq.request
    first = req.next_prompt_logprob
    if first is None:
        return None
    if first < start:  # a scheduler that read cached blocks for this prompt: its positions there have no logits
        raise RuntimeError(f"request {req.request_id}: prompt position {first} is still to be scored but the "
                           f"chunk starts at {start}")
    end = min(start + n, req.num_prompt_tokens - 1)
    if end <= first:
        return None
    return PromptRows(req, first - start, req.prompt_token_ids[first + 1:end + 1])


def score_rows(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list[dict[int, Logprob]]:
    """float32 logits [R, vocab] and int64 targets [R] -> per row {target: Logprob(logprob, rank)} plus the top
    `k` tokens (ranks 1..k). A rank counts the tokens strictly more likely, plus one (the sampler's rule)."""
    out: list[dict[int, Logprob]] = []
    k = min(k, logits.shape[1])
    for i in range(0, logits.shape[0], SCORE_SLICE_ROWS):
        lp = logits[i:i + SCORE_SLICE_ROWS].log_softmax(-1)
        tgt = targets[i:i + SCORE_SLICE_ROWS].to(lp.device)
        tgt_lp = lp.gather(1, tgt[:, None])
        ranks = ((lp > tgt_lp).sum(1) + 1).tolist()
        if k:
            top = lp.topk(k, dim=-1)
            top_ids, top_vals = top.indices.tolist(), top.values.tolist()
        else:
            top_ids = top_vals = [[]] * lp.shape[0]
        for t, v, rank, ids, vals in zip(tgt.tolist(), tgt_lp[:, 0].tolist(), ranks, top_ids, top_vals, strict=True):
            entry = {t: Logprob(v, rank)}
            for place, (tok, val) in enumerate(zip(ids, vals, strict=True), start=1):
                entry.setdefault(tok, Logprob(val, place))
            out.append(entry)
    return out


def take_for_output(holder, num_prompt_tokens: int, kind: OutputKind) -> list[dict[int, Logprob] | None] | None:
    """What an output carries of `holder.prompt_logprobs` (a Request, or the front end's RequestState): the whole
    list once every prompt token is scored (None before, and when not asked); a DELTA output only the first time."""
    lps = holder.prompt_logprobs
    if lps is None or len(lps) < num_prompt_tokens:
        return None
    if kind is OutputKind.DELTA:
        if holder.prompt_logprobs_sent:
            return None
        holder.prompt_logprobs_sent = True
    return lps


@dataclass(slots=True)
class PromptLogits:
    """A step's prompt-scoring rows: `rows` in batch order, and their float32 logits [sum of their targets,
    vocab] in the same order."""

    rows: list[PromptRows]
    logits: torch.Tensor

    def score(self) -> list[tuple[Request, list[dict[int, Logprob]] | Exception]]:
        """Per chunk its request and its entries, or the error scoring them raised (that request's alone)."""
        results: list[tuple[Request, list[dict[int, Logprob]] | Exception]] = []
        start = 0
        for rows in self.rows:
            end = start + len(rows.targets)
            try:
                targets = torch.tensor(rows.targets, dtype=torch.int64)
                results.append((rows.request, score_rows(self.logits[start:end], targets,
                                                         rows.request.params.prompt_logprobs)))
            except Exception as e:  # e.g. out of memory for a long prompt's rows: that request fails alone
                results.append((rows.request, e))
            start = end
        return results
