"""The Scheduler driven directly, on a real (C++) BlockManager and no model: admission, swap-in, budgets,
and the request lifecycle after the forward (`update_from_output`: tokens, stop rules, forks, freeing).

Each test builds the exact block-pool state that a rule is about and checks the one decision the rule makes,
so a scheduler that forgets the rule (the watermark, the blocks the running decodes take this step) fails.
"""

from __future__ import annotations

import pytest
from pagedkv.config import CacheConfig, SchedulerConfig
from pagedkv.core.block_manager import BlockManager
from pagedkv.core.scheduler import Scheduler, SchedulerOutput, StepUpdate
from pagedkv.core.sequence import Request, Sequence, SequenceStatus
from pagedkv.outputs import Logprob, RequestMetrics, SamplerOutput
from pagedkv.sampling_params import SamplingParams

BS = 8


def make_scheduler(num_gpu_blocks: int, watermark: float = 0.0, num_cpu_blocks: int = 0, max_num_seqs: int = 8,
                   budget: int = 256, mode: str = "recompute", max_model_len: int = 1024,
                   eos_token_ids: frozenset[int] = frozenset(), sliding_window: int | None = None) -> Scheduler:
    bm = BlockManager(BS, num_gpu_blocks, num_cpu_blocks, watermark, sliding_window=sliding_window)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                     max_model_len=max_model_len, preemption_mode=mode),
                     CacheConfig(block_size=BS, watermark=watermark), bm, eos_token_ids)


def make_seq(seq_id: int, num_prompt: int) -> Sequence:
    prompt = list(range(1, num_prompt + 1))
    req = Request(f"r{seq_id}", None, prompt, SamplingParams(), RequestMetrics(0.0))
    seq = Sequence(seq_id, req, 0, list(prompt))
    req.seqs.append(seq)
    return seq


def running_decode(sched: Scheduler, seq_id: int, num_computed: int) -> Sequence:
    """A running sequence whose `num_computed` tokens are in the cache and whose next token was just sampled."""
    seq = make_seq(seq_id, num_computed)
    sched.bm.allocate(seq.seq_id, num_computed)
    seq.num_computed_tokens = num_computed
    seq.token_ids.append(7)  # the sampled token: the decode of this step computes it
    seq.status = SequenceStatus.RUNNING
    sched.running.append(seq)
    return seq


def test_admission_keeps_the_watermark_free():
    sched = make_scheduler(num_gpu_blocks=20, watermark=0.25)
    assert sched.bm.core.watermark_blocks == 5
    big = make_seq(1, 16 * BS)  # 16 blocks: 20 - 16 = 4 would be left, under the watermark of 5
    sched.add(big)
    out = sched.schedule()
    assert out.is_empty and list(sched.waiting) == [big] and sched.bm.num_free_gpu_blocks == 20
    fits = make_seq(2, 15 * BS)  # 15 blocks leave exactly the watermark: admitted
    sched.waiting.clear()
    sched.add(fits)
    out = sched.schedule()
    assert out.prefill_seqs == [fits] and out.prefill_lens == [15 * BS]
    assert sched.bm.num_free_gpu_blocks == 5


def test_admission_is_first_come_first_served():
    """A waiting prompt that does not fit blocks the ones behind it (no overtaking, as vLLM's FCFS)."""
    sched = make_scheduler(num_gpu_blocks=10)
    first, second = make_seq(1, 11 * BS), make_seq(2, BS)
    sched.add(first)
    sched.add(second)
    assert sched.schedule().is_empty and list(sched.waiting) == [first, second]


@pytest.mark.parametrize("num_gpu_blocks, swapped_in", [(8, False), (9, True)])
def test_swap_in_counts_the_blocks_running_decodes_take_this_step(num_gpu_blocks, swapped_in):
    """Two running decodes at a block boundary take one new block each this step; a swapped-out sequence
    (2 blocks, +1 for its own decode) comes back only if its 3 blocks fit beside those 2."""
    sched = make_scheduler(num_gpu_blocks, num_cpu_blocks=8, mode="swap")
    a, b = running_decode(sched, 1, 2 * BS), running_decode(sched, 2, 2 * BS)
    c = make_seq(3, 2 * BS)
    sched.bm.allocate(c.seq_id, 2 * BS)
    sched.bm.swap_out(c.seq_id)
    c.num_computed_tokens, c.status = 2 * BS, SequenceStatus.SWAPPED
    c.token_ids.append(7)
    sched.swapped.append(c)
    assert sched.bm.num_free_gpu_blocks == num_gpu_blocks - 4
    out = sched.schedule()
    assert out.preempted == []
    if swapped_in:
        assert out.decode_seqs == [a, b, c] and len(out.blocks_to_swap_in) == 2
        assert sched.bm.num_free_gpu_blocks == 0
    else:  # 3 blocks > 4 free - 2 pending: it waits, and the decodes get their blocks
        assert out.decode_seqs == [a, b] and out.blocks_to_swap_in == [] and list(sched.swapped) == [c]
        assert sched.bm.num_free_gpu_blocks == 2
    sched.bm.check_invariants()


