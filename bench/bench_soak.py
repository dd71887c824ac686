"""Soak test of `pagedkv serve`: thousands of mixed requests (some hostile, some dropped), memory before and after.

Starts `python3 -m pagedkv.cli serve` on 127.0.0.1 (a free port, loopback only) with a small KV cache
(--kv-cache-memory, default 256 MiB), --max-model-len 512, --max-num-seqs 32, prefix caching and an API
key, waits for GET /health, warms it up, and records a START snapshot: the server's RSS (VmRSS of the
process and its children, from /proc), and from GET /metrics the KV blocks in the pool, the blocks in use
(vllm:kv_cache_usage_perc x vllm:num_gpu_blocks), running and waiting requests, plus a greedy "canary"
completion. Then it sends --num-requests requests from --concurrency clients (stopping early after
--max-seconds), each of a kind drawn from a seeded mix:

  normal    completions, chat completions, streamed ones (read to `data: [DONE]`), stop strings with
            logprobs, and a shared ~100-token prefix (prefix caching): each expects 200;
  dropped   a stream closed by its client after the first data line, and a 200-token request whose client
            gives up after 0.3 s: the server must abort them and free their blocks (counted as dropped);
  hostile   out-of-range or malformed fields, a lone surrogate, NaN / Infinity, a 10000-deep JSON body, a
            64 MiB body, 10000 stop strings, a wrong or missing API key: each expects its 4xx, never a 5xx.

Every answer is classified against what its kind expects: expected, an unexpected 4xx, a 5xx (an error
event inside a 200 stream whose type is server_error counts as one), other (e.g. a 200 where a 4xx was
due, or a stream without [DONE]), dropped, or a transport error. When the requests are done it waits for
0 running and 0 waiting, takes the END snapshot and the canary again, checks GET /health, and stops the
server (SIGTERM, then SIGKILL after --stop-timeout), reporting its exit code.

PASS when there was no 5xx, the canary's text is unchanged, no KV block is in use at the end, and the
server still answered GET /health with 200 at the end. Exit status 0 on PASS, 1 otherwise.

Usage:
    python3 bench/bench_soak.py [--num-requests 2000] [--concurrency 16] [--max-seconds 900] [--seed 0]
        [--model DIR] [--out soak.md] [--json soak.json]
    python3 bench/bench_soak.py --num-requests 150 --concurrency 8 --out /tmp/soak.md --json /tmp/soak.json
Stdout is the markdown report; progress goes to stderr. The server's log is kept in a temp file (its path
is in the report).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from bench_common import cpu_model, header_lines, machine_info, markdown_table
from prometheus_client.parser import text_string_to_metric_families

HOST = "127.0.0.1"  # loopback only: the soak never listens on, or talks to, any other address
API_KEY = "soak-key"
MODEL_NAME = "soak"
MiB = 1 << 20
CANARY = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
CATEGORIES = ("expected", "unexpected_4xx", "5xx", "other", "dropped", "transport")
MAX_EXAMPLES = 20
BIG_BODY_BYTES = 64 * MiB


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- the server -----------------------------------------------------------------------------------------------

def free_port() -> int:
    """A port the kernel says is free on the loopback (bound to port 0, then released for the server)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_command(args: argparse.Namespace, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "pagedkv.cli", "serve"]
    if args.model:
        cmd += ["--model", args.model]
    return cmd + ["--host", HOST, "--port", str(port), "--kv-cache-memory", str(args.kv_cache_memory),
                  "--max-model-len", "512", "--max-num-seqs", "32", "--enable-prefix-caching",
                  "--served-model-name", MODEL_NAME, "--api-key", API_KEY, "--uvicorn-log-level", "warning"]


