"""Speculative decoding (n-gram drafts): the settings, the block manager's cut, the scheduler's verification
rule on hand-made rows, and the engine on the default model, where speculation must change nothing a request
gets (greedy tokens, logprobs, lengths, stop rules) while it accepts drafts.
"""

from __future__ import annotations

import pytest
from pagedkv import LLM, SamplingParams
from pagedkv._block_manager import InvalidSequenceStateError
from pagedkv.config import CacheConfig, EngineArgs, SchedulerConfig, SpeculativeConfig
from pagedkv.core.block_manager import BlockManager
from pagedkv.core.scheduler import Scheduler, SchedulerOutput
from pagedkv.core.sequence import Request, Sequence
from pagedkv.outputs import Logprob, RequestMetrics, SamplerOutput
from pagedkv.spec_decode.drafter import SpecDecodeCounts, num_accepted

BS = 4  # the block manager's own tests
SBS = 8  # the scheduler's (a block size the engine runs)
EOS = 2
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}


# ---- settings -------------------------------------------------------------------------------------------------
def test_config_defaults_and_one_sided_lookup():
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    assert SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=3).prompt_lookup_min == 3
    assert SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=2).prompt_lookup_max == 2
    assert SpeculativeConfig.parse('{"method": "[ngram]", "num_speculative_tokens": 1}').method == "ngram"
    assert EngineArgs(speculative_config=NGRAM).speculative_config.num_speculative_tokens == 3


def test_batch_size_schedule():
    """vLLM's dynamic schedule: inclusive ranges, gaps and the tail carry the k before them, capped at k."""
    c = SpeculativeConfig(num_speculative_tokens=4,
                          num_speculative_tokens_per_batch_size=[[9, 16, 2], [1, 4, 6], [32, 64, 0]])
    assert [c.tokens_for_batch(b) for b in (0, 1, 4, 5, 8, 9, 16, 31, 32, 100)] == [4, 4, 4, 4, 4, 2, 2, 2, 0, 0]
    assert SpeculativeConfig(num_speculative_tokens=3).tokens_for_batch(500) == 3


