"""AsyncEngine: the (not thread-safe) LLMEngine driven by one background thread, fed from asyncio.

    asyncio side                          engine thread
    generate() -> inbox.append(add) --->  drain inbox: add_request / abort_request
                                          engine.step() while requests are unfinished
    per-request asyncio.Queue  <-------   one loop.call_soon_threadsafe per step with every output
    generate() exits early -> abort --->  (a client that went away frees its blocks)

Only the engine thread touches the engine after `start()`; the asyncio side
talks to it through a deque guarded by a Condition (the thread sleeps on it
when there is nothing to do) and reads `stats`, a snapshot the thread
replaces after every step. A failing step fails the requests it held (they
get an EngineStepError, the server answers 500) and the thread goes on
serving new ones; a tensor-parallel worker that died ends the thread (every
request then gets an EngineDeadError: 503).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pagedkv.core.sequence import OutputKind
from pagedkv.distributed.runtime import WorkerDiedError
from pagedkv.engine.llm_engine import EngineStats, LLMEngine
from pagedkv.outputs import RequestOutput
from pagedkv.sampling_params import SamplingParams
from pagedkv.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class RequestRefused(ValueError):
    """The engine refused the request at add_request (answered with 400)."""


class EngineStepError(RuntimeError):
    """The step that held the request raised (answered with 500); the traceback is in the server log."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shutdown or a crash outside a step)."""


@dataclass(slots=True)
class EngineRequest:
    """One prompt for the engine. tag: which prompt of its HTTP request it is (the choice index base)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    cache_salt: str | None = None
    output_kind: OutputKind = OutputKind.DELTA
    arrival_time: float = field(default_factory=time.time)
    tag: int = 0


@dataclass(slots=True)
class _Stream:
    """Where the engine thread sends one request's outputs."""

    queue: asyncio.Queue
    tag: int


