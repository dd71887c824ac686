"""The Scheduler driven directly, on a real (C++) BlockManager and no model: admission, swap-in, budgets,
and the request lifecycle after the forward (`update_from_output`: tokens, stop rules, forks, freeing).

Each test builds the exact block-pool state that a rule is about and checks the one decision the rule makes,
so a scheduler that forgets the rule (the watermark, the blocks the running decodes take this step) fails.
"""

from __future__ import annotations

import pytest
from pagedkv.beam_search import BeamSearchParams
from pagedkv.config import CacheConfig, SchedulerConfig
from pagedkv.core.beam_search import BeamGroup
from pagedkv.core.block_manager import BlockManager
from pagedkv.core.scheduler import Scheduler, SchedulerOutput, StepUpdate
from pagedkv.core.sequence import Request, Sequence, SequenceStatus
from pagedkv.outputs import Logprob, RequestMetrics, SamplerOutput
from pagedkv.sampling_params import SamplingParams

BS = 8


def make_scheduler(num_gpu_blocks: int, watermark: float = 0.0, num_cpu_blocks: int = 0, max_num_seqs: int = 8,
                   budget: int = 256, mode: str = "recompute", max_model_len: int = 1024,
                   eos_token_ids: frozenset[int] = frozenset(), sliding_window: int | None = None,
                   caching: bool = False, long_prefill_token_threshold: int = 0) -> Scheduler:
    bm = BlockManager(BS, num_gpu_blocks, num_cpu_blocks, watermark, enable_caching=caching,
                      sliding_window=sliding_window)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                     max_model_len=max_model_len, preemption_mode=mode,
                                     long_prefill_token_threshold=long_prefill_token_threshold),
                     CacheConfig(block_size=BS, watermark=watermark, enable_prefix_caching=caching), bm,
                     eos_token_ids)


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


def swapped_out(sched: Scheduler, seq_id: int, num_computed: int) -> Sequence:
    """A sequence preempted by swap: its `num_computed` tokens' blocks in the CPU pool, its next token sampled."""
    seq = make_seq(seq_id, num_computed)
    sched.bm.allocate(seq.seq_id, num_computed)
    sched.bm.swap_out(seq.seq_id)
    seq.num_computed_tokens, seq.status = num_computed, SequenceStatus.SWAPPED
    seq.token_ids.append(7)
    sched.swapped.append(seq)
    return seq


def running_prompt(sched: Scheduler, seq_id: int, num_prompt: int, num_computed: int) -> Sequence:
    """A running sequence part way through its prompt: `num_computed` of its `num_prompt` tokens are cached."""
    seq = make_seq(seq_id, num_prompt)
    sched.bm.allocate(seq.seq_id, num_computed)
    seq.num_computed_tokens, seq.status = num_computed, SequenceStatus.RUNNING
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
    c = swapped_out(sched, 3, 2 * BS)
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


def test_running_sequences_stop_at_the_token_budget():
    """A prompt's chunk spends the whole budget: the decode behind it waits for the next step (no token, no
    preemption)."""
    sched = make_scheduler(num_gpu_blocks=16, budget=8)
    partial = running_prompt(sched, 1, 30, 8)
    waiting_decode = running_decode(sched, 2, BS - 2)
    queued = make_seq(3, 4)
    sched.add(queued)
    out = sched.schedule()
    assert out.prefill_seqs == [partial] and out.prefill_lens == [8] and out.decode_seqs == []
    assert list(sched.waiting) == [queued]
    assert out.blocks_to_copy == []  # a chunk into its own blocks copies nothing
    assert out.preempted == [] and sched.running == [partial, waiting_decode]


def test_a_prompt_chunk_of_one_token_is_a_chunk_not_a_decode():
    """A running prompt with 5 tokens left and 1 token of budget gets a 1-token chunk (no sample this step)."""
    sched = make_scheduler(num_gpu_blocks=16, budget=2, max_num_seqs=2)
    a = running_decode(sched, 1, BS - 2)
    partial = running_prompt(sched, 2, 13, 8)
    out = sched.schedule()
    assert out.prefill_seqs == [partial] and out.prefill_lens == [1] and not out.sampled(0)
    assert out.decode_seqs == [a]