class SoakServer:
    """`pagedkv serve` as a subprocess logging to a kept temp file; stop() sends SIGTERM, then SIGKILL."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.port = free_port()
        self.base_url = f"http://{HOST}:{self.port}"
        cmd = server_command(args, self.port)
        fd, path = tempfile.mkstemp(prefix="pagedkv-soak-", suffix=".log")
        self.log_path = Path(path)
        self._log = open(fd, "w")  # noqa: SIM115 (closed in stop())
        log(f"starting {' '.join(cmd)} (log: {self.log_path})")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.started = time.monotonic()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            return httpx.get(self.base_url + "/health", timeout=10.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout_s: float) -> float:
        """Polls GET /health; returns the start-up time in seconds."""
        while time.monotonic() < self.started + timeout_s:
            if not self.alive():
                raise RuntimeError(f"the server exited with code {self.proc.returncode} while starting")
            if self.healthy():
                return time.monotonic() - self.started
            time.sleep(1.0)
        raise TimeoutError(f"no healthy server after {timeout_s:.0f} s")

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM, then SIGKILL if it is still running after timeout_s; returns the exit code."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log(f"the server ignored SIGTERM for {timeout_s:.0f} s: SIGKILL")
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


# --- snapshots: RSS from /proc, KV blocks from /metrics ---------------------------------------------------------

def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc/<pid>/task/*/children (one file per thread)."""
    out: list[int] = []
    for f in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [int(c) for c in f.read_text().split()]
        except OSError:
            continue  # the thread exited meanwhile
    return out


def vm_rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0  # exited (or a zombie: no VmRSS line)


def tree_rss_mib(pid: int) -> tuple[float, int]:
    """VmRSS of `pid` and all its descendants (MiB), and how many processes that is."""
    todo, seen, kib = [pid], set(), 0
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        kib += vm_rss_kib(p)
        todo += child_pids(p)
    return kib / 1024, len(seen)


def scrape_metrics(base_url: str) -> dict[str, float]:
    """The vllm:* gauges of GET /metrics (the soak's server has one model, so one sample per gauge)."""
    text = httpx.get(base_url + "/metrics", timeout=10.0).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model_name", MODEL_NAME) == MODEL_NAME:
                values.setdefault(sample.name, sample.value)
    return values


def kv_state(base_url: str) -> dict[str, Any]:
    """Total / used / free KV blocks (used = round(usage x total)), running and waiting requests."""
    m = scrape_metrics(base_url)
    total = int(m["vllm:num_gpu_blocks"])
    used = round(m["vllm:kv_cache_usage_perc"] * total)
    return {"total_blocks": total, "used_blocks": used, "free_blocks": total - used,
            "running": int(m["vllm:num_requests_running"]), "waiting": int(m["vllm:num_requests_waiting"])}


def snapshot(server: SoakServer, tries: int = 10) -> dict[str, Any]:
    """RSS and KV state. The engine gauges appear in /metrics only once the engine thread has published its first
    stats, so a missing gauge is retried for a few seconds."""
    rss, procs = tree_rss_mib(server.proc.pid)
    snap: dict[str, Any] = {"rss_mib": round(rss, 1), "processes": procs}
    for attempt in range(tries):
        try:
            return snap | kv_state(server.base_url)
        except (httpx.HTTPError, KeyError, ValueError) as e:
            snap["metrics_error"] = f"{type(e).__name__}: {e}"
            if attempt + 1 < tries:
                time.sleep(1.0)
    return snap