def test_token_budget_splits_a_prompt_into_chunks():
    sched = make_scheduler(num_gpu_blocks=64, budget=32, max_num_seqs=4)
    a = running_decode(sched, 1, BS)
    long = make_seq(2, 100)
    sched.add(long)
    out = sched.schedule()
    # The decode takes 1 token of the budget; the prompt gets the other 31.
    assert out.decode_seqs == [a] and out.prefill_seqs == [long] and out.prefill_lens == [31]
    assert out.num_batched_tokens == 32


def test_preemption_takes_the_latest_arrived_running_sequence():
    sched = make_scheduler(num_gpu_blocks=4)
    first, last = running_decode(sched, 1, 2 * BS), running_decode(sched, 2, 2 * BS)
    out = sched.schedule()  # each needs a new block; the pool has none: the latest arrival gives its blocks up
    assert out.preempted == [last] and out.decode_seqs == [first]
    assert last.status is SequenceStatus.WAITING and last.num_computed_tokens == 0
    assert sched.waiting[0] is last


# ---- update_from_output: the request lifecycle after the forward ----------------------------------------------
EOS = 2


def make_request(sched: Scheduler, seq_id: int, num_prompt: int, n: int = 1, **params) -> Request:
    """A request of `n` samples queued as the engine queues it: sample 0 waits, the others wait to fork."""
    prompt = list(range(10, 10 + num_prompt))
    req = Request(f"r{seq_id}", None, prompt, SamplingParams(n=n, **params), RequestMetrics(0.0))
    for i in range(n):
        seq = Sequence(seq_id + i, req, i, list(prompt))
        if i:
            seq.status = SequenceStatus.FORK_PENDING
        req.seqs.append(seq)
    sched.add(req.seqs[0])
    return req


def sampled_rows(out: SchedulerOutput) -> list[Sequence]:
    """The model runner's rows: decodes, prompts at their last token, a fork point once per sample."""
    rows = list(out.decode_seqs) + [s for i, s in enumerate(out.prefill_seqs) if out.sampled(i)]
    return [r for s in rows for r in (s.request.seqs if s.is_fork_point else [s])]


def run_step(sched: Scheduler, tokens: int | list[int], errors: list | None = None,
             logprobs: bool = False) -> tuple[list[Sequence], StepUpdate]:
    """Schedules a step and feeds `tokens` (one per row, or the same for all) back as if sampled at time 1.0."""
    out = sched.schedule()
    rows = sampled_rows(out)
    ids = tokens if isinstance(tokens, list) else [tokens] * len(rows)
    lps = [{t: Logprob(-0.5)} if logprobs else None for t in ids]
    return rows, sched.update_from_output(out, rows, SamplerOutput(ids, lps), errors, now=1.0)


def assert_freed(sched: Scheduler, *seqs: Sequence) -> None:
    assert all(s.is_finished and s.seq_id not in sched.bm for s in seqs)
    sched.bm.check_invariants()


def test_update_moves_computed_tokens_and_appends_the_sampled_ones():
    sched = make_scheduler(num_gpu_blocks=16)
    req = make_request(sched, 1, 20, max_tokens=5, logprobs=0)
    seq = req.seqs[0]
    rows, update = run_step(sched, 7, logprobs=True)
    assert rows == [seq] and update.appended == [seq] and update.finished == [] and update.failed == {}
    assert seq.num_computed_tokens == 20 and seq.output_token_ids == [7]
    assert seq.logprobs == [{7: Logprob(-0.5)}] and seq.cumulative_logprob == -0.5
    assert req.metrics.first_scheduled_time == 1.0 and req.metrics.first_token_time == 1.0
    assert list(update.requests) == ["r1"]
    run_step(sched, 8, logprobs=True)  # the decode of token 7
    assert seq.num_computed_tokens == 21 and seq.output_token_ids == [7, 8] and seq.cumulative_logprob == -1.0