class AsyncEngine:
    """Runs `engine` in a background thread; `generate` streams a request's outputs to a coroutine."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None, idle_wake_s: float = 1.0) -> None:
        self.engine = engine
        self.metrics = metrics
        self.stats: EngineStats = engine.get_stats()  # replaced (never mutated) by the engine thread
        self._idle_wake_s = idle_wake_s  # the periodic stats log runs even when idle
        self._inbox: deque[tuple[Any, ...]] = deque()
        self._cond = threading.Condition()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead_reason: str | None = None

    # --- life cycle (asyncio side) -------------------------------------------------------------------------------
    def start(self) -> None:
        """Starts the engine thread; outputs are delivered to the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Aborts what is left, stops the thread and waits for it."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_reason is None

    def _submit(self, *commands: tuple[Any, ...]) -> None:
        with self._cond:
            self._inbox.extend(commands)
            self._cond.notify()

    # --- requests (asyncio side) ------------------------------------------------------------------------------
    async def generate(self, requests: list[EngineRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yields (tag, output) for every step output of `requests`, until all have finished.

        Raises RequestRefused / EngineStepError / EngineDeadError for the first
        request that fails. Leaving early (the client went away: the task is
        cancelled, or the consumer stops) aborts the unfinished requests, which
        frees their blocks.
        """
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        queue: asyncio.Queue = asyncio.Queue()
        pending = {r.request_id for r in requests}
        self._submit(*(("add", r, queue) for r in requests))
        try:
            while pending:
                tag, request_id, item = await queue.get()
                if isinstance(item, BaseException):
                    pending.discard(request_id)  # the engine thread has dropped it already
                    raise item
                if item.finished:
                    pending.discard(request_id)
                yield tag, item
        finally:
            if pending:
                self._submit(*(("abort", rid) for rid in pending))

    # --- the engine thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._loop_once():
                pass
        except BaseException as e:  # a bug outside step(): fail everyone rather than hang them
            logger.exception("the engine thread died")
            self.dead_reason = f"the engine thread died: {e!r}"
            self._fail_all(EngineDeadError(self.dead_reason), "error")
        else:
            self.dead_reason = self.dead_reason or "the server is shutting down"
        with self._cond:  # requests that came in while the thread was stopping: nobody will run them
            late = [c for c in self._inbox if c[0] == "add"]
            self._inbox.clear()
        self._deliver([(queue, (req.tag, req.request_id, EngineDeadError(self.dead_reason))) for _, req, queue in late])

    def _loop_once(self) -> bool:
        """Applies queued commands, runs one step, delivers its outputs. False once shutting down."""
        engine = self.engine
        with self._cond:
            if not self._inbox and not self._stopping and not engine.has_unfinished_requests():
                self._cond.wait(self._idle_wake_s)
            commands = list(self._inbox)
            self._inbox.clear()
            stopping = self._stopping
        deliveries: list[tuple[asyncio.Queue, tuple[int, str, Any]]] = []
        for command in commands:
            if command[0] == "add":
                self._add(command[1], command[2], deliveries)
            else:
                self._abort(command[1])
        if stopping:
            self._deliver(deliveries)
            self._fail_all(EngineDeadError("the server is shutting down"), "abort")
            return False
        stepped = engine.has_unfinished_requests()
        if stepped:
            self._step(deliveries)
        if self.dead_reason is not None:
            self._deliver(deliveries)
            return False
        if commands or stepped:
            self.stats = engine.get_stats()
        if self.metrics is not None:
            self.metrics.record_stats(self.stats)
        self._deliver(deliveries)
        return True

    def _add(self, req: EngineRequest, queue: asyncio.Queue, deliveries: list) -> None:
        prompt = {"prompt_token_ids": req.prompt_token_ids, "prompt": req.prompt}
        try:
            self.engine.add_request(req.request_id, prompt, req.params, arrival_time=req.arrival_time,
                                    cache_salt=req.cache_salt, output_kind=req.output_kind)
        except ValueError as e:
            deliveries.append((queue, (req.tag, req.request_id, RequestRefused(str(e)))))
            return
        self._streams[req.request_id] = _Stream(queue, req.tag)
        if self.metrics is not None:
            self.metrics.request_started(req.request_id, req.output_kind is OutputKind.CUMULATIVE)

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is None:
            return  # finished (or failed) in the meantime
        self.engine.abort_request(request_id)
        if self.metrics is not None:
            self.metrics.request_ended(request_id, "abort")

    def _step(self, deliveries: list) -> None:
        try:
            outputs = self.engine.step()
        except WorkerDiedError as e:  # the engine cannot run again: everyone, now and later, gets a 503
            logger.error("%s", e)
            self.dead_reason = str(e)
            self._fail_all(EngineDeadError(self.dead_reason), "error", deliveries)
            return
        except Exception as e:
            logger.error("engine step failed; failing the %d requests in the engine:\n%s", len(self._streams),
                         traceback.format_exc())
            self._fail_all(EngineStepError(f"the engine failed while running this request: {e!r}"), "error",
                           deliveries)
            return
        now = time.time()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if self.metrics is not None:
                self.metrics.request_output(output, now)
            deliveries.append((stream.queue, (stream.tag, output.request_id, output)))
            if output.finished:
                del self._streams[output.request_id]

    def _fail_all(self, error: BaseException, reason: str, deliveries: list | None = None) -> None:
        """Aborts every request in the engine and hands `error` to each of their streams."""
        out = deliveries if deliveries is not None else []
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # the engine may be in a bad state after a failed step; still answer everyone
                logger.exception("abort of %s failed", request_id)
            if self.metrics is not None:
                self.metrics.request_ended(request_id, reason)
            out.append((stream.queue, (stream.tag, request_id, error)))
        self._streams.clear()
        if deliveries is None:
            self._deliver(out)
        try:
            self.stats = self.engine.get_stats()
        except Exception:
            logger.exception("get_stats failed")

    def _deliver(self, deliveries: list) -> None:
        """Hands a step's outputs to the event loop in one wake-up (not one per request)."""
        if not deliveries or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(_put_all, deliveries)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def _put_all(deliveries: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in deliveries:
        queue.put_nowait(item)
