"""`pagedkv serve` against hostile and careless clients: no request may hurt another.

One guarded server for the module (prefix caching on, cached-token details on, a small body and nesting
limit, a tiny socket send buffer so a client that stops reading blocks the server's writes at once). Every
hostile request is followed by a canary whose greedy text must not change; schemathesis fuzzes the bodies
from the server's own OpenAPI schema; faults are injected into the engine to check that only their
requests fail and that the prefix cache never offers KV that a failed step did not write.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import socket
import threading

import httpx
import openai
import pytest
from pagedkv import LLM, SamplingParams
from pagedkv.config import EngineArgs
from server_util import assert_stops_dead, post, running_server, wait_idle, wait_until

MODEL = "guarded"
KEY = "hostile-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 4
BODY_LIMIT = 1 << 20
DEPTH_LIMIT = 16
PROMPT = "The capital of France is"
VOCAB = 49152


GUARDED_ARGS = EngineArgs(device="cpu", dtype="float32", kv_cache_memory=128 << 20, max_model_len=MAX_MODEL_LEN,
                          max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=64, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def guarded(default_model_dir):
    """The server as `pagedkv serve` runs it (the engine core in its own process), with tight guards."""
    from pagedkv.server import ServerOptions, build_app

    args = GUARDED_ARGS
    options = ServerOptions(api_keys=(KEY,), max_request_body_bytes=BODY_LIMIT, max_json_nesting_depth=DEPTH_LIMIT,
                            enable_prompt_tokens_details=True)
    app = build_app(dataclasses.replace(args, model=str(default_model_dir), engine_core="process"),
                    served_model_names=[MODEL], options=options)
    with running_server(app, sndbuf=4096) as srv:
        yield srv


@pytest.fixture(scope="module")
def guarded_thread(loaded_model):
    """`guarded`'s settings with the engine on the server's own thread: faults can be planted in it."""
    from pagedkv.server import ServerOptions, build_app

    options = ServerOptions(api_keys=(KEY,), enable_prompt_tokens_details=True)
    app = build_app(GUARDED_ARGS, served_model_names=[MODEL], loaded=loaded_model, options=options)
    with running_server(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def llm(loaded_model):
    return LLM(loaded_model=loaded_model, kv_cache_memory=64 << 20, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def canary(guarded):
    """A greedy completion and its text now; `check()` asks again and compares."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}

    def ask() -> str:
        r = post(guarded.url, body, headers=AUTH)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    text = ask()

    def check() -> None:
        assert ask() == text

    return check


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def nested(depth: int) -> str:
    return '{"model": "guarded", "prompt": ' + "[" * depth + "1" + "]" * depth + "}"