def test_eos_stops_only_from_min_tokens_on():
    sched = make_scheduler(num_gpu_blocks=16, eos_token_ids=frozenset({EOS}))
    seq = make_request(sched, 1, 12, max_tokens=10, min_tokens=2).seqs[0]
    _, update = run_step(sched, EOS)  # 1 output token < min_tokens: it goes on
    assert update.finished == [] and seq.status is SequenceStatus.RUNNING
    _, update = run_step(sched, EOS)
    assert update.finished == [seq] and (seq.finish_reason, seq.stop_reason) == ("stop", None)
    assert seq.output_token_ids == [EOS, EOS]
    assert_freed(sched, seq)
    assert sched.bm.num_free_gpu_blocks == 16


def test_ignore_eos_runs_to_max_tokens():
    sched = make_scheduler(num_gpu_blocks=16, eos_token_ids=frozenset({EOS}))
    seq = make_request(sched, 1, 12, max_tokens=3, ignore_eos=True).seqs[0]
    for _ in range(2):
        assert run_step(sched, EOS)[1].finished == []
    assert run_step(sched, EOS)[1].finished == [seq] and seq.finish_reason == "length"
    assert_freed(sched, seq)


def test_a_stop_token_id_is_the_stop_reason_even_with_ignore_eos():
    sched = make_scheduler(num_gpu_blocks=16, eos_token_ids=frozenset({EOS}))
    seq = make_request(sched, 1, 12, max_tokens=10, ignore_eos=True, stop_token_ids=[9]).seqs[0]
    run_step(sched, 5)
    _, update = run_step(sched, 9)
    assert update.finished == [seq] and (seq.finish_reason, seq.stop_reason) == ("stop", 9)
    assert seq.output_token_ids == [5, 9]
    assert_freed(sched, seq)


def test_max_tokens_ends_by_length():
    sched = make_scheduler(num_gpu_blocks=16)
    seq = make_request(sched, 1, 12, max_tokens=2).seqs[0]
    assert run_step(sched, 5)[1].finished == []
    assert run_step(sched, 6)[1].finished == [seq]
    assert (seq.finish_reason, seq.stop_reason, seq.output_token_ids) == ("length", None, [5, 6])
    assert_freed(sched, seq)


def test_max_model_len_ends_by_length_before_max_tokens():
    sched = make_scheduler(num_gpu_blocks=16, max_model_len=14)
    seq = make_request(sched, 1, 12, max_tokens=None).seqs[0]
    run_step(sched, 5)
    _, update = run_step(sched, 6)
    assert update.finished == [seq] and seq.finish_reason == "length" and len(seq.token_ids) == 14
    assert_freed(sched, seq)


def test_parallel_samples_fork_from_sample_0_and_share_its_blocks():
    sched = make_scheduler(num_gpu_blocks=16)
    req = make_request(sched, 1, 20, n=3, max_tokens=4)
    s0, s1, s2 = req.seqs
    rows, update = run_step(sched, [5, 6, 7])
    assert rows == [s0, s1, s2] and update.appended == [s0, s1, s2]
    assert [s.output_token_ids for s in req.seqs] == [[5], [6], [7]]
    assert all(s.status is SequenceStatus.RUNNING and s.num_computed_tokens == 20 for s in req.seqs)
    assert sched.running == [s0, s1, s2]  # the scheduler keeps its own queue: the forks run from the next step
    table = sched.bm.get_block_table(s0.seq_id)
    assert sched.bm.get_block_table(s1.seq_id) == sched.bm.get_block_table(s2.seq_id) == table
    assert sched.bm.num_used_gpu_blocks == 3  # 20 prompt tokens in blocks of 8, held once
    out = sched.schedule()
    assert out.decode_seqs == [s0, s1, s2] and len(out.blocks_to_copy) == 2  # the shared last block, copied on write
    sched.bm.check_invariants()


def test_parallel_samples_that_finish_at_once_free_every_block():
    """The fork runs before the stop rules: sample 0 ending on its first token cannot free blocks its forks need."""
    sched = make_scheduler(num_gpu_blocks=16)
    req = make_request(sched, 1, 20, n=3, max_tokens=1)
    _, update = run_step(sched, [5, 6, 7])
    assert update.finished == req.seqs and req.finished
    assert all(s.finish_reason == "length" for s in req.seqs)
    assert_freed(sched, *req.seqs)
    assert sched.bm.num_free_gpu_blocks == 16 and sched.bm.seq_ids() == []


