"""What completions and chat completions share: request checks, SamplingParams, streaming state, SSE.

A request becomes one engine request per prompt (`EngineRequest`), all
streaming into one queue (`AsyncEngine.generate`). Outputs are DELTA (only the
new tokens and text of each step), except for requests with stop strings: the
engine cuts a stop string out of the text only once it is complete, so those
run CUMULATIVE and `ChoiceState` holds back the last len(stop) - 1 characters
until it knows they are not the start of a stop string.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from pagedkv.core.sequence import OutputKind
from pagedkv.outputs import CompletionOutput, Logprob
from pagedkv.sampling_params import SamplingParams
from pagedkv.server.async_engine import AsyncEngine, EngineDeadError, EngineRequest, EngineStepError, RequestRefused
from pagedkv.server.protocol import APIError, PromptTokensDetails, UsageInfo, _SamplingFields

logger = logging.getLogger(__name__)

T = TypeVar("T")
MIN_LOGPROB = -9999.0  # JSON has no -inf (vLLM clamps the same way)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def engine_error(e: Exception) -> APIError:
    """The API error for an exception out of AsyncEngine.generate."""
    if isinstance(e, RequestRefused):
        return APIError(str(e), 400, param="prompt")
    if isinstance(e, EngineStepError):
        return APIError(str(e), 500, type="server_error")
    if isinstance(e, EngineDeadError):
        return APIError(str(e), 503, type="server_error")
    raise e


@dataclass(slots=True)
class ChoiceDelta:
    """What one step added to one choice."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(slots=True)
