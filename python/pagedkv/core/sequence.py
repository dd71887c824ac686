"""Sequences and requests: the state the scheduler and the engine share.

A request (one prompt, one SamplingParams) owns `n` sequences. Until its
prompt is computed only the first one runs; when the prompt's last position
is sampled, the other samples are forked from it (`BlockManager.fork`) and
share its blocks copy-on-write.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedkv.outputs import Logprob, RequestMetrics
from pagedkv.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # needs a (re)prefill: new, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted to the CPU swap pool
    FORK_PENDING = "fork_pending"  # sample i > 0 of a request whose prompt is still being computed
    FINISHED = "finished"


class OutputKind(enum.Enum):
    """What a step reports for a request (vLLM's RequestOutputKind)."""

    CUMULATIVE = "cumulative"  # everything so far, every step
    DELTA = "delta"  # only the new tokens/text, every step
    FINAL_ONLY = "final"  # once, when it finishes


@dataclass(slots=True, eq=False)
class Sequence:
    """One sample: its tokens, how many have KV in the cache, how it ended.

    num_computed_tokens equals the block manager's token count for this
    sequence between steps: the tokens whose K/V the cache holds.
    """

    seq_id: int
    request: Request
    index: int
    token_ids: list[int]
    generator: torch.Generator | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""  # detokenized output, kept up to date only when stop strings or streaming need it
    prefix_offset: int = 0  # incremental detokenizer state (see engine.detokenizer)
    read_offset: int = 0
    num_emitted_tokens: int = 0  # DELTA outputs: tokens already reported
    num_emitted_chars: int = 0
    # structured_outputs: this sample's grammar matcher (pagedkv.structured_outputs), fed every token it takes.
    grammar: Any = None
    # Speculative decoding (pagedkv.spec_decode): the drafts this step checks after the last token ([] when none).
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.request.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.request.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def in_beam_group(self) -> bool:
        """A beam past its prompt: it decodes only together with its group's other beams."""
        return self.request.beam is not None and self.num_output_tokens > 0

    @property
    def is_fork_point(self) -> bool:
        """Sample 0 of an n > 1 request about to sample its first token: the other samples start here."""
        return self.index == 0 and self.num_output_tokens == 0 and len(self.request.seqs) > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def speculates(self) -> bool:
        """Whether it may check draft tokens in a step (pagedkv.spec_decode.drafter): not while a rule of its
        request reads the tokens before each row (penalties, bad words, a grammar, min_tokens), nor in beam
        search, nor with stop strings (its text is checked once per step)."""
        req = self.request
        p = req.params
        return (req.beam is None and self.grammar is None and not p.stop_strings and not req.bad_words_ids
                and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
                and self.num_output_tokens >= p.min_tokens)


@dataclass(slots=True, eq=False)
class Request:
    """A prompt and its samples. extra_keys: prefix-cache keys (cache_salt) that must match to share blocks."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    output_kind: OutputKind = OutputKind.CUMULATIVE
    extra_keys: tuple = ()
    seqs: list[Sequence] = field(default_factory=list)
    error: str | None = None  # why the engine failed it (its finish reason is then "error")
    banned_before_min_tokens: list[int] | None = None  # the model runner's cache: EOS and stop ids, sorted
    logit_bias_tensors: tuple | None = None  # the model runner's cache: logit_bias as (ids, values) tensors
    allowed_ids_tensor: Any = None  # the model runner's cache: allowed_token_ids as an int64 tensor
    bad_words_ids: list[list[int]] | None = None  # bad_words as token-id sequences (pagedkv.bad_words)
    # A beam search's state (pagedkv.core.beam_search.BeamGroup), or None: then seqs are its live beams.
    beam: Any = None
    # With params.prompt_logprobs: None for the first prompt token, then one {token: Logprob} per prompt token
    # whose position has been computed (pagedkv.engine.prompt_logprobs); None when not asked.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False  # a DELTA output carried them already
    lora_request: Any = None  # the LoRA adapter it runs with (pagedkv.lora.LoRARequest), or None: the base model
    # A pooling request (embeddings): its pagedkv.pooler.PoolingState; it computes its prompt and samples nothing.
    pooling: Any = None

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def next_prompt_logprob(self) -> int | None:
        """The prompt position whose next token is scored next, or None when nothing is left to score (all done,
        or not asked). Position p's logits score prompt token p + 1."""
        if self.prompt_logprobs is None:
            return None
        p = len(self.prompt_logprobs) - 1
        return p if p < self.num_prompt_tokens - 1 else None

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether its prompt may start from cached blocks: not while prompt positions are left to score (a cached
        position has no logits), as in vLLM, nor for a pooling that reads every position (MEAN, CLS)."""
        return self.next_prompt_logprob is None and (self.pooling is None or self.pooling.reads_prefix_cache)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
