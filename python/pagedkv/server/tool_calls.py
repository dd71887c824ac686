"""Tool calling in chat completions: OpenAI's `tools` / `tool_choice`, vLLM's server flags and rules.

The tools go to the chat template (`tools=`), which renders them the way the
model was trained to read them. What comes back depends on `tool_choice`:

- "none": the reply is text, as without tools.
- a named function (`{"type": "function", "function": {"name": ...}}`): the
  reply is constrained (structured outputs) to a JSON object of that
  function's `parameters` schema and returned as its one tool call, content
  "" (finish_reason as the engine gave it: "stop", or "length" if cut).
- "required": the reply is constrained to a JSON array of at least one
  `{"name": ..., "parameters": {...}}` object, each name one of the tools
  and its parameters that tool's schema (one element with
  `parallel_tool_calls: false`); finish_reason "tool_calls".
- "auto" (the default when tools are given, as OpenAI's): the model decides;
  the server needs `--enable-auto-tool-choice --tool-call-parser P` (vLLM's
  flags, 400 otherwise) and parser P finds the calls in the text: "hermes"
  (Qwen 2.5 / 3, Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks after any text, which is the content) or "llama3_json" (Llama 3.1+:
  a reply that is `{"name": ..., "parameters": {...}}` objects, `;`-separated,
  after an optional `<|python_tag|>`).

Streaming: a named or required reply sends its calls once they are complete
(one delta per call, arguments whole); an auto reply streams its content and
holds back text from where a call may begin (`CallStream`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedkv.server.protocol import APIError, ChatCompletionRequest, FunctionCall, ToolCall
from pagedkv.server.serving import random_id

_HERMES_OPEN = "<tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass(slots=True)
class ToolPlan:
    """What a chat request's tools mean for its reply: `mode` "none", "named", "required" or "auto"."""

    mode: str
    tools: list[dict[str, Any]] = field(default_factory=list)  # as the chat template gets them
    name: str | None = None  # the named function
    constraint: dict[str, Any] | None = None  # structured_outputs fields for named / required
    parser: str | None = None  # auto: the --tool-call-parser

    def finish(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, tool calls, finish_reason) of a whole reply."""
        if self.mode == "named":
            return "", [_call(self.name, text)], finish_reason
        if self.mode == "required":
            calls = parse_required(text)
            if calls is None:  # cut short (length) or not a list: the text as it is
                return text, [], finish_reason
            return "", calls, "tool_calls" if finish_reason == "stop" else finish_reason
        if self.mode == "auto":
            content, calls = CALL_FORMATS[self.parser].parse(text)
            return content, calls, "tool_calls" if calls and finish_reason == "stop" else finish_reason
        return text, [], finish_reason


def plan_tools(req: ChatCompletionRequest, tool_call_parser: str | None) -> ToolPlan | None:
    """The request's ToolPlan (None without tools); 400 for what cannot be honoured, as vLLM refuses it."""
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none":
            raise APIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    functions = {t.function.name: t.function for t in req.tools}
    if len(functions) != len(req.tools):
        raise APIError("tools must have distinct function names.", param="tools")
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan("none", tools)
    if req.use_beam_search:
        raise APIError("tools with a tool_choice other than 'none' cannot run a beam search.", param="tool_choice")
    if req.structured_outputs or (req.response_format or {}).get("type", "text") != "text":
        raise APIError("tool_choice (other than 'none') constrains the reply itself: it cannot be combined with "
                       "response_format or structured_outputs.", param="tool_choice")
    if choice == "auto":
        if tool_call_parser is None:
            raise APIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                           param="tool_choice")
        return ToolPlan("auto", tools, parser=tool_call_parser)
    if choice == "required":
        return ToolPlan("required", tools, constraint={"json": required_schema(req)})
    name = choice.function.name
    if name not in functions:
        raise APIError(f"tool_choice names function {name[:64]!r}, which is not among the tools.",
                       param="tool_choice")
    return ToolPlan("named", tools, name, {"json": _parameters(functions[name].parameters)})


def _parameters(schema: dict[str, Any] | None) -> dict[str, Any]:
    """A function's parameters schema; none given: any JSON object (OpenAI's reading)."""
    return schema if schema else {"type": "object"}