# (name, path, body: dict or raw JSON text, headers (None: the key), expected status, expected error param)
HOSTILE = [
    ("huge top_k", "/v1/completions", completion(top_k=10 ** 9), None, 400, "top_k"),
    ("top_k past int64", "/v1/completions", completion(top_k=2 ** 70), None, 400, "top_k"),
    ("top_k below -1", "/v1/completions", completion(top_k=-5), None, 400, "top_k"),
    ("stop token 2**70 with min_tokens", "/v1/completions", completion(stop_token_ids=[2 ** 70], min_tokens=2),
     None, 400, "stop_token_ids.0"),
    ("stop token outside the vocabulary", "/v1/completions", completion(stop_token_ids=[VOCAB], min_tokens=2),
     None, 400, "stop_token_ids"),
    ("negative stop token", "/v1/completions", completion(stop_token_ids=[-1]), None, 400, "stop_token_ids.0"),
    ("lone surrogate in the prompt", "/v1/completions", '{"model": "guarded", "prompt": "a\\ud800b"}', None, 400,
     "prompt.str"),
    ("lone surrogate in a message", "/v1/chat/completions",
     '{"model": "guarded", "messages": [{"role": "user", "content": "\\udfff"}]}', None, 400, None),
    ("lone surrogate in the model name", "/v1/completions", '{"model": "\\ud800", "prompt": "hi"}', None, 400,
     None),
    ("infinite temperature", "/v1/completions", '{"model": "guarded", "prompt": "hi", "temperature": Infinity}',
     None, 400, "temperature"),
    ("temperature overflowing to inf", "/v1/completions",
     '{"model": "guarded", "prompt": "hi", "temperature": 1e400}', None, 400, "temperature"),
    ("NaN top_p", "/v1/completions", '{"model": "guarded", "prompt": "hi", "top_p": NaN}', None, 400, "top_p"),
    ("NaN min_p", "/v1/chat/completions",
     '{"model": "guarded", "messages": [{"role": "user", "content": "hi"}], "min_p": NaN}', None, 400, "min_p"),
    ("infinite repetition_penalty", "/v1/completions",
     '{"model": "guarded", "prompt": "hi", "repetition_penalty": Infinity}', None, 400, "repetition_penalty"),
    ("seed past int64", "/v1/completions", completion(seed=2 ** 64), None, 400, "seed"),
    ("seed of the wrong type", "/v1/completions", completion(seed="x"), None, 400, "seed"),
    ("logprobs over max_logprobs", "/v1/completions", completion(logprobs=21), None, 400, "logprobs"),
    ("top_logprobs over max_logprobs", "/v1/chat/completions", chat(logprobs=True, top_logprobs=21), None, 400,
     "top_logprobs"),
    ("n over max_num_seqs", "/v1/completions", completion(n=10 ** 6), None, 400, "n"),
    ("max_tokens past max_model_len", "/v1/completions", completion(max_tokens=10 ** 30), None, 400, "max_tokens"),
    ("min_tokens over max_tokens", "/v1/completions", completion(min_tokens=5), None, 400, "min_tokens"),
    ("token id outside the vocabulary", "/v1/completions", completion(prompt=[1, 10 ** 9]), None, 400, "prompt"),
    ("token id past int64", "/v1/completions", completion(prompt=[1, 2 ** 70]), None, 400, "prompt"),
    ("empty cache_salt", "/v1/completions", completion(cache_salt=""), None, 400, "cache_salt"),
    ("huge cache_salt", "/v1/completions", completion(cache_salt="s" * 5000), None, 400, "cache_salt"),
    ("too many stop strings", "/v1/completions", completion(stop=[f"s{i}" for i in range(100)]), None, 400, "stop"),
    ("a huge stop string", "/v1/completions", completion(stop=["x" * 5000]), None, 400, "stop"),
    ("too many prompts", "/v1/completions", completion(prompt=["hi"] * 1100), None, 400, "prompt"),
    ("JSON nested too deep", "/v1/completions", nested(10_000), None, 400, None),
    ("JSON nested just too deep", "/v1/completions", nested(DEPTH_LIMIT), None, 400, None),
    ("a body over the limit", "/v1/completions", json.dumps(completion(user="u" * (BODY_LIMIT + 1))), None, 413,
     None),
    ("malformed JSON", "/v1/completions", '{"model": "guarded", "prompt": ', None, 400, None),
    ("wrong top-level type", "/v1/completions", "[1, 2, 3]", None, 400, None),
    ("prompt of the wrong type", "/v1/completions", completion(prompt={"a": 1}), None, 400, "prompt.str"),
    ("detokenize outside the vocabulary", "/detokenize", {"tokens": [10 ** 9]}, None, 400, "tokens"),
    ("detokenize past int64", "/detokenize", {"tokens": [2 ** 70]}, None, 400, "tokens.0"),
    ("tokenize without the key", "/tokenize", {"prompt": "hi"}, {}, 401, None),
    ("detokenize without the key", "/detokenize", {"tokens": [1]}, {}, 401, None),
    ("completion with a wrong key", "/v1/completions", completion(), {"Authorization": "Bearer nope"}, 401, None),
    ("frequency_penalty past 2", "/v1/completions", completion(frequency_penalty=2.5), None, 400,
     "frequency_penalty"),
    ("presence_penalty below -2", "/v1/completions", completion(presence_penalty=-3), None, 400, "presence_penalty"),
    ("logit_bias outside the vocabulary", "/v1/completions", completion(logit_bias={"999999999": 1}), None, 400,
     "logit_bias"),
    ("logit_bias key not a token id", "/v1/completions", completion(logit_bias={"hello": 1}), None, 400,
     "logit_bias"),
    ("logit_bias past 100", "/v1/completions", completion(logit_bias={"5": 101}), None, 400, "logit_bias"),
    ("logit_bias with too many entries", "/v1/completions", completion(logit_bias={str(i): 1 for i in range(1025)}),
     None, 400, "logit_bias"),
    ("allowed_token_ids empty", "/v1/completions", completion(allowed_token_ids=[]), None, 400, "allowed_token_ids"),
    ("allowed_token_ids outside the vocabulary", "/v1/completions", completion(allowed_token_ids=[1, 10 ** 9]),
     None, 400, "allowed_token_ids"),
    ("prompt_logprobs past max_logprobs", "/v1/completions", completion(prompt_logprobs=10 ** 6), None, 400,
     "prompt_logprobs"),
    ("prompt_logprobs streamed", "/v1/completions", completion(prompt_logprobs=2, stream=True), None, 400,
     "prompt_logprobs"),
    ("chat prompt_logprobs past max_logprobs", "/v1/chat/completions", chat(prompt_logprobs=10 ** 6), None, 400,
     "prompt_logprobs"),
    ("max_tokens 0 without echo", "/v1/completions", completion(max_tokens=0), None, 400, "max_tokens"),
    ("echo with logprobs past max_logprobs", "/v1/completions", completion(echo=True, logprobs=10 ** 6), None, 400,
     "logprobs"),
    ("structured_outputs regex past 64k characters", "/v1/completions",
     completion(structured_outputs={"regex": "a" * 70000}), None, 400, "structured_outputs"),
    ("structured_outputs with 1025 choices", "/v1/completions",
     completion(structured_outputs={"choice": [str(i) for i in range(1025)]}), None, 400, "structured_outputs"),
    ("structured_outputs schema xgrammar refuses", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "array", "minItems": 10 ** 9}}}),
     None, 400, "structured_outputs"),
    ("structured_outputs of a wrong type", "/v1/completions", completion(structured_outputs={"json": 5}), None, 400,
     "structured_outputs"),
    ("response_format not a known type", "/v1/chat/completions", chat(response_format={"type": ["json"]}), None, 400,
     "response_format"),
]


