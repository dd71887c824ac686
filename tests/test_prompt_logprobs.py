"""Prompt logprobs (SamplingParams.prompt_logprobs) on the default model's real weights, against HF transformers.

Each prompt token's logprob (given the tokens before it), its rank and the
top-k there must equal HF's log-softmax of the same prompt's logits, over
chunked prefills, beside other requests, and with the prefix cache warm
(such a prompt reads nothing from it). The scoring itself is checked
against a reference on random logits, the row planning on hand-built
requests (chunks, a recompute after preemption), the per-step bound on
scored tokens, the output kinds, and a scoring failure that must fail its
request alone.
"""

from __future__ import annotations

import pytest
import torch
from pagedkv import LLM, SamplingParams
from pagedkv.core.sequence import OutputKind, Request, Sequence
from pagedkv.engine import prompt_logprobs as pl
from pagedkv.outputs import Logprob, RequestMetrics
from pagedkv.sampling_params import SamplingParamsError

TOL = 1e-4  # fp32 logprobs of two implementations with different reduction orders
PARAGRAPH = ("Virtual memory lets every process believe it owns a large contiguous address space, while the "
             "operating system maps its pages onto scattered physical frames and brings them in on demand. ")


@pytest.fixture(scope="module")
def llm(loaded_model):
    """A small token budget, so a prompt of ~70 tokens is computed in three chunks."""
    return LLM(loaded_model=loaded_model, kv_cache_memory=64 << 20, max_model_len=512, max_num_batched_tokens=32,
               max_num_seqs=8, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def prompt_ids(loaded_model) -> list[int]:
    return loaded_model.tokenizer.encode(PARAGRAPH * 2 + "In short,")


def hf_prompt_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row p is HF's log-distribution of token p + 1."""
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)


def assert_matches(entries, ids: list[int], ref: torch.Tensor, k: int) -> None:
    """entries (RequestOutput.prompt_logprobs) against HF's: each prompt token's logprob and rank (a rank may
    differ only among values within TOL of it), and the top-k values."""
    assert len(entries) == len(ids) and entries[0] is None
    for p, (entry, token) in enumerate(zip(entries[1:], ids[1:], strict=True)):
        row, want = ref[p], ref[p, token].item()
        got = entry[token]
        assert got.logprob == pytest.approx(want, abs=TOL), p
        lo, hi = int((row > want + TOL).sum()) + 1, int((row > want - TOL).sum()) + 1
        assert lo <= got.rank <= hi, (p, got.rank, lo, hi)
        top = sorted((v for v in entry.values() if v.rank <= k), key=lambda v: v.rank)
        assert [v.rank for v in top] == list(range(1, k + 1))
        assert [v.logprob for v in top] == pytest.approx(row.topk(k).values.tolist(), abs=TOL)
        assert len(entry) in (k, k + 1)  # the prompt token is one of the top k, or beside them


def assert_same(got, want) -> None:
    """Two runs' prompt logprobs: the same tokens at every position, logprobs within TOL."""
    assert [e and list(e) for e in got] == [e and list(e) for e in want]
    flat = [(v.logprob for v in e.values()) for e in got if e], [(v.logprob for v in e.values()) for e in want if e]
    assert [x for row in flat[0] for x in row] == pytest.approx([x for row in flat[1] for x in row], abs=TOL)


def test_prompt_logprobs_match_hf_over_chunks_beside_other_requests(llm, hf_model, prompt_ids):
    ref = hf_prompt_logprobs(hf_model, prompt_ids)
    short = prompt_ids[:9]
    outs = llm.generate([{"prompt_token_ids": prompt_ids}, {"prompt_token_ids": short}, "The capital of France is"],
                        [SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3),
                         SamplingParams(temperature=0.8, seed=1, max_tokens=4, prompt_logprobs=0, n=2),
                         SamplingParams(temperature=0, max_tokens=4)], use_tqdm=False)
    assert len(prompt_ids) > 2 * 32  # three chunks
    assert_matches(outs[0].prompt_logprobs, prompt_ids, ref, 3)
    assert_matches(outs[1].prompt_logprobs, short, ref[:len(short) - 1], 0)
    assert outs[2].prompt_logprobs is None
    # A one-token prompt has nothing to score.
    one = llm.generate([{"prompt_token_ids": prompt_ids[:1]}], SamplingParams(max_tokens=1, prompt_logprobs=2),
                       use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]