def test_admission_takes_what_the_budget_has_left():
    """Budget 20: a running prompt's chunk of 7 leaves 13; the first waiting prompt takes 12 of them, the second
    the last one (a 1-token chunk), a third none."""
    sched = make_scheduler(num_gpu_blocks=32, budget=20)
    partial = running_prompt(sched, 1, 15, 8)
    a, b, c = make_seq(2, 12), make_seq(3, 30), make_seq(4, 3)
    for seq in (a, b, c):
        sched.add(seq)
    out = sched.schedule()
    assert out.prefill_seqs == [partial, a, b] and out.prefill_lens == [7, 12, 1]
    assert list(sched.waiting) == [c]


def test_admission_after_a_swap_in_takes_the_rest_of_the_budget():
    sched = make_scheduler(num_gpu_blocks=16, num_cpu_blocks=8, mode="swap", budget=9)
    c = swapped_out(sched, 1, BS - 2)
    p = make_seq(2, 20)
    sched.add(p)
    out = sched.schedule()
    assert out.decode_seqs == [c] and out.prefill_seqs == [p] and out.prefill_lens == [8]


@pytest.mark.parametrize("num_gpu_blocks, admitted", [(7, False), (8, True)])
def test_admission_leaves_the_blocks_running_decodes_take_this_step(num_gpu_blocks, admitted):
    """Two decodes at a block boundary hold 4 blocks and take 1 each now: a 2-block prompt fits only in 8."""
    sched = make_scheduler(num_gpu_blocks=num_gpu_blocks)
    running_decode(sched, 1, 2 * BS)
    running_decode(sched, 2, 2 * BS)
    p = make_seq(3, 2 * BS)
    sched.add(p)
    out = sched.schedule()
    assert len(out.decode_seqs) == 2 and out.prefill_seqs == ([p] if admitted else [])


def test_the_per_sequence_chunk_cap_splits_a_prompt_within_a_larger_budget():
    sched = make_scheduler(num_gpu_blocks=16, budget=256, long_prefill_token_threshold=10)
    first, second = make_seq(1, 30), make_seq(2, 4)
    sched.add(first)
    sched.add(second)
    out = sched.schedule()
    assert out.prefill_seqs == [first, second] and out.prefill_lens == [10, 4]
    assert sched.schedule().prefill_lens[0] == 10  # next step: the next 10 of first's prompt (not yet computed)


def test_decodes_that_need_no_block_leave_every_free_block_to_admission():
    """Two decodes in the middle of their blocks take no block this step, so a prompt needing all 4 free
    blocks is admitted beside them."""
    sched = make_scheduler(num_gpu_blocks=6)
    a, b = running_decode(sched, 1, BS - 3), running_decode(sched, 2, BS - 3)
    p = make_seq(3, 4 * BS)
    sched.add(p)
    out = sched.schedule()
    assert out.decode_seqs == [a, b] and out.prefill_seqs == [p] and sched.bm.num_free_gpu_blocks == 0


def test_no_preemption_when_the_free_blocks_exactly_cover_the_decodes():
    sched = make_scheduler(num_gpu_blocks=6)
    a, b = running_decode(sched, 1, 2 * BS), running_decode(sched, 2, 2 * BS)  # 4 blocks, 1 more each now
    out = sched.schedule()
    assert out.preempted == [] and out.decode_seqs == [a, b] and sched.bm.num_free_gpu_blocks == 0
    assert sched.num_preemptions == 0


@pytest.mark.parametrize("left, swapped_in", [(8, False), (7, True)])
def test_swap_in_takes_a_token_of_the_budget(left, swapped_in):
    """A prompt's chunk takes `left` of the 8 tokens of budget: a swapped sequence's decode needs the last one."""
    sched = make_scheduler(num_gpu_blocks=16, num_cpu_blocks=8, mode="swap", budget=8)
    running_prompt(sched, 1, 8 + left, 8)
    c = swapped_out(sched, 3, BS)
    out = sched.schedule()
    assert out.prefill_lens == [left]
    assert out.decode_seqs == ([c] if swapped_in else []) and list(sched.swapped) == ([] if swapped_in else [c])


@pytest.mark.parametrize("max_num_seqs, swapped_in", [(2, False), (3, True)])
def test_swap_in_takes_a_seat_of_max_num_seqs(max_num_seqs, swapped_in):
    sched = make_scheduler(num_gpu_blocks=16, num_cpu_blocks=8, mode="swap", max_num_seqs=max_num_seqs)
    running = [running_decode(sched, 1, BS - 2), running_decode(sched, 2, BS - 2)]
    c = swapped_out(sched, 3, BS)
    out = sched.schedule()
    assert out.decode_seqs == (running + [c] if swapped_in else running)
    assert list(sched.swapped) == ([] if swapped_in else [c])
    assert sched.num_unfinished == 3


