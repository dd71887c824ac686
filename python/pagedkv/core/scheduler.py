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

Beam search (pagedkv.core.beam_search): a beam request's live beams are
sequences forked from each other, kept side by side in `running`, and
scheduled as one: they decode in the same step or not at all, and a
preempted group is swapped or recomputed whole. A recomputed beam stops one
token short of its end, so that its group decodes its last token together.
Its first prompt runs like any other; a beam request takes `beam_width`
seats of `max_num_seqs` from admission on.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Set
from dataclasses import dataclass, field

from pagedkv._block_manager import NoFreeBlocksError
from pagedkv.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagedkv.core.beam_search import BeamGroup
from pagedkv.core.block_manager import BlockManager
from pagedkv.core.kv_tiers import TierMoves
from pagedkv.core.sequence import Request, Sequence, SequenceStatus
from pagedkv.outputs import SamplerOutput
from pagedkv.spec_decode.drafter import NgramDrafter, SpecDecodeCounts, num_accepted

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
    # Speculative decoding: decodes that check drafts (seq.spec_token_ids) this step, each a chunk of its next
    # token and its drafts (their slots are taken; the rejected ones are given back after the step).
    spec_seqs: list[Sequence] = field(default_factory=list)
    # Moves between the pool and its host/disk tiers (pagedkv.core.kv_tiers): offload runs before the swap
    # out, restores after it.
    tier_moves: TierMoves | None = None

    @property
    def num_batched_tokens(self) -> int:
        return len(self.decode_seqs) + sum(self.prefill_lens) + sum(1 + len(s.spec_token_ids) for s in self.spec_seqs)

    @property
    def is_empty(self) -> bool:
        return not self.decode_seqs and not self.prefill_seqs and not self.spec_seqs

    @property
    def seqs(self) -> list[Sequence]:
        """Every sequence that runs in the step."""
        return [*self.decode_seqs, *self.prefill_seqs, *self.spec_seqs]

    def sampled(self, i: int) -> bool:
        """Whether prefill_seqs[i] reaches its last token this step (its next token is sampled)."""
        s = self.prefill_seqs[i]
        return s.num_computed_tokens + self.prefill_lens[i] == len(s.token_ids)


@dataclass(slots=True)
class StepUpdate:
    """What `update_from_output` did with one step's sampled rows.

    appended: the sequences that got a token, in row order (first the pooling
    requests whose prompt the step completed: they end without one). finished:
    those of them that stopped (finish_reason set, blocks freed). failed: request id ->
    (request, the error its row raised); the engine fails these requests, whose
    later rows this step got no token.
    """

    appended: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    failed: dict[str, tuple[Request, Exception]] = field(default_factory=dict)
    # Speculative decoding: tokens each speculating sequence took (by seq_id; every other appended one took 1),
    # and the rows whose tokens were not kept (rejected drafts' rows, rows after a stop).
    num_new: dict[int, int] = field(default_factory=dict)
    num_dropped_rows: int = 0

    @property
    def requests(self) -> dict[str, Request]:
        """The requests that moved (got a token), by id, in row order."""
        return {s.request.request_id: s.request for s in self.appended}