@pytest.mark.parametrize(("value", "message"), [
    ({"method": "eagle", "num_speculative_tokens": 3}, "method must be one of"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"num_speculative_tokens": 0}, "must be a positive int"),
    ({"num_speculative_tokens": True}, "must be a positive int"),
    ({"num_speculative_tokens": 2.5}, "must be a positive int"),
    ({"num_speculative_tokens": 33}, "must be <= 32"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "must be <="),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": -1}, "must be a positive int"),
    ({"num_speculative_tokens": 2, "model": "x"}, "unknown keys"),
    ({"num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[2, 4, 1]]}, "must start at batch size 1"),
    ({"num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4, 1], [4, 8, 0]]}, "overlap"),
    ({"num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4]]}, "must be \\[start, end, k\\]"),
    ({"num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4, -1]]}, "k >= 0"),
    ({"num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": []}, "non-empty list"),
    ("not json", "must be a JSON object"),
    ("[1, 2]", "must be a JSON object"),
])
def test_bad_settings_are_refused_by_name(value, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(speculative_config=value)


# ---- the block manager's cut ------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["cpp", "python"])
def test_truncate_releases_emptied_trailing_blocks(backend):
    bm = BlockManager(BS, 8, 2, 0.0, backend=backend)
    bm.allocate(1, 5)  # 2 blocks
    bm.append_slots(1, 6)  # 11 tokens: 3 blocks
    free = bm.num_free_gpu_blocks
    bm.core.truncate(1, 8)  # 2 full blocks: the third goes
    assert bm.num_free_gpu_blocks == free + 1 and bm.get_num_tokens(1) == 8 and len(bm.get_block_table(1)) == 2
    bm.core.truncate(1, 7)  # inside the last kept block: nothing goes
    assert bm.num_free_gpu_blocks == free + 1 and bm.get_num_tokens(1) == 7
    bm.append_slots(1, 1)  # writes over the cut slot
    bm.check_invariants()
    with pytest.raises(ValueError, match=r"num_tokens must be in \[0, 8\], got 9"):
        bm.core.truncate(1, 9)
    with pytest.raises(ValueError, match="got -1"):
        bm.core.truncate(1, -1)
    bm.swap_out(1)
    with pytest.raises(InvalidSequenceStateError, match="swapped"):
        bm.core.truncate(1, 4)


@pytest.mark.parametrize("backend", ["cpp", "python"])
def test_truncate_keeps_a_shared_block_and_refuses_the_window(backend):
    bm = BlockManager(BS, 16, 0, 0.0, backend=backend)
    bm.allocate(1, 6)
    bm.fork(1, 2)  # both hold blocks 0 and 1
    bm.append_slots(2, 5)  # copy-on-write of the partial block, then one more: 11 tokens
    bm.core.truncate(2, 6)
    assert bm.get_block_table(2)[0] == bm.get_block_table(1)[0]
    assert bm.get_block_table(2)[1] != bm.get_block_table(1)[1]
    bm.check_invariants()
    win = BlockManager(BS, 16, 0, 0.0, sliding_window=4, backend=backend)
    win.allocate(3, 4)
    win.append_slots(3, 8)
    win.append_slots(3, 1)  # its query at 12 sees from 9 on: blocks 0 and 1 (positions 0-7) dropped
    assert win.num_dropped_blocks(3) == 2
    with pytest.raises(InvalidSequenceStateError, match="sliding window"):
        win.core.truncate(3, 11)  # its next query at 11 would read from 8 on: block 1 was dropped
    win.core.truncate(3, 12)
    win.check_invariants()


def test_draft_blocks_enter_the_prefix_cache_only_when_accepted():
    bm = BlockManager(BS, 16, 0, 0.0, enable_caching=True)
    prompt = [11, 12, 13, 14, 15, 16]  # 1 full block + 2 tokens
    bm.allocate(1, prompt)
    # Next token 17, drafts 18, 19, 20: the second block (15..18) and third (19, 20) are filled by drafts.
    bm.append_drafts(1, 17, 3)
    assert bm.get_num_tokens(1) == 10
    assert bm.match_prefix(prompt + [17, 18, 0]).num_cached_tokens == BS  # not the draft-filled block
    bm.settle_drafts(1, 8, [18])  # the model accepted 18: tokens 0..7 have KV
    assert bm.get_num_tokens(1) == 8 and len(bm.get_block_table(1)) == 2
    assert bm.match_prefix(prompt + [17, 18, 0]).num_cached_tokens == 2 * BS
    bm.check_invariants()


# ---- the verification rule ----------------------------------------------------------------------------------------
def test_num_accepted_and_counts():
    assert num_accepted([5, 6, 7], [5, 6, 9, 1]) == 2
    assert num_accepted([5, 6, 7], [5, 6, 7, 1]) == 3
    assert num_accepted([5], [4, 5]) == 0
    c = SpecDecodeCounts()
    c.record(3, 2)
    c.record(2, 2)
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, c.accepted_per_pos) == (2, 5, 4, [2, 2, 0])


def make_scheduler(num_blocks: int = 32, caching: bool = False, budget: int = 64, max_model_len: int = 256,
                   spec: dict | None = None) -> Scheduler:
    bm = BlockManager(SBS, num_blocks, 0, 0.0, enable_caching=caching)
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=max_model_len),
                     CacheConfig(block_size=SBS, enable_prefix_caching=caching), bm, frozenset({EOS}),
                     speculative=SpeculativeConfig.parse(spec or NGRAM))


PROMPT = [5, 6, 7, 8, 9, 5, 6]  # after a sampled 7 the tail [6, 7] recurs at 1: drafts 8, 9, 5


def decoding(sched: Scheduler, seq_id: int = 0, prompt: list[int] = PROMPT, first: int = 7, **params) -> Sequence:
    """A request whose prompt is computed and whose first token `first` was just sampled."""
    req = Request(f"r{seq_id}", None, list(prompt), SamplingParams(**params), RequestMetrics(0.0))
    seq = Sequence(seq_id, req, 0, list(prompt))
    req.seqs.append(seq)
    sched.add(seq)
    out = sched.schedule()
    assert out.prefill_seqs == [seq]
    sched.update_from_output(out, [seq], SamplerOutput([first], [None]), now=1.0)
    return seq


def rows_of(out: SchedulerOutput) -> list[Sequence]:
    """The model runner's rows: decodes, prompts at their last token, a speculating sequence once per row."""
    rows = list(out.decode_seqs) + [s for i, s in enumerate(out.prefill_seqs) if out.sampled(i)]
    return rows + [s for s in out.spec_seqs for _ in range(1 + len(s.spec_token_ids))]


def step(sched: Scheduler, tokens: list[int], errors: list | None = None):
    out = sched.schedule()
    rows = rows_of(out)
    assert len(rows) == len(tokens), f"{len(rows)} rows"
    lps = [{t: Logprob(-0.25)} for t in tokens]
    return out, sched.update_from_output(out, rows, SamplerOutput(tokens, lps), errors, now=2.0)


def test_tokens_kept_up_to_the_first_disagreement_and_the_cache_cut_to_them():
    sched = make_scheduler()
    seq = decoding(sched)
    out, update = step(sched, [8, 9, 1, 4])  # rows agree with drafts 8, 9, not with 5: keep 8, 9, then 1
    assert out.spec_seqs == [seq] and seq.spec_token_ids == []
    assert seq.token_ids == PROMPT + [7, 8, 9, 1]
    assert seq.num_computed_tokens == len(PROMPT) + 3  # KV of 7, 8, 9; not of 1 (the next step's input)
    assert sched.bm.get_num_tokens(0) == seq.num_computed_tokens
    assert update.appended == [seq] and update.num_new == {0: 3} and update.num_dropped_rows == 1
    assert [list(e) for e in seq.logprobs] == [[8], [9], [1]]  # each kept token's entry from its own row
    c = sched.spec_counts
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, c.accepted_per_pos) == (1, 3, 2, [1, 1, 0])
    sched.bm.check_invariants()


def test_all_drafts_kept_give_a_bonus_token():
    sched = make_scheduler()
    seq = decoding(sched)
    step(sched, [8, 9, 5, 6])
    assert seq.token_ids == PROMPT + [7, 8, 9, 5, 6]
    assert seq.num_computed_tokens == len(PROMPT) + 4
    assert sched.bm.get_num_tokens(0) == seq.num_computed_tokens


def test_a_stop_among_the_drafts_ends_there_and_frees_the_blocks():
    sched = make_scheduler()
    seq = decoding(sched)
    free = sched.bm.num_free_gpu_blocks
    _, update = step(sched, [8, EOS, 5, 6])  # EOS where draft 9 was: kept, and the sequence ends
    assert seq.token_ids == PROMPT + [7, 8, EOS] and seq.finish_reason == "stop"
    assert update.finished == [seq] and 0 not in sched.bm
    assert sched.bm.num_free_gpu_blocks > free


def test_drafts_never_pass_max_tokens_or_the_model_length():
    sched = make_scheduler()
    seq = decoding(sched, max_tokens=3)  # one token out: at most 2 more, so one draft
    out, _ = step(sched, [8, 9])
    assert seq.token_ids == PROMPT + [7, 8, 9] and seq.finish_reason == "length"
    sched = make_scheduler(max_model_len=len(PROMPT) + 3)
    seq = decoding(sched)  # 8 tokens of 10: one draft fits (its row's token is the 10th)
    out, _ = step(sched, [8, 9])
    assert out.spec_seqs and seq.token_ids == PROMPT + [7, 8, 9] and seq.finish_reason == "length"


def test_drafts_take_only_free_blocks():
    sched = make_scheduler(num_blocks=2)  # the prompt and its next token fill 1 block; drafts would need a second
    sched.bm.allocate(99, 4)  # ...which another sequence holds
    seq = decoding(sched)
    out = sched.schedule()
    assert out.decode_seqs == [seq] and not out.spec_seqs and not out.preempted


@pytest.mark.parametrize("params", [
    {"repetition_penalty": 1.2}, {"presence_penalty": 0.5}, {"frequency_penalty": 0.5}, {"stop": ["x"]},
    {"min_tokens": 4}])
def test_requests_whose_rules_read_the_tokens_before_each_row_take_no_drafts(params):
    sched = make_scheduler()
    decoding(sched, **params)
    out = sched.schedule()
    assert len(out.decode_seqs) == 1 and not out.spec_seqs


def test_a_failed_row_fails_the_request_and_cuts_the_cache_to_its_last_token():
    sched = make_scheduler()
    seq = decoding(sched)
    _, update = step(sched, [8, -1, 5, 6], errors=[None, RuntimeError("row"), None, None])
    assert "r0" in update.failed and seq.token_ids == PROMPT + [7]
    assert sched.bm.get_num_tokens(0) == len(PROMPT) + 1 == seq.num_computed_tokens


# ---- the engine on the default model --------------------------------------------------------------------------------
PASSAGE = ("The block manager keeps a free list of physical blocks and a table per sequence. When a sequence "
           "grows past its last block, it takes a new block from the free list; when it finishes, its blocks "
           "return to the list.")
PROMPTS = [f"Repeat the following text exactly.\n\n{PASSAGE}\n\nRepeat:",
           f"Copy this paragraph:\n{PASSAGE}\nCopy:",
           "List the numbers from 1 to 30 separated by commas: 1, 2, 3,",
           "The capital of France is"]
MAX_TOKENS = 40


def _llm(loaded_model, spec: dict | None = NGRAM, **kwargs) -> LLM:
    kwargs = {"kv_cache_memory": 64 << 20, "max_model_len": 512, "max_num_seqs": 8} | kwargs
    return LLM(loaded_model=loaded_model, device="cpu", dtype="float32", speculative_config=spec, **kwargs)


@pytest.fixture(scope="module")
def plain_outputs(loaded_model):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2)
    return _llm(loaded_model, spec=None).generate(PROMPTS, params, use_tqdm=False)


def _check_same(ref, outputs, logprobs: bool = True) -> None:
    for r, o in zip(ref, outputs, strict=True):
        a, b = r.outputs[0], o.outputs[0]
        assert b.token_ids == a.token_ids, r.prompt
        assert (b.text, b.finish_reason) == (a.text, a.finish_reason)
        if logprobs:  # every kept token's logprob as one-at-a-time decoding gives it, from its own row
            assert [e[t].logprob for t, e in zip(b.token_ids, b.logprobs, strict=True)] == pytest.approx(
                [e[t].logprob for t, e in zip(a.token_ids, a.logprobs, strict=True)], abs=1e-4)
            assert [sorted(e) for e in b.logprobs] == [sorted(e) for e in a.logprobs]


def test_greedy_outputs_and_logprobs_unchanged_while_drafts_are_accepted(loaded_model, plain_outputs):
    llm = _llm(loaded_model)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    _check_same(plain_outputs, outputs)
    stats = llm.llm_engine.get_stats()
    assert stats.spec_num_accepted_tokens > 0 and stats.spec_num_draft_tokens >= stats.spec_num_accepted_tokens
    assert stats.generation_tokens == sum(len(o.outputs[0].token_ids) for o in outputs)
    # Fewer steps than tokens: what speculation is for.
    assert llm.llm_engine.counters.num_steps < stats.generation_tokens
    bm = llm.llm_engine.block_manager
    bm.check_invariants()
    assert bm.num_used_gpu_blocks == 0


def test_one_request_at_a_time_and_with_prefix_caching(loaded_model, plain_outputs):
    """Alone in the batch (every step a speculating chunk only), and again from the prefix cache its accepted
    drafts filled."""
    llm = _llm(loaded_model, enable_prefix_caching=True, max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2)
    first = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    _check_same(plain_outputs[:2], first)
    again = llm.generate([PROMPTS[0] + first[0].outputs[0].text], SamplingParams(temperature=0.0, max_tokens=8),
                         use_tqdm=False)
    assert again[0].num_cached_tokens > len(first[0].prompt_token_ids)  # the output's blocks came from drafts too
    llm.llm_engine.block_manager.check_invariants()


def test_preemption_under_a_small_cache(loaded_model, plain_outputs):
    # 14 blocks of 16 for 4 sequences of ~100 tokens (7 blocks each): they preempt one another.
    llm = _llm(loaded_model, kv_cache_memory=10 << 20, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    _check_same(plain_outputs, outputs)
    stats = llm.llm_engine.get_stats()
    assert stats.spec_num_accepted_tokens > 0 and stats.num_preemptions > 0


def test_stop_strings_and_penalties_decode_without_drafts(loaded_model):
    """Their rules read each token as it comes: such requests decode one token a step, beside others that
    speculate, and get what they would without speculation."""
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    base = _llm(loaded_model, spec=None)
    text = base.generate(PROMPTS[:1], plain, use_tqdm=False)[0].outputs[0].text
    word = text[len(text) // 2:len(text) // 2 + 6]  # a stop string met half way through
    stop = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[word])
    pen = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, repetition_penalty=1.3)
    params = [stop, pen, plain]
    ref = base.generate(PROMPTS[:3], params, use_tqdm=False)
    llm = _llm(loaded_model)
    outputs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    _check_same(ref, outputs, logprobs=False)
    assert outputs[0].outputs[0].finish_reason == "stop" and outputs[0].outputs[0].stop_reason == word
    assert llm.llm_engine.get_stats().spec_num_drafts > 0  # the plain one speculated


def test_sampling_with_seeds_and_n(loaded_model):
    """Sampled requests speculate too: every row draws from its own distribution (pagedkv.spec_decode.drafter),
    so a seeded request repeats itself, n samples differ, and lengths follow max_tokens."""
    params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=24, n=2, seed=7, ignore_eos=True, logprobs=1)
    llm = _llm(loaded_model)
    a = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    b = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    for x, y in zip(a, b, strict=True):
        assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
        for c in x.outputs:
            assert len(c.token_ids) == 24 and len(c.logprobs) == 24
            assert all(t in e for t, e in zip(c.token_ids, c.logprobs, strict=True))
    assert llm.llm_engine.get_stats().spec_num_accepted_tokens > 0


def test_engine_core_process_matches_in_process(default_model_dir, plain_outputs):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2)
    with LLM(str(default_model_dir), device="cpu", dtype="float32", kv_cache_memory=64 << 20, max_model_len=512,
             speculative_config=NGRAM, engine_core="process") as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        stats = llm.llm_engine.get_stats()
    _check_same(plain_outputs, outputs)
    assert stats.spec_num_accepted_tokens > 0


def test_requests_left_alone_by_a_failed_speculating_step(loaded_model, monkeypatch):
    """A step that fails with drafts in it fails its requests; the engine goes on and the pool is whole."""
    llm = _llm(loaded_model)
    engine = llm.llm_engine
    real = engine.runner.execute_model
    calls = {"n": 0}

    def flaky(out):
        calls["n"] += 1
        if out.spec_seqs and calls["n"] < 100:
            calls["n"] = 100
            raise RuntimeError("injected")
        return real(out)

    monkeypatch.setattr(engine.runner, "execute_model", flaky)
    outputs = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert outputs[0].outputs[0].finish_reason == "error"
    monkeypatch.setattr(engine.runner, "execute_model", real)
    ok = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert ok[0].outputs[0].finish_reason == "length"
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_used_gpu_blocks == 0


def test_tensor_parallel_matches_one_device(default_model_dir, plain_outputs):
    """At tensor_parallel_size=3 (the default model's 3 KV heads) every rank runs the speculating chunks the
    driver scheduled."""
    from model_util import assert_same_greedy

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2)
    with LLM(str(default_model_dir), device="cpu", dtype="float32", kv_cache_memory=32 << 20, max_model_len=256,
             speculative_config=NGRAM, tensor_parallel_size=3) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert llm.llm_engine.get_stats().spec_num_accepted_tokens > 0
    assert_same_greedy(plain_outputs, outputs, "speculative decoding at tensor_parallel_size=3")