def test_swap_in_waits_for_room_in_the_device_pool_and_the_cpu_blocks_stay():
    """A swapped sequence whose 2 blocks (+1 for its decode) do not fit stays swapped out, in order."""
    sched = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=8, mode="swap")
    a = running_decode(sched, 1, 2 * BS - 2)  # 2 blocks held, none needed now: 2 free
    c, d = swapped_out(sched, 3, 2 * BS), swapped_out(sched, 4, 2)
    out = sched.schedule()
    assert out.decode_seqs == [a] and out.blocks_to_swap_in == [] and list(sched.swapped) == [c, d]
    assert sched.bm.num_free_cpu_blocks == 8 - 3


def test_preemption_by_swap_counts_what_it_swapped_out():
    sched = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=8, mode="swap")
    first, last = running_decode(sched, 1, 2 * BS), running_decode(sched, 2, 2 * BS)
    out = sched.schedule()
    assert out.decode_seqs == [first]
    assert out.preempted == [last] and len(out.blocks_to_swap_out) == 2
    assert (sched.num_preemptions, sched.num_swapped_out) == (1, 1) and list(sched.swapped) == [last]
    assert last.status is SequenceStatus.SWAPPED and last.request.metrics.num_preemptions == 1
    assert sched.num_unfinished == 2


def test_num_unfinished_counts_every_queue_and_not_finished_running_sequences():
    sched = make_scheduler(num_gpu_blocks=16, num_cpu_blocks=8, mode="swap")
    done = running_decode(sched, 1, BS - 2)
    running_decode(sched, 2, BS - 2)
    swapped_out(sched, 3, BS)
    sched.add(make_seq(4, 3))
    sched.add(make_seq(5, 3))
    assert sched.num_unfinished == 5
    sched.finish(done, "length")
    assert sched.num_unfinished == 4 and done in sched.running  # it leaves `running` at the next schedule


def test_a_swapped_in_decode_that_needs_no_block_leaves_the_rest_to_admission():
    """The swapped sequence holds BS - 1 tokens: its decode fills its block without a new one, so after it
    comes back the 7 free blocks all go to a 7-block prompt."""
    sched = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=8, mode="swap")
    c = swapped_out(sched, 1, BS - 1)
    p = make_seq(2, 7 * BS)
    sched.add(p)
    out = sched.schedule()
    assert out.decode_seqs == [c] and out.prefill_seqs == [p] and sched.bm.num_free_gpu_blocks == 0


def test_preemption_in_swap_mode_recomputes_a_sequence_still_in_its_prompt():
    """Its prompt is not all in the cache yet: nothing worth swapping, it goes back to waiting."""
    sched = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=8, mode="swap", budget=BS)
    first = running_decode(sched, 1, 2 * BS)
    partial = running_prompt(sched, 2, 4 * BS, 2 * BS)
    out = sched.schedule()
    assert out.preempted == [partial] and out.blocks_to_swap_out == [] and out.decode_seqs == [first]
    assert partial.status is SequenceStatus.WAITING and partial.num_computed_tokens == 0
    assert sched.num_swapped_out == 0 and sched.bm.num_free_cpu_blocks == 8


def test_preemption_in_recompute_mode_never_swaps():
    sched = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=8, mode="recompute")
    first, last = running_decode(sched, 1, 2 * BS), running_decode(sched, 2, 2 * BS)
    out = sched.schedule()
    assert out.decode_seqs == [first]
    assert out.preempted == [last] and out.blocks_to_swap_out == [] and list(sched.waiting) == [last]
    assert sched.bm.num_free_cpu_blocks == 8


def hits_of(sched: Scheduler, prompt: list[int]) -> int:
    return sched.bm.match_prefix(prompt).num_cached_tokens


