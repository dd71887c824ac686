"""The KV-cache dashboard's routes, KV traces (recorder, reader, `generate --kv-trace`) and `kv-view`'s app.

One in-process server on the shared default model (`loaded_model`), with an
API key and prefix caching on; generations stay at a few dozen tokens.
"""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from pagedkv.config import EngineArgs
from pagedkv.engine.kv_snapshot import BLOCK_CACHED, BLOCK_FREE, BLOCK_SHARED, BLOCK_USED, decode_blocks
from pagedkv.engine.kv_trace import KVTraceRecorder, read_trace
from prometheus_client.parser import text_string_to_metric_families
from server_util import post, running_server, wait_idle, wait_until

API_KEY = "dash-key"
MODEL = "smol-dash"
# About 50 tokens: three full blocks of 16 that every prompt starting with it shares.
SHARED_PREFIX = ("You are a careful assistant for engineers who run language models in production. Answer briefly "
                 "and precisely, prefer concrete numbers to adjectives, and say so when you do not know. Keep "
                 "every answer under two sentences. The question follows. ")
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(loaded_model):
    from pagedkv.server import build_app

    args = EngineArgs(device="cpu", dtype="float32", kv_cache_memory=64 << 20, max_model_len=512, max_num_seqs=16,
                      enable_prefix_caching=True)
    app = build_app(args, served_model_names=[MODEL], api_key=API_KEY, loaded=loaded_model)
    with running_server(app) as srv:
        yield srv


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def complete(server, prompt: str, max_tokens: int) -> None:
    r = post(server.url, {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                          "ignore_eos": True}, headers=auth())
    assert r.status_code == 200, r.text


