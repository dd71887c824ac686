"""POST /v1/chat/completions: messages through the checkpoint's chat template, one assistant reply per choice.

With use_beam_search (vLLM's extra) the reply is one beam search of width n,
answered once it ends: one choice per returned beam, best first; streaming is
refused.
"""

from __future__ import annotations

import contextlib
import json
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
    DeltaToolCall,
    ToolCall,
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
from pagedkv.server.tool_calls import CALL_FORMATS, CallStream, ToolPlan, plan_tools


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template wants them: role and plain-text content (text parts joined), and an
    assistant turn's tool_calls (their arguments as objects, as templates print them) or a tool turn's id."""
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
        message = {"role": m.role, "content": content}
        if m.tool_calls:
            message["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


def _template_call(call: dict) -> dict:
    """An OpenAI tool call of an earlier turn, its JSON-text arguments parsed (templates print them as objects)."""
    function = call.get("function")
    if not isinstance(function, dict):
        return call
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return call | {"function": function | {"arguments": args}}


class OpenAIServingChat(OpenAIServing):
    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    tools: list[dict] | None = None) -> list[int]:
        """Token ids of the conversation under the chat template (400 if the template refuses it), with the
        request's tools for the template to render.

        Runs on the tokenizer thread (`off_loop`): templates are Python and can be slow on long conversations.
        """
        if self.tokenizer is None:
            raise APIError("chat needs a tokenizer; this server runs without one.")
        try:
            ids = self.tokenizer.apply_chat_template(message_dicts(messages), tokenize=True, return_dict=False,
                                                     add_generation_prompt=add_generation_prompt,
                                                     **({"tools": tools} if tools else {}))
        except APIError:
            raise
        except Exception as e:  # jinja errors, e.g. roles the template does not accept
            raise APIError(f"the chat template failed on these messages: {e}", param="messages") from e
        return list(ids)

    async def create(self, req: ChatCompletionRequest, raw: Request) -> JSONResponse | StreamingResponse:
        arrival = time.time()
        lora = self.check_common(req)
        tools = plan_tools(req, self.options.tool_call_parser)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs=true.", param="top_logprobs")
        beam = req.use_beam_search
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if beam:
            self.check_beam_search(req, num_logprobs, logprobs_param="top_logprobs")
        ids = await self.off_loop(self.chat_prompt, req.messages, req.add_generation_prompt,
                                  tools.tools if tools is not None else None)
        max_tokens = self.check_prompt(ids, req.max_completion_tokens or req.max_tokens, param="messages")
        if beam:
            params = self.beam_search_params(req, max_tokens)
        else:
            params = self.sampling_params(req, max_tokens, num_logprobs, logprobs_param="top_logprobs",
                                          prompt_logprobs=req.prompt_logprobs,
                                          constraint=tools.constraint if tools is not None else None)
        if tools is not None and tools.mode == "none":
            tools = None  # rendered for the template; the reply is plain text
        request_id = random_id("chatcmpl")
        requests = self.engine_requests(request_id, [(None, ids)], [params], req.cache_salt, arrival, lora)
        # A stream of named / required calls keeps its text: the calls are sent once complete.
        keep = not req.stream or (tools is not None and tools.mode != "auto")
        states = [ChoiceState(keep=keep) for _ in range(req.n)]
        outputs = await self.start(raw, requests, req.stream)
        if req.stream:
            chunks = self._chunks(req, request_id, outputs, states, len(ids), tools)
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

            choices = []
            for i, s in enumerate(answered):
                content, calls, finish = (tools.finish(s.text, s.finish_reason) if tools is not None
                                          else (s.text, [], s.finish_reason))
                choices.append(ChatChoice(
                    index=i, message=ChatResponseMessage(content=content, tool_calls=calls),
                    logprobs=self._logprobs(s.token_ids, logprobs(s), req) if req.logprobs else None,
                    finish_reason=finish, stop_reason=s.stop_reason))
            return ChatCompletionResponse(id=request_id, model=self.response_model(req.model), choices=choices,
                                          usage=self.usage([len(ids)], states, cached),
                                          prompt_logprobs=self.prompt_logprobs_body(prompt_logprobs))

        response = await unless_disconnected(raw, run)
        return JSONResponse(response.model_dump())

    async def _chunks(self, req: ChatCompletionRequest, request_id: str, outputs: AsyncIterator,
                      states: list[ChoiceState], prompt_len: int,
                      tools: ToolPlan | None) -> AsyncIterator[ChatCompletionChunk]:
        created, cached, model = int(time.time()), 0, self.response_model(req.model)
        streams = ([CallStream(CALL_FORMATS[tools.parser]) for _ in range(req.n)]
                   if tools is not None and tools.mode == "auto" else None)

        def chunk(choice: ChatStreamChoice) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice])

        for i in range(req.n):  # OpenAI opens every choice with the role
            yield chunk(ChatStreamChoice(index=i, delta=ChatDelta(role="assistant", content="")))
        async for _, out in outputs:
            for c in out.outputs:
                state = states[c.index]
                delta = state.update(c)
                if delta is None:
                    continue
                logprobs = self._logprobs(delta.token_ids, delta.logprobs, req) if req.logprobs else None
                content, calls, finish = delta.text, None, delta.finish_reason
                if tools is not None:
                    content, calls, finish = self._tool_delta(tools, streams, c.index, state, delta)
                    if content is None and calls is None and finish is None and logprobs is None:
                        continue  # text held back (a call in the making): nothing to send yet
                yield chunk(ChatStreamChoice(index=c.index, delta=ChatDelta(content=content, tool_calls=calls),
                                             logprobs=logprobs, finish_reason=finish,
                                             stop_reason=delta.stop_reason))
            cached += out.num_cached_tokens if out.finished else 0
        if req.stream_options is not None and req.stream_options.include_usage:
            yield ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                      usage=self.usage([prompt_len], states, cached))

    @staticmethod
    def _tool_delta(tools: ToolPlan, streams: list[CallStream] | None, index: int, state: ChoiceState,
                    delta) -> tuple[str | None, list[DeltaToolCall] | None, str | None]:
        """(content, tool calls, finish_reason) of one streamed delta of a reply with tools: named / required
        calls go out whole when the reply ends; an auto reply's content streams, its calls come at the end."""
        if streams is not None:
            stream = streams[index]
            content = stream.feed(delta.text)
            if delta.finish_reason is None:
                return content or None, None, None
            rest, calls = stream.finish()
            finish = "tool_calls" if calls and delta.finish_reason == "stop" else delta.finish_reason
            return (content + rest) or None, _indexed(calls), finish
        if delta.finish_reason is None:
            return None, None, None
        content, calls, finish = tools.finish(state.text, delta.finish_reason)
        return content or None, _indexed(calls), finish

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


def _indexed(calls: list[ToolCall]) -> list[DeltaToolCall] | None:
    return [DeltaToolCall(index=i, **c.model_dump()) for i, c in enumerate(calls)] or None
