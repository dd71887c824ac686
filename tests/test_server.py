"""`pagedkv serve` end to end: a real uvicorn server on a free loopback port, driven by the official `openai` client.

One server for the module (the default model, shared with the other engine
tests through `loaded_model`), with an API key. Greedy outputs are compared
with `LLM.generate` / `LLM.chat` on the same model; the engine's state (used
blocks, running requests) is read from the snapshot the engine thread
publishes. Generations stay short (at most 16 tokens, except the requests a
test cuts off) to keep the file fast on a 2-core CPU.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pagedkv
import pytest
from pagedkv import LLM, SamplingParams
from pagedkv.config import EngineArgs
from prometheus_client.parser import text_string_to_metric_families
from server_util import assert_stops_dead, bound_socket, loaded_model_server, running_server, wait_idle, wait_until

MODEL = "smol-test"
API_KEY = "test-key"
SECOND_KEY = "second-key"  # the server takes either (comma-separated keys, as vLLM accepts)
MAX_MODEL_LEN = 512
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three prime numbers."}]


@pytest.fixture(scope="module")
def server(default_model_dir):
    """The server as `pagedkv serve` runs it: the engine core in its own process."""
    from pagedkv.server import build_app

    args = EngineArgs(model=str(default_model_dir), device="cpu", dtype="float32", kv_cache_memory=256 << 20,
                      max_model_len=MAX_MODEL_LEN, max_num_seqs=48, engine_core="process")
    app = build_app(args, served_model_names=[MODEL], api_key=f"{API_KEY},{SECOND_KEY}")
    with running_server(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def thread_server(loaded_model):
    """The engine in the server's own process (a model already in memory): faults can be planted in it."""
    with loaded_model_server(loaded_model, MODEL, API_KEY, MAX_MODEL_LEN, 48) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(loaded_model):
    """The offline API on the same weights: the reference for greedy outputs."""
    return LLM(loaded_model=loaded_model, kv_cache_memory=64 << 20, max_model_len=MAX_MODEL_LEN)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def metric_samples(server) -> dict[tuple[str, tuple], float]:
    """/metrics parsed with prometheus_client's parser: {(sample name, sorted labels): value}."""
    text = httpx.get(server.url + "/metrics").text  # open without a key (no --protect-metrics)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples: dict, name: str, **labels: str) -> float:
    want = {"model_name": MODEL, "engine": "0", **labels}
    return samples[(name, tuple(sorted(want.items())))]


# --- the API -----------------------------------------------------------------------------------------------------

def test_models_health_version(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version", headers=auth()).json() == {"version": pagedkv.__version__}


def test_completion_matches_llm_generate(client, llm, loaded_model):
    ref = llm.generate(PROMPT, greedy(12), use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert (choice.text, choice.finish_reason) == (ref.text, ref.finish_reason)
    num_prompt = len(loaded_model.tokenizer.encode(PROMPT))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (num_prompt, len(ref.token_ids))
    assert r.usage.total_tokens == num_prompt + len(ref.token_ids)
    assert r.usage.prompt_tokens_details is None  # only with --enable-prompt-tokens-details
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_matches_llm_chat(client, llm):
    ref = llm.chat(CHAT, greedy(12), use_tqdm=False)[0].outputs[0]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=12, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason and r.usage.completion_tokens == len(ref.token_ids)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")

    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_prompt_lists_token_ids_and_n(client, llm, loaded_model):
    prompts = ["1, 2, 3, 4,", "The sky is"]
    refs = [o.outputs[0].text for o in llm.generate(prompts, greedy(6), use_tqdm=False)]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=0)
    # OpenAI's order: prompt i's sample j is choice i * n + j.
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [refs[0], refs[0], refs[1], refs[1]]
    ids = [loaded_model.tokenizer.encode(p) for p in prompts]
    assert r.usage.prompt_tokens == sum(map(len, ids))
    one = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=6, temperature=0)
    assert one.choices[0].text == refs[0]
    both = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in both.choices] == refs

    streamed = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=0,
                                           stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {0: refs[0], 1: refs[0], 2: refs[1], 3: refs[1]}