class Scheduler:
    """FCFS continuous batching with chunked prefill, preemption and prefix caching."""

    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, block_manager: BlockManager,
                 eos_token_ids: Set[int] = frozenset(), max_scored_prompt_tokens: int | None = None,
                 max_loras: int | None = None, speculative: SpeculativeConfig | None = None) -> None:
        """eos_token_ids: the tokens that end a sequence (unless its request sets ignore_eos).

        max_scored_prompt_tokens: prompt tokens of requests that ask for prompt logprobs computed per step at
        most (each needs a row of logits: the engine bounds their memory by the vocabulary); None: no bound.
        speculative: the speculative-decoding settings (None: off).
        max_loras: distinct LoRA adapters running at once at most (each needs a device slot); a waiting request
        whose adapter would be one too many waits, and those behind it with a running adapter (or none) go first,
        as in vLLM.
        """
        self.config = config
        self.max_loras = max_loras
        # Speculative decoding (pagedkv.spec_decode): the drafts' source, and vLLM's acceptance counters.
        self.speculative = speculative
        self.drafter = NgramDrafter(speculative, config.max_model_len) if speculative is not None else None
        self.spec_counts = SpecDecodeCounts()
        self._spec_k = 0  # drafts per sequence in the step being scheduled (by the running batch's size)
        self.max_scored_prompt_tokens = max_scored_prompt_tokens
        self._scoring_left = 0  # of max_scored_prompt_tokens, in the step being scheduled
        self.eos_token_ids = eos_token_ids
        self.block_size = cache_config.block_size
        self.bm = block_manager
        self.caching = cache_config.enable_prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_swapped_out = 0
        self._seq_ids = itertools.count()
        self.beam_requests: dict[str, Request] = {}  # unfinished beam searches, by request id

    def next_seq_id(self) -> int:
        """A sequence id no other sequence has (new requests and forked beams alike)."""
        return next(self._seq_ids)

    # --- queues -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        if seq.request.beam is not None:
            self.beam_requests[seq.request.request_id] = seq.request

    def finish(self, seq: Sequence, reason: str | None = None, stop_reason: int | str | None = None) -> None:
        """Frees a sequence's blocks and records why it ended (reason None: as set already); it leaves `running`
        at the next schedule (no O(n) removal here)."""
        if seq.seq_id in self.bm:
            self.bm.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq.request.beam is not None and seq.request.finished:
            self.beam_requests.pop(seq.request.request_id, None)

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
        if self.beam_requests:
            self.running = self._running_grouped()
        else:
            self.running = [s for s in self.running if s.status is SequenceStatus.RUNNING]
        budget = self.config.max_num_batched_tokens
        self._scoring_left = self.max_scored_prompt_tokens or budget
        if self.speculative is not None:
            self._spec_k = self.speculative.tokens_for_batch(len(self.running))
        budget, decodes, pending = self._schedule_running(out, budget)
        if not out.preempted:
            reserved = self._reserved_seats() if self.beam_requests else 0
            budget, pending = self._schedule_swapped(out, budget, decodes, pending, reserved)
            self._schedule_waiting(out, budget, pending, reserved)
        self._append_decodes(out, decodes)
        out.tier_moves = self.bm.take_tier_moves()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[int, list[Sequence], int]:
        decodes: list[Sequence] = []
        pending = 0  # blocks the decodes will take in the batched append at the end
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.in_beam_group:
                step = self._schedule_beam_group(out, i, budget, decodes, pending)
                if step is None:  # preempted itself: nothing after it is left
                    break
                i, budget, pending = step
                continue
            n = self._chunk(seq.num_uncomputed_tokens, budget, seq)
            if n == 0:  # its prompt-scoring share of the step is spent
                i += 1
                continue
            if self._spec_k and seq.num_uncomputed_tokens == 1:
                taken = self._schedule_drafts(out, seq, budget, pending)
                if taken:
                    budget -= taken
                    i += 1
                    continue
            need = self._make_room(out, seq, [(seq, n)], pending)
            if need is None:  # preempted itself: nothing after it is left
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

    def _schedule_drafts(self, out: SchedulerOutput, seq: Sequence, budget: int, pending: int) -> int:
        """Schedules decode `seq` with drafts when it speculates, some are found and their blocks are free now
        (drafts never preempt anyone); returns the tokens it took of the budget (0: it decodes as usual)."""
        if not seq.speculates:
            return 0
        p = seq.request.params
        left = (p.max_tokens or 1 << 62) - seq.num_output_tokens  # tokens it may still take, drafts kept included
        drafts = self.drafter.drafts(seq.token_ids, min(self._spec_k + 1, budget, left) - 1)
        if not drafts:
            return 0
        n = 1 + len(drafts)
        if self.bm.blocks_to_append(seq.seq_id, n) > self.bm.num_free_gpu_blocks - pending:
            return 0
        cow = self.bm.append_drafts(seq.seq_id, seq.token_ids[-1], len(drafts))
        if cow is not None:
            out.blocks_to_copy.append(cow)
        seq.spec_token_ids = drafts
        out.spec_seqs.append(seq)
        return n

    def _make_room(self, out: SchedulerOutput, owner: Sequence, plan: list[tuple[Sequence, int]],
                   pending: int) -> int | None:
        """Preempts from the back of `running` until the sequences of `plan` ((sequence, new tokens) pairs) can
        take their blocks; returns the blocks they need (net: negative when a window drop frees more), or None
        when `owner` was preempted itself."""
        need = sum(self.bm.blocks_to_append(s.seq_id, n) for s, n in plan)
        while need > self.bm.num_free_gpu_blocks - pending:
            self._preempt_last(out)
            if owner.status is not SequenceStatus.RUNNING:
                return None
            need = sum(self.bm.blocks_to_append(s.seq_id, n) for s, n in plan)  # a freed sharer can spare a copy
        return need

    def _schedule_beam_group(self, out: SchedulerOutput, i: int, budget: int, decodes: list[Sequence],
                             pending: int) -> tuple[int, int, int] | None:
        """Schedules the beam group whose running beams start at running[i]: all of them decode if all are
        ready (one token left each), else those still being recomputed get a chunk that stops one short.
        Returns (the index after the group, budget, pending), or None when the group was preempted."""
        req = self.running[i].request
        j = i
        while j < len(self.running) and self.running[j].request is req:
            j += 1
        members = self.running[i:j]
        ready = len(members) == len(req.seqs) and all(s.num_uncomputed_tokens == 1 for s in members)
        plan: list[tuple[Sequence, int]] = []
        if ready:
            if len(members) > budget:
                return j, budget, pending  # the group decodes whole or not at all
            plan = [(s, 1) for s in members]
        else:
            left = budget
            for s in members:
                if s.num_uncomputed_tokens > 1 and left > 0:
                    n = self._chunk(s.num_uncomputed_tokens - 1, left)
                    plan.append((s, n))
                    left -= n
        if not plan:
            return j, budget, pending
        need = self._make_room(out, members[0], plan, pending)
        if need is None:
            return None
        for s, n in plan:
            if ready:
                decodes.append(s)
            else:
                self._append_chunk(out, s, n)
            budget -= n
        return j, budget, pending + max(need, 0) if ready else pending

    def _running_grouped(self) -> list[Sequence]:
        """`running` without the sequences that left it, each beam group's running beams side by side (in beam
        order) where its first one was."""
        grouped: list[Sequence] = []
        seen: set[str] = set()
        for s in self.running:
            if s.status is not SequenceStatus.RUNNING:
                continue
            req = s.request
            if req.beam is None:
                grouped.append(s)
            elif req.request_id not in seen:
                seen.add(req.request_id)
                grouped.extend(b for b in req.seqs if b.status is SequenceStatus.RUNNING)
        return grouped

    def _reserved_seats(self) -> int:
        """Seats of max_num_seqs the admitted beam groups will fill when they fork up to beam_width beams."""
        reserved = 0
        for req in self.beam_requests.values():
            if any(s.status is not SequenceStatus.WAITING for s in req.seqs):
                reserved += req.beam.params.beam_width - len(req.seqs)
        return reserved

    def _chunk(self, remaining: int, budget: int, seq: Sequence | None = None) -> int:
        """Prompt tokens a sequence computes this step: what is left, within the budget and the per-sequence cap;
        for `seq` still scoring its prompt (prompt logprobs), also within the step's scoring share (0 when spent)."""
        cap = self.config.long_prefill_token_threshold
        n = min(remaining, budget, cap) if cap else min(remaining, budget)
        if seq is not None and seq.request.next_prompt_logprob is not None:
            n = min(n, max(self._scoring_left, 0))
        return n

    def _took_chunk(self, seq: Sequence, n: int) -> None:
        """A chunk of `n` tokens was scheduled for `seq`: a scoring prompt's tokens spend the step's scoring share."""
        if seq.request.next_prompt_logprob is not None:
            self._scoring_left -= n

    def _append_chunk(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        self._took_chunk(seq, n)
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
                          pending: int, reserved: int) -> tuple[int, int]:
        while self.swapped and budget > 0:
            seq = self.swapped[0]
            # A beam group was swapped out whole and comes back whole (one call: its shared blocks stay shared).
            group = list(seq.request.seqs) if seq.in_beam_group else [seq]
            ids = [s.seq_id for s in group]
            if (len(group) > budget or len(self.running) + reserved + len(group) > self.config.max_num_seqs
                    or not self.bm.can_swap_in(ids)
                    or (self.max_loras is not None and self._lora_full(seq, self._running_loras()))):
                break
            # Room for its blocks (those it holds: the window's dropped entries cost nothing; a group's shared
            # ones once) and for the token each decodes this step.
            blocks = self._held_blocks(ids) + len(ids)
            if blocks > self.bm.num_free_gpu_blocks - pending:
                break
            for _ in group:
                self.swapped.popleft()
            out.blocks_to_swap_in.extend(self.bm.swap_in(ids))
            for s in group:
                s.status = SequenceStatus.RUNNING
                self.running.append(s)
                pending += max(self.bm.blocks_to_append(s.seq_id, 1), 0)
                decodes.append(s)
            budget -= len(group)
        return budget, pending

    def _held_blocks(self, ids: list[int]) -> int:
        """Distinct blocks the sequences `ids` hold (a forked group shares most of them)."""
        if len(ids) == 1:
            return self.bm.num_held_blocks(ids[0])
        return len({b for i in ids for b in self.bm.get_block_table(i) if b >= 0})

    def _running_loras(self) -> set[int]:
        return {s.request.lora_request.lora_int_id for s in self.running
                if s.request.lora_request is not None and s.status is SequenceStatus.RUNNING}

    def _lora_full(self, seq: Sequence, loras: set[int] | None) -> bool:
        """Whether `seq`'s adapter would be one more than max_loras beside `loras` (the running ones)."""
        lora = seq.request.lora_request
        return (loras is not None and lora is not None and lora.lora_int_id not in loras
                and len(loras) >= self.max_loras)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, pending: int, reserved: int) -> None:
        loras = self._running_loras() if self.max_loras is not None else None
        skipped: list[Sequence] = []  # behind an adapter that has no slot this step: back in front, in order
        try:
            self._admit(out, budget, pending, reserved, loras, skipped)
        finally:
            self.waiting.extendleft(reversed(skipped))

    def _admit(self, out: SchedulerOutput, budget: int, pending: int, reserved: int, loras: set[int] | None,
               skipped: list[Sequence]) -> None:
        bs = self.block_size
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if self._lora_full(seq, loras):
                skipped.append(self.waiting.popleft())
                continue
            req = seq.request
            # A beam search's first prompt holds the seats its beams will fill.
            seats = req.beam.params.beam_width if req.beam is not None and not seq.in_beam_group else 1
            if len(self.running) + reserved + seats > self.config.max_num_seqs:
                break
            extra = req.extra_keys
            # A recomputed beam stops one short: its group decodes the last token together.
            tokens = seq.token_ids[:-1] if seq.in_beam_group else seq.token_ids
            prompt = tokens if self.caching else len(tokens)
            match = self.bm.match_prefix(prompt, extra, read=req.reads_prefix_cache)
            cached = match.num_cached_tokens
            n = self._chunk(len(tokens) - cached, budget, seq)
            if n == 0:  # the step's prompt-scoring share is spent: it waits for the next step, in order
                break
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
            if loras is not None and req.lora_request is not None:
                loras.add(req.lora_request.lora_int_id)
            out.prefill_seqs.append(seq)
            out.prefill_lens.append(n)
            self._took_chunk(seq, n)
            budget -= n
            reserved += seats - 1

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
        update = StepUpdate()
        for seq, n in zip(out.prefill_seqs, out.prefill_lens, strict=True):
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = now
            seq.num_computed_tokens += n
            if seq.request.pooling is not None and seq.num_computed_tokens == len(seq.token_ids):
                self._finish_pooling(seq, update, now)
        # Fork first: sample 0 may finish on its first token and free its blocks below.
        for seq in rows:
            if seq.status is SequenceStatus.FORK_PENDING:
                self._fork(seq)
        errors = errors if errors is not None else [None] * len(rows)
        if len(sampled.token_ids) != len(rows) or len(errors) != len(rows):
            raise ValueError(f"update_from_output: {len(rows)} rows, {len(sampled.token_ids)} tokens, "
                             f"{len(errors)} errors")
        beam_rows: dict[str, list[tuple[Sequence, dict]]] = {}
        i = 0
        while i < len(rows):
            seq, token, logprobs, error = rows[i], sampled.token_ids[i], sampled.logprobs[i], errors[i]
            req = seq.request
            if seq.spec_token_ids:  # its next token's row, then one row per draft
                n = 1 + len(seq.spec_token_ids)
                self._settle_drafts(seq, sampled, errors, i, update, now)
                i += n
                continue
            i += 1
            if req.request_id in update.failed:
                continue
            if req.beam is not None and error is None:  # scored below, with the other beams of its group
                beam_rows.setdefault(req.request_id, []).append((seq, logprobs))
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
        for rid, scored in beam_rows.items():
            req = scored[0][0].request
            if rid in update.failed:
                continue
            try:
                beams = self._beam_step(req, scored, now)
            except Exception as e:  # e.g. a row without its candidates' logprobs: this request fails alone
                update.failed[rid] = (req, e)
                continue
            update.appended.extend(beams)
            if req.finished:
                update.finished.extend(beams)
        return update

    def _finish_pooling(self, seq: Sequence, update: StepUpdate, now: float) -> None:
        """A pooling request's prompt is computed (the model runner pooled its vector): it ends, sampling
        nothing, and its blocks are freed (into the prefix cache, with caching on)."""
        if seq.request.metrics.first_token_time is None:
            seq.request.metrics.first_token_time = now
        self.finish(seq, "stop")
        update.appended.append(seq)
        update.finished.append(seq)

    def _settle_drafts(self, seq: Sequence, sampled: SamplerOutput, errors: list[Exception | None], first: int,
                       update: StepUpdate, now: float) -> None:
        """Closes a speculating sequence's step from its rows first .. first + len(drafts): it takes row 0's token,
        then each next row's while the previous row's token equals its draft (pagedkv.spec_decode.drafter); its
        slots shrink to the tokens whose KV holds, and the accepted drafts enter the prefix cache."""
        drafts, seq.spec_token_ids = seq.spec_token_ids, []
        n = 1 + len(drafts)
        tokens = sampled.token_ids[first:first + n]
        base = seq.num_computed_tokens  # its last token's position: the chunk's KV starts there
        req = seq.request
        error = next((e for e in errors[first:first + n] if e is not None), None)
        if req.request_id in update.failed or error is not None:
            seq.num_computed_tokens = base + 1
            self.bm.settle_drafts(seq.seq_id, base + 1, [])
            update.num_dropped_rows += n
            if error is not None:
                update.failed[req.request_id] = (req, error)
            return
        accepted = num_accepted(drafts, tokens)
        self.spec_counts.record(len(drafts), accepted)
        taken, finished = 0, False
        try:
            while taken <= accepted and not finished:
                self._append_token(seq, tokens[taken], sampled.logprobs[first + taken], now)
                taken += 1
                finished = self._check_stop(seq, tokens[taken - 1])
        except Exception as e:  # this row's own state: its request fails
            update.failed[req.request_id] = (req, e)
            finished = True
        # KV holds its last token and the drafts now in its tokens (the newest token has none yet); a row that
        # failed before any token was taken leaves the last token alone.
        kept = max(taken, 1)
        seq.num_computed_tokens = base + kept
        if not seq.is_finished:
            self.bm.settle_drafts(seq.seq_id, base + kept, drafts[:kept - 1])
        update.num_dropped_rows += n - taken
        if req.request_id in update.failed:
            return
        update.appended.append(seq)
        update.num_new[seq.seq_id] = taken
        if finished:
            update.finished.append(seq)

    def _beam_step(self, req: Request, scored: list[tuple[Sequence, dict]], now: float) -> list[Sequence]:
        """One step of a beam group: the winners of its beams' candidates become its beams (a parent chosen k
        times forks k - 1 children, one chosen never is freed now), each gets its token; at max_tokens, the
        length limit, or with no live candidate left, the search ends. Returns the group's beams."""
        group: BeamGroup = req.beam
        if len(scored) != len(req.seqs):
            raise RuntimeError(f"beam request {req.request_id!r}: {len(scored)} of its {len(req.seqs)} beams were "
                               f"sampled this step; a group decodes whole")
        if any(entry is None for _, entry in scored):
            raise RuntimeError(f"beam request {req.request_id!r}: a beam's row came without its candidates")
        choices = group.select(scored)
        chosen = {id(c.parent) for c in choices}
        for seq in req.seqs:
            if id(seq) not in chosen:
                self.finish(seq, "length")  # pruned: its blocks (those it does not share) return now
        # Forks first, from the parents as they are; then every beam takes its own token.
        used: set[int] = set()
        beams: list[Sequence] = []
        for c in choices:
            if id(c.parent) in used:
                beams.append(self._fork_beam(c.parent))
            else:
                used.add(id(c.parent))
                beams.append(c.parent)
        for i, (beam, c) in enumerate(zip(beams, choices, strict=True)):
            beam.index = i
            self._append_token(beam, c.token, c.entry, now)
        req.seqs = beams
        if (not beams or group.num_steps >= group.params.max_tokens
                or len(beams[0].token_ids) >= self.config.max_model_len):
            group.finish(beams)
            for beam in beams:
                self.finish(beam, "length")
        return beams

    def _fork_beam(self, parent: Sequence) -> Sequence:
        """A new beam sharing every block of `parent` (copy-on-write from its next token on)."""
        child = Sequence(self.next_seq_id(), parent.request, 0, list(parent.token_ids),
                         status=SequenceStatus.RUNNING, num_computed_tokens=parent.num_computed_tokens,
                         cumulative_logprob=parent.cumulative_logprob,
                         logprobs=list(parent.logprobs) if parent.logprobs is not None else None)
        self.bm.fork(parent.seq_id, child.seq_id)
        self.running.append(child)
        return child

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
        if seq.grammar is not None and not seq.grammar.accept_token(token):
            # The sampler masked every token the grammar forbids: this is a bug, failing this request alone.
            raise RuntimeError(f"token {token} does not follow the request's structured_outputs grammar")
        seq.token_ids.append(token)
        if logprobs is not None:
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token].logprob
        if seq.request.metrics.first_token_time is None:
            seq.request.metrics.first_token_time = now

    def _check_stop(self, seq: Sequence, token: int) -> bool:
        """Stops by id (EOS unless ignore_eos, a stop token id; neither before min_tokens), by a complete grammar
        (structured outputs), then by length (max_tokens, max_model_len). Returns whether the sequence finished."""
        p = seq.request.params
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                self.finish(seq, "stop")
                return True
            if token in p.all_stop_token_ids:
                self.finish(seq, "stop", token)
                return True
        if seq.grammar is not None and seq.grammar.is_terminated():  # it took an EOS that ignore_eos let pass
            self.finish(seq, "stop", token)
            return True
        if seq.num_output_tokens >= (p.max_tokens or 1 << 62) or len(seq.token_ids) >= self.config.max_model_len:
            self.finish(seq, "length")
            return True
        return False

    # --- preemption -------------------------------------------------------------
    def _preempt_last(self, out: SchedulerOutput) -> None:
        """Frees the GPU blocks of the latest-arrived running sequence (with its whole beam group, if it is a
        beam): swap (if asked and possible) or recompute."""
        victim = self.running.pop()
        group = [victim]
        if victim.in_beam_group:  # its running beams sit side by side at the back
            while self.running and self.running[-1].request is victim.request:
                group.append(self.running.pop())
            group.reverse()
        self.num_preemptions += 1
        victim.request.metrics.num_preemptions += 1
        out.preempted.extend(group)
        ids = [s.seq_id for s in group]
        # Swapped only whole: every beam running, none in the middle of its (re)computation.
        whole = not victim.in_beam_group or len(group) == len(victim.request.seqs)
        ready = all(s.num_computed_tokens >= max(s.num_prompt_tokens, len(s.token_ids) - 1) for s in group)
        if self.config.preemption_mode == "swap" and whole and ready and self.bm.can_swap_out(ids):
            out.blocks_to_swap_out.extend(self.bm.swap_out(ids))
            self.num_swapped_out += len(group)
            for s in reversed(group):  # victims come latest-first: the earliest ends up in front
                s.status = SequenceStatus.SWAPPED
                self.swapped.appendleft(s)
            return
        for s in reversed(group):
            self.bm.free(s.seq_id)
            s.num_computed_tokens = 0
            s.status = SequenceStatus.WAITING
            self.waiting.appendleft(s)
