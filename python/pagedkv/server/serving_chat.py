"""POST /v1/chat/completions: messages through the checkpoint's chat template, one assistant reply per choice.

With use_beam_search (vLLM's extra) the reply is one beam search of width n,
answered once it ends: one choice per returned beam, best first; streaming is
refused.
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
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    TopLogprob,
)
from pagedkv.server.serving import (
    ENGINE_ERRORS,
    ChoiceState,
    OpenAIServing,
    engine_error,
    random_id,
    sse_stream,
    top_candidates,
    unless_disconnected,
)


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template wants them: role and plain-text content (text parts joined)."""
    out = []
    for i, m in enumerate(messages):
        if m.content is None or isinstance(m.content, str):
            content = m.content or ""
        else:
            bad = next((p.type for p in m.content if p.type != "text"), None)
            if bad is not None:
                raise APIError(f"content parts of type {bad!r} are not supported (text only).",
                               param=f"messages.{i}.content")
            content = "\n".join(p.text or "" for p in m.content)
        out.append({"role": m.role, "content": content})
    return out


class OpenAIServingChat(OpenAIServing):
    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
        """Token ids of the conversation under the chat template (400 if the template refuses it).

        Runs on the tokenizer thread (`off_loop`): templates are Python and can be slow on long conversations.
        """
        if self.tokenizer is None:
            raise APIError("chat needs a tokenizer; this server runs without one.")
        try:
            ids = self.tokenizer.apply_chat_template(message_dicts(messages), tokenize=True, return_dict=False,
                                                     add_generation_prompt=add_generation_prompt)
        except APIError:
            raise
        except Exception as e:  # jinja errors, e.g. roles the template does not accept
            raise APIError(f"the chat template failed on these messages: {e}", param="messages") from e
        return list(ids)

    async def create(self, req: ChatCompletionRequest, raw: Request) -> JSONResponse | StreamingResponse:
        arrival = time.time()
        lora = self.check_common(req)
        if req.tools:
            raise APIError("tools are not supported.", param="tools")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs=true.", param="top_logprobs")
        beam = req.use_beam_search
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if beam:
            self.check_beam_search(req, num_logprobs, logprobs_param="top_logprobs")
        ids = await self.off_loop(self.chat_prompt, req.messages, req.add_generation_prompt)
        max_tokens = self.check_prompt(ids, req.max_completion_tokens or req.max_tokens, param="messages")
        if beam:
            params = self.beam_search_params(req, max_tokens)
        else:
            params = self.sampling_params(req, max_tokens, num_logprobs, logprobs_param="top_logprobs",
                                          prompt_logprobs=req.prompt_logprobs)
        request_id = random_id("chatcmpl")
        requests = self.engine_requests(request_id, [(None, ids)], [params], req.cache_salt, arrival, lora)
        states = [ChoiceState(keep=not req.stream) for _ in range(req.n)]
        outputs = await self.start(raw, requests, req.stream)
        if req.stream:
            chunks = self._chunks(req, request_id, outputs, states, len(ids))
            return StreamingResponse(sse_stream(chunks), media_type="text/event-stream")

        async def run() -> ChatCompletionResponse:
            cached, prompt_logprobs = 0, None
            try:
                async with contextlib.aclosing(outputs):
                    async for _, out in outputs:
                        if out.prompt_logprobs is not None:
                            prompt_logprobs = out.prompt_logprobs
                        for c in out.outputs:
                            states[c.index].update(c)
                        cached += out.num_cached_tokens if out.finished else 0
            except ENGINE_ERRORS as e:
                raise engine_error(e) from e
            # A beam search may return fewer than n beams: one choice per beam that came, best first.
            answered = [s for s in states if s.finished] if beam else states

            def logprobs(s: ChoiceState) -> list[dict[int, Logprob]]:
                return top_candidates(s.token_ids, s.logprobs, req.top_logprobs or 0) if beam else s.logprobs

            choices = [ChatChoice(index=i, message=ChatResponseMessage(content=s.text),
                                  logprobs=self._logprobs(s.token_ids, logprobs(s), req) if req.logprobs else None,
                                  finish_reason=s.finish_reason, stop_reason=s.stop_reason)
                       for i, s in enumerate(answered)]
            return ChatCompletionResponse(id=request_id, model=self.response_model(req.model), choices=choices,
                                          usage=self.usage([len(ids)], states, cached),
                                          prompt_logprobs=self.prompt_logprobs_body(prompt_logprobs))

        response = await unless_disconnected(raw, run)
        return JSONResponse(response.model_dump())

    async def _chunks(self, req: ChatCompletionRequest, request_id: str, outputs: AsyncIterator,
                      states: list[ChoiceState], prompt_len: int) -> AsyncIterator[ChatCompletionChunk]:
        created, cached, model = int(time.time()), 0, self.response_model(req.model)

        def chunk(choice: ChatStreamChoice) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice])

        for i in range(req.n):  # OpenAI opens every choice with the role
            yield chunk(ChatStreamChoice(index=i, delta=ChatDelta(role="assistant", content="")))
        async for _, out in outputs:
            for c in out.outputs:
                delta = states[c.index].update(c)
                if delta is None:
                    continue
                logprobs = self._logprobs(delta.token_ids, delta.logprobs, req) if req.logprobs else None
                yield chunk(ChatStreamChoice(index=c.index, delta=ChatDelta(content=delta.text), logprobs=logprobs,
                                             finish_reason=delta.finish_reason, stop_reason=delta.stop_reason))
            cached += out.num_cached_tokens if out.finished else 0
        if req.stream_options is not None and req.stream_options.include_usage:
            yield ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                      usage=self.usage([prompt_len], states, cached))

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None,
                  req: ChatCompletionRequest) -> ChatLogprobs:
        top = req.top_logprobs or 0
        content = []
        for token, entry in zip(token_ids, logprobs or [], strict=True):
            ranked = sorted(((t, v) for t, v in entry.items() if v.rank is not None and v.rank <= top),
                            key=lambda kv: kv[1].rank)
            text = self.token_text(token)
            lp = entry[token].logprob if token in entry else float("-inf")
            content.append(ChatTokenLogprob(
                token=text, logprob=self.logprob_value(lp), bytes=list(text.encode()),
                top_logprobs=[TopLogprob(token=self.token_text(t), logprob=self.logprob_value(v.logprob),
                                         bytes=list(self.token_text(t).encode())) for t, v in ranked]))
        return ChatLogprobs(content=content)