def test_prefix_caching_hashes_the_blocks_a_chunked_prompt_fills():
    """A 3-block prompt computed in chunks of 12 tokens: every block it fills (by the admission's allocate and by
    the later chunks' appends) is found again by the same prompt, up to its last token."""
    sched = make_scheduler(num_gpu_blocks=16, budget=12, caching=True)
    seq = make_request(sched, 1, 3 * BS + 1, max_tokens=4).seqs[0]
    prompt = list(seq.request.prompt_token_ids)
    computed = []
    while seq.num_computed_tokens < len(prompt):
        run_step(sched, 5)
        computed.append(seq.num_computed_tokens)
    assert computed == [12, 24, 25]
    assert hits_of(sched, prompt) == 3 * BS
    assert hits_of(sched, prompt[:BS] + [1] + prompt[BS + 1:]) == BS  # a changed token ends the chain there


@pytest.mark.parametrize("num_gpu_blocks, admitted", [(5, False), (6, True)])
def test_admission_of_a_cached_prefix_computes_and_counts_only_the_rest(num_gpu_blocks, admitted):
    """A second request with the first one's 3-block prompt plus 9 tokens: its 3 blocks are hits (shared, not
    taken again), so it needs 2 new blocks beside the first request's 3 and the one its decode takes now,
    and computes 9 tokens."""
    sched = make_scheduler(num_gpu_blocks=num_gpu_blocks, caching=True)
    first = make_request(sched, 1, 3 * BS + 1, max_tokens=4).seqs[0]
    first.token_ids.pop()  # a 3-block prompt (its 25th token, a fourth block, would not be cached)
    first.request.prompt_token_ids.pop()
    run_step(sched, 5)
    assert sched.bm.num_used_gpu_blocks == 3  # token 5's decode takes a fourth block in the next step
    prompt = list(first.request.prompt_token_ids) + list(range(70, 79))
    second = Request("r2", None, prompt, SamplingParams(max_tokens=4), RequestMetrics(0.0))
    second.seqs.append(Sequence(2, second, 0, list(prompt)))
    sched.add(second.seqs[0])
    out = sched.schedule()
    if not admitted:  # 3 used, 1 for the decode, 2 needed
        assert list(sched.waiting) == [second.seqs[0]]
        return
    assert out.prefill_seqs == [second.seqs[0]] and out.prefill_lens == [9]
    assert second.seqs[0].num_computed_tokens == 3 * BS and second.metrics.num_cached_tokens == 3 * BS


def test_a_prompt_whose_evictable_hits_leave_too_few_blocks_waits_unharmed():
    """A 5-block prompt whose first 2 blocks are cached but evictable (counted among the 4 free blocks): the
    estimate (3 new blocks) passes, but reviving the hits leaves 2, so the allocation fails. The prompt waits,
    nothing is half-allocated, and it is admitted once a running sequence frees its blocks."""
    sched = make_scheduler(num_gpu_blocks=6, caching=True)
    first = make_request(sched, 1, 2 * BS + 1, max_tokens=1).seqs[0]
    run_step(sched, 5)  # computed and finished at once: its 2 full blocks stay cached, evictable
    holder = make_request(sched, 50, 2 * BS - 2, max_tokens=8).seqs[0]
    holder.token_ids[:] = holder.request.prompt_token_ids[:] = list(range(300, 300 + 2 * BS - 2))
    run_step(sched, 5)
    prompt = list(first.request.prompt_token_ids[:2 * BS]) + list(range(70, 70 + 3 * BS - 4))
    late = Request("r2", None, prompt, SamplingParams(max_tokens=4), RequestMetrics(0.0))
    late.seqs.append(Sequence(2, late, 0, list(prompt)))
    sched.add(late.seqs[0])
    assert len(sched.bm.match_prefix(prompt).hits) == 2 and sched.bm.num_free_gpu_blocks == 4
    out = sched.schedule()
    assert out.decode_seqs == [holder] and out.prefill_seqs == [] and list(sched.waiting) == late.seqs
    assert late.seqs[0].seq_id not in sched.bm and sched.bm.num_free_gpu_blocks == 4
    sched.bm.check_invariants()
    sched.finish(holder, "length")
    out = sched.schedule()
    assert out.prefill_seqs == late.seqs and out.prefill_lens == [len(prompt) - 2 * BS]


