"""Tool calling in /v1/chat/completions through the official `openai` client: a named function and "required"
(the reply constrained to the tools' schemas), "auto" with the hermes and llama3_json parsers (parsers and
stream splitters on known texts, and the server's plumbing), and the refusals vLLM makes."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pagedkv.server.protocol import ChatCompletionRequest
from pagedkv.server.tool_calls import CALL_FORMATS, CallStream, parse_hermes, parse_llama3_json, plan_tools
from server_util import running_server

MODEL = "tools-model"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                                       "required": ["zone"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(loaded_model):
    from pagedkv.config import EngineArgs
    from pagedkv.server import build_app
    from pagedkv.server.api_server import ServerOptions

    args = EngineArgs(device="cpu", dtype="float32", kv_cache_memory=64 << 20, max_model_len=1024, max_num_seqs=8)
    options = ServerOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    app = build_app(args, served_model_names=[MODEL], loaded=loaded_model, options=options)
    with running_server(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _args(call, tool: dict) -> dict:
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == tool["function"]["name"]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_named_function_returns_its_call(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=60,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                         temperature=0.0)
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == ""
    (call,) = choice.message.tool_calls
    _args(call, WEATHER)


def test_required_calls_are_the_tools_with_their_schemas(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=120,
                                         tool_choice="required", temperature=0.8, seed=3, n=3,
                                         parallel_tool_calls=False)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls  # parallel_tool_calls=False: exactly one
        _args(call, {"get_weather": WEATHER, "get_time": TIME}[call.function.name])


def test_streamed_named_call_matches_the_whole_reply(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=60, temperature=0.0,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    calls, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            assert not c.delta.content  # the arguments are not content
            calls.extend(c.delta.tool_calls or [])
            finish = c.finish_reason or finish
    (call,) = calls
    assert call.index == 0 and call.function.name == "get_weather" and finish == "stop"
    assert json.loads(call.function.arguments) == json.loads(whole.function.arguments)


def test_auto_without_a_call_is_plain_content(client):
    """The default model writes no <tool_call>: "auto" gives its text as content, no calls, streamed or not."""
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=12, temperature=0.0)
    out = client.chat.completions.create(**kwargs).choices[0]
    assert out.message.content and not out.message.tool_calls and out.finish_reason == "length"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == out.message.content


def test_tool_choice_none_and_tool_turns(client):
    """tool_choice none: text; a conversation with an assistant call and a tool's answer goes through the
    template (arguments given as JSON text, as OpenAI sends them)."""
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                         max_tokens=8, temperature=0.0).choices[0]
    assert out.message.content and not out.message.tool_calls


@pytest.mark.parametrize("body, needle", [
    ({"tool_choice": "required"}, "`tools` must be set"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "distinct function names"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [WEATHER] * 129}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tool_requests_are_400(client, body, needle):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **body)
    assert needle in str(e.value)


def test_auto_needs_the_server_flags():
    """Without --enable-auto-tool-choice, tools with tool_choice auto (the default) are refused as vLLM does."""
    from pagedkv.server.protocol import APIError

    req = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": [WEATHER]})
    with pytest.raises(APIError, match="--enable-auto-tool-choice"):
        plan_tools(req, None)
    assert plan_tools(req, "hermes").mode == "auto"


def test_hermes_parser():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
    assert parse_hermes("no calls here") == ("no calls here", [])
    broken = 'x <tool_call>{"name": "get_weather", "arguments": {"city": '
    assert parse_hermes(broken) == (broken, [])  # cut short: no call is made up
    unterminated = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}'
    assert [c.function.name for c in parse_hermes(unterminated)[1]] == ["get_time"]


@pytest.mark.parametrize("pieces", [
    ["Sure", ", one moment.", " <tool", "_call>", '{"name": "get_time", "arguments": {}}', "</tool_call>"],
    ["Sure, one moment. <tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>"],
    ["Sure, one mom", "ent. <", "t", "ool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>"],
])
def test_hermes_stream_sends_content_and_holds_calls(pieces):
    stream = CallStream(CALL_FORMATS["hermes"])
    sent = "".join(stream.feed(p) for p in pieces)
    assert "<" not in sent  # nothing of the call's opening tag went out as content
    rest, calls = stream.finish()
    assert (sent + rest).strip() == "Sure, one moment." and [c.function.name for c in calls] == ["get_time"]


def test_hermes_stream_releases_a_false_start():
    stream = CallStream(CALL_FORMATS["hermes"])
    sent = stream.feed("a < b and <tool") + stream.feed("s are fun")
    rest, calls = stream.finish()
    assert sent + rest == "a < b and <tools are fun" and not calls


def test_llama3_json_parser():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}; ' \
           '{"name": "get_time", "parameters": {"zone": "CET"}}'
    content, calls = parse_llama3_json(text)
    assert content is None and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
    assert parse_llama3_json("The answer is {x}.") == ("The answer is {x}.", [])
    assert parse_llama3_json('{"name": "get_time", "parameters": {"zone": ') == (
        '{"name": "get_time", "parameters": {"zone": ', [])


@pytest.mark.parametrize("pieces, content, names", [
    ([" ", "{\"name\": \"get_time\", ", "\"parameters\": {}}"], "", ["get_time"]),
    (["It is", " sunny {probably}."], "It is sunny {probably}.", []),
    (["<|python", "_tag|>{\"name\": \"get_time\", \"parameters\": {}}"], "", ["get_time"]),
])
def test_llama3_json_stream(pieces, content, names):
    stream = CallStream(CALL_FORMATS["llama3_json"])
    sent = "".join(stream.feed(p) for p in pieces)
    rest, calls = stream.finish()
    assert sent + rest == content and [c.function.name for c in calls] == names


def test_llama3_json_server_plumbing(loaded_model):
    """A server started with --tool-call-parser llama3_json answers auto requests (the default model writes
    text: it comes back as content)."""
    from pagedkv.config import EngineArgs
    from pagedkv.server import build_app
    from pagedkv.server.api_server import ServerOptions

    args = EngineArgs(device="cpu", dtype="float32", kv_cache_memory=32 << 20, max_model_len=512, max_num_seqs=4)
    app = build_app(args, served_model_names=[MODEL], loaded=loaded_model,
                    options=ServerOptions(enable_auto_tool_choice=True, tool_call_parser="llama3_json"))
    with running_server(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=6,
                                             temperature=0.0).choices[0]
        assert out.message.content and not out.message.tool_calls
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ServerOptions(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="is not one of"):
        ServerOptions(enable_auto_tool_choice=True, tool_call_parser="pythonic")