def test_sampling_fields(client, llm):
    def text(**kw) -> tuple[str, str]:
        c = client.completions.create(model=MODEL, prompt=PROMPT, **kw).choices[0]
        return c.text, c.finish_reason

    # seed: a per-request generator, the same output whatever runs beside it.
    assert text(max_tokens=8, temperature=1.0, seed=7) == text(max_tokens=8, temperature=1.0, seed=7)
    # vLLM's extra sampling fields are accepted and honoured.
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0.8, seed=1,
                                  extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2,
                                              "ignore_eos": True, "cache_salt": "tenant-a"})
    assert r.usage.completion_tokens == 5

    ref = llm.generate(PROMPT, greedy(16, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    # stop strings: cut from the text, streamed or not (the stream holds back what may start a stop string).
    stop = ref.text[len(ref.text) // 2:len(ref.text) // 2 + 3]
    expected = ref.text[:ref.text.index(stop)]
    assert text(max_tokens=16, temperature=0, stop=[stop], extra_body={"ignore_eos": True}) == (expected, "stop")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == expected
    # stop_token_ids: the stop token counts as generated, its text is left out.
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                  extra_body={"stop_token_ids": [ref.token_ids[3]], "ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == ref.token_ids.index(
        ref.token_ids[3]) + 1

    # OpenAI's logit_bias and penalties, vLLM's allowed_token_ids: the same tokens as LLM.generate with them
    # (through the engine-core process, streamed and not).
    shaped = dict(presence_penalty=1.5, frequency_penalty=0.5, logit_bias={str(ref.token_ids[1]): -100})
    want = llm.generate(PROMPT, greedy(12, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.5,
                                       logit_bias={ref.token_ids[1]: -100}), use_tqdm=False)[0].outputs[0]
    assert ref.token_ids[1] not in want.token_ids and want.token_ids != ref.token_ids[:12]
    assert text(max_tokens=12, temperature=0, extra_body={"ignore_eos": True}, **shaped) == (want.text, "length")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True},
        **shaped) if c.choices)
    assert streamed == want.text
    allowed = sorted(set(ref.token_ids[:3]))
    sampled = llm.generate(PROMPT, SamplingParams(temperature=0.9, seed=2, max_tokens=6, ignore_eos=True,
                                                  allowed_token_ids=allowed), use_tqdm=False)[0].outputs[0]
    assert set(sampled.token_ids) <= set(allowed)
    assert text(max_tokens=6, temperature=0.9, seed=2, extra_body={"allowed_token_ids": allowed, "ignore_eos": True}
                ) == (sampled.text, "length")

    # logprobs: completions' legacy object, chat's per-token list with top_logprobs.
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(tok in top for tok, top in zip(lp.tokens, lp.top_logprobs, strict=True))  # top-2 + sampled
    c = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2).choices[0]
    assert len(c.logprobs.content) == 4
    for entry in c.logprobs.content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the top token


def _prompt_scores(ref, ids: list[int]) -> list[float]:
    """The engine's logprob of each prompt token after the first (the reference the server must return)."""
    return [ref.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i]


def test_bad_words_as_llm_generate(client, llm):
    """vLLM's bad_words field: tokenized by the front end (the core has no tokenizer), the text LLM.generate's."""
    words = ["Paris", "capital"]
    ref = llm.generate(PROMPT, greedy(12, bad_words=words), use_tqdm=False)[0].outputs[0].text
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"bad_words": words})
    assert r.choices[0].text == ref and "Paris" not in ref


def test_echo_scores_the_prompt_as_the_engine_does(client, llm, loaded_model):
    """lm-eval's loglikelihood request (echo, max_tokens=0, logprobs) and echo before a completion, streamed and
    not: the prompt's text and its tokens' logprobs (the first null) as LLM.generate's prompt_logprobs give."""
    tok = loaded_model.tokenizer
    ids = tok.encode(PROMPT)
    ref = llm.generate(PROMPT, greedy(4, logprobs=2, prompt_logprobs=2), use_tqdm=False)[0]
    out = ref.outputs[0]

    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2, temperature=0)
    c = r.choices[0]
    assert c.text == PROMPT and (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)
    lp = c.logprobs
    assert lp.tokens == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(_prompt_scores(ref, ids), abs=1e-4)
    assert all(len(top) >= 2 and tok_text in top for tok_text, top in zip(lp.tokens[1:], lp.top_logprobs[1:],
                                                                          strict=True))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]

    # A token-id prompt is echoed decoded; the completion and its logprobs follow the prompt's.
    whole = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, echo=True, logprobs=2,
                                      temperature=0).choices[0]
    assert whole.text == tok.decode(ids) + out.text
    assert len(whole.logprobs.tokens) == len(ids) + len(out.token_ids)
    assert whole.logprobs.token_logprobs[len(ids):] == pytest.approx(
        [e[t].logprob for e, t in zip(out.logprobs, out.token_ids, strict=True)], abs=1e-4)
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=4, echo=True, logprobs=2,
                                            temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == whole.text
    assert [t for ch in chunks for t in ch.choices[0].logprobs.tokens] == whole.logprobs.tokens
    assert [o for ch in chunks for o in ch.choices[0].logprobs.text_offset] == whole.logprobs.text_offset
    # Without logprobs echo is text only; with n > 1 every choice starts with the prompt.
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, n=2, temperature=0)
    assert [ch.text for ch in plain.choices] == [PROMPT + tok.decode(out.token_ids[:3])] * 2
    assert plain.choices[0].logprobs is None