@pytest.mark.parametrize("name, path, body, headers, status, param", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_request_is_refused_and_hurts_no_one(guarded, canary, name, path, body, headers, status, param):
    r = post(guarded.url, body, path, AUTH if headers is None else headers)
    assert r.status_code == status, (name, r.status_code, r.text[:300])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param.split(".")[0]), error
    canary()
    assert httpx.get(guarded.url + "/health").status_code == 200


def test_scoring_a_whole_context_beside_others_hurts_no_one(guarded, canary, llm):
    """A prompt of max_model_len - 1 tokens scored at every position with the most logprobs allowed (echo,
    max_tokens=0, logprobs=20: the engine bounds the scored tokens a step) while the canary runs: both answered,
    the scores those of LLM.generate."""
    ids = [1000 + (7 * i) % 3000 for i in range(MAX_MODEL_LEN - 1)]
    result = {}
    scorer = threading.Thread(target=lambda: result.update(r=post(
        guarded.url, completion(prompt=ids, echo=True, max_tokens=0, logprobs=20, temperature=0), headers=AUTH)))
    scorer.start()
    canary()
    scorer.join(timeout=300)
    r = result["r"]
    assert r.status_code == 200, r.text[:300]
    lp = r.json()["choices"][0]["logprobs"]
    ref = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=20),
                       use_tqdm=False)[0].prompt_logprobs
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids)
    assert lp["token_logprobs"][1:] == pytest.approx([ref[i][t].logprob for i, t in enumerate(ids) if i], abs=1e-4)
    assert all(len(top) >= 20 for top in lp["top_logprobs"][1:])
    canary()


