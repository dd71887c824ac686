"""POST /v1/completions: prompts in, text out (whole, or streamed as server-sent events).

Several prompts (a list of strings or of token-id lists) run as separate
engine requests side by side; with `n` samples each, prompt i's sample j is
choice i * n + j, as in OpenAI's API. With use_beam_search (vLLM's extra)
each prompt is one beam search of width n, which the engine answers once,
when it ends: the choices are every prompt's best beams, best first, numbered
in order (as vLLM does); streaming is refused.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

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


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest, raw: Request) -> JSONResponse | StreamingResponse:
        arrival = time.time()
        self.check_common(req)
        if req.echo:
            raise APIError("echo is not supported.", param="echo")
        if req.suffix:
            raise APIError("suffix is not supported.", param="suffix")
        beam = req.use_beam_search
        if beam:
            self.check_beam_search(req, req.logprobs)
            if req.best_of is not None and req.best_of != req.n:
                raise APIError("best_of must equal n with beam search (n is the beam width).", param="best_of")
        elif req.best_of is not None and req.best_of != req.n:
            raise APIError("best_of must equal n (no best-of selection; use_beam_search=true runs a beam "
                           "search of width n).", param="best_of")
        prompts = await self._prompts(req.prompt)
        if beam:
            params = [self.beam_search_params(req, self.check_prompt(ids, req.max_tokens)) for _, ids in prompts]
        else:
            params = [self.sampling_params(req, self.check_prompt(ids, req.max_tokens), req.logprobs)
                      for _, ids in prompts]
        request_id = random_id("cmpl")
        requests = self.engine_requests(request_id, prompts, params, req.cache_salt, arrival)
        states = [ChoiceState(keep=not req.stream) for _ in params for _ in range(req.n)]
        prompt_lens = [len(ids) for _, ids in prompts]
        outputs = await self.start(raw, requests, req.stream)
        if req.stream:
            chunks = self._chunks(req, request_id, outputs, states, prompt_lens)
            return StreamingResponse(sse_stream(chunks), media_type="text/event-stream")

        async def run() -> CompletionResponse:
            cached = 0
            try:
                async with contextlib.aclosing(outputs):
                    async for tag, out in outputs:
                        for c in out.outputs:
                            states[tag * req.n + c.index].update(c)
                        cached += out.num_cached_tokens if out.finished else 0
            except ENGINE_ERRORS as e:
                raise engine_error(e) from e
            # A beam search may return fewer than n beams: its choices are the beams that came, numbered in order.
            answered = [s for s in states if s.finished] if beam else states
            choices = [CompletionChoice(index=i, text=s.text, finish_reason=s.finish_reason,
                                        stop_reason=s.stop_reason,
                                        logprobs=self._logprobs(s.token_ids, self._chosen_logprobs(s, req, beam),
                                                                0)[0]
                                        if req.logprobs is not None else None)
                       for i, s in enumerate(answered)]
            return CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                      usage=self.usage(prompt_lens, states, cached))

        response = await unless_disconnected(raw, run)
        return JSONResponse(response.model_dump())

    async def _prompts(self, prompt: str | list) -> list[tuple[str | None, list[int]]]:
        """(text, token ids) of every prompt in the request (text is tokenized off the event loop)."""
        if isinstance(prompt, str):
            return [(prompt, await self.off_loop(self.encode, prompt))]
        if not prompt:
            raise APIError("prompt must not be empty.", param="prompt")
        if isinstance(prompt[0], int):
            return [(None, list(prompt))]
        limit = self.options.max_prompts_per_request
        if len(prompt) > limit:
            raise APIError(f"at most {limit} prompts in one request, got {len(prompt)}.", param="prompt")
        if isinstance(prompt[0], str):
            ids = await self.off_loop(lambda texts: [self.encode(p) for p in texts], prompt)
            return list(zip(prompt, ids, strict=True))
        return [(None, list(p)) for p in prompt]

    async def _chunks(self, req: CompletionRequest, request_id: str, outputs: AsyncIterator, states: list[ChoiceState],
                      prompt_lens: list[int]) -> AsyncIterator[CompletionResponse]:
        created, cached = int(time.time()), 0
        async for tag, out in outputs:
            for c in out.outputs:
                index = tag * req.n + c.index
                state = states[index]
                offset = state.text_offset
                delta = state.update(c)
                if delta is not None:
                    yield CompletionResponse(id=request_id, created=created, model=self.model_name,
                                             choices=[self._choice(index, delta, state, offset, req.logprobs)])
            cached += out.num_cached_tokens if out.finished else 0
        if req.stream_options is not None and req.stream_options.include_usage:
            yield CompletionResponse(id=request_id, created=created, model=self.model_name, choices=[],
                                     usage=self.usage(prompt_lens, states, cached))

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

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]],
                  offset: int) -> tuple[CompletionLogprobs, int]:
        """The legacy logprobs object for these tokens; returns it and the text offset after them."""
        out = CompletionLogprobs()
        for token, entry in zip(token_ids, logprobs, strict=True):
            text = self.token_text(token)
            out.tokens.append(text)
            out.token_logprobs.append(self.logprob_value(entry[token].logprob) if token in entry else None)
            out.top_logprobs.append({self.token_text(t): self.logprob_value(v.logprob) for t, v in
                                     sorted(entry.items(), key=lambda kv: kv[1].rank or 1 << 30)})
            out.text_offset.append(offset)
            offset += len(text)
        return out, offset