def test_a_scored_prompt_reads_no_cached_blocks_but_offers_its_own(llm, prompt_ids):
    ids = [7] + prompt_ids  # a prefix no other test cached
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    first = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    plain = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    again = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    assert plain.num_cached_tokens >= 16 * ((len(ids) - 1) // 16)  # the scored prompt's blocks were cached
    assert first.num_cached_tokens == again.num_cached_tokens == 0
    assert_same(again.prompt_logprobs, first.prompt_logprobs)


def test_scored_tokens_per_step_are_bounded(llm, prompt_ids, monkeypatch):
    """The scheduler gives scoring requests at most max_scored_prompt_tokens prompt tokens a step (their logits'
    memory); the long prompt takes more steps and scores the same."""
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    want = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0].prompt_logprobs
    engine = llm.llm_engine
    sched = engine.scheduler
    monkeypatch.setattr(sched, "max_scored_prompt_tokens", 10)
    scheduled = []
    real = sched.schedule

    def recording():
        out = real()
        scheduled.append(sum(n for s, n in zip(out.prefill_seqs, out.prefill_lens, strict=True)
                             if s.request.params.prompt_logprobs is not None))
        return out

    monkeypatch.setattr(sched, "schedule", recording)
    outs = llm.generate([{"prompt_token_ids": prompt_ids}, {"prompt_token_ids": prompt_ids[5:40]}],
                        [params, params], use_tqdm=False)
    assert max(scheduled) == 10 and sum(scheduled) == len(prompt_ids) + 35
    got = outs[0].prompt_logprobs
    assert_same(got, want)
    assert len(outs[1].prompt_logprobs) == 35


def test_output_kinds_carry_them_once_whole(llm, prompt_ids):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1)
    for kind, expect in ((OutputKind.DELTA, [True, False, False]), (OutputKind.CUMULATIVE, [True, True, True]),
                         (OutputKind.FINAL_ONLY, [True])):
        engine.add_request(f"kind-{kind.value}", {"prompt_token_ids": prompt_ids[:40]}, params, output_kind=kind)
        outputs = []
        while engine.has_unfinished_requests():
            outputs.extend(engine.step())
        assert [o.prompt_logprobs is not None for o in outputs] == expect, kind
        assert all(len(o.prompt_logprobs) == 40 for o in outputs if o.prompt_logprobs is not None)


def test_a_failed_scoring_fails_its_request_alone(llm, prompt_ids, monkeypatch):
    real = pl.score_rows

    def failing(logits, targets, k):
        if k == 4:
            raise RuntimeError("planted scoring failure")
        return real(logits, targets, k)

    monkeypatch.setattr(pl, "score_rows", failing)
    outs = llm.generate([{"prompt_token_ids": prompt_ids[:20]}, {"prompt_token_ids": prompt_ids[:20]},
                         {"prompt_token_ids": prompt_ids[:12]}],
                        [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=4),
                         SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1),
                         SamplingParams(temperature=0, max_tokens=3)], use_tqdm=False)
    assert "planted scoring failure" in outs[0].error and outs[0].outputs[0].finish_reason == "error"
    assert outs[1].error is None and len(outs[1].prompt_logprobs) == 20 and len(outs[1].outputs[0].token_ids) == 3
    assert outs[2].error is None and len(outs[2].outputs[0].token_ids) == 3
    assert not llm.llm_engine.has_unfinished_requests()