def test_tiny_temperature_is_raised_not_overflowed(guarded, canary):
    """0 < temperature < 0.01 overflows float32 logits; as in vLLM it is raised to 0.01 (sampling, not garbage)."""
    r = post(guarded.url, completion(temperature=1e-30, max_tokens=6, seed=3), headers=AUTH)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    canary()


def test_unknown_fields_are_logged_once_escaped_at_debug(guarded, caplog):
    caplog.set_level(logging.DEBUG, logger="pagedkv.server.serving")
    field = "evil\nWARNING forged line"
    for _ in range(3):
        assert post(guarded.url, completion(**{field: 1}), headers=AUTH).status_code == 200
    records = [r for r in caplog.records if "ignoring unsupported request fields" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.DEBUG
    assert "\n" not in records[0].getMessage() and "\\n" in records[0].getMessage()


# --- fuzzing from the OpenAPI schema ------------------------------------------------------------------------------

# Examples per operation and mode; PAGEDKV_FUZZ_EXAMPLES=500 for a deeper run than the suite's.
FUZZ_EXAMPLES = int(os.environ.get("PAGEDKV_FUZZ_EXAMPLES", "25"))
FUZZED = [("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/v1/embeddings", "POST"),
          ("/tokenize", "POST"), ("/detokenize", "POST")]


def _bounded(body):
    """Keeps a fuzzed body cheap to serve: generations of at most 4 tokens (an out-of-range value stays)."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and 4 < body[key] <= MAX_MODEL_LEN:
                body[key] = 4
        if isinstance(body.get("n"), int) and 1 < body["n"] <= MAX_NUM_SEQS:
            body["n"] = 2
    return body


@pytest.mark.parametrize("path, method", FUZZED)
def test_fuzzed_bodies_never_get_a_5xx(guarded, canary, path, method):
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(guarded.app.openapi())
    operation = schema[path][method]
    statuses = []
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case) -> None:
            case.body = _bounded(case.body)
            response = case.call(base_url=guarded.url, headers=AUTH, timeout=60)
            statuses.append(response.status_code)
            assert response.status_code < 500, (case.body, response.text[:500])

        run()
    assert statuses and any(400 <= s < 500 for s in statuses)
    wait_idle(guarded)
    canary()
    assert httpx.get(guarded.url + "/health").status_code == 200


# --- faults inside the engine ------------------------------------------------------------------------------------

LONG_PROMPT = ("Paged attention keeps the keys and values of every sequence in fixed-size blocks, and a block "
               "table maps each sequence's logical blocks to physical ones, so memory is allocated on demand. ") * 2


def test_failed_step_does_not_poison_the_prefix_cache(guarded_thread, llm, loaded_model):
    """A forward that fails after its blocks were offered to the prefix cache: the retry of the same prompt
    must compute them again (and get the right text), not reuse blocks whose KV was never written."""
    guarded = guarded_thread
    runner = guarded.engine.runner
    num_prompt = len(loaded_model.tokenizer.encode(LONG_PROMPT))
    assert num_prompt > 3 * 16  # several full blocks get registered by the failed step
    ref = llm.generate(LONG_PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].text
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    def broken(*args, **kwargs):
        del runner.execute_model
        raise RuntimeError("injected forward fault")

    wait_idle(guarded)
    runner.execute_model = broken
    r = post(guarded.url, body, headers=AUTH)
    assert r.status_code == 500 and "injected forward fault" in r.json()["error"]["message"]
    wait_idle(guarded)
    retry = post(guarded.url, body, headers=AUTH).json()
    assert retry["choices"][0]["text"] == ref
    assert retry["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing of the failed step was kept
    again = post(guarded.url, body, headers=AUTH).json()  # now the blocks are real: a hit
    assert again["choices"][0]["text"] == ref
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (num_prompt - 1) // 16 * 16


def test_cached_tokens_are_the_engines_count_streamed_or_not(guarded, loaded_model):
    tok = loaded_model.tokenizer
    prompt = LONG_PROMPT + "Chat and completions report the same count."
    messages = [{"role": "user", "content": prompt}]
    ids = {"completion": tok.encode(prompt),
           "chat": list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=False))}
    for kind, path, body in (("completion", "/v1/completions", {"prompt": prompt}),
                             ("chat", "/v1/chat/completions", {"messages": messages})):
        body = {"model": MODEL, "max_tokens": 2, **body}
        post(guarded.url, body, path, AUTH)  # computes (and caches) the prompt's blocks
        expected = (len(ids[kind]) - 1) // 16 * 16
        r = post(guarded.url, body, path, AUTH).json()
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == expected, kind
        streamed = post(guarded.url, {**body, "stream": True, "stream_options": {"include_usage": True}}, path,
                        AUTH)
        usage = [json.loads(line[6:]) for line in streamed.text.splitlines()
                 if line.startswith("data: {")][-1]["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == expected, kind


# --- clients that leave early, and clients that stop reading ------------------------------------------------------

def _raw_request(port: int, path: str, body: dict, rcvbuf: int | None = None) -> socket.socket:
    """Sends an HTTP request on a raw socket and reads nothing back (a client that stops reading or leaves)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()
    sock.sendall(head + data)
    return sock


def _dechunk(body: bytes) -> bytes:
    """The payload of an HTTP/1.1 chunked body."""
    out, pos = [], 0
    while True:
        end = body.index(b"\r\n", pos)
        size = int(body[pos:end], 16)
        if size == 0:
            return b"".join(out)
        out.append(body[end + 2:end + 2 + size])
        pos = end + 2 + size + 2


def _aborted(guarded) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(guarded.url + "/metrics").text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "vllm:request_success_total" and s.labels.get("finished_reason") == "abort")


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_while_queued_aborts(guarded, stream):
    """Every sequence slot is taken: a new request waits in the queue; its client leaves; it is dropped there
    (never prefilled), and the busy ones, left too, free every block."""
    wait_idle(guarded)
    aborted = _aborted(guarded)
    engine = guarded.engine
    busy = [_raw_request(guarded.port, "/v1/completions", completion(max_tokens=400, ignore_eos=True, stream=True,
                                                                     prompt=f"{i} {PROMPT}"))
            for i in range(MAX_NUM_SEQS)]
    try:
        wait_until(lambda: guarded.async_engine.stats.num_running == MAX_NUM_SEQS, 60, "the busy requests to run")
        queued = _raw_request(guarded.port, "/v1/completions",
                              completion(max_tokens=4, stream=stream, prompt="queued " + PROMPT))
        wait_until(lambda: guarded.async_engine.stats.num_waiting == 1, 30, "the new request to queue")
        queued.close()
        wait_until(lambda: guarded.async_engine.stats.num_waiting == 0, 30, "the queued request to be dropped")
        assert guarded.async_engine.stats.num_running == MAX_NUM_SEQS  # it never ran
        assert not any(r.prompt and r.prompt.startswith("queued") for r in engine.requests.values())
    finally:
        for sock in busy:
            sock.close()
    wait_idle(guarded)
    assert _aborted(guarded) == aborted + MAX_NUM_SEQS + 1
    assert guarded.async_engine.inspect()["used_blocks"] == 0


