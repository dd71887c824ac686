"""The KV-cache dashboard: a live page at /dashboard over the engine's snapshots, and `pagedkv kv-view` over a trace.

Routes (mounted by `build_app`; the API key guards them like every route, and
the page alone also takes `?api_key=KEY`, since a browser cannot send a header
when it navigates; the page's own requests then send the header):

    GET /dashboard           the page (static/dashboard.html, one self-contained file)
    GET /dashboard/snapshot  one snapshot (pagedkv.engine.kv_snapshot's schema) as JSON
    GET /dashboard/stream    server-sent events: a snapshot every `interval_s` seconds

One `SnapshotBroadcaster` serves every open stream: while at least one page is
open it takes one snapshot per interval and hands the same encoded text to
all of them; with none open it takes none, so a closed page costs nothing.

`pagedkv kv-view FILE` serves the same page in trace mode: it fetches
GET /dashboard/trace (every snapshot of a --kv-trace file) and shows one at a
time under a slider.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from pagedkv.server.api_key import APIKeyMiddleware

logger = logging.getLogger(__name__)

PAGE_PATH = "/dashboard"
# Paths where `?api_key=` stands in for the Authorization header: only the page a browser navigates to.
QUERY_KEY_PATHS = frozenset({PAGE_PATH})
_MODE_MARKER = "__PAGEDKV_DASHBOARD_MODE__"
_INTERVAL_MARKER = "__PAGEDKV_DASHBOARD_INTERVAL__"
_SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}  # no proxy may hold events back


def page_html(mode: str, interval_s: float) -> str:
    """The page, told whether it is live ("live": the stream) or a replay ("trace": /dashboard/trace)."""
    text = resources.files("pagedkv.server").joinpath("static/dashboard.html").read_text(encoding="utf-8")
    return text.replace(_MODE_MARKER, mode).replace(_INTERVAL_MARKER, f"{interval_s:g}")


def _event(data: str) -> bytes:
    return f"data: {data}\n\n".encode()


class SnapshotBroadcaster:
    """Takes a snapshot every `interval_s` seconds while someone listens, and gives each listener the latest.

    `take` blocks (it waits for the engine thread to answer between two
    steps), so it runs on a worker thread, never on the event loop. A listener
    that reads slowly only ever has the newest snapshot waiting: the older
    one is dropped, so it costs one snapshot of memory at most.
    """

    def __init__(self, take: Callable[[], dict[str, Any]], interval_s: float = 0.5,
                 keep_going: Callable[[], bool] = lambda: True) -> None:
        if interval_s <= 0:
            raise ValueError(f"the dashboard's interval must be > 0 s, got {interval_s}")
        self.take, self.interval_s, self.keep_going = take, interval_s, keep_going
        self.num_taken = 0  # snapshots taken so far: a test can see none are taken while nobody listens
        self._listeners: set[asyncio.Queue[str | None]] = set()
        self._producer: asyncio.Task | None = None

    @property
    def num_listeners(self) -> int:
        return len(self._listeners)

    async def listen(self) -> AsyncIterator[str]:
        """Yields encoded snapshots until the caller stops (the client went away) or the server stops."""
        queue: asyncio.Queue[str | None] = asyncio.Queue(maxsize=1)
        self._listeners.add(queue)
        if self._producer is None or self._producer.done():
            self._producer = asyncio.ensure_future(self._produce())
        try:
            while (item := await queue.get()) is not None:
                yield item
        finally:
            self._listeners.discard(queue)

    async def _produce(self) -> None:
        loop = asyncio.get_running_loop()
        while self._listeners:
            started = loop.time()
            item: str | None
            try:
                item = json.dumps(await asyncio.to_thread(self.take), separators=(",", ":"))
                self.num_taken += 1
            except Exception as e:  # the engine stopped or died: the pages are told, the server goes on
                logger.warning("dashboard snapshot failed: %r", e)
                item = None
            if not self.keep_going():
                item = None
            for queue in list(self._listeners):
                _put_latest(queue, item)
            if item is None:
                return
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))


def _put_latest(queue: asyncio.Queue, item: Any) -> None:
    """Replaces what the listener has not read yet with `item`."""
    if queue.full():
        queue.get_nowait()
    queue.put_nowait(item)


def _stream_response(broadcaster: SnapshotBroadcaster) -> StreamingResponse:
    async def events() -> AsyncIterator[bytes]:
        async for data in broadcaster.listen():
            yield _event(data)

    return StreamingResponse(events(), media_type="text/event-stream", headers=_SSE_HEADERS)


def mount_dashboard(app: FastAPI, async_engine: Any, interval_s: float = 0.5, timeout_s: float = 30.0) -> None:
    """Adds the live dashboard's routes to the server's app; app.state.dashboard is the broadcaster."""

    def serving() -> bool:  # a stream must not hold up a shutdown: it ends when the server drains or stops
        server = getattr(app.state, "server", None)
        stopping = server is not None and server.should_exit
        return async_engine.is_alive and not async_engine.draining and not stopping

    broadcaster = SnapshotBroadcaster(lambda: async_engine.kv_snapshot(timeout_s), interval_s, serving)
    app.state.dashboard = broadcaster

    @app.get(PAGE_PATH, include_in_schema=False)
    async def dashboard_page() -> HTMLResponse:
        return HTMLResponse(page_html("live", interval_s), headers={"Cache-Control": "no-store"})

    @app.get(PAGE_PATH + "/snapshot")
    async def dashboard_snapshot() -> JSONResponse:
        return JSONResponse(await asyncio.to_thread(async_engine.kv_snapshot, timeout_s))

    @app.get(PAGE_PATH + "/stream")
    async def dashboard_stream() -> StreamingResponse:
        return _stream_response(broadcaster)


def build_trace_app(snapshots: list[dict[str, Any]], api_keys: tuple[str, ...] = ()) -> FastAPI:
    """`pagedkv kv-view`: the page in trace mode over `snapshots` (read_trace's list)."""
    app = FastAPI(title="pagedkv kv-view")
    body = json.dumps(snapshots, separators=(",", ":"))  # encoded once: the trace does not change

    @app.get(PAGE_PATH, include_in_schema=False)
    async def trace_page() -> HTMLResponse:
        return HTMLResponse(page_html("trace", 0.5))

    @app.get(PAGE_PATH + "/trace")
    async def trace_snapshots() -> Response:
        return Response(body, media_type="application/json")

    @app.get(PAGE_PATH + "/snapshot")
    async def trace_last() -> Response:
        return JSONResponse(snapshots[-1] if snapshots else {})

    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys, open_paths=frozenset(),
                           query_key_paths=QUERY_KEY_PATHS)
    return app


def run_kv_view(path: str | Path, host: str = "127.0.0.1", port: int = 8000, api_keys: tuple[str, ...] = ()) -> int:
    """Serves a --kv-trace file at http://HOST:PORT/dashboard until interrupted."""
    import uvicorn

    from pagedkv.engine.kv_trace import read_trace

    snapshots = read_trace(path)
    if not snapshots:
        raise ValueError(f"{path} holds no snapshot")
    logger.info("kv-view: %d snapshots (steps %s..%s) at http://%s:%d%s", len(snapshots),
                snapshots[0].get("step"), snapshots[-1].get("step"), host, port, PAGE_PATH)
    uvicorn.run(build_trace_app(snapshots, api_keys), host=host, port=port, log_level="warning")
    return 0
