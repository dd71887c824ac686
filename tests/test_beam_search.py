"""In-engine beam search against a plain reference beam search on HF transformers.

The reference (`reference_beam_search`) is vLLM's rule written out with no
cache: every step it recomputes each live beam from scratch with the HF model
(float32), takes the top 2 * beam_width tokens of the raw log_softmax, sends
EOS candidates (unless ignore_eos) to `completed`, keeps the best beam_width
others by cumulative logprob (stable sort), and at the end ranks completed +
live beams by cum / L ** length_penalty (L: every token, prompt included, less
a final EOS). pagedkv's beams (tokens and cumulative logprobs) must equal it
under every scheduling path: plain, prefix caching, chunked prefill,
preemption by recompute and by swap, beam requests mixed with ordinary ones.

The model is a tiny random Llama (vocab 512, 2 layers) whose lm_head row of
EOS (id 2, the default model's tokenizer's EOS, which the engine uses) is
pushed towards the mean hidden state so that EOS is among the candidates in
a good share of the steps: the "completed" path really runs.
"""

from __future__ import annotations

import math

import pytest
import torch
from model_util import randomize, torch_threads
from pagedkv import LLM, SamplingParams
from pagedkv.beam_search import BeamSearchParams, beam_search_score
from pagedkv.core.sequence import SequenceStatus

transformers = pytest.importorskip("transformers")

BS = 16
VOCAB = 512
EOS = 2
CUM_TOL = 1e-4
BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 4  # layers * (K, V) * KV heads * head_dim * float32


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint folder, HF model) of a tiny random Llama where EOS is often a candidate."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=512, initializer_range=0.1, rms_norm_eps=1e-6,
                                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
    torch.manual_seed(2024)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    randomize(model, 7)
    with torch.no_grad():
        ctx = torch.randint(3, VOCAB, (8, 40), generator=torch.Generator().manual_seed(0))
        mean = model.model(ctx).last_hidden_state.reshape(-1, cfg.hidden_size).mean(0)
        w = model.lm_head.weight
        w[EOS] += 0.3 * mean / mean.norm() * w.norm(dim=1).mean()
    path = tmp_path_factory.mktemp("tiny_llama_beam")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


@pytest.fixture(scope="module")
def tiny_loaded(tiny, default_model_dir):
    """The tiny model loaded once (the default model's tokenizer: EOS 2), shared by every engine of the module."""
    from pagedkv.config import EngineArgs
    from pagedkv.model.loader import LoadedModel

    path, _ = tiny
    return LoadedModel.load(EngineArgs(model=str(path), tokenizer=str(default_model_dir), device="cpu",
                                       dtype="float32"))


@pytest.fixture(scope="module")
def hf(tiny):
    return tiny[1]


def make_llm(tiny_loaded, **kw) -> LLM:
    args = dict(block_size=BS, kv_cache_memory=256 * BS * BYTES_PER_TOKEN, max_model_len=256, max_num_seqs=32,
                max_num_batched_tokens=256)
    llm = LLM(loaded_model=tiny_loaded, **(args | kw))
    assert llm.llm_engine.beam_eos_token_id == EOS
    guard_steps(llm.llm_engine)
    return llm


MAX_STEPS = 2000  # every test here finishes in a few hundred steps: more means the engine stopped progressing


def guard_steps(engine) -> None:
    """Makes engine.step raise after MAX_STEPS calls, so that a scheduler livelock fails instead of hanging."""
    step, count = engine.step, [0]

    def guarded(*a, **kw):
        count[0] += 1
        if count[0] > MAX_STEPS:
            sched = engine.scheduler
            raise AssertionError(f"no progress after {MAX_STEPS} steps: running {len(sched.running)}, waiting "
                                 f"{len(sched.waiting)}, swapped {len(sched.swapped)}, free GPU blocks "
                                 f"{engine.block_manager.num_free_gpu_blocks}")
        return step(*a, **kw)

    engine.step = guarded


def tokens(seed: int, n: int) -> list[int]:
    """n random token ids, none of them special (0, 1, 2)."""
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- the reference ------------------------------------------------------------------------------------------
class Ref:
    """A reference result: `beams` = [(all tokens, cum logprob)] best first; `num_completed`: EOS candidates
    seen; `margin`: the smallest gap between the last kept and the first dropped live candidate (near-ties)."""

    def __init__(self, beams, num_completed, margin):
        self.beams, self.num_completed, self.margin = beams, num_completed, margin