def required_schema(req: ChatCompletionRequest) -> dict[str, Any]:
    """The JSON schema of a "required" reply: an array of calls, each of one tool with its parameters."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.function.name]},
                             "parameters": _parameters(t.function.parameters)},
              "required": ["name", "parameters"]} for t in req.tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def _call(name: str, arguments: Any) -> ToolCall:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=random_id("chatcmpl-tool"), function=FunctionCall(name=name, arguments=args))


def parse_required(text: str) -> list[ToolCall] | None:
    """The calls of a "required" reply, or None when it is not the array its grammar asks for (cut short)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not all(isinstance(i, dict) and isinstance(i.get("name"), str)
                                              for i in items):
        return None
    return [_call(i["name"], i.get("parameters", {})) for i in items]


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a reply in the hermes format; a block that is not a {"name", "arguments"} JSON object
    leaves the whole reply as content (no call is invented from a broken one)."""
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return text, []
    calls = []
    for block in _HERMES_BLOCK.findall(text[start:]):
        try:
            obj = json.loads(block.strip())
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        calls.append(_call(obj["name"], obj.get("arguments", {})))
    content = text[:start].strip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a reply in Llama 3's JSON format: the whole reply is the calls, or it is content."""
    s = text.strip().removeprefix("<|python_tag|>").lstrip()
    if not s.startswith("{"):
        return text, []
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(s):
        try:
            obj, i = decoder.raw_decode(s, i)
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        calls.append(_call(obj["name"], obj.get("parameters", obj.get("arguments", {}))))
        while i < len(s) and s[i] in " \t\r\n;":
            i += 1
    return None, calls


@dataclass(frozen=True, slots=True)
class CallFormat:
    """How a --tool-call-parser's calls are written: the text that opens them (anywhere, or only at the start
    of the reply), and the parser of a whole reply."""

    markers: tuple[str, ...]
    at_start: bool
    parse: Callable[[str], tuple[str | None, list[ToolCall]]]


CALL_FORMATS = {"hermes": CallFormat((_HERMES_OPEN,), False, parse_hermes),
                "llama3_json": CallFormat(("<|python_tag|>", "{"), True, parse_llama3_json)}
TOOL_CALL_PARSERS = tuple(CALL_FORMATS)


class CallStream:
    """An auto reply streamed: its content goes out as it comes, except text that may be the start of a call
    (held until it is told apart); from the first call on, everything is held for `finish`."""

    def __init__(self, fmt: CallFormat) -> None:
        self.fmt = fmt
        self.text = ""  # the whole reply so far
        self.sent = 0  # characters of it sent as content
        self.in_call = False
        self.plain = False  # at_start formats: the reply began with text, so it is content

    def feed(self, delta: str) -> str:
        """The content to send now for this new text."""
        self.text += delta
        if self.in_call:
            return ""
        if self.plain:
            return self._send_to(len(self.text))
        if self.fmt.at_start:
            return self._feed_at_start()
        start = self._first_marker(self.sent)
        if start >= 0:
            self.in_call = True
            return self._send_to(start)
        # Hold a tail that could grow into a marker.
        longest = max(len(m) for m in self.fmt.markers) - 1
        hold = next((k for k in range(min(longest, len(self.text) - self.sent), 0, -1)
                     if any(self.text.endswith(m[:k]) for m in self.fmt.markers)), 0)
        return self._send_to(len(self.text) - hold)

    def _feed_at_start(self) -> str:
        body = self.text.lstrip()
        if any(body.startswith(m) for m in self.fmt.markers):
            self.in_call = True
            return ""
        if not body or any(m.startswith(body) for m in self.fmt.markers):
            return ""  # still undecided
        self.plain = True
        return self._send_to(len(self.text))

    def _send_to(self, end: int) -> str:
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the content still to send, the calls) once the reply has ended."""
        _, calls = self.fmt.parse(self.text)
        if not calls:  # no call after all (or a broken one): the held text is content
            return self._send_to(len(self.text)), []
        if self.fmt.at_start:
            return "", calls
        return self._send_to(self._first_marker()), calls

    def _first_marker(self, start: int = 0) -> int:
        """Where the first call opens from `start` (-1: nowhere yet)."""
        found = [i for i in (self.text.find(m, start) for m in self.fmt.markers) if i >= 0]
        return min(found, default=-1)
