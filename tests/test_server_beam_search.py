"""Beam search through the OpenAI-compatible server (vLLM's `use_beam_search` / `length_penalty` extras).

One in-process server for the module (the default model already in memory,
shared through `loaded_model`), plus one request against a server whose
engine core runs in its own process (`pagedkv serve`'s default). Beam
outputs are compared with the engine's own answer to the same
BeamSearchParams (`LLM.beam_search` and a plain `add_request`). Generations
stay at 8 tokens or fewer to keep the file fast on a 2-core CPU.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pagedkv import LLM
from pagedkv.beam_search import BeamSearchParams
from pagedkv.config import EngineArgs
from pagedkv.core.sequence import OutputKind
from server_util import loaded_model_server, post, running_server, wait_idle

MODEL = "smol-test"
API_KEY = "test-key"
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 8
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three prime numbers."}]
BEAM = {"use_beam_search": True}


@pytest.fixture(scope="module")
def server(loaded_model):
    with loaded_model_server(loaded_model, MODEL, API_KEY, MAX_MODEL_LEN, MAX_NUM_SEQS) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.client


@pytest.fixture(scope="module")
def llm(loaded_model):
    return LLM(loaded_model=loaded_model, kv_cache_memory=64 << 20, max_model_len=MAX_MODEL_LEN)


def engine_beams(llm: LLM, prompt_ids: list[int], params: BeamSearchParams):
    """The engine's own answer to a beam request: its one (final) output's CompletionOutputs, best first."""
    engine = llm.llm_engine
    rid = f"ref-{id(params)}-{len(prompt_ids)}"
    engine.add_request(rid, {"prompt_token_ids": prompt_ids}, params, output_kind=OutputKind.FINAL_ONLY)
    final = []
    while engine.has_unfinished_requests():
        final += [o for o in engine.step() if o.request_id == rid and o.finished]
    assert len(final) == 1
    return final[0].outputs


def error_of(excinfo) -> dict:
    return excinfo.value.response.json()["error"]


def test_completion_beam_search_matches_engine(client, llm, loaded_model):
    ids = loaded_model.tokenizer.encode(PROMPT)
    for n in (2, 4):
        ref = engine_beams(llm, ids, BeamSearchParams(beam_width=n, max_tokens=8))
        assert 1 <= len(ref) <= n
        r = client.completions.create(model=MODEL, prompt=PROMPT, n=n, max_tokens=8, temperature=0, extra_body=BEAM)
        assert [c.index for c in r.choices] == list(range(len(ref)))
        assert [(c.text, c.finish_reason) for c in r.choices] == [(o.text, o.finish_reason) for o in ref]
        assert len({c.text for c in r.choices}) == len(r.choices)  # distinct beams
        assert all(c.logprobs is None for c in r.choices)  # only when asked
        # usage: the prompt once, every returned beam's tokens (as vLLM counts them).
        assert r.usage.prompt_tokens == len(ids)
        assert r.usage.completion_tokens == sum(len(o.token_ids) for o in ref)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_beam_search_matches_llm_beam_search(client, llm, loaded_model):
    tok = loaded_model.tokenizer
    ids = tok.encode(PROMPT)
    out = llm.beam_search([{"prompt": PROMPT}], BeamSearchParams(beam_width=2, max_tokens=8))[0]
    top = out.sequences[0]
    assert top.tokens[:len(ids)] == ids
    r = client.completions.create(model=MODEL, prompt=PROMPT, n=2, best_of=2, max_tokens=8, temperature=0,
                                  extra_body=BEAM)
    output_ids = [t for t in top.tokens[len(ids):] if t != tok.eos_token_id]
    assert r.choices[0].text == tok.decode(output_ids, skip_special_tokens=True)
    assert r.choices[0].finish_reason == top.finish_reason


def test_chat_beam_search_matches_engine(client, llm, loaded_model):
    ids = list(loaded_model.tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=False,
                                                          add_generation_prompt=True))
    ref = engine_beams(llm, ids, BeamSearchParams(beam_width=3, max_tokens=8))
    r = client.chat.completions.create(model=MODEL, messages=CHAT, n=3, max_completion_tokens=8, temperature=0,
                                       extra_body=BEAM)
    assert [c.index for c in r.choices] == list(range(len(ref)))
    assert [(c.message.content, c.finish_reason) for c in r.choices] == [(o.text, o.finish_reason) for o in ref]
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in ref)


def test_beam_search_consistent_across_endpoints(client, loaded_model):
    """The chat prompt sent as token ids to /v1/completions gets the same beams as /v1/chat/completions."""
    ids = list(loaded_model.tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=False,
                                                          add_generation_prompt=True))
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, n=2, max_tokens=6, temperature=0,
                                          extra_body=BEAM)
    cmpl = client.completions.create(model=MODEL, prompt=ids, n=2, max_tokens=6, temperature=0, extra_body=BEAM)
    assert [c.message.content for c in chat.choices] == [c.text for c in cmpl.choices]


def test_beam_search_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=6, temperature=0, logprobs=2,
                                  extra_body=BEAM)
    total = 0
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
        assert all(v is not None and v <= 0 for v in lp.token_logprobs)
        for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert 1 <= len(top) <= 3 and top[token] == value  # the 2 most likely candidates + the chosen token
            assert max(top.values()) >= value
        total += len(lp.tokens)
    assert r.usage.completion_tokens == total
    c = client.chat.completions.create(model=MODEL, messages=CHAT, n=2, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=1, extra_body=BEAM)
    for choice in c.choices:
        assert choice.logprobs.content and all(len(t.top_logprobs) == 1 for t in choice.logprobs.content)
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, n=2, max_tokens=4, temperature=0,
                                           extra_body=BEAM)
    assert all(choice.logprobs is None for choice in plain.choices)


def test_beam_search_several_prompts(client):
    r = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], n=2, max_tokens=4, temperature=0,
                                  extra_body=BEAM)
    assert [c.index for c in r.choices] == list(range(len(r.choices))) and 2 <= len(r.choices) <= 4
    first = client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=4, temperature=0,
                                      extra_body=BEAM)
    assert [c.text for c in r.choices[:len(first.choices)]] == [c.text for c in first.choices]


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize(("extra", "param"), [
    ({"stream": True}, "stream"),
    ({"top_p": 0.5}, "top_p"),
    ({"top_k": 5}, "top_k"),
    ({"min_p": 0.1}, "min_p"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"stop": ["\n"]}, "stop"),
    ({"stop_token_ids": [2]}, "stop_token_ids"),
    ({"seed": 1}, "seed"),
    ({"min_tokens": 2}, "min_tokens"),
    ({"n": MAX_NUM_SEQS + 1}, "n"),
    ({"temperature": 0, "logit_bias": {"1": 1.0}}, "logit_bias"),
])
def test_beam_search_refusals(server, route, extra, param):
    if route == "completions":
        body, path = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "n": 2, **BEAM, **extra}, "/v1/completions"
    else:
        body, path = ({"model": MODEL, "messages": CHAT, "max_tokens": 4, "n": 2, **BEAM, **extra},
                      "/v1/chat/completions")
    r = post(server.url, body, path, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param in error["message"] or "Streaming" in error["message"]
    if param == "stream":
        assert "beam search" in error["message"]


def test_beam_search_refusals_openai_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=8, stream=True, extra_body=BEAM)
    assert error_of(e)["param"] == "stream"
    assert "Streaming is not currently supported with beam search" in error_of(e)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=8, top_p=0.5, extra_body=BEAM)
    assert error_of(e)["param"] == "top_p" and "top_p" in error_of(e)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, n=MAX_NUM_SEQS + 1, max_tokens=8, extra_body=BEAM)
    assert error_of(e)["param"] == "n" and "max_num_seqs" in error_of(e)["message"]
    with pytest.raises(openai.BadRequestError) as e:  # the engine's own refusal: the beams cannot fit in the cache
        client.completions.create(model=MODEL, prompt=PROMPT, n=MAX_NUM_SEQS, max_tokens=MAX_MODEL_LEN - 16,
                                  extra_body=BEAM)
    assert error_of(e)["param"] == "n" and "blocks" in error_of(e)["message"]
    with pytest.raises(openai.BadRequestError) as e:  # best_of: absent or equal to n (the beam width)
        client.completions.create(model=MODEL, prompt=PROMPT, n=2, best_of=3, max_tokens=8, extra_body=BEAM)
    assert error_of(e)["param"] == "best_of"
    with pytest.raises(openai.BadRequestError) as e:  # without beam search best_of != n is refused as before
        client.completions.create(model=MODEL, prompt=PROMPT, n=1, best_of=2, max_tokens=4)
    assert error_of(e)["param"] == "best_of"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, n=2, max_tokens=4, stream=True, extra_body=BEAM)
    assert error_of(e)["param"] == "stream"
    # top_p, top_k, ... at their neutral values are accepted.
    r = client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=2, temperature=0, top_p=1.0,
                                  extra_body={**BEAM, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0})
    assert len(r.choices) >= 1


def test_beam_search_length_penalty(server, client):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    for bad in ("Infinity", "NaN", "-Infinity"):  # JSON's extensions: refused, naming the field
        text = (f'{{"model": "{MODEL}", "prompt": {json.dumps(PROMPT)}, "n": 2, "max_tokens": 4, '
                f'"use_beam_search": true, "length_penalty": {bad}}}')
        r = httpx.post(server.url + "/v1/completions", content=text, headers=headers, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "length_penalty"
    for huge in (1e308, 1000.0, -1000.0, -1e308):  # finite, though length ** length_penalty over- or underflows
        r = post(server.url, {"model": MODEL, "prompt": PROMPT, "n": 2, "max_tokens": 4, **BEAM,
                              "length_penalty": huge}, headers=headers)
        assert r.status_code == 200, r.text
        assert 1 <= len(r.json()["choices"]) <= 2
    r = client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=4, temperature=0,
                                  extra_body={**BEAM, "length_penalty": 0.5})
    assert 1 <= len(r.choices) <= 2


def test_server_keeps_serving(server, client):
    """After beam searches and refusals, a plain request still answers, and nothing is left in the engine."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert len(r.choices) == 1 and r.choices[0].finish_reason in ("stop", "length")
    c = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, n=2)
    assert len(c.choices) == 2
    wait_idle(server)


def test_beam_search_engine_core_process(default_model_dir, client):
    """The same beams when the engine core runs in its own process (`pagedkv serve`'s default)."""
    from pagedkv.server import build_app

    args = EngineArgs(model=str(default_model_dir), device="cpu", dtype="float32", kv_cache_memory=64 << 20,
                      max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, engine_core="process")
    app = build_app(args, served_model_names=[MODEL], api_key=API_KEY)
    kw = dict(model=MODEL, prompt=PROMPT, n=2, max_tokens=6, temperature=0, extra_body=BEAM)
    with running_server(app) as srv:
        remote = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        r = remote.completions.create(**kw)
        with pytest.raises(openai.BadRequestError):
            remote.completions.create(**{**kw, "stream": True})
        wait_idle(srv)
    assert [c.text for c in r.choices] == [c.text for c in client.completions.create(**kw).choices]