def reference_beam_search(model, prompt: list[int], beam_width: int, max_tokens: int, ignore_eos: bool = False,
                          length_penalty: float = 1.0, eos: int = EOS) -> Ref:
    beams: list[tuple[list[int], float]] = [(list(prompt), 0.0)]
    completed: list[tuple[list[int], float]] = []
    margin = math.inf
    for _ in range(max_tokens):
        # Every live beam has the same length: one batched forward, full recompute (no cache).
        with torch.inference_mode():
            logits = model(torch.tensor([b[0] for b in beams])).logits[:, -1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        candidates = []
        for (toks, cum), lp in zip(beams, logprobs, strict=True):
            top = lp.topk(2 * beam_width)
            for value, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                cand = (toks + [token], cum + value)
                if token == eos and not ignore_eos:
                    completed.append(cand)
                else:
                    candidates.append(cand)
        candidates.sort(key=lambda c: c[1], reverse=True)
        if len(candidates) > beam_width:
            margin = min(margin, candidates[beam_width - 1][1] - candidates[beam_width][1])
        beams = candidates[:beam_width]
        if not beams:
            break

    def score(c):
        toks, cum = c
        length = len(toks) - (1 if toks[-1] == eos and not ignore_eos else 0)
        return cum / (length ** length_penalty)

    ranked = sorted(completed + beams, key=score, reverse=True)[:beam_width]
    return Ref(ranked, len(completed), margin)


def assert_beams_match(ref: Ref, got: list[tuple[list[int], float]], what: str) -> None:
    """got: [(all tokens, cum logprob)] best first, as pagedkv returned them."""
    expected = [toks for toks, _ in ref.beams]
    assert [t for t, _ in got] == expected, (
        f"{what}: beams differ from the reference (reference's smallest keep/drop margin {ref.margin:.2e})\n"
        f"ours: {got}\nref:  {ref.beams}")
    for (_, c_ours), (_, c_ref) in zip(got, ref.beams, strict=True):
        assert abs(c_ours - c_ref) <= CUM_TOL, f"{what}: cum logprob {c_ours} vs reference {c_ref}"


def check_sequences(out, prompt: list[int], ref: Ref, params: BeamSearchParams, what: str) -> None:
    """A BeamSearchOutput against the reference, and each sequence's own consistency."""
    seqs = out.sequences
    assert 1 <= len(seqs) <= params.beam_width
    assert_beams_match(ref, [(list(s.tokens), s.cum_logprob) for s in seqs], what)
    scores = []
    for s in seqs:
        assert s.tokens[:len(prompt)] == prompt
        output = s.tokens[len(prompt):]
        ends_eos = output[-1] == EOS and not params.ignore_eos
        assert s.finish_reason == ("stop" if ends_eos else "length"), (what, s.finish_reason, output)
        if not ends_eos:
            assert len(output) == params.max_tokens
        # One candidates' dict per step, holding the chosen token; the chosen logprobs sum to the cum.
        assert len(s.logprobs) == len(output), what
        total = 0.0
        for token, entry in zip(output, s.logprobs, strict=True):
            assert token in entry and len(entry) >= 2 * params.beam_width, (what, len(entry))
            total += entry[token].logprob
        assert abs(total - s.cum_logprob) <= CUM_TOL, what
        assert s.text is not None
        scores.append(beam_search_score(len(s.tokens), s.cum_logprob, ends_eos, params.length_penalty))
    assert scores == sorted(scores, reverse=True), f"{what}: not best first"


def run_and_check(llm: LLM, hf, prompts: list[list[int]], params: BeamSearchParams, what: str) -> list[Ref]:
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert len(outs) == len(prompts)
    refs = []
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        ref = reference_beam_search(hf, p, params.beam_width, params.max_tokens, params.ignore_eos,
                                    params.length_penalty)
        check_sequences(out, p, ref, params, f"{what}, prompt {i}")
        refs.append(ref)
    assert_no_leak(llm)
    return refs


def assert_no_leak(llm: LLM) -> None:
    engine = llm.llm_engine
    bm = engine.block_manager
    bm.check_invariants()
    assert not engine.has_unfinished_requests()
    assert bm.num_used_gpu_blocks == 0 and not bm.seq_ids()


# ---- matching the reference ---------------------------------------------------------------------------------
@pytest.mark.parametrize("beam_width", [1, 2, 4])
def test_matches_reference(tiny_loaded, hf, beam_width):
    llm = make_llm(tiny_loaded)
    params = BeamSearchParams(beam_width=beam_width, max_tokens=12)
    refs = run_and_check(llm, hf, [tokens(1, 7), tokens(2, 21), tokens(3, 3)], params, f"width {beam_width}")
    if beam_width == 4:
        assert sum(r.num_completed for r in refs) > 0  # the EOS path was exercised


def test_eos_hypotheses_win_and_are_returned(tiny_loaded, hf):
    """Some finished (EOS) hypothesis ranks among the returned ones: the completed path is end to end."""
    llm = make_llm(tiny_loaded)
    params = BeamSearchParams(beam_width=4, max_tokens=16)
    prompts = [tokens(10 + i, 5 + 3 * i) for i in range(4)]
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        check_sequences(out, p, reference_beam_search(hf, p, 4, 16), params, f"prompt {i}")
    assert any(s.finish_reason == "stop" for o in outs for s in o.sequences)
    assert_no_leak(llm)


@pytest.mark.parametrize("length_penalty", [0.0, 2.5])
def test_length_penalty(tiny_loaded, hf, length_penalty):
    llm = make_llm(tiny_loaded)
    params = BeamSearchParams(beam_width=3, max_tokens=12, length_penalty=length_penalty)
    run_and_check(llm, hf, [tokens(4, 9), tokens(5, 17)], params, f"length_penalty {length_penalty}")


def test_ignore_eos(tiny_loaded, hf):
    llm = make_llm(tiny_loaded)
    params = BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True)
    prompts = [tokens(1, 7), tokens(2, 21)]
    refs = run_and_check(llm, hf, prompts, params, "ignore_eos")
    assert all(r.num_completed == 0 for r in refs)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        assert all(len(s.tokens) == len(p) + 12 and s.finish_reason == "length" for s in o.sequences)


