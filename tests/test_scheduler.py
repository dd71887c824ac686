"""The Scheduler driven directly, on a real (C++) BlockManager and no model: admission, swap-in, budgets.

Each test builds the exact block-pool state that a rule is about and checks the one decision the rule makes,
so a scheduler that forgets the rule (the watermark, the blocks the running decodes take this step) fails.
"""

from __future__ import annotations

import pytest
from pagedkv.config import CacheConfig, SchedulerConfig
from pagedkv.core.block_manager import BlockManager
from pagedkv.core.scheduler import Scheduler
from pagedkv.core.sequence import Request, Sequence, SequenceStatus
from pagedkv.outputs import RequestMetrics
from pagedkv.sampling_params import SamplingParams

BS = 8


def make_scheduler(num_gpu_blocks: int, watermark: float = 0.0, num_cpu_blocks: int = 0, max_num_seqs: int = 8,
                   budget: int = 256, mode: str = "recompute") -> Scheduler:
    bm = BlockManager(BS, num_gpu_blocks, num_cpu_blocks, watermark)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=1024,
                                     preemption_mode=mode),
                     CacheConfig(block_size=BS, watermark=watermark), bm)


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