def canary(base_url: str) -> str | None:
    """The greedy canary's text (None when it fails): it must not change across the soak."""
    try:
        r = httpx.post(base_url + "/v1/completions", json=CANARY, headers=auth_headers(API_KEY), timeout=120.0)
        r.raise_for_status()
        return r.json()["choices"][0]["text"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        log(f"canary failed: {type(e).__name__}: {e}")
        return None


def wait_idle(base_url: str, timeout_s: float) -> tuple[bool, float]:
    """Waits for 0 running and 0 waiting in /metrics; returns (idle, seconds waited)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            s = kv_state(base_url)
            if s["running"] == 0 and s["waiting"] == 0:
                return True, time.monotonic() - start
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.5)
    return False, time.monotonic() - start


# --- request kinds ------------------------------------------------------------------------------------------------

PROMPTS = ["The capital of France is", "Write a haiku about paged memory.", "List three prime numbers:",
           "Explain in one sentence why a KV cache speeds up text generation.", "Once upon a time",
           "The best way to learn a language is", "def fibonacci(n):", "Translate to French: good morning",
           "Q: What is 12 times 7?\nA:", "A short poem about the sea:"]
# ~100 tokens shared by every "shared_prefix" request, so that prefix caching has whole blocks to reuse.
SHARED_PREFIX = ("You are a careful assistant for the operators of a large language model serving cluster. "
                 "The cluster runs many replicas behind a load balancer, each with a paged key-value cache, "
                 "continuous batching and prefix caching. Operators ask short questions about capacity, "
                 "latency, memory and failures. Answer in one short sentence, give numbers where you can, "
                 "and say so plainly when you do not know the answer. Never invent metrics or logs.\n\n")
QUESTIONS = ["How many blocks does a 512-token request use?", "Why did latency go up?", "Is the cache full?",
             "What does preemption cost?", "How do I read the metrics?", "Why is the first token slow?"]


@dataclass(slots=True)
class Spec:
    """One request to send: the route, the raw body, the statuses that count as expected, how to send it."""

    kind: str
    body: bytes
    path: str = "/v1/completions"
    expect: frozenset[int] = frozenset({200})
    mode: str = "plain"  # plain | stream | drop_stream (close after one data line) | drop_timeout (0.3 s)
    api_key: str | None = API_KEY  # None: no Authorization header


def raw(body: dict[str, Any]) -> bytes:
    """The body as JSON bytes. Python's json writes NaN / Infinity and \\ud800 escapes (ensure_ascii), which
    httpx's json= refuses; every request is sent as these bytes, so hostile and normal ones go the same way."""
    return json.dumps(body).encode()


def sampling(rng: random.Random) -> dict[str, Any]:
    """Greedy, or temperature 0.8 with top_p / top_k and a seed."""
    if rng.random() < 0.5:
        return {"temperature": 0}
    return {"temperature": 0.8, "top_p": 0.9, "top_k": rng.choice([20, 50]), "seed": rng.randrange(1 << 31)}


def prompt(rng: random.Random) -> str:
    p = rng.choice(PROMPTS)
    return p if rng.random() < 0.5 else f"{p} ({rng.randrange(10000)})"  # some repeats hit the prefix cache


def completion(rng: random.Random, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": prompt(rng), "max_tokens": rng.randint(1, 16), **sampling(rng), **extra}


def chat(rng: random.Random, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt(rng)}],
            "max_completion_tokens": rng.randint(1, 16), **sampling(rng), **extra}


def k_completion(rng: random.Random) -> Spec:
    return Spec("completion", raw(completion(rng)))


def k_chat(rng: random.Random) -> Spec:
    return Spec("chat", raw(chat(rng)), path="/v1/chat/completions")


def k_stream_completion(rng: random.Random) -> Spec:
    body = completion(rng, stream=True, stream_options={"include_usage": True})
    return Spec("stream_completion", raw(body), mode="stream")


def k_stream_chat(rng: random.Random) -> Spec:
    return Spec("stream_chat", raw(chat(rng, stream=True)), path="/v1/chat/completions", mode="stream")


def k_stop_logprobs(rng: random.Random) -> Spec:
    return Spec("stop_logprobs", raw(completion(rng, stop=["\n", "."], logprobs=2)))


def k_shared_prefix(rng: random.Random) -> Spec:
    text = f"{SHARED_PREFIX}Question {rng.randrange(1000)}: {rng.choice(QUESTIONS)}\nAnswer:"
    return Spec("shared_prefix", raw({"model": MODEL_NAME, "prompt": text, "max_tokens": rng.randint(1, 8),
                                      "temperature": 0}))


def k_drop_stream(rng: random.Random) -> Spec:
    body = completion(rng, stream=True, ignore_eos=True) | {"max_tokens": 64}
    return Spec("drop_stream", raw(body), mode="drop_stream")


def k_drop_timeout(rng: random.Random) -> Spec:
    body = completion(rng, ignore_eos=True) | {"max_tokens": 200}
    return Spec("drop_timeout", raw(body), mode="drop_timeout")