def test_prefix_caching(tiny_loaded, hf):
    llm = make_llm(tiny_loaded, enable_prefix_caching=True)
    shared = tokens(6, 40)
    prompts = [shared + tokens(7, 5), shared + tokens(8, 6)]
    params = BeamSearchParams(beam_width=4, max_tokens=12)
    run_and_check(llm, hf, prompts, params, "prefix caching, cold")
    hits = llm.get_stats().prefix_cache_hits
    assert hits > 0
    run_and_check(llm, hf, prompts, params, "prefix caching, warm")
    assert llm.get_stats().prefix_cache_hits > hits


def test_chunked_prefill(tiny_loaded, hf):
    llm = make_llm(tiny_loaded, max_num_batched_tokens=16, max_num_seqs=8)
    params = BeamSearchParams(beam_width=4, max_tokens=10)
    run_and_check(llm, hf, [tokens(9, 45), tokens(10, 23)], params, "chunked prefill")


@pytest.mark.parametrize("mode, num_blocks", [("recompute", 14), ("swap", 14), ("swap", 20)])
def test_preemption(tiny_loaded, hf, mode, num_blocks):
    """Three groups of 4 beams of up to 40 tokens (3 blocks each, 12 unshared: check_beam_request's bound)
    cannot all be resident in 14 or 20 blocks; one group always fits, so each must finish."""
    llm = make_llm(tiny_loaded, kv_cache_memory=num_blocks * BS * BYTES_PER_TOKEN, max_model_len=64,
                   preemption_mode=mode, swap_space=0.01, max_num_seqs=16)
    assert llm.llm_engine.block_manager.num_total_gpu_blocks == num_blocks
    params = BeamSearchParams(beam_width=4, max_tokens=20, ignore_eos=True)  # no beam ends early
    run_and_check(llm, hf, [tokens(11, 20), tokens(12, 19), tokens(13, 18)], params,
                  f"preemption ({mode}, {num_blocks} blocks)")
    assert llm.get_stats().num_preemptions > 0
    if mode == "swap":
        assert llm.llm_engine.scheduler.num_swapped_out > 0
        bm = llm.llm_engine.block_manager
        assert bm.num_free_cpu_blocks == bm.core.num_cpu_blocks


def test_preemption_with_eos(tiny_loaded, hf):
    """Preemption (recompute) while beams also finish on EOS."""
    llm = make_llm(tiny_loaded, kv_cache_memory=14 * BS * BYTES_PER_TOKEN, max_model_len=64,
                   max_num_seqs=16)
    params = BeamSearchParams(beam_width=4, max_tokens=20)
    run_and_check(llm, hf, [tokens(14, 20), tokens(15, 19), tokens(16, 18)], params, "preemption with EOS")
    assert llm.get_stats().num_preemptions > 0


