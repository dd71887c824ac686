"""POST /v1/completions: prompts in, text out (whole, or streamed as server-sent events).

Several prompts (a list of strings or of token-id lists) run as separate
engine requests side by side; with `n` samples each, prompt i's sample j is
choice i * n + j, as in OpenAI's API. With use_beam_search (vLLM's extra)
each prompt is one beam search of width n, which the engine answers once,
when it ends: the choices are every prompt's best beams, best first, numbered
in order (as vLLM does); streaming is refused.

echo puts each prompt before its choices' text (a token-id prompt decoded);
with logprobs, the prompt's tokens get theirs too (the first one null), from
the engine's prompt logprobs, as in vLLM. max_tokens=0 with echo returns the
prompt alone: the way evaluation harnesses score a text (loglikelihood).
`prompt_logprobs` (vLLM's extra) returns them in vLLM's own form instead.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedkv.outputs import Logprob
from pagedkv.server.protocol import (
    APIError,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from pagedkv.server.serving import (
    ENGINE_ERRORS,
    ChoiceDelta,
    ChoiceState,
    OpenAIServing,
    engine_error,
    random_id,
    sse_stream,
    top_candidates,
    unless_disconnected,
)


@dataclass(slots=True)
class _Echo:
    """What echo puts before each prompt's choices: the prompt's text and ids, and its tokens' logprobs once the
    engine has them (with logprobs). only: max_tokens=0, the prompt alone (the engine still samples one token,
    which is dropped, as in vLLM)."""

    texts: list[str]
    ids: list[list[int]]
    logprobs: list[list | None]
    only: bool

    def apply(self, tag: int, text: str, ids: list[int], logprobs: list | None) -> tuple[str, list[int], list | None]:
        """A choice's text, ids and logprobs with its prompt in front (the first delta of a stream, or the whole)."""
        if self.only:
            text, ids, logprobs = "", [], [] if logprobs is not None else None
        lps = None if logprobs is None else [*(self.logprobs[tag] or []), *logprobs]
        return self.texts[tag] + text, [*self.ids[tag], *ids], lps


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest, raw: Request) -> JSONResponse | StreamingResponse:
        arrival = time.time()
        lora = self.check_common(req)
        if req.suffix:
            raise APIError("suffix is not supported.", param="suffix")
        if req.max_tokens == 0 and not req.echo:
            raise APIError("max_tokens must be at least 1 (0 only with echo=true: the prompt alone).",
                           param="max_tokens")
        beam = req.use_beam_search
        if beam:
            self.check_beam_search(req, req.logprobs)
            if req.echo and req.logprobs is not None:
                raise APIError("echo with logprobs is not supported with beam search.", param="echo")
            if req.best_of is not None and req.best_of != req.n:
                raise APIError("best_of must equal n with beam search (n is the beam width).", param="best_of")
        elif req.best_of is not None and req.best_of != req.n:
            raise APIError("best_of must equal n (no best-of selection; use_beam_search=true runs a beam "
                           "search of width n).", param="best_of")
        prompts = await self.prompt_inputs(req.prompt)
        max_tokens = 1 if req.max_tokens == 0 else req.max_tokens
        if beam:
            params = [self.beam_search_params(req, self.check_prompt(ids, max_tokens)) for _, ids in prompts]
        else:
            # echo with logprobs scores the prompt too, as prompt_logprobs=logprobs would (vLLM's rule).
            prompt_logprobs = req.logprobs if req.prompt_logprobs is None and req.echo else req.prompt_logprobs
            params = [self.sampling_params(req, self.check_prompt(ids, max_tokens), req.logprobs,
                                           prompt_logprobs=prompt_logprobs) for _, ids in prompts]
        echo = await self._echo(prompts, req) if req.echo else None
        request_id = random_id("cmpl")
        requests = self.engine_requests(request_id, prompts, params, req.cache_salt, arrival, lora)
        states = [ChoiceState(keep=not req.stream) for _ in params for _ in range(req.n)]
        prompt_lens = [len(ids) for _, ids in prompts]
        outputs = await self.start(raw, requests, req.stream)
        if req.stream:
            chunks = self._chunks(req, request_id, outputs, states, prompt_lens, echo)
            return StreamingResponse(sse_stream(chunks), media_type="text/event-stream")

        async def run() -> CompletionResponse:
            cached = 0
            prompt_lps: list[list | None] = [None] * len(prompts)
            try:
                async with contextlib.aclosing(outputs):
                    async for tag, out in outputs:
                        if out.prompt_logprobs is not None:
                            prompt_lps[tag] = out.prompt_logprobs
                        for c in out.outputs:
                            states[tag * req.n + c.index].update(c)
                        cached += out.num_cached_tokens if out.finished else 0
            except ENGINE_ERRORS as e:
                raise engine_error(e) from e
            if echo is not None:
                echo.logprobs = prompt_lps
            # A beam search may return fewer than n beams: its choices are the beams that came, numbered in order.
            answered = [(k // req.n, s) for k, s in enumerate(states) if s.finished or not beam]
            choices = [self._whole_choice(i, tag, s, req, beam, echo, prompt_lps[tag])
                       for i, (tag, s) in enumerate(answered)]
            return CompletionResponse(id=request_id, model=self.response_model(req.model), choices=choices,
                                      usage=self.usage(prompt_lens, [] if req.max_tokens == 0 else states, cached))

        response = await unless_disconnected(raw, run)
        return JSONResponse(response.model_dump())

    async def _echo(self, prompts: list[tuple[str | None, list[int]]], req: CompletionRequest) -> _Echo:
        """The prompts as echo returns them: a text prompt as sent, a token-id prompt decoded (off the loop)."""
        if self.tokenizer is None and any(text is None for text, _ in prompts):
            raise APIError("echo of token-id prompts needs a tokenizer; this server runs without one.",
                           param="echo")
        texts = await self.off_loop(lambda ps: [text if text is not None else self.tokenizer.decode(ids)
                                                for text, ids in ps], prompts)
        return _Echo(texts, [ids for _, ids in prompts], [None] * len(prompts), req.max_tokens == 0)

    def _whole_choice(self, index: int, tag: int, s: ChoiceState, req: CompletionRequest, beam: bool,
                      echo: _Echo | None, prompt_logprobs: list | None) -> CompletionChoice:
        text, ids = s.text, s.token_ids
        logprobs = self._chosen_logprobs(s, req, beam) if req.logprobs is not None else None
        if echo is not None:
            text, ids, logprobs = echo.apply(tag, text, ids, logprobs)
        return CompletionChoice(index=index, text=text, finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                                logprobs=self._logprobs(ids, logprobs, 0)[0] if logprobs is not None else None,
                                prompt_logprobs=self.prompt_logprobs_body(prompt_logprobs))

    async def _chunks(self, req: CompletionRequest, request_id: str, outputs: AsyncIterator, states: list[ChoiceState],
                      prompt_lens: list[int], echo: _Echo | None) -> AsyncIterator[CompletionResponse]:
        created, cached, model = int(time.time()), 0, self.response_model(req.model)
        echoed = [False] * len(states)
        async for tag, out in outputs:
            if echo is not None and out.prompt_logprobs is not None:
                echo.logprobs[tag] = out.prompt_logprobs
            for c in out.outputs:
                index = tag * req.n + c.index
                state = states[index]
                offset = state.text_offset
                delta = state.update(c)
                if delta is None:
                    continue
                if echo is not None and (echo.only or not echoed[index]):
                    delta = self._echoed(echo, tag, delta, first=not echoed[index])
                    echoed[index] = True
                yield CompletionResponse(id=request_id, created=created, model=model,
                                         choices=[self._choice(index, delta, state, offset, req.logprobs)])
            cached += out.num_cached_tokens if out.finished else 0
        if req.stream_options is not None and req.stream_options.include_usage:
            yield CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                     usage=self.usage(prompt_lens, [] if req.max_tokens == 0 else states, cached))

    @staticmethod
    def _echoed(echo: _Echo, tag: int, delta: ChoiceDelta, first: bool) -> ChoiceDelta:
        """A streamed choice's delta with the prompt in front (its first one), or emptied (max_tokens=0)."""
        if first:
            text, ids, logprobs = echo.apply(tag, delta.text, delta.token_ids, delta.logprobs)
        else:
            text, ids, logprobs = "", [], [] if delta.logprobs is not None else None
        return ChoiceDelta(text, ids, logprobs, delta.finish_reason, delta.stop_reason)

    def _choice(self, index: int, delta: ChoiceDelta, state: ChoiceState, offset: int,
                logprobs: int | None) -> CompletionChoice:
        lp = None
        if logprobs is not None and delta.logprobs is not None:
            lp, state.text_offset = self._logprobs(delta.token_ids, delta.logprobs, offset)
        return CompletionChoice(index=index, text=delta.text, logprobs=lp, finish_reason=delta.finish_reason,
                                stop_reason=delta.stop_reason)

    @staticmethod
    def _chosen_logprobs(state: ChoiceState, req: CompletionRequest, beam: bool) -> list[dict[int, Logprob]]:
        """A choice's per-token logprobs; a beam's candidates (2 * n a step) cut to the `logprobs` most likely."""
        return top_candidates(state.token_ids, state.logprobs, req.logprobs or 0) if beam else state.logprobs

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob] | None],
                  offset: int) -> tuple[CompletionLogprobs, int]:
        """The legacy logprobs object for these tokens; returns it and the text offset after them. An entry None
        (an echoed prompt's first token, which has no context) gives null logprobs."""
        out = CompletionLogprobs()
        for token, entry in zip(token_ids, logprobs, strict=True):
            text = self.token_text(token)
            out.tokens.append(text)
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                out.token_logprobs.append(self.logprob_value(entry[token].logprob) if token in entry else None)
                out.top_logprobs.append({self.token_text(t): self.logprob_value(v.logprob) for t, v in
                                         sorted(entry.items(), key=lambda kv: kv[1].rank or 1 << 30)})
            out.text_offset.append(offset)
            offset += len(text)
        return out, offset