def hostile_body(**fields: Any) -> bytes:
    """A small, otherwise valid completion with the hostile fields: cheap for the server if it accepts it."""
    return raw({"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, **fields})


def nested_body(depth: int = 10000) -> bytes:
    # Written by hand: json.dumps itself would hit the recursion limit on it.
    return b'{"model": "soak", "max_tokens": 4, "prompt": ' + b"[" * depth + b"]" * depth + b"}"


@functools.cache
def big_body() -> bytes:
    """Exactly 64 MiB: a valid tiny request padded with an unknown field (cheap if the server accepts it)."""
    head, tail = b'{"model": "soak", "prompt": "hi", "max_tokens": 1, "padding": "', b'"}'
    return head + b"a" * (BIG_BODY_BYTES - len(head) - len(tail)) + tail


# Hostile requests: (kind, body builder, route, expected statuses, API key). Range and type errors come back as a
# 400 naming the field (protocol.py); a body over the server's limit as a 413; a bad or missing key as a 401.
BAD_REQUEST = frozenset({400})
HOSTILE: list[tuple[str, Callable[[], bytes], str, frozenset[int], str | None]] = [
    ("hostile_top_k_1e9", lambda: hostile_body(top_k=10**9), "/v1/completions", BAD_REQUEST, API_KEY),
    ("hostile_stop_token_2^70", lambda: hostile_body(stop_token_ids=[2**70], min_tokens=2), "/v1/completions",
     BAD_REQUEST, API_KEY),
    ("hostile_stop_token_1e7", lambda: hostile_body(stop_token_ids=[10**7], min_tokens=2), "/v1/completions",
     BAD_REQUEST, API_KEY),
    ("hostile_lone_surrogate", lambda: hostile_body(prompt="a\ud800b"), "/v1/completions", BAD_REQUEST, API_KEY),
    ("hostile_temperature_inf", lambda: hostile_body(temperature=float("inf")), "/v1/completions", BAD_REQUEST,
     API_KEY),
    ("hostile_top_p_nan", lambda: hostile_body(top_p=float("nan")), "/v1/completions", BAD_REQUEST, API_KEY),
    ("hostile_seed_2^64", lambda: hostile_body(seed=2**64), "/v1/completions", BAD_REQUEST, API_KEY),
    ("hostile_logprobs_100", lambda: hostile_body(logprobs=100), "/v1/completions", BAD_REQUEST, API_KEY),
    ("hostile_n_10000", lambda: hostile_body(n=10000), "/v1/completions", BAD_REQUEST, API_KEY),
    ("hostile_max_tokens_1e9", lambda: hostile_body(max_tokens=10**9), "/v1/completions", BAD_REQUEST, API_KEY),
    ("hostile_token_id_1e9", lambda: hostile_body(prompt=[1, 10**9]), "/v1/completions", BAD_REQUEST, API_KEY),
    ("hostile_empty_cache_salt", lambda: hostile_body(cache_salt=""), "/v1/completions", BAD_REQUEST, API_KEY),
    ("hostile_nested_10000", nested_body, "/v1/completions", frozenset({400, 413}), API_KEY),
    ("hostile_body_64MiB", big_body, "/v1/completions", frozenset({413}), API_KEY),
    ("hostile_10000_stops", lambda: hostile_body(stop=[f"zq{i}" for i in range(10000)]), "/v1/completions",
     BAD_REQUEST, API_KEY),
    ("hostile_wrong_api_key", lambda: hostile_body(), "/v1/completions", frozenset({401}), "wrong-key"),
    ("hostile_detokenize_1e9", lambda: raw({"tokens": [10**9]}), "/detokenize", BAD_REQUEST, API_KEY),
    ("hostile_tokenize_no_key", lambda: raw({"prompt": "Hello"}), "/tokenize", frozenset({401}), None),
]


def hostile_kind(kind: str, build: Callable[[], bytes], path: str, expect: frozenset[int],
                 key: str | None) -> Callable[[random.Random], Spec]:
    return lambda _rng: Spec(kind, build(), path=path, expect=expect, api_key=key)


# (weight, builder) of the mix: ~60% normal, ~8% dropped, ~32% hostile (the 64 MiB body is rarer).
MIX: list[tuple[float, Callable[[random.Random], Spec]]] = [
    (14, k_completion), (10, k_chat), (6, k_stream_completion), (5, k_stream_chat), (6, k_stop_logprobs),
    (10, k_shared_prefix), (4, k_drop_stream), (3, k_drop_timeout),
] + [(1 if h[0] == "hostile_body_64MiB" else 2, hostile_kind(*h)) for h in HOSTILE]
KIND_ORDER = ["completion", "chat", "stream_completion", "stream_chat", "stop_logprobs", "shared_prefix",
              "drop_stream", "drop_timeout"] + [h[0] for h in HOSTILE]


def plan(num: int, seed: int) -> list[Spec]:
    """The seeded sequence of requests (the same for the same --seed and --num-requests)."""
    rng = random.Random(seed)
    weights = [w for w, _ in MIX]
    return [rng.choices(MIX, weights)[0][1](rng) for _ in range(num)]


def expects_label(spec: Spec) -> str:
    if spec.mode.startswith("drop"):
        return "drop"
    return "/".join(str(s) for s in sorted(spec.expect))


# --- sending and classifying ----------------------------------------------------------------------------------

@dataclass(slots=True)
class Outcome:
    kind: str
    category: str
    status: int | None = None
    detail: str = ""


def auth_headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def classify(spec: Spec, status: int) -> str:
    if status in spec.expect:
        return "expected"
    if status >= 500:
        return "5xx"
    return "unexpected_4xx" if 400 <= status < 500 else "other"


def check_body(spec: Spec, status: int, body: bytes) -> Outcome:
    """A whole response: its status against the kind's; an expected 200 must also be a JSON body with choices."""
    category = classify(spec, status)
    detail = body[:200].decode(errors="replace")
    if category == "expected" and status == 200 and spec.path.startswith("/v1"):
        try:
            json.loads(body)["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            return Outcome(spec.kind, "other", status, f"200 without choices: {detail}")
    return Outcome(spec.kind, category, status, detail if category != "expected" else "")


def stream_event(spec: Spec, data: str) -> Outcome | None:
    """An SSE data line: an error event ends the request (a server_error one counts as a 5xx)."""
    try:
        event = json.loads(data)
    except ValueError:
        return Outcome(spec.kind, "other", 200, f"bad SSE data: {data[:200]}")
    error = event.get("error") if isinstance(event, dict) else None
    if error is None:
        return None
    category = "5xx" if isinstance(error, dict) and error.get("type") == "server_error" else "other"
    return Outcome(spec.kind, category, 200, f"error event in the stream: {data[:200]}")


async def send_stream(client: httpx.AsyncClient, spec: Spec, url: str, headers: dict) -> Outcome:
    """A streamed request read to `data: [DONE]` (drop_stream: closed by us after its first data line)."""
    async with client.stream("POST", url, content=spec.body, headers=headers) as r:
        if r.status_code != 200:
            return check_body(spec, r.status_code, await r.aread())
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if spec.mode == "drop_stream":  # leaving the block with the body unread closes the connection
                return Outcome(spec.kind, "dropped", 200)
            data = line[len("data: "):]
            if data == "[DONE]":
                return Outcome(spec.kind, classify(spec, 200), 200)
            bad = stream_event(spec, data)
            if bad is not None:
                return bad
    return Outcome(spec.kind, "other", 200, "the stream ended without data: [DONE]")


async def send(client: httpx.AsyncClient, base_url: str, spec: Spec, timeout_s: float) -> Outcome:
    url = base_url + spec.path
    headers = {"Content-Type": "application/json", **auth_headers(spec.api_key)}
    try:
        if spec.mode in ("stream", "drop_stream"):
            return await send_stream(client, spec, url, headers)
        # drop_timeout: the client gives up after 0.3 s, long before 200 tokens are generated.
        timeout = 0.3 if spec.mode == "drop_timeout" else timeout_s
        r = await client.post(url, content=spec.body, headers=headers, timeout=timeout)
        return check_body(spec, r.status_code, r.content)
    except httpx.ReadTimeout as e:
        if spec.mode == "drop_timeout":
            return Outcome(spec.kind, "dropped")
        return Outcome(spec.kind, "transport", None, f"{type(e).__name__}: {e}")
    except httpx.HTTPError as e:  # connect / read / write errors, a protocol error, a pool timeout
        return Outcome(spec.kind, "transport", None, f"{type(e).__name__}: {e}"[:200])


async def run_soak(server: SoakServer, specs: list[Spec], args: argparse.Namespace,
                   timeline: list[tuple[int, float]] | None = None) -> tuple[list[Outcome], float]:
    """--concurrency workers take the next spec until all are sent, --max-seconds pass, or the server exits.

    timeline: gets (requests done, server RSS MiB) at every tenth of the run, to tell warm-up from a leak.
    """
    outcomes: list[Outcome] = []
    queue = iter(specs)
    big = asyncio.Semaphore(1)  # one 64 MiB body in flight at a time: bounds the memory both sides spend on them
    start = time.monotonic()
    deadline = start + args.max_seconds
    step = max(1, len(specs) // 10)
    # More connections than workers, so a request never waits for the pool (a 0.3 s timeout would count that).
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout, connect=30.0), limits=limits) as client:

        async def worker() -> None:
            for spec in queue:
                if time.monotonic() > deadline or not server.alive():
                    return
                if spec.kind == "hostile_body_64MiB":
                    async with big:
                        outcomes.append(await send(client, server.base_url, spec, args.request_timeout))
                else:
                    outcomes.append(await send(client, server.base_url, spec, args.request_timeout))
                if len(outcomes) % step == 0:
                    log(f"  {len(outcomes)}/{len(specs)} requests done ({time.monotonic() - start:.0f} s)")
                    if timeline is not None:
                        timeline.append((len(outcomes), round(tree_rss_mib(server.proc.pid)[0], 1)))

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return outcomes, time.monotonic() - start


def tally(outcomes: list[Outcome], specs: list[Spec]) -> dict[str, dict[str, Any]]:
    """Per kind: what it expects, how many were sent, and the count of each category."""
    labels = {s.kind: expects_label(s) for s in specs}
    table = {k: {"expects": labels.get(k, ""), "sent": 0, **dict.fromkeys(CATEGORIES, 0)}
             for k in KIND_ORDER if k in labels}
    for o in outcomes:
        table[o.kind]["sent"] += 1
        table[o.kind][o.category] += 1
    return table


def examples(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """Up to MAX_EXAMPLES unexpected results, one per (kind, category, status) first, so rare kinds show."""
    bad = [o for o in outcomes if o.category not in ("expected", "dropped")]
    seen, first, rest = set(), [], []
    for o in bad:
        key = (o.kind, o.category, o.status)
        (rest if key in seen else first).append(o)
        seen.add(key)
    return [{"kind": o.kind, "category": o.category, "status": o.status, "body": o.detail}
            for o in (first + rest)[:MAX_EXAMPLES]]


# --- one soak -------------------------------------------------------------------------------------------------------

def warm_up(server: SoakServer, rng: random.Random) -> int | None:
    """A few normal requests (not counted); returns the shared prefix's token count (from POST /tokenize)."""
    specs = [k_completion(rng), k_chat(rng), k_stream_completion(rng), k_shared_prefix(rng)]
    args = argparse.Namespace(concurrency=2, max_seconds=300, request_timeout=120.0)
    outcomes, _ = asyncio.run(run_soak(server, specs, args))
    log(f"warm-up: {sum(o.category == 'expected' for o in outcomes)}/{len(specs)} as expected")
    try:
        r = httpx.post(server.base_url + "/tokenize", json={"prompt": SHARED_PREFIX},
                       headers=auth_headers(API_KEY), timeout=30.0)
        return r.json()["count"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def soak(server: SoakServer, args: argparse.Namespace) -> dict[str, Any]:
    """Warm-up, START snapshot, the requests, drain, END snapshot; the numbers the report needs."""
    res: dict[str, Any] = {"shared_prefix_tokens": warm_up(server, random.Random(args.seed + 1))}
    res["start"], res["canary_start"] = snapshot(server), canary(server.base_url)
    log(f"START: {res['start']}; canary {res['canary_start']!r}")
    specs = plan(args.num_requests, args.seed)
    log(f"sending {len(specs)} requests, {args.concurrency} at a time (at most {args.max_seconds:.0f} s) ...")
    res["rss_timeline"] = []
    outcomes, res["duration_s"] = asyncio.run(run_soak(server, specs, args, res["rss_timeline"]))
    res["sent"], res["kinds"], res["examples"] = len(outcomes), tally(outcomes, specs), examples(outcomes)
    res["idle"], res["drain_s"] = wait_idle(server.base_url, args.drain_timeout)
    time.sleep(2.0)  # let the engine thread publish its last stats and the allocator settle
    res["end"], res["canary_end"] = snapshot(server), canary(server.base_url)
    log(f"END: {res['end']}; canary {res['canary_end']!r}")
    res["alive_at_end"] = server.healthy()
    return res


def totals(res: dict[str, Any]) -> dict[str, int]:
    kinds = res.get("kinds", {})
    return {c: sum(k[c] for k in kinds.values()) for c in ("sent", *CATEGORIES)}


def verdict(res: dict[str, Any]) -> tuple[bool, list[str]]:
    """PASS: no 5xx, the canary unchanged, no block in use at the end, the server healthy at the end."""
    if "error" in res:
        return False, [res["error"]]
    t = totals(res)
    reasons = []
    if t["5xx"]:
        reasons.append(f"{t['5xx']} 5xx answers")
    if res["canary_start"] is None or res["canary_end"] is None:
        reasons.append("the canary request failed")
    elif res["canary_start"] != res["canary_end"]:
        reasons.append("the canary's text changed")
    if res["end"].get("used_blocks") != 0:
        reasons.append(f"{res['end'].get('used_blocks', 'unknown')} KV blocks still in use at the end")
    if not res["alive_at_end"]:
        reasons.append("GET /health was not 200 at the end")
    return not reasons, reasons


# --- report ------------------------------------------------------------------------------------------------------

def ram_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return None


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> dict[str, Any]:
    try:
        info = machine_info()
    except Exception as e:  # noqa: BLE001 (the client must still report if pagedkv is mid-edit and won't import)
        info = {"cpu": cpu_model(), "machine_info_error": repr(e)}
    return info | {"ram_gib": ram_gib(), "git_commit": git_commit()}


def kinds_table(res: dict[str, Any]) -> str:
    header = ["kind", "expects", "sent", "expected", "unexpected 4xx", "5xx", "other", "dropped", "transport errors"]
    rows = [[k, v["expects"], v["sent"], *(v[c] for c in CATEGORIES)] for k, v in res["kinds"].items()]
    t = totals(res)
    rows.append(["**total**", "", t["sent"], *(t[c] for c in CATEGORIES)])
    return markdown_table(header, rows)


def state_table(start: dict[str, Any], end: dict[str, Any]) -> str:
    def blocks(s: dict[str, Any]) -> str:
        return f"{s['free_blocks']} / {s['total_blocks']}" if "total_blocks" in s else "n/a"

    rows = [["RSS (MiB)", start["rss_mib"], end["rss_mib"]],
            ["processes", start["processes"], end["processes"]],
            ["free blocks / total", blocks(start), blocks(end)]]
    rows += [[name, start.get(key, "n/a"), end.get(key, "n/a")]
             for name, key in (("used blocks", "used_blocks"), ("running", "running"), ("waiting", "waiting"))]
    return markdown_table(["", "START", "END"], rows)


def settings_lines(args: argparse.Namespace, res: dict[str, Any]) -> list[str]:
    return ["## Settings", "",
            f"- requests: {args.num_requests} planned, {res.get('sent', 0)} sent; concurrency {args.concurrency}; "
            f"seed {args.seed}; max {args.max_seconds:.0f} s; request timeout {args.request_timeout:.0f} s",
            f"- server: model {args.model or 'built-in default'}, --kv-cache-memory {args.kv_cache_memory} "
            f"({args.kv_cache_memory / MiB:.0f} MiB), --max-model-len 512, --max-num-seqs 32, "
            f"--enable-prefix-caching, on {HOST}",
            f"- shared prefix: {res.get('shared_prefix_tokens', 'n/a')} tokens", ""]


def result_lines(res: dict[str, Any]) -> list[str]:
    start, end = res["start"], res["end"]
    growth = end["rss_mib"] - start["rss_mib"]
    pct = 100 * growth / start["rss_mib"] if start["rss_mib"] else float("nan")
    same = res["canary_start"] is not None and res["canary_start"] == res["canary_end"]
    return ["## Requests", "", kinds_table(res), "",
            "## Server state", "", state_table(start, end), "",
            f"- RSS growth: {growth:+.1f} MiB ({pct:+.1f}%); the KV cache's pages count once first touched",
            *rss_second_half(res),
            f"- duration {res['duration_s']:.1f} s, {res['sent'] / res['duration_s']:.2f} requests/s; "
            f"drained to 0 running / 0 waiting: {'yes' if res['idle'] else 'NO'} after {res['drain_s']:.1f} s",
            f"- canary: START {res['canary_start']!r}, END {res['canary_end']!r}; equal: {'yes' if same else 'no'}",
            f"- server alive at the end (GET /health 200): {'yes' if res['alive_at_end'] else 'no'}"]


def rss_second_half(res: dict[str, Any]) -> list[str]:
    """RSS over the run: a leak keeps growing in the second half, warm-up (pages touched once) does not."""
    timeline = res.get("rss_timeline") or []
    if len(timeline) < 2:
        return []
    half = timeline[len(timeline) // 2 - 1]
    points = ", ".join(f"{n}: {rss}" for n, rss in timeline)
    return [f"- RSS during the run (requests done: MiB): {points}",
            f"- growth over the second half ({half[0]} -> {res['sent']} requests): "
            f"{res['end']['rss_mib'] - half[1]:+.1f} MiB"]


def example_lines(res: dict[str, Any]) -> list[str]:
    if not res.get("examples"):
        return []
    lines = ["", f"## Unexpected results (first {MAX_EXAMPLES}, one per kind and status first)", ""]
    for e in res["examples"]:
        body = e["body"].replace("\n", " ").replace("|", "\\|")
        lines.append(f"- {e['kind']}: {e['category']}, status {e['status']}: `{body}`")
    return lines


def report(args: argparse.Namespace, info: dict[str, Any], res: dict[str, Any]) -> str:
    lines = header_lines("Soak test: pagedkv serve", info) + settings_lines(args, res)
    if "start" in res and "end" in res:
        lines += result_lines(res)
    lines.append(f"- server exit code after SIGTERM: {res.get('exit_code')}; log: {res.get('server_log')}")
    lines += example_lines(res)
    ok, reasons = verdict(res)
    lines += ["", f"**Verdict: {'PASS' if ok else 'FAIL'}**" + ("" if ok else f" ({'; '.join(reasons)})"), ""]
    return "\n".join(lines)


# --- main --------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", help="checkpoint for the server (default: its built-in SmolLM2-135M)")
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (one client each)")
    p.add_argument("--max-seconds", type=float, default=900, help="stop sending new requests after this")
    p.add_argument("--seed", type=int, default=0, help="seeds the mix of request kinds and their fields")
    p.add_argument("--kv-cache-memory", type=int, default=256 * MiB, help="KV-cache bytes of the server")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds a (non-dropped) request may take")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for GET /health")
    p.add_argument("--drain-timeout", type=float, default=120.0, help="seconds to wait for 0 running / waiting")
    p.add_argument("--stop-timeout", type=float, default=60.0, help="seconds from SIGTERM to SIGKILL")
    p.add_argument("--out", help="write the markdown report here")
    p.add_argument("--json", help="write the settings, machine and results here")
    args = p.parse_args(argv)
    if args.num_requests < 1 or args.concurrency < 1:
        p.error("--num-requests and --concurrency must be at least 1")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Starts the server, soaks it, and always stops it (SIGTERM, then SIGKILL), recording its exit code."""
    server = SoakServer(args)
    res: dict[str, Any] = {"server_log": str(server.log_path)}
    try:
        res["startup_s"] = round(server.wait_ready(args.startup_timeout), 1)
        log(f"healthy after {res['startup_s']:.0f} s")
        res |= soak(server, args)
    except (RuntimeError, TimeoutError) as e:
        res["error"] = str(e)
        log(f"{e}; the server's log ends with:\n{server.log_tail()}")
    finally:
        res["exit_code"] = server.stop(args.stop_timeout)
        log(f"server stopped, exit code {res['exit_code']}")
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = machine()
    res = run(args)
    text = report(args, info, res)
    print(text)
    ok, reasons = verdict(res)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        data = {"settings": vars(args), "machine": info, **res, "totals": totals(res),
                "verdict": "PASS" if ok else "FAIL", "verdict_reasons": reasons}
        Path(args.json).write_text(json.dumps(data, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