def test_mixed_with_ordinary_requests(tiny_loaded, hf):
    """Beam requests of widths 2 and 4 and greedy requests in one engine: both kinds right."""
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ordinary = [tokens(20, 12), tokens(21, 30), tokens(22, 4)]
    alone = make_llm(tiny_loaded).generate([{"prompt_token_ids": p} for p in ordinary], greedy, use_tqdm=False)

    llm = make_llm(tiny_loaded, max_num_batched_tokens=32, max_num_seqs=12)
    engine = llm.llm_engine
    beams = {"b0": (tokens(23, 10), BeamSearchParams(beam_width=2, max_tokens=12)),
             "b1": (tokens(24, 25), BeamSearchParams(beam_width=4, max_tokens=8)),
             "b2": (tokens(25, 6), BeamSearchParams(beam_width=4, max_tokens=14, length_penalty=0.5))}
    engine.add_request("o0", {"prompt_token_ids": ordinary[0]}, greedy)
    engine.add_request("b0", {"prompt_token_ids": beams["b0"][0]}, beams["b0"][1])
    engine.add_request("o1", {"prompt_token_ids": ordinary[1]}, greedy)
    engine.add_request("b1", {"prompt_token_ids": beams["b1"][0]}, beams["b1"][1])
    engine.step()
    engine.add_request("o2", {"prompt_token_ids": ordinary[2]}, greedy)  # arrives while the others run
    engine.add_request("b2", {"prompt_token_ids": beams["b2"][0]}, beams["b2"][1])
    results = drive(engine)
    assert set(results) == {"o0", "o1", "o2", "b0", "b1", "b2"}
    for i, ref in enumerate(alone):
        out = results[f"o{i}"]
        assert out.error is None and [c.token_ids for c in out.outputs] == [ref.outputs[0].token_ids], i
    for rid, (prompt, params) in beams.items():
        out = results[rid]
        assert out.error is None and out.finished
        ref = reference_beam_search(hf, prompt, params.beam_width, params.max_tokens, params.ignore_eos,
                                    params.length_penalty)
        got = [(prompt + list(c.token_ids), c.cumulative_logprob) for c in out.outputs]
        assert_beams_match(ref, got, rid)
    assert_no_leak(llm)


def drive(engine, check=None) -> dict:
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        if check is not None:
            check()
    return results


# ---- block accounting ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pool", ["ample", "tight"])
def test_block_accounting(tiny_loaded, hf, pool):
    """After every step: the blocks in use are exactly the distinct blocks of the live sequences' tables (the
    beams share theirs), the invariants hold; at the end nothing is held."""
    kw = ({"kv_cache_memory": 14 * BS * BYTES_PER_TOKEN, "max_model_len": 64, "max_num_seqs": 16}
          if pool == "tight" else {})
    llm = make_llm(tiny_loaded, **kw)
    engine, bm = llm.llm_engine, llm.llm_engine.block_manager
    beams = {"a": (tokens(30, 20), BeamSearchParams(beam_width=4, max_tokens=20)),
             "b": (tokens(31, 33), BeamSearchParams(beam_width=3, max_tokens=14, ignore_eos=True))}
    if pool == "ample":
        beams["c"] = (tokens(32, 5), BeamSearchParams(beam_width=2, max_tokens=24))
    for rid, (p, params) in beams.items():
        engine.add_request(rid, {"prompt_token_ids": p}, params)
    engine.add_request("o", {"prompt_token_ids": tokens(33, 17)},
                       SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    seen = {"shared": False, "steps": 0}

    def check():
        bm.check_invariants()
        seen["steps"] += 1
        ids = set(bm.seq_ids())
        held = {s for s in ids if not bm.is_swapped(s)}
        running = {s.seq_id for req in engine.requests.values() for s in req.seqs
                   if s.status is SequenceStatus.RUNNING}
        swapped = {s.seq_id for req in engine.requests.values() for s in req.seqs
                   if s.status is SequenceStatus.SWAPPED}
        assert running == held and swapped == ids - held  # the holders are exactly the live sequences
        for rid in beams:
            if rid in engine.requests:
                req = engine.requests[rid]
                assert len([s for s in req.seqs if not s.is_finished]) <= beams[rid][1].beam_width
        tables = [list(bm.get_block_table(s)) for s in held]
        distinct = {b for t in tables for b in t}
        assert bm.num_used_gpu_blocks == len(distinct), (bm.num_used_gpu_blocks, len(distinct), tables)
        if sum(map(len, tables)) > len(distinct):
            seen["shared"] = True

    results = drive(engine, check)
    assert set(results) == set(beams) | {"o"}
    for rid, (p, params) in beams.items():
        ref = reference_beam_search(hf, p, params.beam_width, params.max_tokens, params.ignore_eos)
        assert_beams_match(ref, [(p + list(c.token_ids), c.cumulative_logprob) for c in results[rid].outputs], rid)
    assert seen["shared"], "no two beams ever shared a block"
    assert bm.num_used_gpu_blocks == 0 and not bm.seq_ids()
    bm.check_invariants()
    if pool == "tight":
        assert engine.get_stats().num_preemptions > 0


# ---- bad input ----------------------------------------------------------------------------------------------------
def test_bad_params():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=float("nan"))
    smallest = BeamSearchParams(beam_width=1, max_tokens=1)  # the least each field allows
    assert (smallest.ignore_eos, smallest.include_stop_str_in_output, smallest.skip_special_tokens) == (
        False, False, True)  # vLLM's defaults