def test_prompt_logprobs_field_as_vllm_returns_it(client, llm, loaded_model):
    """vLLM's `prompt_logprobs` extra: per prompt token {token id: {logprob, rank, decoded_token}}, first null;
    chat completions carry it beside the choices."""
    tok = loaded_model.tokenizer
    ids = tok.encode(PROMPT)
    ref = llm.generate(PROMPT, greedy(1, prompt_logprobs=3), use_tqdm=False)[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 3})
    got = r.choices[0].prompt_logprobs
    assert got[0] is None and len(got) == len(ids)
    for i, t in enumerate(ids[1:], 1):
        want = ref.prompt_logprobs[i]
        assert [int(k) for k in got[i]] == list(want)  # the prompt token first, then the top 3
        entry = got[i][str(t)]
        assert entry["logprob"] == pytest.approx(want[t].logprob, abs=1e-4) and entry["rank"] == want[t].rank
        assert entry["decoded_token"] == tok.decode([t])
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).choices[0].prompt_logprobs is None

    c = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 0})
    assert len(c.prompt_logprobs) == c.usage.prompt_tokens and c.prompt_logprobs[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in c.prompt_logprobs[1:])


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


def test_structured_outputs_follow_their_constraint(client, llm):
    """OpenAI's response_format (json_schema, json_object; streamed too) and vLLM's structured_outputs (choice,
    regex): the text follows the constraint and equals LLM.chat / LLM.generate's with the same one."""
    import jsonschema

    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    c = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "person", "schema": PERSON}})
    text = c.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    ref = llm.chat(messages, greedy(60, structured_outputs={"json": PERSON}), use_tqdm=False)[0].outputs[0]
    assert (text, c.choices[0].finish_reason) == (ref.text, "stop")
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                            response_format={"type": "json_schema",
                                                             "json_schema": {"name": "person", "schema": PERSON}},
                                            stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    r = client.completions.create(model=MODEL, prompt="Say something: ", max_tokens=60, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    ref = llm.generate("Say something: ", greedy(60, structured_outputs={"json_object": True}), use_tqdm=False)
    assert r.choices[0].text == ref[0].outputs[0].text and isinstance(json.loads(r.choices[0].text), dict)

    r = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=5, temperature=0,
                                  n=2, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert all(ch.text in ("yes", "no") for ch in r.choices)
    r = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=12, temperature=0.9, seed=1,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", r.choices[0].text)


def test_concurrent_streams_get_their_own_tokens(server, llm):
    """32 streams at once (one batch in the engine); each must get exactly its own prompt's tokens."""
    prompts = [f"{a}, {a + 1}, {a + 2}," for a in range(1, 32 * 7, 7)]
    refs = [o.outputs[0].text for o in llm.generate(prompts, greedy(8, ignore_eos=True), use_tqdm=False)]
    assert len(set(refs)) > 16  # distinct outputs, so a crossed stream would show

    async def run() -> list[tuple[str, int]]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

        async def one(prompt: str) -> tuple[str, int]:
            stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                      stream=True, stream_options={"include_usage": True},
                                                      extra_body={"ignore_eos": True})
            parts, usage = [], 0
            async for chunk in stream:
                parts += [c.text for c in chunk.choices]
                usage = chunk.usage.completion_tokens if chunk.usage else usage
            return "".join(parts), usage

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    results = asyncio.run(run())
    assert [t for t, _ in results] == refs
    assert all(n == 8 for _, n in results)
    wait_idle(server)