def snapshot(server) -> dict:
    r = httpx.get(server.url + "/dashboard/snapshot", headers=auth(), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


# --- the routes ---------------------------------------------------------------------------------------------------

def test_routes_want_the_api_key(server):
    for path in ("/dashboard", "/dashboard/snapshot", "/dashboard/stream"):
        assert httpx.get(server.url + path).status_code == 401, path
        assert httpx.get(server.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
    page = httpx.get(server.url + "/dashboard", headers=auth())
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'data-mode="live"' in page.text and 'id="blocks-shared"' in page.text
    # A browser navigation carries the key in the URL; only the page takes it there.
    assert httpx.get(server.url + "/dashboard", params={"api_key": API_KEY}).status_code == 200
    assert httpx.get(server.url + "/dashboard", params={"api_key": "wrong"}).status_code == 401
    assert httpx.get(server.url + "/dashboard/snapshot", params={"api_key": API_KEY}).status_code == 401


def test_page_is_self_contained():
    """No script, style or font from elsewhere: the page works on a machine without internet."""
    from pagedkv.server.dashboard import page_html

    html = page_html("live", 0.5)
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "") and "https://" not in html
    assert "<script src" not in html and "<link" not in html


def test_idle_snapshot_matches_inspect_and_metrics(server):
    question = SHARED_PREFIX + "What is two plus two?"
    complete(server, question, 4)
    complete(server, question, 4)  # the same prompt again: its full blocks come from the prefix cache
    wait_idle(server)
    snap = snapshot(server)
    inspect = server.async_engine.inspect()
    assert snap["version"] == 1 and snap["num_blocks"] == server.async_engine.stats.num_gpu_blocks
    arrays = decode_blocks(snap["blocks"])
    assert all(a.size == snap["num_blocks"] for a in arrays.values())
    counts = np.bincount(arrays["state"], minlength=4)
    assert {k: int(counts[i]) for i, k in enumerate(("free", "used", "shared", "cached"))} == snap["counts"]
    # Idle: nothing held, as inspect() and /metrics say; the finished prompts' full blocks stay findable.
    assert snap["counts"]["used"] + snap["counts"]["shared"] == inspect["used_blocks"] == 0
    assert snap["seqs"] == [] and inspect["block_manager_seqs"] == []
    assert snap["queues"] == {"running": 0, "waiting": 0, "swapped": 0} and inspect["waiting"] == 0
    assert snap["counts"]["cached"] >= 2
    cached = arrays["state"] == BLOCK_CACHED
    assert (arrays["hash"][cached] != 0).all() and (arrays["ref"][cached] == 0).all()
    assert (arrays["hash"][arrays["state"] == BLOCK_FREE] == 0).all()
    stats = snap["stats"]
    assert stats["prefix_cache_hits"] == metric(server, "vllm:prefix_cache_hits_total") > 0
    assert stats["prefix_cache_queries"] == metric(server, "vllm:prefix_cache_queries_total")
    assert stats["generation_tokens"] == metric(server, "vllm:generation_tokens_total")
    assert stats["kv_cache_usage"] == metric(server, "vllm:kv_cache_usage_perc") == 0


def _stream_events(server, seconds: float) -> list[dict]:
    events = []
    deadline = time.monotonic() + seconds
    with httpx.stream("GET", server.url + "/dashboard/stream", headers=auth(), timeout=10) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
            if time.monotonic() > deadline:
                break
    return events


def test_stream_sends_snapshots_and_stops_when_nobody_listens(server):
    broadcaster = server.app.state.dashboard
    events = _stream_events(server, 1.4)
    assert len(events) >= 2, len(events)
    assert all(e["version"] == 1 for e in events)
    times = [e["time"] for e in events]
    assert times == sorted(times) and all(b - a >= 0.4 for a, b in zip(times, times[1:], strict=False))
    wait_until(lambda: broadcaster.num_listeners == 0, 5, "the stream's listener to leave")
    taken = broadcaster.num_taken
    time.sleep(1.2)
    assert broadcaster.num_taken <= taken + 1  # at most the one in flight when the client left: then none


def test_running_request_table_is_the_engines(server, loaded_model):
    """While a request decodes, its table in the snapshot is what the block manager holds for it."""
    prompt = SHARED_PREFIX + "Count slowly from one to one hundred."
    prompt_len = len(loaded_model.tokenizer.encode(prompt))
    done = threading.Thread(target=complete, args=(server, prompt, 40))
    done.start()
    try:
        wait_until(lambda: snapshot(server)["seqs"], 30, "the request to hold blocks")
        snap = snapshot(server)
    finally:
        done.join(60)
    (seq,) = snap["seqs"]
    bs = snap["block_size"]
    assert seq["status"] == "running" and seq["prompt_tokens"] == prompt_len
    assert seq["cached_tokens"] % bs == 0 and seq["cached_tokens"] >= bs  # the shared prefix's full blocks
    assert len(seq["table"]) == math.ceil(seq["num_tokens"] / bs)
    assert seq["num_tokens"] in (prompt_len + seq["output_tokens"] - 1, prompt_len + seq["output_tokens"])
    state = decode_blocks(snap["blocks"])["state"]
    assert set(state[seq["table"]].tolist()) <= {BLOCK_USED, BLOCK_SHARED}
    assert len(set(seq["table"])) == len(seq["table"])
    assert snap["counts"]["used"] + snap["counts"]["shared"] == len(seq["table"])
    assert snap["queues"]["running"] == 1


def test_engine_snapshot_tables_equal_the_block_manager(loaded_model):
    """Between steps of an engine in this thread: every table equals BlockManager.get_block_table, and
    shared blocks are exactly those two tables hold."""
    from pagedkv import LLM, SamplingParams

    llm = LLM(loaded_model=loaded_model, kv_cache_memory=32 << 20, max_model_len=256, enable_prefix_caching=True)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = SHARED_PREFIX + "Name a colour."
    engine.add_request("a", prompt, params)
    for _ in range(3):
        engine.step()
    engine.add_request("b", prompt, params)  # its prefix comes from a's blocks: shared
    for _ in range(3):
        engine.step()
    snap = engine.kv_snapshot()
    bm = engine.block_manager
    assert {s["request_id"] for s in snap["seqs"]} == {"a", "b"}
    for seq in snap["seqs"]:
        assert seq["table"] == bm.get_block_table(seq["seq_id"])
        assert seq["num_tokens"] == bm.get_num_tokens(seq["seq_id"])
    state = decode_blocks(snap["blocks"])["state"]
    a, b = (set(s["table"]) for s in sorted(snap["seqs"], key=lambda s: s["request_id"]))
    assert set(np.flatnonzero(state == BLOCK_SHARED).tolist()) == a & b != set()
    assert snap["counts"]["used"] + snap["counts"]["shared"] == engine.inspect()["used_blocks"]
    while engine.has_unfinished_requests():
        engine.step()


# --- traces ---------------------------------------------------------------------------------------------------------

class FakeEngine:
    """Stands in for an LLMEngine: its snapshot is just its step count."""

    def __init__(self) -> None:
        self.step = 0

    def kv_snapshot(self) -> dict:
        return {"step": self.step}


@pytest.mark.parametrize("name", ["trace.jsonl", "trace.jsonl.gz"])
def test_recorder_keeps_one_snapshot_per_interval_and_the_last(tmp_path, name):
    now = [0.0]
    engine = FakeEngine()
    with KVTraceRecorder(tmp_path / name, interval_s=0.25, clock=lambda: now[0]) as rec:
        for step in range(1, 11):  # a step every 0.1 s: snapshots at 0.1, 0.4, 0.7, 1.0
            engine.step, now[0] = step, step * 0.1
            rec.maybe_record(engine)
        engine.step = 11  # within the interval: skipped now; close() writes the final state
        now[0] = 1.05
        assert not rec.maybe_record(engine)
    assert [s["step"] for s in read_trace(tmp_path / name)] == [1, 4, 7, 10, 11]
    assert rec.num_records == 5
    with KVTraceRecorder(tmp_path / ("empty-" + name)):
        pass  # no step: no snapshot
    assert read_trace(tmp_path / ("empty-" + name)) == []
    assert ((tmp_path / name).read_bytes()[:2] == b"\x1f\x8b") == name.endswith(".gz")


def test_read_trace_drops_a_cut_last_line_and_names_a_bad_one(tmp_path):
    cut = tmp_path / "cut.jsonl"
    cut.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "blo')
    assert [s["step"] for s in read_trace(cut)] == [1, 2]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_trace(bad)
    gz = tmp_path / "cut.jsonl.gz"
    gz.write_bytes(gzip.compress(b'{"step": 1}\n{"step": 2}\n' * 50)[:-12])  # a gzip stream cut short
    assert read_trace(gz)[:2] == [{"step": 1}, {"step": 2}]


def test_generate_kv_trace_records_the_run(loaded_model, tmp_path, monkeypatch, capsys):
    """`pagedkv generate --kv-trace FILE` (on the session's model, its default chat prompts, which share a system
    prompt): snapshots of the run, ending idle."""
    import pagedkv
    from pagedkv import cli

    real_llm = pagedkv.LLM
    monkeypatch.setattr(pagedkv, "LLM", lambda **kw: real_llm(**{**kw, "model": None, "loaded_model": loaded_model}))
    path = tmp_path / "run.jsonl.gz"
    code = cli.main(["generate", "--kv-trace", str(path), "--max-tokens", "8", "--enable-prefix-caching",
                     "--kv-cache-memory", str(32 << 20), "--max-model-len", "512"])
    assert code == 0
    assert f"snapshots in {path}" in capsys.readouterr().out
    trace = read_trace(path)
    assert len(trace) >= 2
    steps = [s["step"] for s in trace]
    assert steps == sorted(steps) and steps[0] == 1
    first, last = trace[0], trace[-1]
    assert len(first["seqs"]) == 4 and first["counts"]["shared"] > 0  # the system prompt's blocks
    assert last["seqs"] == [] and last["counts"]["used"] == last["counts"]["shared"] == 0
    assert last["counts"]["cached"] > 0 and last["stats"]["generation_tokens"] >= 4


def test_kv_trace_needs_the_engine_in_this_process():
    from pagedkv import cli

    class Remote:  # what LLM(engine_core="process") holds: no LLMEngine to hook
        llm_engine = object()

    with pytest.raises(ValueError, match="--engine-core inproc"):
        cli._start_kv_trace(Remote(), "x.jsonl")


def test_kv_view_serves_the_trace(tmp_path):
    from pagedkv.server.dashboard import build_trace_app

    snaps = [{"version": 1, "step": i, "time": 100.0 + i} for i in range(3)]
    with KVTraceRecorder(tmp_path / "t.jsonl") as rec:
        for s in snaps:
            rec.record(s)
    client = TestClient(build_trace_app(read_trace(tmp_path / "t.jsonl")))
    page = client.get("/dashboard")
    assert page.status_code == 200 and 'data-mode="trace"' in page.text and 'id="trace-slider"' in page.text
    assert client.get("/dashboard/trace").json() == snaps
    assert client.get("/dashboard/snapshot").json() == snaps[-1]
    guarded = TestClient(build_trace_app(snaps, api_keys=("k",)))
    assert guarded.get("/dashboard/trace").status_code == 401
    assert guarded.get("/dashboard", params={"api_key": "k"}).status_code == 200
    assert guarded.get("/dashboard/trace", headers={"Authorization": "Bearer k"}).json() == snaps


def test_the_page_ships_in_the_wheel(tmp_path):
    """setup.py's build_py (what a wheel holds) copies the page next to the module that reads it."""
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "-d", str(tmp_path)], cwd=REPO, check=True,
                   capture_output=True)
    assert (tmp_path / "pagedkv" / "server" / "static" / "dashboard.html").is_file()
    assert "python/pagedkv/server/static *.html" in (REPO / "MANIFEST.in").read_text()  # and the sdist