def test_disconnect_while_prefilling_aborts(guarded):
    """A long prompt prefills in chunks of 64 tokens; its client leaves in the middle: it stops there."""
    wait_idle(guarded)
    aborted = _aborted(guarded)
    prompt = LONG_PROMPT * 3  # ~230 tokens: four chunks of 64

    def prefilling() -> bool:  # the only prompt of over 200 tokens, part-way through
        return any(n > 200 and 0 < done < n for done, n in guarded.async_engine.inspect()["prompt_progress"])

    sock = _raw_request(guarded.port, "/v1/completions",
                        completion(prompt=prompt, max_tokens=200, ignore_eos=True, stream=True))
    try:
        wait_until(prefilling, 30, "the prompt to be part-way through its prefill")
    finally:
        sock.close()
    wait_idle(guarded)
    assert _aborted(guarded) == aborted + 1  # not finished: 200 tokens would take seconds
    assert guarded.async_engine.inspect()["used_blocks"] == 0


def test_slow_reader_costs_one_merged_output(guarded, llm):
    """A client that stops reading a stream (stop strings and logprobs: the heaviest outputs) while the engine
    generates 300 tokens: the server holds one merged output for it, not one per step, and the client that
    finally reads gets exactly the greedy text."""
    wait_idle(guarded)
    body = completion(max_tokens=300, temperature=0, ignore_eos=True, stream=True, stop=["qqqqqq"], logprobs=5,
                      prompt=PROMPT)
    ref = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=300, ignore_eos=True, stop=["qqqqqq"]),
                       use_tqdm=False)[0].outputs[0].text
    sock = _raw_request(guarded.port, "/v1/completions", body, rcvbuf=4096)
    try:
        # The engine finishes (it never waits for a client) while the response is stuck in the socket buffers.
        wait_until(lambda: not guarded.engine.requests and guarded.async_engine.pending_outputs(), 120,
                   "the engine to finish the slow reader's request")
        pending = guarded.async_engine.pending_outputs()
        assert len(pending) == 1 and pending[0][0] == 1, pending  # one merged output
        assert pending[0][1] > 100, pending  # ... holding the tokens the socket buffers could not take
        data = b""
        sock.settimeout(60)
        while not data.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's last chunk
            chunk = sock.recv(1 << 16)
            assert chunk, data[-300:]
            data += chunk
    finally:
        sock.close()
    texts = []
    for line in _dechunk(data.split(b"\r\n\r\n", 1)[1]).decode().splitlines():
        if line.startswith("data: {"):
            texts.append("".join(c["text"] for c in json.loads(line[6:])["choices"]))
    assert "".join(texts) == ref
    wait_idle(guarded)