def test_prompt_logprobs_are_checked(llm):
    for bad in (-1, True, 1.5, "3"):
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(prompt_logprobs=bad)
        assert e.value.param == "prompt_logprobs"
    with pytest.raises(SamplingParamsError, match="max_logprobs") as e:
        llm.llm_engine.validate_params(SamplingParams(prompt_logprobs=21))
    assert e.value.param == "prompt_logprobs"
    refused = llm.generate("hi", SamplingParams(prompt_logprobs=21), use_tqdm=False)[0]
    assert "21 prompt_logprobs" in refused.error and refused.prompt_logprobs is None


# --- the parts alone -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [0, 1, 5])
def test_score_rows_matches_a_reference(k):
    """Odd vocabulary, more rows than a scoring slice, exact ties and a -inf logit."""
    torch.manual_seed(k)
    rows, vocab = pl.SCORE_SLICE_ROWS + 37, 1003
    logits = torch.randn(rows, vocab) * 3
    logits[0, :10] = 50.0  # ties at the top
    logits[1, 17] = float("-inf")
    targets = torch.randint(0, vocab, (rows,))
    targets[0], targets[1] = 3, 17
    got = pl.score_rows(logits, targets, k)
    ref = logits.double().log_softmax(-1)
    for r in range(rows):
        t = int(targets[r])
        entry = got[r]
        assert list(entry)[0] == t and entry[t].logprob == pytest.approx(ref[r, t].item(), abs=1e-5)
        assert entry[t].rank == int((ref[r] > ref[r, t]).sum()) + 1
        # The others are the top k; the target stands in for one of them when it is among them.
        others = sorted((v.logprob for tok, v in entry.items() if tok != t), reverse=True)
        want = ref[r].topk(k).values.tolist()
        if len(others) < k:
            others = sorted([*others, entry[t].logprob], reverse=True)
        assert others == pytest.approx(want, abs=1e-5)
        ranks = [v.rank for tok, v in entry.items() if tok != t]
        assert len(set(ranks)) == len(ranks) and all(1 <= x <= k for x in ranks)
    assert got[1][17].logprob == float("-inf") and got[1][17].rank == vocab
    assert got[0][3].rank == 1  # tied with nine others at the top: none is strictly more likely


def _request(num_prompt: int, prompt_logprobs: int | None = 2) -> Sequence:
    req = Request("r", None, list(range(100, 100 + num_prompt)), SamplingParams(prompt_logprobs=prompt_logprobs),
                  RequestMetrics(0.0))
    seq = Sequence(0, req, 0, list(req.prompt_token_ids))
    req.seqs.append(seq)
    return seq


def test_plan_rows_over_chunks_and_after_a_recompute():
    seq = _request(10)
    req = seq.request
    assert req.next_prompt_logprob == 0 and not req.reads_prefix_cache
    rows = pl.plan_rows(seq, 0, 4)  # positions 0..3 score tokens 1..4
    assert (rows.offset, rows.targets) == (0, req.prompt_token_ids[1:5])
    req.prompt_logprobs.extend({t: Logprob(-1.0, 1)} for t in rows.targets)
    rows = pl.plan_rows(seq, 4, 6)  # the last chunk: position 9 is sampled, not scored
    assert (rows.offset, rows.targets) == (0, req.prompt_token_ids[5:10])
    req.prompt_logprobs.extend({t: Logprob(-1.0, 1)} for t in rows.targets[:3])  # preempted after 3 of them
    # Recomputed from the start: the positions scored before are skipped.
    rows = pl.plan_rows(seq, 0, 10)
    assert (rows.offset, rows.targets) == (7, req.prompt_token_ids[8:10])
    req.prompt_logprobs.extend({t: Logprob(-1.0, 1)} for t in rows.targets)
    assert req.next_prompt_logprob is None and req.reads_prefix_cache
    assert pl.plan_rows(seq, 0, 10) is None
    assert pl.plan_rows(_request(10, None), 0, 10) is None
    late = _request(10)
    with pytest.raises(RuntimeError, match="still to be scored"):
        pl.plan_rows(late, 16, 4)