def test_prefix_caching_hashes_a_block_a_decode_fills():
    """A 7-token prompt's first decode writes the 8th token: that full block is found by a prompt that starts
    with those 8 tokens (the sampled one included)."""
    sched = make_scheduler(num_gpu_blocks=16, caching=True)
    seq = make_request(sched, 1, BS - 1, max_tokens=4).seqs[0]
    run_step(sched, 5)  # prefill: samples 5
    run_step(sched, 6)  # decode of 5 fills the block
    assert seq.num_computed_tokens == BS
    assert hits_of(sched, seq.token_ids[:BS] + [9, 9]) == BS
    assert hits_of(sched, seq.token_ids[:BS - 1] + [6, 9, 9]) == 0


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
        rows = sampled_rows(out)
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


# --- beam groups ------------------------------------------------------------------------------------------


def make_beam_request(sched: Scheduler, num_prompt: int, width: int, max_tokens: int) -> Request:
    """A beam search queued as the engine queues it; its sequence ids (forks too) come from the scheduler."""
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens)
    prompt = list(range(10, 10 + num_prompt))
    seq_id = sched.next_seq_id()
    req = Request(f"b{seq_id}", None, prompt, params.to_sampling_params(), RequestMetrics(0.0),
                  beam=BeamGroup(params, EOS, num_prompt))
    req.seqs.append(Sequence(seq_id, req, 0, list(prompt)))
    sched.add(req.seqs[0])
    return req


def beam_step(sched: Scheduler, candidates: dict[int, float]) -> tuple[SchedulerOutput, StepUpdate]:
    """Schedules a step; every sampled row gets the same candidates ({token: logprob})."""
    out = sched.schedule()
    rows = sampled_rows(out)
    entry = {t: Logprob(lp) for t, lp in candidates.items()}
    sampled = SamplerOutput([next(iter(candidates))] * len(rows), [dict(entry) for _ in rows])
    return out, sched.update_from_output(out, rows, sampled, now=1.0)


def test_a_beam_group_decodes_whole_and_leaves_no_state_when_done():
    sched = make_scheduler(num_gpu_blocks=32, max_num_seqs=4)
    req = make_beam_request(sched, 10, width=2, max_tokens=2)
    beam_step(sched, {5: -0.1, 6: -0.2, 7: -3.0})  # the prompt: two beams, 5 and 6, from its one row
    assert [s.output_token_ids for s in req.seqs] == [[5], [6]] and len(sched.running) == 2
    beams = list(req.seqs)
    out, update = beam_step(sched, {5: -0.1, 6: -0.2, 7: -3.0})
    assert out.decode_seqs == beams and update.failed == {}
    assert req.finished and [h.output_token_ids for h in req.beam.results] == [[5, 5], [5, 6]]
    assert sched.beam_requests == {} and sched.num_unfinished == 0
    assert sched.bm.num_free_gpu_blocks == 32
    sched.bm.check_invariants()


def test_a_beam_search_holds_its_width_in_seats_from_admission_on():
    """max_num_seqs 3: a width-2 beam search admitted first leaves one seat, though only its first sequence
    runs yet; the second ordinary request waits until the beams are done."""
    sched = make_scheduler(num_gpu_blocks=32, max_num_seqs=3)
    beams = make_beam_request(sched, 10, width=2, max_tokens=1)
    first = make_request(sched, 100, 6, max_tokens=4)
    second = make_request(sched, 200, 6, max_tokens=4)
    out, _ = beam_step(sched, {5: -0.1, 6: -0.2, 7: -3.0})
    assert out.prefill_seqs == [beams.seqs[0], first.seqs[0]] and list(sched.waiting) == [second.seqs[0]]
    assert beams.finished and sched.beam_requests == {}
    out, _ = beam_step(sched, {5: -0.1})
    assert out.prefill_seqs == [second.seqs[0]]


@pytest.mark.parametrize("left, decodes", [(1, False), (2, True)])
def test_a_beam_group_decodes_only_with_a_token_for_every_beam(left, decodes):
    """A prompt's chunk leaves `left` tokens of a 10-token budget: two beams decode together or wait together."""
    sched = make_scheduler(num_gpu_blocks=32, max_num_seqs=4, budget=10)
    req = make_beam_request(sched, 10, width=2, max_tokens=4)
    beam_step(sched, {5: -0.1, 6: -0.2})
    partial = running_prompt(sched, 100, 8 + 10 - left, 8)
    sched.running.remove(partial)
    sched.running.insert(0, partial)  # ahead of the beams
    out = sched.schedule()
    assert out.prefill_seqs == [partial] and out.prefill_lens == [10 - left]
    assert out.decode_seqs == (req.seqs if decodes else [])