class ChoiceState:
    """One choice's progress across step outputs: what was sent, and whether it has finished."""

    holdback: int = 0  # characters kept back while unfinished (stop strings, CUMULATIVE outputs only)
    num_tokens: int = 0
    num_chars: int = 0
    text_offset: int = 0  # completions logprobs: offset of the next token's text
    finished: bool = False
    token_ids: list[int] = field(default_factory=list)  # everything sent (for usage and the non-streamed body)
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def update(self, c: CompletionOutput, cumulative: bool) -> ChoiceDelta | None:
        """The delta that `c` (this choice in one step output) brings; None when there is nothing new."""
        if self.finished:
            return None  # finished samples of an n > 1 request keep appearing in its outputs
        done = c.finish_reason is not None
        if cumulative:
            ids = c.token_ids[self.num_tokens:]
            logprobs = c.logprobs[self.num_tokens:] if c.logprobs is not None else None
            end = len(c.text) if done else max(self.num_chars, len(c.text) - self.holdback)
            text = c.text[self.num_chars:end]
        else:
            ids, logprobs, text = c.token_ids, c.logprobs, c.text
        if not ids and not text and not done:
            return None
        self.num_tokens += len(ids)
        self.num_chars += len(text)
        self.token_ids.extend(ids)
        self.text_parts.append(text)
        if logprobs:
            self.logprobs.extend(logprobs)
        if done:
            self.finished, self.finish_reason, self.stop_reason = True, c.finish_reason, c.stop_reason
        return ChoiceDelta(text, list(ids), list(logprobs) if logprobs is not None else None,
                           c.finish_reason if done else None, c.stop_reason if done else None)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class OpenAIServing:
    """Checks a request against the served model and turns it into engine requests."""

    def __init__(self, async_engine: AsyncEngine, model_names: list[str]) -> None:
        engine = async_engine.engine
        self.async_engine = async_engine
        self.model_names = model_names
        # Read-only from here on: the tokenizer (encode/decode do not mutate it) and fixed configs.
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.scheduler_config.max_model_len
        self.max_num_seqs = engine.scheduler_config.max_num_seqs
        self.vocab_size = engine.model_config.vocab_size
        self._tokenize = engine.tokenize  # a pure function of the tokenizer
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._decode_one)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(f"The model `{model}` does not exist.", 404, param="model", code="model_not_found")

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        try:
            return self._tokenize(prompt)[1]
        except ValueError as e:
            raise APIError(str(e), param="prompt") from e

    def check_prompt(self, token_ids: list[int], max_tokens: int | None, param: str = "prompt") -> int:
        """Refuses prompts the engine could never run; returns max_tokens (None: what max_model_len leaves)."""
        if not token_ids:
            raise APIError("The prompt is empty (0 tokens).", param=param)
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(f"Token id {bad} is out of vocabulary [0, {self.vocab_size}).", param=param)
        room = self.max_model_len - len(token_ids)
        if room < 1:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                           f"prompt has {len(token_ids)} tokens, which leaves no room for an output token.",
                           param=param, code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                           f"requested {len(token_ids) + max_tokens} tokens ({len(token_ids)} in the prompt, "
                           f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                           param="max_tokens", code="context_length_exceeded")
        return room if max_tokens is None else max_tokens

    def check_common(self, req: _SamplingFields) -> None:
        """Fields pagedkv does not implement are refused rather than silently ignored."""
        self.check_model(req.model)
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name):
                raise APIError(f"{name} is not supported (use repetition_penalty).", param=name)
        if req.logit_bias:
            raise APIError("logit_bias is not supported.", param="logit_bias")
        if req.stream_options is not None and not req.stream:
            raise APIError("stream_options is only allowed when stream is true.", param="stream_options")
        if req.n > self.max_num_seqs:
            raise APIError(f"n={req.n} is more than max_num_seqs={self.max_num_seqs}.", param="n")
        if req.ignored_fields:
            logger.warning("ignoring unsupported request fields: %s", ", ".join(req.ignored_fields))

    @staticmethod
    def sampling_params(req: _SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(
                n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                min_p=req.min_p or 0.0, seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
                stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, logprobs=logprobs,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output)
        except ValueError as e:
            raise APIError(str(e)) from e

    @staticmethod
    def engine_requests(base_id: str, prompts: list[tuple[str | None, list[int]]], params: list[SamplingParams],
                        cache_salt: str | None, arrival_time: float) -> list[EngineRequest]:
        """One engine request per prompt; stop strings need CUMULATIVE outputs (see the module docstring)."""
        return [EngineRequest(f"{base_id}-{i}", ids, p, text, cache_salt,
                              OutputKind.CUMULATIVE if p.stop_strings else OutputKind.DELTA, arrival_time, i)
                for i, ((text, ids), p) in enumerate(zip(prompts, params, strict=True))]

    @staticmethod
    def holdback(params: SamplingParams) -> int:
        return max((len(s) for s in params.stop_strings), default=1) - 1

    def usage(self, prompt_lens: list[int], states: list[ChoiceState], cached: int) -> UsageInfo:
        completion = sum(len(s.token_ids) for s in states)
        prompt = sum(prompt_lens)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def logprob_value(self, lp: float) -> float:
        return max(lp, MIN_LOGPROB) if lp == lp else MIN_LOGPROB  # NaN (lp != lp) too


async def prime(agen: AsyncIterator[T]) -> tuple[T, AsyncIterator[T]]:
    """Waits for the first item, so that errors before the first token get a real HTTP status."""
    try:
        first = await anext(agen)
    except BaseException:
        await agen.aclose()
        raise
    return first, agen


async def chain_first(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    yield first
    async with contextlib.aclosing(rest):
        async for item in rest:
            yield item


def sse(payload: Any) -> str:
    """One server-sent event: a pydantic model, a dict, or the final "[DONE]"."""
    if isinstance(payload, str):
        return f"data: {payload}\n\n"
    if hasattr(payload, "model_dump_json"):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


async def sse_stream(events: AsyncIterator[Any]) -> AsyncIterator[str]:
    """SSE lines of `events`, then [DONE]; an error after the first chunk becomes an error event (as in vLLM)."""
    try:
        async for event in events:
            yield sse(event)
    except (RequestRefused, EngineStepError, EngineDeadError) as e:
        yield sse(engine_error(e).response_body())
    yield sse("[DONE]")


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Runs `work` (a non-streamed request) but cancels it, aborting its engine requests, if the client leaves."""
    task = asyncio.ensure_future(work())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise APIError("The client disconnected.", 499, code="client_disconnected")
    return task.result()
