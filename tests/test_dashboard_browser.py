"""The dashboard in a real browser (headless Chromium via selenium): what the page shows is the engine's state.

A live server (in this process) runs a few long requests that share a
prompt prefix; the page must show the numbers of the snapshot it rendered
(`window.__lastSnapshot`), and that snapshot must be the server's latest or
at most one stream interval older. Then `kv-view` over a trace of that run,
moved with the slider's keys. Screenshots of both views are taken; with
PAGEDKV_UPDATE_SCREENSHOTS=1 they replace docs/dashboard_live.png and
docs/dashboard_trace.png (the README's), else they go to a temporary folder,
so a test run leaves the checkout as it was.

Skips (with the reason) where chromium, chromedriver or selenium are missing;
.ci/run installs them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from pagedkv.config import EngineArgs
from pagedkv.engine.kv_trace import KVTraceRecorder, read_trace
from server_util import bound_socket, running_server, wait_until

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                                reason="chromium/chromedriver not found (apt-get install chromium chromium-driver)")

API_KEY = "browser-key"
MODEL = "smol-browser"
INTERVAL_S = 0.5
DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.fixture
def shots(tmp_path) -> Path:
    """Where screenshots go: docs/ when asked to refresh the README's, else this test's temporary folder."""
    if os.environ.get("PAGEDKV_UPDATE_SCREENSHOTS") == "1":
        DOCS.mkdir(exist_ok=True)
        return DOCS
    return tmp_path
PREFIX = ("You are a careful assistant for engineers who run language models in production. Answer briefly and "
          "precisely, prefer concrete numbers to adjectives, and say so when you do not know. ")
QUESTIONS = ["Describe a paged KV cache.", "Explain prefix caching.", "What is continuous batching?"]


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1200,800", "--hide-scrollbars"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_window_size(1200, 800)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def server(loaded_model):
    from pagedkv.server import build_app
    from pagedkv.server.api_server import ServerOptions

    args = EngineArgs(device="cpu", dtype="float32", kv_cache_memory=48 << 20, max_model_len=512, max_num_seqs=8,
                      enable_prefix_caching=True)
    app = build_app(args, served_model_names=[MODEL], api_key=API_KEY, loaded=loaded_model,
                    options=ServerOptions(dashboard_interval_s=INTERVAL_S))
    with running_server(app) as srv:
        yield srv


def snapshot(server) -> dict:
    r = httpx.get(server.url + "/dashboard/snapshot", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    r.raise_for_status()
    return r.json()


@contextlib.contextmanager
def long_requests(server, max_tokens: int = 400):
    """Streams a few long completions sharing PREFIX; leaving the block closes them (the server aborts them)."""
    stop = threading.Event()

    def run(question: str) -> None:
        body = {"model": MODEL, "prompt": PREFIX + question, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=run, args=(q,), daemon=True) for q in QUESTIONS]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(30)


# One call reads everything the test compares: the numbers shown and the snapshot they came from.
READ_PAGE = """
const t = (id) => document.getElementById(id).textContent;
const tables = [...document.querySelectorAll("table.block-table")].map((el) => ({
  request_id: el.dataset.requestId, seq_id: Number(el.dataset.seqId),
  prompt_tokens: Number(el.dataset.promptTokens), output_tokens: Number(el.dataset.outputTokens),
  cached_tokens: Number(el.dataset.cachedTokens),
  logical: [...el.querySelectorAll("tr.logical td")].map((td) => Number(td.textContent)),
  physical: [...el.querySelectorAll("tr.physical td")].map((td) => Number(td.textContent))}));
const snap = window.__lastSnapshot, prev = window.__prevSnapshot;
return {used: t("blocks-used"), shared: t("blocks-shared"), cached: t("blocks-cached"), free: t("blocks-free"),
        hit: t("hit-rate"), hitTotal: t("hit-rate-total"), usage: t("kv-usage"), running: t("num-running"),
        waiting: t("num-waiting"), step: t("step"), tables,
        snap: snap && {step: snap.step, time: snap.time, counts: snap.counts, stats: snap.stats,
                       queues: snap.queues, seqs: snap.seqs},
        prev: prev && {stats: prev.stats}};
"""


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def expected_hit(snap: dict, prev: dict | None) -> str:
    """The page's per-interval hit rate: hits / queries between the two snapshots it rendered."""
    if prev is None:
        return "–"
    queries = snap["stats"]["prefix_cache_queries"] - prev["stats"]["prefix_cache_queries"]
    hits = snap["stats"]["prefix_cache_hits"] - prev["stats"]["prefix_cache_hits"]
    return pct(hits / queries) if queries > 0 else "–"


