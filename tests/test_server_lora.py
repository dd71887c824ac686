"""`pagedkv serve` with LoRA adapters: the request's `model` picks the base model or an adapter, /v1/models lists
them, vLLM's runtime load/unload routes, and vllm:lora_requests_info.

One server for the module, as `pagedkv serve --enable-lora --lora-modules sql=PATH` runs it (the engine core in
its own process), with $PAGEDKV_ALLOW_RUNTIME_LORA_UPDATING set; real PEFT adapters of the default model. Greedy
outputs are compared with the offline LLM(enable_lora=True) on the same weights (8 tokens each).
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest
from lora_util import _save_adapter
from pagedkv import LLM, LoRARequest, SamplingParams
from pagedkv.config import EngineArgs
from prometheus_client.parser import text_string_to_metric_families
from server_util import post, running_server, wait_idle, wait_until

pytest.importorskip("peft")

MODEL = "smol-lora-test"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three prime numbers."}]
MAX_TOKENS = 8
LORA_ARGS = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_model_len": 512, "device": "cpu",
             "dtype": "float32"}


@pytest.fixture(scope="module")
def adapter_paths(default_model_dir, tmp_path_factory):
    """"sql": every projection at rank 8 (served from the start); "qv": q/v at rank 4 (loaded at run time)."""
    root = tmp_path_factory.mktemp("server-lora")
    full = _save_adapter(default_model_dir, root / "full", 11, r=8, lora_alpha=16,
                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    qv = _save_adapter(default_model_dir, root / "qv", 12, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return {"sql": full, "qv": qv}


@pytest.fixture(scope="module")
def server(default_model_dir, adapter_paths):
    from pagedkv.server import build_app
    from pagedkv.server.serving_models import LoRAModulePath

    args = EngineArgs(model=str(default_model_dir), kv_cache_memory=128 << 20, max_num_seqs=16,
                      engine_core="process", **LORA_ARGS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDKV_ALLOW_RUNTIME_LORA_UPDATING", "1")
        app = build_app(args, served_model_names=[MODEL], lora_modules=[LoRAModulePath("sql", adapter_paths["sql"])])
    with running_server(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(loaded_model):
    """The offline API with LoRA on the same weights: the reference."""
    return LLM(loaded_model=loaded_model, kv_cache_memory=64 << 20, **LORA_ARGS)


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)


def offline(llm, adapter_paths, name: str | None, chat: bool = False):
    lora = None if name is None else LoRARequest(name, 1 if name == "sql" else 2, adapter_paths[name])
    run = llm.chat(CHAT, greedy(), use_tqdm=False, lora_request=lora) if chat else \
        llm.generate(PROMPT, greedy(), use_tqdm=False, lora_request=lora)
    assert run[0].error is None, run[0].error
    return run[0].outputs[0]


def token_logprobs(c) -> list[float]:
    return [e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True)]


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def lora_info(server) -> dict[str, str]:
    """The labels of vllm:lora_requests_info's one sample."""
    text = httpx.get(server.url + "/metrics").text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "vllm:lora_requests_info"]
    (sample,) = family.samples
    return sample.labels


def on_server_loop(server, coroutine):
    """Runs an AsyncEngine coroutine on the server's event loop (from the test's thread)."""
    return asyncio.run_coroutine_threadsafe(coroutine, server.app.state.server._loop).result(60)


def engine_lora_ids(server) -> set[int]:
    """The adapters the engine (core) holds, asked through the server's engine thread."""
    return on_server_loop(server, server.async_engine.list_loras())


# --- the model field ---------------------------------------------------------------------------------------------

def test_models_lists_the_adapter(server, client, adapter_paths):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [MODEL, "sql"]
    assert cards["sql"].model_extra["root"] == adapter_paths["sql"]
    assert cards["sql"].model_extra["parent"] == MODEL and cards[MODEL].model_extra["parent"] is None
    assert client.models.retrieve("sql").model_extra["root"] == adapter_paths["sql"]