def beams_back_from_recompute(sched: Scheduler, computed: list[int], num_prompt: int = 20,
                              num_output: int = 3) -> Request:
    """A beam group whose beams were recomputed after a preemption, all running again: beam i holds
    num_prompt + num_output tokens (its last one sampled) and has computed[i] of them in the cache."""
    width = len(computed)
    params = BeamSearchParams(beam_width=width, max_tokens=8)
    prompt = list(range(10, 10 + num_prompt))
    req = Request("beams", None, prompt, params.to_sampling_params(), RequestMetrics(0.0),
                  beam=BeamGroup(params, EOS, num_prompt))
    for i, n in enumerate(computed):
        seq = Sequence(sched.next_seq_id(), req, i, prompt + [5 + i] * num_output, status=SequenceStatus.RUNNING,
                       num_computed_tokens=n)
        sched.bm.allocate(seq.seq_id, n)
        req.seqs.append(seq)
        sched.running.append(seq)
    sched.beam_requests[req.request_id] = req
    return req


@pytest.mark.parametrize("left_behind, chunks", [
    ((2, 11), [(0, 1), (1, 9)]),  # each chunk stops one short of its beam's end; the budget (10) cuts the second
    ((10, 11), [(0, 9), (1, 1)]),  # the first takes 9, the last token of budget goes to the second
    ((12, 5), [(0, 10)]),  # the first takes the whole budget: the second waits
    ((1, 11), [(1, 10)]),  # the first is back (one token left): it waits for the second, which gets a chunk
], ids=["short", "one-left", "none-left", "first-back"])
def test_a_recomputing_beam_group_gets_chunks_that_stop_one_short(left_behind, chunks):
    """Beams still recomputing their tokens get prompt chunks (no decode for the group, which decodes only
    when every beam has one token left), within the budget; a waiting request gets what is left (nothing)."""
    sched = make_scheduler(num_gpu_blocks=32, max_num_seqs=4, budget=10)
    req = beams_back_from_recompute(sched, [23 - n for n in left_behind])
    queued = make_seq(100, 4)
    sched.add(queued)
    out = sched.schedule()
    assert out.decode_seqs == [] and list(sched.waiting) == [queued]
    assert list(zip(out.prefill_seqs, out.prefill_lens, strict=True)) == [(req.seqs[i], n) for i, n in chunks]


def test_a_group_with_one_token_left_in_every_beam_decodes():
    sched = make_scheduler(num_gpu_blocks=32, max_num_seqs=4, budget=10)
    req = beams_back_from_recompute(sched, [22, 22])
    out = sched.schedule()
    assert out.decode_seqs == req.seqs and out.prefill_seqs == []