def check_page_shows(page: dict) -> None:
    """Every number on the page is the rendered snapshot's."""
    snap = page["snap"]
    counts = snap["counts"]
    assert [page["used"], page["shared"], page["cached"], page["free"]] == [
        str(counts["used"]), str(counts["shared"]), str(counts["cached"]), str(counts["free"])]
    assert page["usage"] == pct(snap["stats"]["kv_cache_usage"])
    assert page["hit"] == expected_hit(snap, page["prev"])
    s = snap["stats"]
    assert page["hitTotal"] == (pct(s["prefix_cache_hits"] / s["prefix_cache_queries"]) if s["prefix_cache_queries"]
                                else "–")
    assert page["running"] == str(snap["queues"]["running"]) and page["waiting"] == str(snap["queues"]["waiting"])
    assert page["step"] == str(snap["step"])
    by_seq = {seq["seq_id"]: seq for seq in snap["seqs"]}
    assert sorted(t["seq_id"] for t in page["tables"]) == sorted(by_seq)
    for table in page["tables"]:
        seq = by_seq[table["seq_id"]]
        assert table["request_id"] == seq["request_id"] and table["physical"] == seq["table"]
        assert table["logical"] == list(range(len(seq["table"])))
        assert [table["prompt_tokens"], table["output_tokens"], table["cached_tokens"]] == [
            seq["prompt_tokens"], seq["output_tokens"], seq["cached_tokens"]]


def test_live_page_shows_the_engines_state(browser, server, shots):
    with long_requests(server):
        wait_until(lambda: snapshot(server)["queues"]["running"] == len(QUESTIONS), 60, "the requests to run")
        browser.get(f"{server.url}/dashboard?api_key={API_KEY}")
        wait_until(lambda: browser.execute_script(
            "return window.__renderCount >= 3 && window.__lastSnapshot.queues.running === arguments[0]",
            len(QUESTIONS)), 30, "the page to render the running requests")
        page = browser.execute_script(READ_PAGE)
        server_snap = snapshot(server)  # right after reading the page
        check_page_shows(page)
        snap = page["snap"]
        # The page is at most one snapshot behind the server (a snapshot every INTERVAL_S seconds).
        assert snap["step"] <= server_snap["step"]
        assert server_snap["time"] - snap["time"] < 2 * INTERVAL_S + 1.0
        # The shared prefix: its full blocks are held by every request, in both snapshots alike.
        assert snap["counts"]["shared"] > 0 and snap["counts"]["shared"] == server_snap["counts"]["shared"]
        assert snap["counts"]["cached"] == server_snap["counts"]["cached"]
        held = lambda c: c["used"] + c["shared"]  # noqa: E731
        assert held(server_snap["counts"]) >= held(snap["counts"])  # decoding only adds blocks
        # A request's table then is a prefix of its table now (tables only grow while it decodes).
        now = {s["seq_id"]: s["table"] for s in server_snap["seqs"]}
        for table in page["tables"]:
            assert now[table["seq_id"]][:len(table["physical"])] == table["physical"]
        # A few seconds more for the charts to draw a line (the screenshot), then hovering a shared block
        # names its owners.
        wait_until(lambda: browser.execute_script("return window.__renderCount") >= 10, 30, "more snapshots")
        shared_block = page["tables"][0]["physical"][0]
        tip = hover_block(browser, shared_block)
        assert f"block {shared_block} · shared" in tip and tip.count("cmpl-") == len(QUESTIONS)
        browser.save_screenshot(str(shots / "dashboard_live.png"))


def hover_block(browser, block: int) -> str:
    """Moves the mouse over `block` in the pool's grid; returns the tooltip's text."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    canvas = browser.find_element(By.ID, "pool")
    cell, cols = browser.execute_script("return [pool.cell, pool.cols]")
    rect = canvas.rect
    x = (block % cols) * cell + cell // 2 - rect["width"] / 2
    y = (block // cols) * cell + cell // 2 - rect["height"] / 2
    ActionChains(browser).move_to_element_with_offset(canvas, int(x), int(y)).perform()
    tip = browser.find_element(By.ID, "block-tooltip")
    wait_until(lambda: tip.is_displayed(), 5, "the tooltip")
    return tip.text


@contextlib.contextmanager
def serving(app):
    """Serves a plain ASGI app (kv-view's) on a free loopback port in a thread."""
    import uvicorn

    sock = bound_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "kv-view to start")
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_kv_view_slider_walks_the_trace(browser, server, tmp_path, shots):
    from pagedkv.server.dashboard import build_trace_app
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    path = tmp_path / "run.jsonl.gz"
    with KVTraceRecorder(path) as rec, long_requests(server, max_tokens=64):
        rec.record(snapshot(server))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the run from the server's snapshots, until it ends
            time.sleep(0.25)
            rec.record(snap := snapshot(server))
            if rec.num_records > 4 and not snap["seqs"]:
                break
    trace = read_trace(path)
    assert len(trace) >= 5
    with serving(build_trace_app(trace)) as url:
        browser.get(url + "/dashboard")
        wait_until(lambda: browser.execute_script("return window.__traceIndex") == len(trace) - 1, 30,
                   "the trace to load")
        slider = browser.find_element(By.ID, "trace-slider")
        slider.send_keys(Keys.HOME)
        for _ in range(2):
            slider.send_keys(Keys.ARROW_RIGHT)
        assert browser.execute_script("return window.__traceIndex") == 2
        page = browser.execute_script(READ_PAGE)
        assert page["snap"]["step"] == trace[2]["step"]
        check_page_shows(page)
        assert browser.find_element(By.ID, "trace-position").text.startswith(f"snapshot 3 of {len(trace)}")
        browser.save_screenshot(str(shots / "dashboard_trace.png"))