def test_cli_flag_and_server_metrics(loaded_model, plain_outputs):
    """`--speculative-config` parses as vLLM's; the server's outputs are the offline ones and /metrics carries
    vLLM's spec-decode counters."""
    import argparse
    import json

    import httpx
    from pagedkv.cli import add_engine_args, engine_kwargs
    from pagedkv.server import build_app
    from prometheus_client.parser import text_string_to_metric_families
    from server_util import running_server

    p = argparse.ArgumentParser()
    add_engine_args(p)
    ns = p.parse_args(["--speculative-config", json.dumps(NGRAM)])
    assert EngineArgs(**engine_kwargs(ns)).speculative_config == SpeculativeConfig.parse(NGRAM)
    args = EngineArgs(device="cpu", dtype="float32", kv_cache_memory=64 << 20, max_model_len=512,
                      speculative_config=json.dumps(NGRAM))
    app = build_app(args, served_model_names=["smol"], loaded=loaded_model)

    with running_server(app) as srv:
        body = {"model": "smol", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0.0}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == plain_outputs[0].outputs[0].text
        streamed = []
        with httpx.stream("POST", srv.url + "/v1/completions", json=body | {"stream": True}, timeout=120) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    streamed.extend(c["text"] for c in json.loads(line[6:])["choices"])
        assert "".join(streamed) == plain_outputs[0].outputs[0].text
        metrics = {}
        for family in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text):
            for sample in family.samples:
                metrics.setdefault(sample.name, []).append(sample)
    drafts = metrics["vllm:spec_decode_num_draft_tokens_total"][0].value
    accepted = metrics["vllm:spec_decode_num_accepted_tokens_total"][0].value
    assert 0 < accepted <= drafts and metrics["vllm:spec_decode_num_drafts_total"][0].value > 0
    per_pos = {s.labels["position"]: s.value for s in metrics["vllm:spec_decode_num_accepted_tokens_per_pos_total"]}
    assert sum(per_pos.values()) == accepted and per_pos["0"] >= per_pos.get("1", 0)


def test_no_drafts_where_the_schedule_says_zero():
    sched = make_scheduler(spec=NGRAM | {"num_speculative_tokens_per_batch_size": [[1, 1, 0], [2, 8, 3]]})
    seq = decoding(sched)
    out = sched.schedule()  # one running sequence: k = 0
    assert out.decode_seqs == [seq] and not out.spec_seqs


def test_a_row_whose_token_cannot_be_taken_fails_alone_and_caches_no_draft(monkeypatch):
    sched = make_scheduler(caching=True)
    seq = decoding(sched)

    def refuse(*args):
        raise RuntimeError("its state refuses the token")

    monkeypatch.setattr(Scheduler, "_append_token", staticmethod(refuse))
    _, update = step(sched, [8, 9, 5, 6])
    assert "r0" in update.failed and seq.token_ids == PROMPT + [7]
    assert sched.bm.get_num_tokens(0) == len(PROMPT) + 1 == seq.num_computed_tokens
    sched.bm.check_invariants()