def test_stream_never_sends_text_a_stop_string_will_cut(server, llm):
    """Streamed deltas with a stop string: what was sent is a prefix of the final (cut) text at every chunk,
    including a stop string whose first characters arrive in one token and the rest in the next."""
    ref = llm.generate(PROMPT, greedy(16, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    # A stop string spanning a token boundary: the last 2 characters of token 2's text and the first 2 of token 3.
    tok = server.engine.tokenizer
    pieces = [tok.decode(ref.token_ids[:i]) for i in range(1, 6)]
    boundary = len(pieces[2])
    stop = ref.text[boundary - 2:boundary + 2]
    assert len(stop) == 4 and ref.text.index(stop) == boundary - 2
    expected = ref.text[:boundary - 2]
    for stream in (True, False):
        r = httpx.post(server.url + "/v1/completions", headers=auth(), timeout=60, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop": [stop],
            "ignore_eos": True, "stream": stream})
        if not stream:
            assert r.json()["choices"][0]["text"] == expected
            continue
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        sent = ""
        for e in events:
            sent += "".join(c["text"] for c in e["choices"])
            assert expected.startswith(sent), (sent, expected)  # nothing that the stop string later cuts
        assert sent == expected and events[-1]["choices"][0]["finish_reason"] == "stop"


# --- bad input and faults -------------------------------------------------------------------------------------

def _post(server, body, path: str = "/v1/completions", headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={"Content-Type": "application/json", **(auth() if headers is None else headers)})


@pytest.mark.parametrize("body, param", [
    ('{"model": "smol-test", "prompt": "hi"', None),  # malformed JSON
    ({"model": MODEL}, "prompt"),  # missing field
    ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, "max_tokens"),  # wrong type
    ({"model": MODEL, "prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": MODEL, "prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "n": 0}, "n"),
    ({"model": MODEL, "prompt": "hi " * 600}, "prompt"),  # longer than max_model_len
    ({"model": MODEL, "prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),  # prompt + output too long
    ({"model": MODEL, "prompt": [1, 10 ** 9]}, "prompt"),  # token id outside the vocabulary
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": "hi " * 600, "stream": True}, "prompt"),
    ({"model": MODEL, "prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"model": MODEL, "prompt": "hi", "prompt_logprobs": 10 ** 6}, "prompt_logprobs"),  # past --max-logprobs
    ({"model": MODEL, "prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"model": MODEL, "prompt": "hi", "echo": True, "logprobs": 10 ** 6}, "logprobs"),
    ({"model": MODEL, "prompt": "hi", "echo": True, "logprobs": 1, "use_beam_search": True, "n": 2}, "echo"),
    ({"model": MODEL, "prompt": "hi", "prompt_logprobs": 1, "use_beam_search": True, "n": 2}, "prompt_logprobs"),
    ({"model": MODEL, "prompt": "hi", "response_format": {"type": "json_schema"}}, "response_format"),
    ({"model": MODEL, "prompt": "hi", "response_format": {"type": "xml"}}, "response_format"),
    ({"model": MODEL, "prompt": "hi", "structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"model": MODEL, "prompt": "hi", "structured_outputs": {"json": {"type": "no-such-type"}}},
     "structured_outputs"),
    ({"model": MODEL, "prompt": "hi", "structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
    ({"model": MODEL, "prompt": "hi", "structured_outputs": {"choice": "a"}}, "structured_outputs"),
    ({"model": MODEL, "prompt": "hi", "structured_outputs": {"json_object": True}, "min_tokens": 2}, "min_tokens"),
    ({"model": MODEL, "prompt": "hi", "response_format": {"type": "json_object"}, "use_beam_search": True,
      "n": 2}, "response_format"),
    ({"model": MODEL, "prompt": "hi", "bad_words": ["x"] * 300}, "bad_words"),
    ({"model": MODEL, "prompt": "hi", "bad_words": [" "]}, "bad_words"),
    ({"model": MODEL, "prompt": "hi", "bad_words": ["x"], "use_beam_search": True, "n": 2}, "bad_words"),
])
def test_bad_completion_requests_get_400(server, body, param):
    r = _post(server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_bad_chat_requests_get_400(server, client):
    assert _post(server, {"model": MODEL, "messages": []}, "/v1/chat/completions").status_code == 400
    assert _post(server, {"model": MODEL, "messages": CHAT, "temperature": -1},
                 "/v1/chat/completions").json()["error"]["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 600}])
    assert e.value.body["code"] == "context_length_exceeded"
    # ... and the server goes on serving.
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1


def test_unknown_model_is_404(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    assert _post(server, {"model": "x", "messages": CHAT}, "/v1/chat/completions").status_code == 404


def test_api_key_guards_every_route_but_health_and_metrics(server):
    routes = (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
              ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version"), ("GET", "/openapi.json"),
              ("GET", "/docs"))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, {"Authorization": "Bearer"},
                    {"Authorization": f"Basic {API_KEY}"}, {"Authorization": f"Bearer {API_KEY}x"}):
        for method, path in routes:
            r = httpx.request(method, server.url + path, headers=headers, json={"model": MODEL, "prompt": "hi"})
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    # Either key, and the scheme in any case.
    for header in (f"Bearer {API_KEY}", f"bearer {SECOND_KEY}", f"BEARER {API_KEY}"):
        assert httpx.get(server.url + "/version", headers={"Authorization": header}).status_code == 200
        r = httpx.post(server.url + "/tokenize", headers={"Authorization": header}, json={"prompt": "hi"})
        assert r.status_code == 200 and r.json()["count"] >= 1
    assert httpx.get(server.url + "/health").status_code == 200  # open: load balancers probe it
    assert httpx.get(server.url + "/metrics").status_code == 200  # open unless --protect-metrics


def test_engine_error_fails_its_requests_with_500_and_the_server_lives_on(thread_server):
    server, client = thread_server, thread_server.client
    runner = server.engine.runner
    calls = []

    def broken_execute_model(*args, **kwargs):
        del runner.execute_model  # only this step fails (the instance attribute shadows the method once)
        calls.append(1)
        raise RuntimeError("injected fault")

    runner.execute_model = broken_execute_model
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    assert calls == [1]
    assert e.value.status_code == 500 and e.value.body["type"] == "server_error"
    assert "injected fault" in e.value.body["message"]
    wait_idle(server)
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4).usage.completion_tokens >= 1
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_request_that_breaks_sampling_fails_alone(thread_server, llm):
    """A fault in one row's sampling (here: injected for seed 666) fails that request only; the requests
    batched with it in the same steps get their own, correct outputs."""
    server = thread_server
    runner = server.engine.runner
    real_sample = runner.sample

    def sample(rows, logits):
        if any(s.request.params.seed == 666 for s in rows):
            raise RuntimeError("injected sampling fault")
        return real_sample(rows, logits)

    ref = llm.generate(PROMPT, greedy(12, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    runner.sample = sample
    try:
        async def run():
            aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
            try:
                good = [aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                                   extra_body={"ignore_eos": True}) for _ in range(3)]
                bad = aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, seed=666)
                return await asyncio.gather(*good, bad, return_exceptions=True)
            finally:
                await aclient.close()

        *good, bad = asyncio.run(run())
    finally:
        del runner.sample
    assert isinstance(bad, openai.InternalServerError) and "injected sampling fault" in bad.body["message"]
    assert [g.choices[0].text for g in good] == [ref] * 3
    wait_idle(server)


def test_client_disconnect_aborts_and_frees_blocks(server):
    wait_idle(server)
    aborted = sample(metric_samples(server), "vllm:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=auth(), timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            while not next(lines).startswith("data: "):
                pass
        assert server.async_engine.stats.num_used_gpu_blocks > 0
    # The connection is closed mid-stream: the request is aborted and its blocks go back to the pool.
    wait_idle(server)
    # The same for a non-streamed request whose client gives up.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, headers=auth(), timeout=1.0)
    wait_idle(server)
    assert sample(metric_samples(server), "vllm:request_success_total", finished_reason="abort") == aborted + 2
    assert server.async_engine.stats.num_used_gpu_blocks == 0


def test_metrics_move_as_requests_run(server, client, loaded_model):
    wait_idle(server)
    before = metric_samples(server)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        sample(before, name)  # present, labelled with model_name
    assert sample(before, "vllm:num_requests_running") == 0 and sample(before, "vllm:kv_cache_usage_perc") == 0
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                              extra_body={"ignore_eos": True})
    after = metric_samples(server)

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:prompt_tokens_total") == len(loaded_model.tokenizer.encode(PROMPT))
    assert delta("vllm:generation_tokens_total") == 6
    for hist in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_time_per_output_token_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds"):
        assert delta(f"{hist}_count") == 1, hist
    assert delta("vllm:inter_token_latency_seconds_count") == 5  # one interval between consecutive tokens
    assert delta("vllm:time_per_output_token_seconds_count") == 5
    assert delta("vllm:e2e_request_latency_seconds_sum") > 0
    assert delta("vllm:request_generation_tokens_sum") == 6


def test_cache_config_info_names_the_cache_dtype(server):
    """vLLM's info gauge: 1, labelled with the cache settings (the engine core's, sized pool included)."""
    text = httpx.get(server.url + "/metrics").text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "vllm:cache_config_info"]
    (s,) = family.samples
    assert s.value == 1
    assert s.labels["cache_dtype"] == "auto" and s.labels["engine"] == "0" and s.labels["block_size"] == "16"
    assert s.labels["num_gpu_blocks"] == str(server.engine.get_stats().num_gpu_blocks)
    assert s.labels["calculate_kv_scales"] == "None" and s.labels["kv_cache_memory"] == str(256 << 20)


def test_killed_core_fails_streams_turns_health_503_and_exits_nonzero(default_model_dir):
    """kill -9 of the engine-core process mid-stream: the stream ends with an error event, /health answers 503,
    new requests 503, and the server stops with exit status 1."""
    from pagedkv.server import build_app

    args = EngineArgs(model=str(default_model_dir), device="cpu", dtype="float32", kv_cache_memory=32 << 20,
                      max_model_len=256, engine_core="process", cpu_threads_bind="nobind")
    app = build_app(args)
    with running_server(app) as srv, httpx.Client(timeout=60) as http:
        body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
        response = http.send(http.build_request("POST", srv.url + "/v1/completions", json=body), stream=True)
        assert response.status_code == 200
        events, first = [], threading.Event()
        reader = threading.Thread(target=_read_stream, args=(response, events, first), daemon=True)
        reader.start()
        assert first.wait(60)
        os.kill(srv.engine.core_pid, signal.SIGKILL)
        reader.join(30)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 or error["type"] == "server_error", error
        assert "SIGKILL" in error["message"], error
        assert_stops_dead(srv)


def _read_stream(response: httpx.Response, events: list, first: threading.Event) -> None:
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append(line[6:])
            first.set()


@pytest.mark.slow
def test_pagedkv_serve_cli_drains_on_sigterm(default_model_dir, tmp_path):
    """The command line as users run it, in its own process (the key from $PAGEDKV_API_KEY). SIGTERM with
    streams in flight: new requests get 503, a short stream finishes normally, a long one gets a final error
    event and [DONE] when --shutdown-timeout runs out, and the process exits 0."""
    with bound_socket() as sock:
        port = sock.getsockname()[1]
    env = dict(os.environ, PAGEDKV_API_KEY="env-key")
    cmd = [sys.executable, "-m", "pagedkv.cli", "serve", str(default_model_dir), "--port", str(port),
           "--kv-cache-memory", str(64 << 20), "--max-model-len", "512", "--served-model-name", "cli-test",
           "--shutdown-timeout", "4"]
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": "Bearer env-key"}
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "pagedkv serve did not become healthy"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert httpx.get(url + "/v1/models").status_code == 401
        c = openai.OpenAI(base_url=url + "/v1", api_key="env-key", max_retries=0)
        assert c.completions.create(model="cli-test", prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1
        with httpx.Client(timeout=60, headers=headers) as http:
            streams = []
            for max_tokens in (400, 6):  # 400 tokens cannot finish within the 4 s drain on these cores
                body = {"model": "cli-test", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
                        "stream": True}
                response = http.send(http.build_request("POST", url + "/v1/completions", json=body), stream=True)
                events, first = [], threading.Event()
                reader = threading.Thread(target=_read_stream, args=(response, events, first), daemon=True)
                reader.start()
                assert first.wait(60)
                streams.append((events, reader))
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: httpx.get(url + "/health").status_code == 503, 10, "/health to answer 503")
            late = httpx.post(url + "/v1/completions", headers=headers, json={"model": "cli-test", "prompt": "hi"})
            assert late.status_code == 503 and late.json()["error"]["type"] == "server_error"
            for _, reader in streams:
                reader.join(60)
        (long_events, _), (short_events, _) = streams
        assert short_events[-1] == "[DONE]"
        assert json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
        assert long_events[-1] == "[DONE]"
        final = json.loads(long_events[-2])
        assert "shutting down" in final["error"]["message"], final
        assert proc.wait(60) == 0, log_path.read_text()
        log_text = log_path.read_text()
        assert "engine stopped" in log_text
        core_pid = int(re.search(r"engine core ready \(pid (\d+)\)", log_text).group(1))
        wait_until(lambda: not Path(f"/proc/{core_pid}").exists(), 10, "the engine core to exit with the server")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