# --- engine health and defaults ------------------------------------------------------------------------------------

def test_dead_engine_turns_health_503_and_exits_nonzero(loaded_model):
    """A step fails and the device no longer runs anything (a poisoned CUDA context, simulated): the request
    in flight gets 503, /health 503, and the server stops with exit status 1 (never a live process that
    cannot serve)."""
    from pagedkv.server import build_app

    args = EngineArgs(device="cpu", dtype="float32", kv_cache_memory=32 << 20, max_model_len=256)
    app = build_app(args, loaded=loaded_model)
    runner = app.state.engine.runner

    def poisoned(*args, **kwargs):
        raise RuntimeError("CUDA error: device-side assert triggered (simulated)")

    with running_server(app) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        runner.execute_model = poisoned
        runner.profile_run = poisoned  # the health probe after the failed step fails too
        r = post(srv.url, {"prompt": PROMPT, "max_tokens": 4})
        assert r.status_code == 503 and "device-side assert" in r.json()["error"]["message"]
        assert_stops_dead(srv)


def test_sampling_defaults_come_from_generation_config(loaded_model, default_model_dir, tmp_path):
    """vLLM's --generation-config auto: what a request leaves out comes from generation_config.json."""
    from pagedkv.server import build_app

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "top_k": 50, "max_new_tokens": 5, "bos_token_id": 1}))
    args = EngineArgs(device="cpu", dtype="float32", kv_cache_memory=32 << 20, max_model_len=256,
                      generation_config=str(tmp_path))
    app = build_app(args, loaded=loaded_model)
    engine = app.state.engine
    assert engine.default_sampling == {"temperature": 0.0, "max_tokens": 5}  # top_k 50 is HF's default: skipped
    ref = LLM(loaded_model=loaded_model, kv_cache_memory=32 << 20, max_model_len=256).chat(
        [{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    with running_server(app) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        r = c.chat.completions.create(model=srv.engine.model_name, messages=[{"role": "user", "content": "Say hi."}])
        assert r.choices[0].message.content == ref[0].outputs[0].text
        assert r.usage.completion_tokens <= 5
        # An explicit value still wins over the default.
        r = c.chat.completions.create(model=srv.engine.model_name, messages=[{"role": "user", "content": "Say hi."}],
                                      max_tokens=2, temperature=0)
        assert r.usage.completion_tokens <= 2
    vllm_defaults = build_app(EngineArgs(device="cpu", dtype="float32", kv_cache_memory=32 << 20, max_model_len=256,
                                         generation_config="vllm"), loaded=loaded_model)
    assert vllm_defaults.state.engine.default_sampling == {}


def test_many_clients_at_once_with_some_hostile(guarded, canary):
    """Good and hostile requests interleaved from concurrent clients: the good ones get their greedy texts."""
    ref = post(guarded.url, completion(temperature=0, max_tokens=6), headers=AUTH).json()["choices"][0]["text"]

    async def run():
        async with httpx.AsyncClient(base_url=guarded.url, headers=AUTH, timeout=120) as client:
            async def good():
                r = await client.post("/v1/completions", json=completion(temperature=0, max_tokens=6))
                return r.status_code, r.json()["choices"][0]["text"]

            async def bad(i):
                body = [completion(top_k=10 ** 12), completion(stop_token_ids=[10 ** 8], min_tokens=3),
                        completion(seed=2 ** 65), completion(n=999)][i % 4]
                return (await client.post("/v1/completions", json=body)).status_code, None

            return await asyncio.gather(*[good() if i % 2 else bad(i) for i in range(16)])

    results = asyncio.run(run())
    assert [r for r in results if r[1] is not None] == [(200, ref)] * 8
    assert [r[0] for r in results if r[1] is None] == [400] * 8
    canary()


def test_offline_sampling_params_refuse_what_the_server_refuses(llm):
    for kwargs, param in (({"temperature": float("inf")}, "temperature"), ({"top_p": float("nan")}, "top_p"),
                          ({"seed": 2 ** 64}, "seed"), ({"stop": ["x"] * 100}, "stop"),
                          ({"stop_token_ids": [-3]}, "stop_token_ids"), ({"min_p": float("nan")}, "min_p")):
        with pytest.raises(ValueError) as e:
            SamplingParams(**kwargs)
        assert e.value.param == param
    # What needs the model: refused by the engine, the request comes back with the reason.
    for kwargs in ({"top_k": VOCAB + 1}, {"stop_token_ids": [VOCAB]}, {"logprobs": 21}, {"n": 10 ** 4}):
        out = llm.generate(PROMPT, SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)[0]
        assert out.outputs[0].finish_reason == "abort" and out.error, kwargs
    assert SamplingParams(temperature=1e-9).temperature == pytest.approx(0.01)
    # A refused request in a batch does not stop the others.
    outs = llm.generate([PROMPT, PROMPT], [SamplingParams(top_k=VOCAB + 1), SamplingParams(temperature=0,
                                                                                           max_tokens=4)],
                        use_tqdm=False)
    alone = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert outs[0].error and outs[1].error is None and outs[1].outputs[0].text == alone.outputs[0].text


def test_nothing_is_left_behind(guarded):
    """After every request above (refused, failed, dropped, aborted, finished): no per-request state remains."""
    wait_idle(guarded)
    engine, async_engine = guarded.engine, guarded.async_engine
    wait_until(lambda: not async_engine._streams, 10, "the engine thread to drop its streams")
    assert not engine.requests  # the front end's per-request text state
    core = async_engine.inspect()  # the engine core's own state, from its process
    assert core["requests"] == [] and core["waiting"] == 0 and core["swapped"] == 0, core
    assert core["running_unfinished"] == 0 and core["block_manager_seqs"] == [] and core["used_blocks"] == 0, core
    assert core["prefix_cache_seqs"] == 0  # per-sequence hash state
    assert core["invariants_error"] is None, core
    assert not guarded.app.state.metrics._timings  # per-request metric timings
    assert async_engine.pending_outputs() == [] and async_engine.num_active == 0
