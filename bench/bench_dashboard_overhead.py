"""What an open /dashboard costs the engine: step time with the page's stream open vs closed, in one run.

A server in this process (the engine on the server's engine thread, sharing
the interpreter with the HTTP side: the worst case for the page, whose
snapshots are encoded on the same GIL) runs a decode-heavy load: a fixed
number of requests always in flight, each generating `--max-tokens` tokens
after a short prompt. Windows of `--window-s` seconds alternate between the
stream closed and open (a client reading /dashboard/stream, a snapshot every
0.5 s, as the page does), in ABBA order so that a drift in the machine's load
falls on both alike. Per window: wall time per engine step (which includes the
snapshots taken between steps), the forward+sampling time per step, and the
difference (what a step spends outside the model, snapshots included). Each
open window is compared with the closed one beside it (the ratio's median over
pairs), since the machine's load moves more between windows than the page
does. Last, the direct cost: one snapshot's time on the engine thread, times
two a second, as a share of the engine thread's time.

    python3 bench/bench_dashboard_overhead.py --out bench/results/dashboard_overhead_cpu.md
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import header_lines, machine_info, markdown_table  # noqa: E402

API_KEY = "bench-key"
PROMPTS = ["Tell me about the sea.", "Describe a mountain.", "Write about a city at night.", "Explain rain.",
           "Talk about forests.", "Describe a desert.", "Tell me about rivers.", "Explain the seasons."]


def start_server(app) -> tuple[str, threading.Thread]:
    import uvicorn
    from pagedkv.server import serve

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
    thread = threading.Thread(target=serve, args=(app, config), kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while getattr(app.state, "server", None) is None or not app.state.server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", thread


class Load:
    """Keeps `concurrency` completions in flight until stopped."""

    def __init__(self, url: str, concurrency: int, max_tokens: int) -> None:
        self.url, self.max_tokens, self.stop = url, max_tokens, threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(concurrency)]
        for t in self.threads:
            t.start()

    def _client(self, i: int) -> None:
        # Lengths differ per client, so requests end (and new prompts arrive) spread over time, not all at once:
        # the batch stays near `concurrency` decodes in every window.
        body = {"model": "bench", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": self.max_tokens + 16 * i,
                "temperature": 0, "ignore_eos": True}
        with httpx.Client(timeout=600, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
            while not self.stop.is_set():
                client.post(self.url + "/v1/completions", json=body).raise_for_status()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)


class DashboardClient:
    """Reads /dashboard/stream as the page does (and decodes each snapshot), until closed."""

    def __init__(self, url: str) -> None:
        self.url, self.stop, self.snapshots = url, threading.Event(), 0
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with httpx.stream("GET", self.url + "/dashboard/stream", timeout=30,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    json.loads(line[6:])
                    self.snapshots += 1
                if self.stop.is_set():
                    return

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def step_times_since(counters, before: int) -> list[float]:
    """The forward+sampling times of the steps after the `before`-th (read from the engine thread's deque)."""
    for _ in range(10):
        try:
            times = list(counters.step_times)
            return times[len(times) - (counters.num_steps - before):] if counters.num_steps > before else []
        except RuntimeError:  # appended to while copied: try again
            continue
    return []


def measure(engine, seconds: float) -> dict:
    c = engine.counters
    steps0, tokens0, t0 = c.num_steps, c.generation_tokens, time.perf_counter()
    time.sleep(seconds)
    steps, elapsed = c.num_steps - steps0, time.perf_counter() - t0
    forward = step_times_since(c, steps0)
    wall = 1e3 * elapsed / max(steps, 1)
    fwd = 1e3 * statistics.fmean(forward) if forward else float("nan")
    return {"steps": steps, "wall_ms_per_step": wall, "forward_ms_per_step": fwd, "outside_ms_per_step": wall - fwd,
            "tokens_per_s": (c.generation_tokens - tokens0) / elapsed}


def snapshot_ms(engine, n: int = 40) -> float:
    """Median time of one snapshot (build_snapshot: what the engine thread does for the stream), on the idle
    engine: the same pool, called from here since no step runs."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        engine.kv_snapshot()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128, help="the first client's; client i asks 16 i more")
    p.add_argument("--window-s", type=float, default=12.0)
    p.add_argument("--pairs", type=int, default=7, help="closed/open window pairs (ABBA order)")
    p.add_argument("--warmup-s", type=float, default=10.0)
    p.add_argument("--out", default=None, help="markdown report (a .json with the raw windows goes beside it)")
    ns = p.parse_args()

    from pagedkv.config import EngineArgs
    from pagedkv.model.default_model import ensure_default_model
    from pagedkv.server import build_app

    args = EngineArgs(model=str(ensure_default_model()), device="cpu", dtype="float32", kv_cache_memory=512 << 20,
                      max_model_len=1024, max_num_seqs=ns.concurrency, engine_core="inproc")
    app = build_app(args, served_model_names=["bench"], api_key=API_KEY, log_interval_s=1e9)
    engine = app.state.engine
    url, thread = start_server(app)
    info = machine_info()
    load = Load(url, ns.concurrency, ns.max_tokens)
    time.sleep(ns.warmup_s)
    windows = []
    for pair in range(ns.pairs):
        for state in (("closed", "open") if pair % 2 == 0 else ("open", "closed")):
            client = DashboardClient(url) if state == "open" else None
            result = {"state": state, **measure(engine, ns.window_s)}
            if client is not None:
                client.close()
                result["snapshots_read"] = client.snapshots
            windows.append(result)
            print(f"{state:6s} {result['wall_ms_per_step']:.2f} ms/step wall, "
                  f"{result['forward_ms_per_step']:.2f} ms forward, {result['tokens_per_s']:.1f} tok/s", flush=True)
    load.close()
    direct_ms = snapshot_ms(engine)
    app.state.server.should_exit = True
    thread.join(30)

    def summary(key: str, state: str) -> float:
        return statistics.median(w[key] for w in windows if w["state"] == state)

    def paired_change(key: str) -> float:
        """Median over window pairs of open / closed - 1 (each pair: two adjacent windows)."""
        pairs = [(windows[i], windows[i + 1]) for i in range(0, len(windows) - 1, 2)]
        ratios = [(a if a["state"] == "open" else b)[key] / (b if a["state"] == "open" else a)[key] for a, b in pairs]
        return 100 * (statistics.median(ratios) - 1)

    rows = []
    for key, label in (("wall_ms_per_step", "wall time per step (ms)"),
                       ("forward_ms_per_step", "forward + sampling per step (ms)"),
                       ("outside_ms_per_step", "outside the model per step (ms)"),
                       ("tokens_per_s", "generated tokens/s")):
        closed, opened = summary(key, "closed"), summary(key, "open")
        rows.append([label, f"{closed:.2f}", f"{opened:.2f}", f"{paired_change(key):+.1f}%"])
    table = markdown_table(["median over windows", "stream closed", "stream open", "change (paired median)"], rows)
    median_step_ms = summary("wall_ms_per_step", "closed")
    direct = (f"Direct cost: one snapshot takes {direct_ms:.3f} ms on the engine thread; two a second are "
              f"{100 * direct_ms * 2 / 1000:.3f}% of the engine thread's time, i.e. "
              f"{100 * direct_ms * 2 * median_step_ms / 1e6:.4f} ms a step at {median_step_ms:.1f} ms a step.")
    per_window = markdown_table(["window", "state", "steps", "wall ms/step", "forward ms/step", "tok/s",
                                 "snapshots read"],
                                [[i + 1, w["state"], w["steps"], f"{w['wall_ms_per_step']:.2f}",
                                  f"{w['forward_ms_per_step']:.2f}", f"{w['tokens_per_s']:.1f}",
                                  w.get("snapshots_read", "")] for i, w in enumerate(windows)])
    settings = {"concurrency": ns.concurrency, "max_tokens": ns.max_tokens, "window_s": ns.window_s,
                "pairs": ns.pairs, "warmup_s": ns.warmup_s, "dashboard_interval_s": 0.5,
                "num_gpu_blocks": engine.cache_config.num_gpu_blocks, "engine_core": "inproc (server thread)",
                "model": "default (SmolLM2-135M-Instruct), float32"}
    print(table)
    print(direct)
    if ns.out:
        text = "\n".join(header_lines("Dashboard overhead: engine step time, stream open vs closed", info) +
                         [f"- settings: {json.dumps(settings)}", "", table, "", direct, "", "Per window:", "",
                          per_window, ""])
        Path(ns.out).write_text(text)
        Path(ns.out).with_suffix(".json").write_text(json.dumps({"machine": info, "settings": settings,
                                                                 "windows": windows, "snapshot_ms": direct_ms},
                                                                indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