def test_a_failed_row_fails_its_request_alone():
    """A row whose sampling raised: its request is reported failed and its later rows get no token; the other
    requests of the step go on."""
    sched = make_scheduler(num_gpu_blocks=32)
    bad = make_request(sched, 1, 12, n=2, max_tokens=4)
    good = make_request(sched, 10, 12, max_tokens=4)
    error = RuntimeError("bad row")
    rows, update = run_step(sched, [-1, 6, 7], errors=[error, None, None])
    assert rows == [*bad.seqs, good.seqs[0]]
    assert update.failed == {"r1": (bad, error)} and update.appended == [good.seqs[0]]
    assert [s.output_token_ids for s in bad.seqs] == [[], []] and good.seqs[0].output_token_ids == [7]
    assert list(update.requests) == ["r10"]


def test_finish_with_a_reason_frees_a_running_sequence():
    sched = make_scheduler(num_gpu_blocks=16)
    seq = make_request(sched, 1, 12, max_tokens=8).seqs[0]
    run_step(sched, 5)
    sched.abort(seq, "stop", "###")
    assert (seq.finish_reason, seq.stop_reason) == ("stop", "###")
    assert_freed(sched, seq)
    assert sched.schedule().is_empty


# --- sliding window -------------------------------------------------------------------------------


def run_steps(sched: Scheduler, max_steps: int) -> int:
    """Schedules and closes steps (every sampled row gets token 5) until nothing is left; returns the peak of
    used blocks."""
    peak = 0
    for _ in range(max_steps):
        out = sched.schedule()
        if out.is_empty:
            break
        peak = max(peak, sched.bm.num_used_gpu_blocks)
        rows = list(out.decode_seqs) + [s for i, s in enumerate(out.prefill_seqs) if out.sampled(i)]
        sched.update_from_output(out, rows, SamplerOutput([5] * len(rows), [None] * len(rows)), now=1.0)
        sched.bm.check_invariants()
    assert sched.num_unfinished == 0, "did not finish in max_steps"
    return peak


def long_seq(seq_id: int, num_prompt: int, max_tokens: int) -> Sequence:
    prompt = list(range(1, num_prompt + 1))
    req = Request(f"r{seq_id}", None, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                  RequestMetrics(0.0))
    seq = Sequence(seq_id, req, 0, list(prompt))
    req.seqs.append(seq)
    return seq


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_sliding_window_sequences_fit_without_preemption(mode):
    """6 sequences growing to 10 blocks each need 60 blocks of a 24-block pool: without the window they preempt
    each other. With a window of 2 blocks each holds at most 3 blocks, so all run side by side, unpreempted, also
    when they grow far longer (34 blocks each, more than the whole pool)."""
    plain = make_scheduler(24, num_cpu_blocks=64, mode=mode)
    for i in range(6):
        plain.add(long_seq(i, 2 * BS, 8 * BS))
    run_steps(plain, 400)
    assert plain.num_preemptions > 0
    for length in (8 * BS, 32 * BS):
        sched = make_scheduler(24, num_cpu_blocks=64, mode=mode, sliding_window=2 * BS)
        seqs = [long_seq(i, 2 * BS, length) for i in range(6)]
        for s in seqs:
            sched.add(s)
        peak = run_steps(sched, 2 * length)
        assert sched.num_preemptions == 0
        assert peak <= 6 * 3
        assert all(s.finish_reason == "length" and s.num_output_tokens == length for s in seqs)
        assert sched.bm.num_free_gpu_blocks == 24


def test_sliding_window_long_prompt_is_admitted_chunk_by_chunk():
    """A 40-block prompt in a 12-block pool: with chunks of 2 blocks and a 2-block window it needs at most
    2 + 2 + 1 blocks at a time, so it is admitted and prefilled without preemption."""
    sched = make_scheduler(12, budget=2 * BS, max_num_seqs=2, sliding_window=2 * BS)
    seq = long_seq(1, 40 * BS, 4)
    sched.add(seq)
    peak = run_steps(sched, 100)
    assert sched.num_preemptions == 0 and peak <= 5
    assert seq.num_output_tokens == 4
