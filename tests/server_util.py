"""Helpers for tests that run a real `pagedkv serve` app on a loopback port (in this process, in a thread)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import uvicorn


def bound_socket(sndbuf: int | None = None) -> socket.socket:
    """A listening-ready socket on a free loopback port (handed to uvicorn: no race for the port).

    sndbuf: a small send buffer, inherited by accepted connections, so that a client that stops reading
    blocks the server's writes at once (slow-reader tests).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if sndbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def running_server(app, sndbuf: int | None = None) -> Iterator[SimpleNamespace]:
    """Serves `app` with pagedkv's Server (drain, exit status) until the block ends.

    Yields url, app, engine, async_engine, server and result (result.exit_code once it has stopped).
    """
    from pagedkv.server import serve

    sock = bound_socket(sndbuf)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
    result = SimpleNamespace(exit_code=None)

    def run() -> None:
        result.exit_code = serve(app, config, sockets=[sock])

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while getattr(app.state, "server", None) is None or not app.state.server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    port = sock.getsockname()[1]
    ns = SimpleNamespace(url=f"http://127.0.0.1:{port}", port=port, app=app, engine=app.state.engine,
                         async_engine=app.state.async_engine, server=app.state.server, thread=thread, result=result)
    try:
        yield ns
    finally:
        app.state.server.should_exit = True
        thread.join(30)
        sock.close()


@contextlib.contextmanager
def loaded_model_server(loaded_model, model_name: str, api_key: str, max_model_len: int,
                        max_num_seqs: int) -> Iterator[SimpleNamespace]:
    """An fp32 CPU server on a model already in memory (64 MiB of KV cache), with an `openai` client as
    `.client`: what running_server yields, plus that."""
    import openai
    from pagedkv.config import EngineArgs
    from pagedkv.server import build_app

    args = EngineArgs(device="cpu", dtype="float32", kv_cache_memory=64 << 20, max_model_len=max_model_len,
                      max_num_seqs=max_num_seqs)
    app = build_app(args, served_model_names=[model_name], api_key=api_key, loaded=loaded_model)
    with running_server(app) as srv:
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key=api_key, max_retries=0, timeout=120)
        yield srv


def wait_idle(server, timeout: float = 30.0) -> None:
    """Until the engine thread reports no running request and no block in use."""
    deadline = time.monotonic() + timeout
    while True:
        s = server.async_engine.stats
        busy = server.async_engine.has_work or server.async_engine.num_active  # the snapshot may lag a step
        if s.num_used_gpu_blocks == 0 and s.num_running == 0 and s.num_waiting == 0 and not busy:
            return
        assert time.monotonic() < deadline, f"the engine did not become idle: {s}"
        time.sleep(0.05)


def wait_until(predicate, timeout: float = 30.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def post(url: str, body, path: str = "/v1/completions", headers: dict | None = None,
         timeout: float = 60) -> httpx.Response:
    """POSTs `body` (a dict, sent as JSON, or raw text/bytes sent as they are)."""
    import json

    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(url + path, content=content, timeout=timeout,
                      headers={"Content-Type": "application/json", **(headers or {})})


def assert_stops_dead(server, timeout: float = 30.0) -> None:
    """The engine is dead: /health answers 503 (unless the server has stopped already), and the server stops
    with exit status 1."""
    try:
        assert httpx.get(server.url + "/health", timeout=5).status_code == 503
    except httpx.TransportError:
        pass  # already stopped
    server.thread.join(timeout)
    assert not server.thread.is_alive() and server.result.exit_code == 1