def test_adapter_and_base_match_offline(client, llm, adapter_paths):
    """model=adapter runs the adapter, model=base the base model: tokens and logprobs as offline; the response
    names the model the client sent."""
    outputs = {}
    for name in ("sql", None):
        ref = offline(llm, adapter_paths, name)
        r = client.completions.create(model=name or MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                      logprobs=0)
        assert r.model == (name or MODEL)
        assert r.choices[0].text == ref.text
        assert r.choices[0].logprobs.token_logprobs == pytest.approx(token_logprobs(ref), abs=1e-3)
        outputs[name] = token_logprobs(ref)
    # The adapter moves the outputs (the comparison above would not tell them apart otherwise).
    assert outputs["sql"] != pytest.approx(outputs[None], abs=1e-2)


def test_adapter_streams_and_chats(client, llm, adapter_paths):
    ref = offline(llm, adapter_paths, "sql")
    chunks = list(client.completions.create(model="sql", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert {c.model for c in chunks} == {"sql"}

    chat_ref = offline(llm, adapter_paths, "sql", chat=True)
    r = client.chat.completions.create(model="sql", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert (r.model, r.choices[0].message.content) == ("sql", chat_ref.text)
    chunks = list(client.chat.completions.create(model="sql", messages=CHAT, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat_ref.text
    assert {c.model for c in chunks} == {"sql"}


def test_unknown_model_is_404(server, client):
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT, max_tokens=2)
    assert httpx.get(server.url + "/v1/models/nope").status_code == 404


# --- runtime loading ---------------------------------------------------------------------------------------------

def test_load_use_unload_at_run_time(server, client, llm, adapter_paths, tmp_path):
    url = server.url
    r = post(url, {"lora_name": "qv", "lora_path": adapter_paths["qv"]}, "/v1/load_lora_adapter")
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'qv' added successfully.")
    assert [m.id for m in client.models.list().data] == [MODEL, "sql", "qv"]
    ref = offline(llm, adapter_paths, "qv")
    r = client.completions.create(model="qv", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert (r.model, r.choices[0].text) == ("qv", ref.text)

    # Refusals: a name already served, a folder that is not an adapter (the engine's reason), fields missing.
    error = error_of(post(url, {"lora_name": "qv", "lora_path": adapter_paths["qv"]}, "/v1/load_lora_adapter"), 400)
    assert "has already been loaded" in error["message"]
    error = error_of(post(url, {"lora_name": "gone", "lora_path": str(tmp_path / "nothing")},
                          "/v1/load_lora_adapter"), 400)
    assert "no such folder" in error["message"] and error["type"] == "invalid_request_error"
    error = error_of(post(url, {"lora_name": "empty", "lora_path": str(tmp_path)}, "/v1/load_lora_adapter"), 400)
    assert "adapter_config.json" in error["message"]
    assert "must be provided" in error_of(post(url, {"lora_name": "x"}, "/v1/load_lora_adapter"), 400)["message"]
    assert [m.id for m in client.models.list().data] == [MODEL, "sql", "qv"]  # the failed loads left nothing

    qv_id = server.app.state.models.lora_requests["qv"].lora_int_id
    assert qv_id in engine_lora_ids(server)
    r = post(url, {"lora_name": "qv"}, "/v1/unload_lora_adapter")
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'qv' removed successfully.")
    assert qv_id not in engine_lora_ids(server)  # the engine core forgot it
    with pytest.raises(openai.NotFoundError, match="`qv` does not exist"):
        client.completions.create(model="qv", prompt=PROMPT, max_tokens=2)
    error = error_of(post(url, {"lora_name": "qv"}, "/v1/unload_lora_adapter"), 404)
    assert "cannot be found" in error["message"]
    assert [m.id for m in client.models.list().data] == [MODEL, "sql"]
    # The adapter at start-up is served as before.
    assert client.completions.create(model="sql", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                     temperature=0).choices[0].text == offline(llm, adapter_paths, "sql").text


def test_unload_ends_running_requests_and_metrics_name_adapters(server, adapter_paths):
    """A stream of an adapter running when it is unloaded ends with a 404 error event; meanwhile
    vllm:lora_requests_info names it as running."""
    assert post(server.url, {"lora_name": "long", "lora_path": adapter_paths["qv"]},
                "/v1/load_lora_adapter").status_code == 200
    assert lora_info(server)["max_lora"] == "2"
    body = {"model": "long", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        response = http.send(http.build_request("POST", server.url + "/v1/completions", json=body), stream=True)
        assert response.status_code == 200
        events, first = [], threading.Event()

        def read() -> None:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert first.wait(60)
        wait_until(lambda: lora_info(server)["running_lora_adapters"] == "long", 30, "the metric to name the adapter")
        assert lora_info(server)["waiting_lora_adapters"] == ""
        assert post(server.url, {"lora_name": "long"}, "/v1/unload_lora_adapter").status_code == 200
        reader.join(30)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "`long` was unloaded" in error["message"] and error["code"] == "model_not_found", error
    wait_idle(server)
    wait_until(lambda: lora_info(server)["running_lora_adapters"] == "", 10, "the metric to drop the adapter")


def test_engine_stats_name_waiting_and_running_adapters(llm, adapter_paths):
    """What vllm:lora_requests_info's labels come from: EngineStats' comma-joined names."""
    engine = llm.llm_engine
    loras = [LoRARequest("sql", 1, adapter_paths["sql"]), LoRARequest("qv", 2, adapter_paths["qv"]), None]
    for i, lora in enumerate(loras):
        engine.add_request(f"stats-{i}", PROMPT, SamplingParams(max_tokens=4), lora_request=lora)
    s = engine.get_stats()
    assert (s.waiting_lora_adapters, s.running_lora_adapters) == ("qv,sql", "")
    engine.step()
    s = engine.get_stats()
    assert (s.waiting_lora_adapters, s.running_lora_adapters) == ("", "qv,sql")
    engine.abort_request([f"stats-{i}" for i in range(len(loras))])
    assert engine.get_stats().running_lora_adapters == ""


# --- start-up, and a server without runtime loading ------------------------------------------------------------

def test_parse_lora_modules():
    from pagedkv.server.serving_models import LoRAModulePath, parse_lora_module

    assert parse_lora_module("sql=/a/b") == LoRAModulePath("sql", "/a/b")
    assert parse_lora_module('{"name": "sql", "path": "/a", "base_model_name": "m"}') == \
        LoRAModulePath("sql", "/a", "m")
    for bad in ("sql", "=/a", '{"name": "sql"}', '{"name": "x", "path": "/a", "rank": 8}', "{oops"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_module(bad)


def test_start_up_refusals_and_in_process_engine(loaded_model, adapter_paths, llm, tmp_path, monkeypatch):
    """A bad adapter at start fails with its name; without the environment variable the runtime routes do not
    exist; the engine on the server's own thread serves the adapters too.

    Last in the file: an engine with LoRA attaches its adapter slots to the model's projections, so the ones
    built here on the shared `loaded_model` take them from `llm` (whose reference is taken first)."""
    from pagedkv.server import build_app
    from pagedkv.server.serving_models import LoRAModulePath

    monkeypatch.delenv("PAGEDKV_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    ref = offline(llm, adapter_paths, "sql").text
    args = EngineArgs(kv_cache_memory=32 << 20, **LORA_ARGS)
    with pytest.raises(ValueError, match="needs --enable-lora"):
        build_app(EngineArgs(device="cpu"), loaded=loaded_model, lora_modules=[LoRAModulePath("a", "/a")])
    with pytest.raises(ValueError, match=r"--lora-modules broken=.*no such folder"):
        build_app(args, loaded=loaded_model, lora_modules=[LoRAModulePath("broken", str(tmp_path / "nothing"))])

    app = build_app(args, served_model_names=[MODEL], loaded=loaded_model,
                    lora_modules=[LoRAModulePath("sql", adapter_paths["sql"], "base-x")])
    with running_server(app) as srv:
        assert post(srv.url, {"lora_name": "qv", "lora_path": adapter_paths["qv"]},
                    "/v1/load_lora_adapter").status_code == 404
        models = httpx.get(srv.url + "/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [(MODEL, None), ("sql", "base-x")]
        r = post(srv.url, {"model": "sql", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert (r.json()["model"], r.json()["choices"][0]["text"]) == ("sql", ref)
        # AsyncEngine's LoRA calls run on the engine thread here (no core process to ask).
        engine = srv.async_engine
        on_server_loop(srv, engine.add_lora(LoRARequest("qv", 9, adapter_paths["qv"])))
        assert engine_lora_ids(srv) == {1, 9}
        with pytest.raises(ValueError, match="no such folder"):
            on_server_loop(srv, engine.add_lora(LoRARequest("gone", 10, str(tmp_path / "nothing"))))
        on_server_loop(srv, engine.remove_lora(LoRARequest("qv", 9, adapter_paths["qv"])))
        assert engine_lora_ids(srv) == {1}
