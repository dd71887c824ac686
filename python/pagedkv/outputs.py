"""What `LLM.generate` and `LLMEngine.step` return (vLLM's RequestOutput shape), and what the sampler hands the
scheduler each step (SamplerOutput)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Logprob:
    """Log-probability of a token, its rank in the distribution (1 = most likely), and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class SamplerOutput:
    """token_ids[i]: row i's token. logprobs[i]: {token: Logprob} with the sampled token and the top ones, or None."""

    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request. logprobs[i]: token id -> Logprob at output position i (if asked)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's life, and prompt tokens served from the prefix cache."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step: its prompt, its samples so far, whether it is done.

    error: why the engine refused or aborted it (None otherwise).
    prompt_logprobs: with SamplingParams.prompt_logprobs, per prompt token {token: Logprob} (the prompt token
    with its rank, and the top ones), None for the first token; set once the whole prompt is computed (a DELTA
    output carries it once). None when not asked.
    pooled: a pooling request's vector; its `outputs` is then one empty sample that finished with "stop".
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    pooled: Any = None  # a pooling request's vector (float32 tensor [dimensions]) once finished (pagedkv.pooler)


@dataclass(slots=True)
class PoolingOutput:
    """A pooling request's result: data, float32 [dimensions] (vLLM's PoolingOutput)."""

    data: Any


@dataclass(slots=True)
class PoolingRequestOutput:
    """What `LLM.encode` returns per prompt (vLLM's shape). error: why the engine refused or failed it (its
    data is then an empty tensor)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    error: str | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    """One prompt's embedding as a list of floats (vLLM's EmbeddingOutput)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt (vLLM's shape). error: why the engine refused or failed it (its
    embedding is then empty)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool
    error: str | None = None
