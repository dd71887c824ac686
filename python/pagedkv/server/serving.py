"""What completions and chat completions share: request checks, SamplingParams, streaming state, SSE.

A request becomes one engine request per prompt (`EngineRequest`), all
streaming DELTA outputs into one collector (`AsyncEngine.generate`): only
what each step added, merged while the client has not read it. The engine
keeps back the text that may start a stop string until it knows, so every
delta can be sent as it comes.

Tokenization and chat templates run on a worker thread with the front end's
own copy of the tokenizer, never on the event loop (a long prompt must not
stall every other client) and never on the engine thread's tokenizer.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from pagedkv.beam_search import BeamSearchParams
from pagedkv.lora.request import LoRARequest
from pagedkv.outputs import CompletionOutput, Logprob
from pagedkv.sampling_params import SamplingParams, SamplingParamsError
from pagedkv.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineDraining,
    EngineRequest,
    EngineStepError,
    RequestRefused,
)
from pagedkv.server.protocol import (
    APIError,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    UsageInfo,
    _SamplingFields,
)
from pagedkv.server.serving_models import OpenAIServingModels
from pagedkv.structured_outputs import CONSTRAINT_KINDS, StructuredOutputsParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
MIN_LOGPROB = -9999.0  # JSON has no -inf (vLLM clamps the same way)
ENGINE_ERRORS = (RequestRefused, EngineStepError, EngineDeadError, EngineDraining)
_MAX_LOGGED_FIELDS = 256  # distinct unknown field names logged (once each), so logging them is bounded too


@dataclass(slots=True)
class ServingOptions:
    """Server settings the request checks use (pagedkv serve's flags)."""

    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens (vLLM's flag)
    # --enable-auto-tool-choice with --tool-call-parser: how "auto" tool calls are found (None: refused).
    tool_call_parser: str | None = None
    max_prompts_per_request: int = 1024  # prompts in one /v1/completions request


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def engine_error(e: Exception) -> APIError:
    """The API error for an exception out of AsyncEngine.generate."""
    if isinstance(e, RequestRefused):  # a beam search's width is the request's n
        return APIError(str(e), e.status_code, param="n" if e.param == "beam_width" else e.param,
                        code="model_not_found" if e.status_code == 404 else None)
    if isinstance(e, EngineStepError):
        return APIError(str(e), 500, type="server_error")
    if isinstance(e, (EngineDeadError, EngineDraining)):
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
    """One choice's progress across DELTA outputs: what was sent, and whether it has finished.

    keep: hold the whole text, token ids and logprobs (a non-streamed answer
    needs them); a stream keeps only counts, so it holds nothing per token.
    """

    keep: bool = True
    num_tokens: int = 0
    text_offset: int = 0  # completions logprobs: offset of the next token's text
    finished: bool = False
    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def update(self, c: CompletionOutput) -> ChoiceDelta | None:
        """The delta that `c` (this choice in one output) brings; None when there is nothing new."""
        if self.finished:
            return None  # finished samples of an n > 1 request keep appearing in its outputs
        done = c.finish_reason is not None
        if not c.token_ids and not c.text and not done:
            return None
        self.num_tokens += len(c.token_ids)
        if self.keep:
            self.token_ids.extend(c.token_ids)
            self.text_parts.append(c.text)
            if c.logprobs:
                self.logprobs.extend(c.logprobs)
        if done:
            self.finished, self.finish_reason, self.stop_reason = True, c.finish_reason, c.stop_reason
        return ChoiceDelta(c.text, c.token_ids, c.logprobs, c.finish_reason if done else None,
                           c.stop_reason if done else None)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class OpenAIServing:
    """Checks a request against the served model (and its LoRA adapters) and turns it into engine requests."""

    def __init__(self, async_engine: AsyncEngine, models: OpenAIServingModels, options: ServingOptions | None = None,
                 executor: ThreadPoolExecutor | None = None, tokenizer: Any = None) -> None:
        """models: the served names (base model and adapters). executor, tokenizer: the tokenizer thread and the
        front end's tokenizer copy, shared by the routes (default: new ones)."""
        engine = async_engine.engine
        self.async_engine = async_engine
        self.models = models
        self.options = options or ServingOptions()
        # The front end's own tokenizer: the engine thread decodes with the other one at the same time.
        if tokenizer is None and engine.tokenizer is not None:
            tokenizer = copy.deepcopy(engine.tokenizer)
        self.tokenizer = tokenizer
        self.max_model_len = engine.scheduler_config.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.validate_params = engine.validate_params  # pure: reads fixed configs only
        limits = getattr(engine, "limits", None)
        self.max_logprobs: int | None = getattr(limits, "max_logprobs", None)
        self.defaults = dict(engine.default_sampling)
        self.executor = executor or ThreadPoolExecutor(1, thread_name_prefix="pagedkv-tokenizer")
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._decode_one)
        self._logged_fields: set[str] = set()

    @property
    def model_name(self) -> str:
        return self.models.model_name

    def response_model(self, model: str | None) -> str:
        """A response's `model`: the name the client sent (an adapter's, or one of the base model's), as vLLM."""
        return model if model is not None else self.model_name

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs tokenizer work on the tokenizer thread, so the event loop keeps serving everyone else."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model); 404 for a name not served."""
        return self.models.resolve(model)

    def encode(self, prompt: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """Token ids of a text prompt (on the tokenizer thread: see `off_loop`)."""
        if self.tokenizer is None:
            raise APIError("text prompts need a tokenizer; this server runs without one: send token ids.",
                           param=param)
        try:
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        except (UnicodeError, TypeError, ValueError) as e:
            raise APIError(f"the prompt could not be tokenized: {e}", param=param) from e

    async def prompt_inputs(self, prompt: str | list, param: str = "prompt",
                            add_special_tokens: bool = True) -> list[tuple[str | None, list[int]]]:
        """(text, token ids) of every prompt of a request given as a string, strings, token ids or token-id
        lists (text is tokenized off the event loop); at most max_prompts_per_request of them."""
        if isinstance(prompt, str):
            return [(prompt, await self.off_loop(self.encode, prompt, add_special_tokens, param))]
        if not prompt:
            raise APIError(f"{param} must not be empty.", param=param)
        if isinstance(prompt[0], int):
            return [(None, list(prompt))]
        limit = self.options.max_prompts_per_request
        if len(prompt) > limit:
            raise APIError(f"at most {limit} prompts in one request, got {len(prompt)}.", param=param)
        if isinstance(prompt[0], str):
            ids = await self.off_loop(lambda texts: [self.encode(p, add_special_tokens, param) for p in texts], prompt)
            return list(zip(prompt, ids, strict=True))
        return [(None, list(p)) for p in prompt]

    def check_token_ids(self, token_ids: list[int], param: str, what: str = "prompt") -> None:
        """A prompt (`what`: the field's noun in the message) that is not empty and lies in the vocabulary."""
        if not token_ids:
            raise APIError(f"The {what} is empty (0 tokens).", param=param)
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(f"Token id {bad} is out of vocabulary [0, {self.vocab_size}).", param=param)

    def check_prompt(self, token_ids: list[int], max_tokens: int | None, param: str = "prompt") -> int:
        """Refuses prompts the engine could never run; returns max_tokens (None: what max_model_len leaves,
        capped by the generation config's max_new_tokens, as in vLLM)."""
        self.check_token_ids(token_ids, param)
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
        limits = [v for v in (room, max_tokens, self.defaults.get("max_tokens")) if v is not None]
        return min(limits)

    def check_common(self, req: _SamplingFields) -> LoRARequest | None:
        """Fields pagedkv does not implement are refused rather than silently ignored. The ranges that depend on
        the model (n, top_k, stop ids, logprobs) are the engine's own check, in `sampling_params`. Returns the
        LoRA adapter the request's `model` names (None: the base model)."""
        lora = self.check_model(req.model)
        if req.stream_options is not None and not req.stream:
            raise APIError("stream_options is only allowed when stream is true.", param="stream_options")
        if req.stream and req.prompt_logprobs is not None:  # as vLLM: they come whole, with the first token
            raise APIError("prompt_logprobs are not available when stream is true.", param="prompt_logprobs")
        self._log_ignored(req.ignored_fields)
        return lora

    def _log_ignored(self, names: list[str]) -> None:
        """Unknown fields, each name once at debug level, escaped: a client cannot forge or flood the log."""
        new = [n for n in names if n not in self._logged_fields]
        if not new or len(self._logged_fields) >= _MAX_LOGGED_FIELDS:
            return
        self._logged_fields.update(new[:_MAX_LOGGED_FIELDS - len(self._logged_fields)])
        logger.debug("ignoring unsupported request fields: %s", ", ".join(ascii(n[:64]) for n in new[:16]))

    def sampling_params(self, req: _SamplingFields, max_tokens: int, logprobs: int | None,
                        logprobs_param: str = "logprobs", prompt_logprobs: int | None = None,
                        constraint: dict | None = None) -> SamplingParams:
        """The request's SamplingParams: what it leaves out (None) comes from the generation config, else vLLM's
        defaults. A refusal names its field. prompt_logprobs: the request's, or what echo implies. constraint:
        structured_outputs fields that replace the request's own (a chat's tool_choice)."""
        d = self.defaults

        def pick(value: Any, name: str, fallback: Any) -> Any:
            return d.get(name, fallback) if value is None else value

        constraint = (StructuredOutputsParams.coerce(constraint) if constraint is not None
                      else self.structured_outputs(req))
        try:
            params = SamplingParams(
                n=req.n, temperature=pick(req.temperature, "temperature", 1.0), top_p=pick(req.top_p, "top_p", 1.0),
                top_k=pick(req.top_k, "top_k", 0), min_p=pick(req.min_p, "min_p", 0.0), seed=req.seed,
                max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos, logprobs=logprobs,
                repetition_penalty=pick(req.repetition_penalty, "repetition_penalty", 1.0),
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                logit_bias=req.logit_bias, allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output, prompt_logprobs=prompt_logprobs,
                structured_outputs=constraint)
            self.validate_params(params)
        except SamplingParamsError as e:
            raise APIError(str(e), param=logprobs_param if e.param == "logprobs" else e.param) from e
        return params

    @staticmethod
    def structured_outputs(req: _SamplingFields) -> StructuredOutputsParams | None:
        """The request's constraint: vLLM's structured_outputs, with OpenAI's response_format (json_object, or a
        json_schema's schema) in place of its kind when given, as vLLM does."""
        fields = dict(req.structured_outputs or {})
        rf = req.response_format
        kind = rf.get("type", "text") if rf is not None else "text"
        if kind == "json_object":
            fields = {k: v for k, v in fields.items() if k not in CONSTRAINT_KINDS} | {"json_object": True}
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise APIError("response_format of type json_schema needs json_schema.schema, a JSON schema object.",
                               param="response_format")
            fields = {k: v for k, v in fields.items() if k not in CONSTRAINT_KINDS} | {"json": schema}
        elif kind != "text":
            raise APIError(f"response_format type {str(kind)[:40]!r} is not supported (text, json_object, "
                           f"json_schema).", param="response_format")
        if not fields:
            return None
        try:
            return StructuredOutputsParams.coerce(fields)
        except (SamplingParamsError, TypeError) as e:
            raise APIError(str(e), param="structured_outputs" if kind == "text" else "response_format") from e

    def check_beam_search(self, req: _SamplingFields, logprobs: int | None, logprobs_param: str = "logprobs") -> None:
        """Refuses what a beam search cannot honour (as vLLM does for streaming); n is the beam width. The
        sampling fields that beam search has no use for are refused when set to anything but their neutral
        value, rather than silently ignored."""
        if req.stream:
            raise APIError("Streaming is not currently supported with beam search.", param="stream")
        unsupported = (
            ("top_p", req.top_p is not None and req.top_p != 1.0),
            ("top_k", req.top_k is not None and req.top_k not in (0, -1)),
            ("min_p", req.min_p is not None and req.min_p != 0.0),
            ("repetition_penalty", req.repetition_penalty is not None and req.repetition_penalty != 1.0),
            ("presence_penalty", bool(req.presence_penalty)),
            ("frequency_penalty", bool(req.frequency_penalty)),
            ("logit_bias", bool(req.logit_bias)),
            ("allowed_token_ids", req.allowed_token_ids is not None),
            ("bad_words", bool(req.bad_words)),
            ("stop", bool(req.stop)),
            ("stop_token_ids", bool(req.stop_token_ids)),
            ("seed", req.seed is not None),
            ("min_tokens", req.min_tokens > 0),
            ("prompt_logprobs", req.prompt_logprobs is not None),
            ("structured_outputs", req.structured_outputs is not None),
            ("response_format", (req.response_format or {}).get("type", "text") != "text"),
        )
        for name, is_set in unsupported:
            if is_set:
                raise APIError(f"{name} is not supported with beam search (use_beam_search=true).", param=name)
        if logprobs is not None and self.max_logprobs is not None and logprobs > self.max_logprobs:
            raise APIError(f"requested {logprobs} logprobs, more than the {self.max_logprobs} allowed "
                           f"(max_logprobs).", param=logprobs_param)

    def beam_search_params(self, req: _SamplingFields, max_tokens: int) -> BeamSearchParams:
        """The request's BeamSearchParams (vLLM's `to_beam_search_params`): beam_width = n; a temperature left
        out comes from the generation config, else 1.0, as in vLLM. A refusal names its field."""
        temperature = self.defaults.get("temperature", 1.0) if req.temperature is None else req.temperature
        try:
            params = BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                      temperature=temperature, length_penalty=req.length_penalty,
                                      include_stop_str_in_output=req.include_stop_str_in_output,
                                      skip_special_tokens=req.skip_special_tokens)
            self.validate_params(params)  # the width against max_num_seqs
            return params
        except SamplingParamsError as e:
            raise APIError(str(e), param="n" if e.param == "beam_width" else e.param) from e

    @staticmethod
    def engine_requests(base_id: str, prompts: list[tuple[str | None, list[int]]],
                        params: list[SamplingParams] | list[BeamSearchParams],
                        cache_salt: str | None, arrival_time: float,
                        lora_request: LoRARequest | None = None) -> list[EngineRequest]:
        """One engine request per prompt (all with the request's LoRA adapter, if any)."""
        return [EngineRequest(f"{base_id}-{i}", ids, p, text, cache_salt, arrival_time, i, lora_request)
                for i, ((text, ids), p) in enumerate(zip(prompts, params, strict=True))]

    def usage(self, prompt_lens: list[int], states: list[ChoiceState], cached: int) -> UsageInfo:
        completion = sum(s.num_tokens for s in states)
        prompt = sum(prompt_lens)
        # Cached-token counts tell a tenant which prefixes someone else sent: only when the operator asks.
        details = (PromptTokensDetails(cached_tokens=cached) if self.options.enable_prompt_tokens_details
                   else None)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                         prompt_tokens_details=details)

    def logprob_value(self, lp: float) -> float:
        return max(lp, MIN_LOGPROB) if lp == lp else MIN_LOGPROB  # NaN (lp != lp) too

    def prompt_logprobs_body(self, entries: list[dict[int, Logprob] | None] | None) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs field: per prompt token {token id: {logprob, rank, decoded_token}}, the prompt
        token first, then the top ones."""
        if entries is None:
            return None
        return [None if e is None else {t: PromptLogprob(logprob=self.logprob_value(v.logprob), rank=v.rank,
                                                         decoded_token=self.token_text(t)) for t, v in e.items()}
                for e in entries]

    async def start(self, raw: Request, requests: list[EngineRequest],
                    stream: bool) -> AsyncIterator[tuple[int, Any]]:
        """The engine's outputs for `requests`; for a stream, after its first one has come (so an error before
        the first token gets a real HTTP status). A client that leaves while its requests wait for their first
        token (queued or prefilling) aborts them."""
        agen = self.async_engine.generate(requests)
        if not stream:
            return agen
        try:
            first = await unless_disconnected(raw, functools.partial(anext, agen))
        except ENGINE_ERRORS as e:
            await agen.aclose()
            raise engine_error(e) from e
        except BaseException:
            await agen.aclose()
            raise
        return chain_first(first, agen)


def top_candidates(token_ids: list[int], logprobs: list[dict[int, Logprob]] | None,
                   k: int) -> list[dict[int, Logprob]]:
    """A beam's per-token candidate logprobs (2 * beam_width of them each step) cut to the `k` most likely, plus
    the chosen token, each with its rank (the engine's, else its place among the candidates): the shape a
    sampled request's logprobs have, so the usual formatting applies."""
    out = []
    for token, entry in zip(token_ids, logprobs or [], strict=True):
        ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob if kv[1].logprob == kv[1].logprob else 1e30)
        kept = {}
        for place, (t, v) in enumerate(ranked, 1):
            if place <= k or t == token:
                kept[t] = Logprob(v.logprob, v.rank if v.rank is not None else place, v.decoded_token)
        out.append(kept)
    return out


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
    except ENGINE_ERRORS as e:
        yield sse(engine_error(e).response_body())
    yield sse("[DONE]")


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Runs `work` but cancels it (which aborts its engine requests) if the client leaves first."""
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