@pytest.mark.parametrize("computed, free_after, admitted", [
    (23, 4, True),    # 24 tokens each: the decodes fill their own third blocks; 4 free blocks for the prompt
    (24, 2, False),   # 25 tokens each: each decode takes a fourth block, 2 are left, the prompt needs 4
])
def test_admission_leaves_the_blocks_a_decoding_beam_group_takes(computed, free_after, admitted):
    sched = make_scheduler(num_gpu_blocks=10, max_num_seqs=4, budget=64)
    beams_back_from_recompute(sched, [computed, computed], num_output=computed - 19)
    assert sched.bm.num_free_gpu_blocks == 10 - 2 * (-(-computed // BS))
    p = make_seq(100, 4 * BS)
    sched.add(p)
    out = sched.schedule()
    assert len(out.decode_seqs) == 2 and out.prefill_seqs == ([p] if admitted else [])
    assert sched.bm.num_free_gpu_blocks == (0 if admitted else free_after)


def test_a_beam_prompt_still_prefilling_keeps_its_seats_in_later_steps():
    """max_num_seqs 3 and a width-2 beam search whose prompt takes two steps: in the second, the one seat left
    goes to the first newcomer; the second newcomer waits."""
    sched = make_scheduler(num_gpu_blocks=32, max_num_seqs=3, budget=16)
    beams = make_beam_request(sched, 20, width=2, max_tokens=2)
    assert beam_step(sched, {5: -0.1})[0].prefill_lens == [16]
    first, second = make_seq(100, 4), make_seq(200, 4)
    sched.add(first)
    sched.add(second)
    out = sched.schedule()
    assert out.prefill_seqs == [beams.seqs[0], first] and out.prefill_lens == [4, 4]
    assert list(sched.waiting) == [second]


def test_a_beam_group_is_scheduled_as_one_among_other_sequences():
    """running: a finished sequence (not yet dropped), a width-3 beam group, an ordinary decode. The group's
    three beams decode side by side, and so does the sequence after it."""
    sched = make_scheduler(num_gpu_blocks=32, max_num_seqs=8)
    done = running_decode(sched, 100, 5)
    sched.finish(done, "length")
    req = beams_back_from_recompute(sched, [22, 22, 22])
    other = running_decode(sched, 200, 5)
    out = sched.schedule()
    assert out.decode_seqs == [*req.seqs, other] and sched.running == [*req.seqs, other]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_preempted_beam_group_leaves_whole(mode):
    """An earlier sequence needs the last free block: the beam group behind it is preempted, all its beams.
    By recompute each beam later recomputes up to its last token (the group decodes that one together); by
    swap the group's blocks go to the CPU together."""
    sched = make_scheduler(num_gpu_blocks=7, num_cpu_blocks=8, max_num_seqs=4, budget=64, mode=mode)
    first = running_decode(sched, 100, BS)  # 1 block, needs a second now
    req = beams_back_from_recompute(sched, [22, 22])  # 3 blocks each: none left
    out = sched.schedule()
    assert out.preempted == req.seqs and out.decode_seqs == [first]
    if mode == "swap":
        assert list(sched.swapped) == req.seqs and len(out.blocks_to_swap_out) == 6
        assert sched.num_swapped_out == 2
        return
    assert list(sched.waiting) == req.seqs and all(s.num_computed_tokens == 0 for s in req.seqs)
    sched.finish(first, "length")
    out = sched.schedule()
    assert out.prefill_seqs == req.seqs and out.prefill_lens == [22, 22] and out.decode_seqs == []


def test_a_sample_of_an_n_request_is_swapped_out_alone():
    """Swap preemption takes a beam group whole, but the samples of an n > 1 request are sequences of their own:
    the last one swaps out alone when the first needs the pool's last block."""
    sched = make_scheduler(num_gpu_blocks=2, num_cpu_blocks=8, mode="swap")
    req = make_request(sched, 1, 2 * BS - 1, n=2, max_tokens=8)
    run_step(sched, [5, 6])  # the prompt's 2 blocks, shared by both samples
    s0, s1 = req.seqs
    out = sched.schedule()  # sample 0's token goes into a copy of the shared last block: none is free
    assert out.preempted == [s1] and out.decode_seqs == [s0] and len(out.blocks_to_swap_out) == 2
    assert s1.status is SequenceStatus.SWAPPED and list(sched.swapped) == [s1]


@pytest.mark.parametrize("filler_blocks, back", [(2, True), (3, False)])
def test_a_swapped_beam_group_comes_back_whole_when_its_blocks_fit(filler_blocks, back):
    """Two swapped-out beams hold 3 blocks each (none shared) and each decodes a token: 8 blocks. A running
    sequence holds `filler_blocks` of the 10, leaving 8 (back) or 7 (both stay out)."""
    sched = make_scheduler(num_gpu_blocks=10, num_cpu_blocks=8, max_num_seqs=4, mode="swap")
    filler = running_decode(sched, 100, filler_blocks * BS - 3)
    req = beams_back_from_recompute(sched, [22, 22])
    ids = [s.seq_id for s in req.seqs]
    sched.bm.swap_out(ids)
    for seq in req.seqs:
        sched.running.remove(seq)
        seq.status = SequenceStatus.SWAPPED
        sched.swapped.append(seq)
    out = sched.schedule()
    assert out.decode_seqs == ([filler, *req.seqs] if back else [filler])
    assert len(out.blocks_to_swap_in) == (6 if back else 0) and list(sched.swapped) == ([] if back else req.seqs)


@pytest.mark.parametrize("max_num_seqs, back", [(3, False), (4, True)])
def test_swap_in_leaves_the_seats_a_prefilling_beam_search_holds(max_num_seqs, back):
    """A width-2 beam search whose prompt is still prefilling holds a second seat: with it and one running
    sequence, a swapped sequence needs a fourth seat."""
    sched = make_scheduler(num_gpu_blocks=32, num_cpu_blocks=8, max_num_seqs=max_num_seqs, mode="swap",
                           budget=16)
    make_beam_request(sched, 20, width=2, max_tokens=2)
    beam_step(sched, {5: -0.1})  # its first 16 prompt tokens
    other = running_decode(sched, 200, BS - 2)
    c = swapped_out(sched, 100, BS - 2)
    out = sched.schedule()
    assert out.decode_seqs == ([other, c] if back else [other]) and list(sched.swapped) == ([] if back else [c])


@pytest.mark.parametrize("bad", ["error", "no-candidates"])
def test_a_failed_beam_group_fails_alone(bad):
    """Two beam searches sample their prompts' rows in one step; the first row raised in sampling, or came
    without its candidates: that request fails, the other forks its beams."""
    sched = make_scheduler(num_gpu_blocks=32, max_num_seqs=4)
    first = make_beam_request(sched, 10, width=2, max_tokens=4)
    second = make_beam_request(sched, 12, width=2, max_tokens=4)
    out = sched.schedule()
    rows = [first.seqs[0], second.seqs[0]]
    entry = {5: Logprob(-0.1), 6: Logprob(-0.2)}
    errors = [RuntimeError("sampling failed"), None] if bad == "error" else None
    sampled = SamplerOutput([5, 5], [dict(entry) if bad == "error" else None, dict(entry)])
    update = sched.update_from_output(out, rows, sampled, errors, now=1.0)
    assert list(update.failed) == [first.request_id]
    assert [s.output_token_ids for s in second.seqs] == [[5], [6]] and update.appended == second.seqs


def test_beams_end_at_max_model_len():
    sched = make_scheduler(num_gpu_blocks=32, max_num_seqs=4, max_model_len=22)
    req = make_beam_request(sched, 20, width=2, max_tokens=8)
    beam_step(sched, {5: -0.1, 6: -0.2})
    assert not req.finished
    beam_step(sched, {5: -0.1, 6: -0.2})
    assert req.finished and all(len(h.output_token_ids) == 2 for h in req.beam.results)
    assert sched.bm.num_free_gpu_blocks == 32


def test_a_beam_whose_row_raised_fails_its_group_and_not_the_next():
    """Decode rows of two forked groups; the second beam of the first raised in sampling: the first request
    fails (its good beam's row included), the second group takes its step."""
    sched = make_scheduler(num_gpu_blocks=32, max_num_seqs=4)
    first = make_beam_request(sched, 10, width=2, max_tokens=4)
    second = make_beam_request(sched, 12, width=2, max_tokens=4)
    beam_step(sched, {5: -0.1, 6: -0.2})
    out = sched.schedule()
    rows = list(out.decode_seqs)
    assert rows == [*first.seqs, *second.seqs]
    entry = {5: Logprob(-0.1), 6: Logprob(-0.2)}
    sampled = SamplerOutput([5] * 4, [dict(entry) for _ in rows])
    update = sched.update_from_output(out, rows, sampled, [None, RuntimeError("row 1"), None, None], now=1.0)
    assert list(update.failed) == [first.request_id]
    assert update.appended == second.seqs and all(len(s.output_token_ids) == 2 for s in second.seqs)


def test_max_loras_admits_past_an_adapter_without_a_slot():
    """max_loras=1 with adapter 1 running: a waiting request of adapter 2 waits, the requests behind it that run
    adapter 1 or no adapter are admitted in order, and adapter 2's goes first once adapter 1 is done."""
    from pagedkv.lora import LoRARequest

    sched = make_scheduler(64)
    sched.max_loras = 1
    lora = {i: LoRARequest(f"a{i}", i, f"/adapters/{i}") for i in (1, 2)}
    running = running_decode(sched, 0, 8)
    running.request.lora_request = lora[1]
    waiting = [make_seq(i, 8) for i in (1, 2, 3, 4)]
    for seq, adapter in zip(waiting, (2, 1, None, 2), strict=True):
        seq.request.lora_request = lora.get(adapter)
        sched.add(seq)
    out = sched.schedule()
    assert [s.seq_id for s in out.prefill_seqs] == [2, 3]
    assert [s.seq_id for s in sched.waiting] == [1, 4]  # still in arrival order, first in line
    for s in (running, *out.prefill_seqs):
        sched.finish(s, "stop")
    out = sched.schedule()
    assert [s.seq_id for s in out.prefill_seqs] == [1, 4]  # both adapter 2: one slot serves them
