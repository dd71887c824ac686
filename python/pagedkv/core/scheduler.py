"""Continuous batching over the paged KV cache: which sequences run this step, and how many tokens each.

Every step has a token budget (`max_num_batched_tokens`) and a cap on
running sequences (`max_num_seqs`). Running sequences come first, in arrival
order: a decoding one takes one token, one still in its prompt takes the next
chunk of it (chunked prefill), so a long prompt runs beside the decodes
instead of stalling them. When the KV blocks for that do not suffice, the
latest-arrived running sequence is preempted, by recompute (its blocks are
freed and it prefills again later) or by swap (its blocks move to the CPU
pool and come back when there is room). Only then, if nothing was preempted,
swapped-out sequences return and waiting ones are admitted, first come first
served, with only their uncached prompt tokens to compute.

The result is one plain `SchedulerOutput`: the decode sequences, the prefill
sequences with their chunk lengths, and the block copies (swap out, swap in,
copy-on-write, and the moves to and from the prefix cache's host and disk
tiers, pagedkv.core.kv_tiers) to apply before the forward pass. With tiers, a
waiting prompt's cached tokens include the blocks the tiers restore; those
cost new blocks like its uncached ones. All block bookkeeping goes
through the C++ manager: one `append_slots_batch` for the decodes.

Sliding-window models (the block manager has `sliding_window`): a sequence
releases the blocks before its window as it grows, so every block count here
is the manager's net one (`blocks_to_append` subtracts what an append frees,
a swapped-out sequence costs only the blocks it holds), and nothing is
refused or preempted for blocks about to be dropped. Admission asks only for
the blocks of the first chunk, as for any prompt: a long prompt then goes on
in chunks of at most the step's budget (or `long_prefill_token_threshold`),
each needing about (window + chunk) / block_size blocks at a time, since the
blocks before each chunk's window are released when it gets its slots.

After the forward, `update_from_output` (vLLM's name) closes the step: the
computed tokens move on, the `n > 1` samples of a prompt just computed fork
from sample 0, each sampled row gets its token, and a sequence that reached
EOS, a stop token id or its length limit finishes and frees its blocks.
Text (detokenization, stop strings) is the engine's: the scheduler knows
token ids only.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Set
from dataclasses import dataclass, field

from pagedkv._block_manager import NoFreeBlocksError
from pagedkv.config import CacheConfig, SchedulerConfig
from pagedkv.core.block_manager import BlockManager
from pagedkv.core.kv_tiers import TierMoves
from pagedkv.core.sequence import Request, Sequence, SequenceStatus
from pagedkv.outputs import SamplerOutput

logger = logging.getLogger(__name__)

BlockPair = tuple[int, int]


@dataclass(slots=True)
class SchedulerOutput:
    """One step's batch: decodes first (one token each), then prefill chunks.

    prefill_lens[i]: tokens of prefill_seqs[i] computed this step, starting at
    its num_computed_tokens. blocks_to_*: (src, dst) block pairs to apply, in
    the order swap out, swap in, copy, before the forward pass.
    """

    decode_seqs: list[Sequence] = field(default_factory=list)
    prefill_seqs: list[Sequence] = field(default_factory=list)
    prefill_lens: list[int] = field(default_factory=list)
    blocks_to_swap_out: list[BlockPair] = field(default_factory=list)
    blocks_to_swap_in: list[BlockPair] = field(default_factory=list)
    blocks_to_copy: list[BlockPair] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Moves between the pool and its host/disk tiers (pagedkv.core.kv_tiers): offload runs before the swap
    # out, restores after it.
    tier_moves: TierMoves | None = None

    @property
    def num_batched_tokens(self) -> int:
        return len(self.decode_seqs) + sum(self.prefill_lens)

    @property
    def is_empty(self) -> bool:
        return not self.decode_seqs and not self.prefill_seqs

    def sampled(self, i: int) -> bool:
        """Whether prefill_seqs[i] reaches its last token this step (its next token is sampled)."""
        s = self.prefill_seqs[i]
        return s.num_computed_tokens + self.prefill_lens[i] == len(s.token_ids)


@dataclass(slots=True)
class StepUpdate:
    """What `update_from_output` did with one step's sampled rows.

    appended: the sequences that got a token, in row order. finished: those of
    them that stopped (finish_reason set, blocks freed). failed: request id ->
    (request, the error its row raised); the engine fails these requests, whose
    later rows this step got no token.
    """

    appended: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    failed: dict[str, tuple[Request, Exception]] = field(default_factory=dict)

    @property
    def requests(self) -> dict[str, Request]:
        """The requests that moved (got a token), by id, in row order."""
        return {s.request.request_id: s.request for s in self.appended}


class Scheduler:
    """FCFS continuous batching with chunked prefill, preemption and prefix caching."""

    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, block_manager: BlockManager,
                 eos_token_ids: Set[int] = frozenset()) -> None:
        """eos_token_ids: the tokens that end a sequence (unless its request sets ignore_eos)."""
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.block_size = cache_config.block_size
        self.bm = block_manager
        self.caching = cache_config.enable_prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_swapped_out = 0

    # --- queues -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str | None = None, stop_reason: int | str | None = None) -> None:
        """Frees a sequence's blocks and records why it ended (reason None: as set already); it leaves `running`
        at the next schedule (no O(n) removal here)."""
        if seq.seq_id in self.bm:
            self.bm.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, stop_reason

    def abort(self, seq: Sequence, reason: str | None = None, stop_reason: int | str | None = None) -> None:
        """Finishes a sequence wherever it is: running, waiting or swapped out."""
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        self.finish(seq, reason, stop_reason)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.swapped) + sum(1 for s in self.running if not s.is_finished)

    # --- one step ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.running = [s for s in self.running if s.status is SequenceStatus.RUNNING]
        budget = self.config.max_num_batched_tokens
        budget, decodes, pending = self._schedule_running(out, budget)
        if not out.preempted:
            budget, pending = self._schedule_swapped(out, budget, decodes, pending)
            self._schedule_waiting(out, budget, pending)
        self._append_decodes(out, decodes)
        out.tier_moves = self.bm.take_tier_moves()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[int, list[Sequence], int]:
        decodes: list[Sequence] = []
        pending = 0  # blocks the decodes will take in the batched append at the end
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq.num_uncomputed_tokens, budget)
            need = self.bm.blocks_to_append(seq.seq_id, n)
            while need > self.bm.num_free_gpu_blocks - pending:
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is seq:
                    break
                need = self.bm.blocks_to_append(seq.seq_id, n)  # a freed sharer can spare a copy
            if seq.status is not SequenceStatus.RUNNING:  # preempted itself: nothing after it is left
                break
            if n == 1 and seq.num_uncomputed_tokens == 1:
                decodes.append(seq)
                # A decode's window drop happens in the batched append at the end: blocks it frees
                # (need < 0) cannot serve the chunks appended before that, so they are not lent here.
                pending += max(need, 0)
            else:
                self._append_chunk(out, seq, n)
            budget -= n
            i += 1
        return budget, decodes, pending

    def _chunk(self, remaining: int, budget: int) -> int:
        """Prompt tokens a sequence computes this step: what is left, within the budget and the per-sequence cap."""
        cap = self.config.long_prefill_token_threshold
        return min(remaining, budget, cap) if cap else min(remaining, budget)

    def _append_chunk(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        start = seq.num_computed_tokens
        cow = self.bm.append_slots(seq.seq_id, n, seq.token_ids[start:start + n] if self.caching else None)
        if cow is not None:
            out.blocks_to_copy.append(cow)
        out.prefill_seqs.append(seq)
        out.prefill_lens.append(n)

    def _append_decodes(self, out: SchedulerOutput, decodes: list[Sequence]) -> None:
        if not decodes:
            return
        ids = [s.seq_id for s in decodes]
        tokens = [[s.token_ids[-1]] for s in decodes] if self.caching else None
        out.blocks_to_copy.extend(self.bm.append_slots_batch(ids, 1, tokens))
        out.decode_seqs = decodes

    def _schedule_swapped(self, out: SchedulerOutput, budget: int, decodes: list[Sequence],
                          pending: int) -> tuple[int, int]:
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            if not self.bm.can_swap_in(seq.seq_id):
                break
            # Room for its blocks (those it holds: the window's dropped entries cost nothing) and for the
            # token it decodes this step.
            blocks = self.bm.num_held_blocks(seq.seq_id) + 1
            if blocks > self.bm.num_free_gpu_blocks - pending:
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(self.bm.swap_in(seq.seq_id))
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            pending += max(self.bm.blocks_to_append(seq.seq_id, 1), 0)
            decodes.append(seq)
            budget -= 1
        return budget, pending

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, pending: int) -> None:
        bs = self.block_size
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            extra = seq.request.extra_keys
            prompt = seq.token_ids if self.caching else len(seq.token_ids)
            match = self.bm.match_prefix(prompt, extra)
            cached = match.num_cached_tokens
            n = self._chunk(len(seq.token_ids) - cached, budget)
            # Every block past the device hits is new, restored ones from the tiers included.
            need = -(-(cached + n) // bs) - len(match.hits)
            if self.bm.num_free_gpu_blocks - pending - need < self.bm.core.watermark_blocks:
                break
            try:
                end = cached + n
                cached = self.bm.allocate(seq.seq_id, prompt, extra, num_tokens=end, match=match)
                n = end - cached  # more than planned only when a disk block failed its checks at load
            except NoFreeBlocksError:  # reviving evictable hits took blocks the estimate did not count
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = cached
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.num_cached_tokens = cached
            self.running.append(seq)
            out.prefill_seqs.append(seq)
            out.prefill_lens.append(n)
            budget -= n

    # --- after the forward: the request lifecycle ------------------------------------
    def update_from_output(self, out: SchedulerOutput, rows: list[Sequence], sampled: SamplerOutput,
                           errors: list[Exception | None] | None = None, now: float | None = None) -> StepUpdate:
        """Closes the step `out` scheduled: rows[i] (the model runner's sampled rows) gets sampled.token_ids[i],
        with sampled.logprobs[i] ({token: Logprob} or None).

        errors[i]: the exception sampling row i raised (its token is then -1), or
        None; such a row's request is reported failed and its later rows get no
        token. now: the step's wall-clock time (time.time()) for the metrics.
        """
        now = time.time() if now is None else now
        for seq in out.decode_seqs:
            seq.num_computed_tokens += 1
        for seq, n in zip(out.prefill_seqs, out.prefill_lens, strict=True):
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = now
            seq.num_computed_tokens += n
        # Fork first: sample 0 may finish on its first token and free its blocks below.
        for seq in rows:
            if seq.status is SequenceStatus.FORK_PENDING:
                self._fork(seq)
        update = StepUpdate()
        errors = errors if errors is not None else [None] * len(rows)
        for seq, token, logprobs, error in zip(rows, sampled.token_ids, sampled.logprobs, errors, strict=True):
            req = seq.request
            if req.request_id in update.failed:
                continue
            if error is None:
                try:
                    self._append_token(seq, token, logprobs, now)
                    finished = self._check_stop(seq, token)
                except Exception as e:  # this row's own state (e.g. logprobs without its token): its request fails
                    error = e
            if error is not None:
                update.failed[req.request_id] = (req, error)
                continue
            update.appended.append(seq)
            if finished:
                update.finished.append(seq)
        return update

    def _fork(self, child: Sequence) -> None:
        """Sample i > 0 of a prompt just computed: share sample 0's blocks (copy-on-write from here on)."""
        parent = child.request.seqs[0]
        self.bm.fork(parent.seq_id, child.seq_id)
        child.token_ids = list(parent.token_ids[:parent.num_computed_tokens])
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    @staticmethod
    def _append_token(seq: Sequence, token: int, logprobs, now: float) -> None:
        seq.token_ids.append(token)
        if logprobs is not None:
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token].logprob
        if seq.request.metrics.first_token_time is None:
            seq.request.metrics.first_token_time = now

    def _check_stop(self, seq: Sequence, token: int) -> bool:
        """Stops by id (EOS unless ignore_eos, a stop token id; neither before min_tokens), then by length
        (max_tokens, max_model_len). Returns whether the sequence finished."""
        p = seq.request.params
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                self.finish(seq, "stop")
                return True
            if token in p.all_stop_token_ids:
                self.finish(seq, "stop", token)
                return True
        if seq.num_output_tokens >= (p.max_tokens or 1 << 62) or len(seq.token_ids) >= self.config.max_model_len:
            self.finish(seq, "length")
            return True
        return False

    # --- preemption -------------------------------------------------------------
    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Frees a running sequence's GPU blocks: swap (if asked and possible) or recompute."""
        self.num_preemptions += 1
        seq.request.metrics.num_preemptions += 1
        out.preempted.append(seq)
        mid_prefill = seq.num_computed_tokens < seq.num_prompt_tokens
        if self.config.preemption_mode == "swap" and not mid_prefill and self.bm.can_swap_out(seq.seq_id):
            out.blocks_to_swap_out.extend(self.bm.swap_out(seq.seq_id))
            self.num_swapped_out += 1
            seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(seq)  # victims come latest-first: the earliest ends up in front
            return
        self.bm.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