def test_width_over_max_num_seqs_is_refused(tiny_loaded):
    llm = make_llm(tiny_loaded, max_num_seqs=4)
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search([{"prompt_token_ids": tokens(1, 5)}], BeamSearchParams(beam_width=5, max_tokens=4))
    with pytest.raises(ValueError, match="beam_width"):
        engine.add_request("x", {"prompt_token_ids": tokens(1, 5)}, BeamSearchParams(beam_width=5, max_tokens=4))
    assert not engine.has_unfinished_requests() and "x" not in engine.requests
    # A batch where only the second prompt is refused runs nothing.
    with pytest.raises(ValueError):
        llm.beam_search([{"prompt_token_ids": tokens(1, 5)}, {"prompt_token_ids": []}],
                        BeamSearchParams(beam_width=2, max_tokens=4))
    assert not engine.has_unfinished_requests()
    assert_no_leak(llm)
    # The engine still works afterwards.
    out = llm.beam_search([{"prompt_token_ids": tokens(1, 5)}], BeamSearchParams(beam_width=4, max_tokens=3))
    assert len(out[0].sequences) >= 1


# ---- the default model ----------------------------------------------------------------------------------------
def test_default_model_top_beam_matches_hf(loaded_model, hf_model):
    llm = LLM(loaded_model=loaded_model, kv_cache_memory=64 << 20, max_model_len=256)
    guard_steps(llm.llm_engine)
    tok = loaded_model.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):")]
    params = BeamSearchParams(beam_width=4, max_tokens=8)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    eos = llm.llm_engine.beam_eos_token_id
    assert eos == tok.eos_token_id
    for p, out in zip(prompts, outs, strict=True):
        ref = reference_beam_search(hf_model, p, 4, 8, eos=eos)
        top = out.sequences[0]
        assert list(top.tokens) == ref.beams[0][0], (tok.decode(top.tokens), tok.decode(ref.beams[0][0]))
        assert abs(top.cum_logprob - ref.beams[0][1]) <= 1e-3
        assert top.text == tok.decode(top.tokens, skip_special_tokens=True)
    assert_no_leak(llm)


def test_beam_search_score_stays_defined_for_extreme_length_penalties():
    from pagedkv.beam_search import beam_search_score
    assert beam_search_score(10, -3.0, False, 1.0) == -0.3
    assert beam_search_score(11, -3.0, True, 1.0) == -0.3  # a final EOS is not counted
    assert beam_search_score(10, -3.0, False, 1e308) == 0.0  # the length's power overflows: -3 / inf
    assert beam_search_score(10, -3.0, False, -1e308) == float("-inf")  # it underflows to 0
    assert beam_search_score(10, 0.0, False, -1e308) == 0.0
    # Lengths below 2: a 1-token hypothesis divides by 1 whatever the penalty, an EOS-only one too.
    assert beam_search_score(1, -2.0, False, 2.0) == -2.0
    assert beam_search_score(1, -2.0, True, 2.0) == -2.0


def test_live_beams_ending_in_eos_under_ignore_eos_finish_by_length():
    """With ignore_eos EOS is a token like any other: a live beam that ends in it when the search ends reports
    "length" and no stop reason."""
    from pagedkv.core.beam_search import BeamGroup
    from pagedkv.core.sequence import Request, Sequence
    from pagedkv.outputs import RequestMetrics

    params = BeamSearchParams(beam_width=1, max_tokens=2, ignore_eos=True)
    req = Request("b", None, [5, 6], params.to_sampling_params(), RequestMetrics(0.0))
    beam = Sequence(0, req, 0, [5, 6, 9, EOS])
    (h,) = BeamGroup(params, EOS, 2).finish([beam])
    assert (h.output_token_ids, h.finish_reason, h.stop_reason) == ([9, EOS], "length", None)
