"""AsyncEngine: the (not thread-safe) LLMEngine driven by one background thread, fed from asyncio.

    asyncio side                          engine thread
    generate() -> inbox.append(add) --->  drain inbox: add_request / abort_request
                                          engine.step() while requests are unfinished
    RequestOutputCollector  <---------    one loop.call_soon_threadsafe per step with every output
    generate() exits early -> abort --->  (a client that went away frees its blocks)
    add_lora / remove_lora ----------->  the engine's (in its core process: an inspection), answered by a Future

Only the engine thread touches the engine after `start()`; the asyncio side
talks to it through a deque guarded by a Condition (the thread sleeps on it
when there is nothing to do) and reads `stats`, a snapshot the thread
replaces after every step. Outputs are DELTA and go into one collector per
HTTP request, which merges what its client has not read yet, so a slow
reader costs no memory per step.

Faults: a step that fails fails only its own requests (the engine says
which: they get an EngineStepError, the server answers 500) and the thread
goes on. An engine that cannot step again (EngineDeadError: a dead
tensor-parallel rank, an unusable device, an error outside a step) ends the
thread: every request in flight, and every later one, gets an
EngineDeadError (503), and `on_dead` is called once so the server can exit.
Draining (SIGTERM): new requests get EngineDraining (503), the ones in
flight run to the end or until `abort_all`. Unloading a LoRA adapter ends
its requests in flight (and refuses later ones naming it) with a 404.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from pagedkv.beam_search import BeamSearchParams
from pagedkv.core.sequence import OutputKind
from pagedkv.engine.llm_engine import EngineStats, LLMEngine
from pagedkv.errors import EngineDeadError
from pagedkv.lora.request import LoRARequest
from pagedkv.outputs import RequestOutput
from pagedkv.sampling_params import SamplingParams
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.output_collector import RequestOutputCollector

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError", "EngineDraining", "EngineRequest", "EngineStepError",
           "RequestRefused"]


class RequestRefused(ValueError):
    """The engine refused the request at add_request (answered with 400), or its LoRA adapter was unloaded (404).
    param: the field at fault."""

    def __init__(self, message: str, param: str | None = "prompt", status_code: int = 400) -> None:
        super().__init__(message)
        self.param, self.status_code = param, status_code


class EngineStepError(RuntimeError):
    """The step that held the request failed (answered with 500); the traceback is in the server log."""


class EngineDraining(RuntimeError):
    """The server is shutting down: no new requests (503), or one still running when the drain ran out."""


@dataclass(slots=True)
class EngineRequest:
    """One prompt for the engine. tag: which prompt of its HTTP request it is (the choice index base). params:
    BeamSearchParams for a beam search (the engine runs it and answers once, with the best beams). lora_request:
    the LoRA adapter it runs with (None: the base model)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    prompt: str | None = None
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.time)
    tag: int = 0
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class _Stream:
    """Where the engine thread sends one engine request's outputs."""

    collector: RequestOutputCollector
    tag: int
    lora: LoRARequest | None = None


Delivery = tuple[RequestOutputCollector, int, str, Any]


class AsyncEngine:
    """Runs `engine` in a background thread; `generate` streams a request's outputs to a coroutine."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None, idle_wake_s: float = 1.0,
                 on_dead: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.on_dead = on_dead  # called once, from the engine thread, when the engine can no longer step
        self.stats: EngineStats = engine.get_stats()  # replaced (never mutated) by the engine thread
        self._idle_wake_s = idle_wake_s  # the periodic stats log runs even when idle
        self._inbox: deque[tuple[Any, ...]] = deque()
        self._cond = threading.Condition()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._unloaded_loras: set[int] = set()  # engine thread only: lora_int_ids removed (ids are not reused)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead_reason: str | None = None
        self.crashed = False  # dead for a fault, not for a shutdown
        # asyncio side: generate() calls in flight, for the drain.
        self.draining = False
        self._num_active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._collectors: weakref.WeakSet[RequestOutputCollector] = weakref.WeakSet()  # for pending_outputs()
        # An engine core in another process: its step() waits for the core's outputs, so a new command must
        # wake it, and the core's death must wake the thread even when it is idle.
        self._wake_engine: Callable[[], None] = getattr(engine, "wake", lambda: None)
        self._engine_wait_idle: Callable[[float], None] | None = getattr(engine, "wait_idle", None)
        if hasattr(engine, "set_death_callback"):
            engine.set_death_callback(self._notify)

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
        self._notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_reason is None

    @property
    def has_work(self) -> bool:
        """Commands not yet applied, or requests in the engine (a cheap read from any thread)."""
        return bool(self._inbox) or self.engine.has_unfinished_requests()

    @property
    def num_active(self) -> int:
        """HTTP requests with engine requests in flight."""
        return self._num_active

    def pending_outputs(self) -> list[tuple[int, int]]:
        """Per HTTP request in flight: (unread outputs, unread tokens). At most one output per engine request,
        however many steps its client has not read: that is all a slow reader costs."""
        return [(c.num_pending, c.pending_tokens()) for c in list(self._collectors)]

    def begin_drain(self) -> None:
        """From now on generate() refuses new requests (EngineDraining); those in flight go on."""
        self.draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """Waits until no request is in flight; False if `timeout` seconds passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def abort_all(self, message: str) -> None:
        """Ends every request in flight with EngineDraining(message) (streams get it as their last event)."""
        self._submit(("abort_all", message))

    def inspect(self, timeout: float = 30.0) -> dict[str, Any]:
        """`LLMEngine.inspect()` of the engine (in its core process, if it runs in one), from any thread: what
        it holds between two steps. For tests and debugging."""
        answer: Future = Future()
        self._submit(("inspect", answer, "state"))
        return answer.result(timeout)

    def kv_snapshot(self, timeout: float = 30.0) -> dict[str, Any]:
        """`LLMEngine.kv_snapshot()` (pagedkv.engine.kv_snapshot), from any thread, taken between two steps."""
        answer: Future = Future()
        self._submit(("inspect", answer, "kv_snapshot"))
        return answer.result(timeout)

    # --- LoRA adapters (asyncio side) --------------------------------------------------------------------------
    async def add_lora(self, lora_request: LoRARequest, timeout: float = 300.0) -> None:
        """Has the engine read an adapter (on the engine thread, or in its core process), without blocking the
        event loop. Raises ValueError with the engine's reason when it cannot run it."""
        await self._lora_call("add_lora", lora_request, timeout)

    async def remove_lora(self, lora_request: LoRARequest, timeout: float = 300.0) -> None:
        """Ends the adapter's requests in flight (RequestRefused, 404), refuses later ones, and has the engine
        forget it."""
        await self._lora_call("remove_lora", lora_request, timeout)

    async def list_loras(self, timeout: float = 30.0) -> set[int]:
        """The lora_int_ids the engine holds in host memory."""
        return set(await self._lora_call("list_loras", None, timeout))

    async def _lora_call(self, what: str, arg: LoRARequest | None, timeout: float) -> Any:
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        answer: Future = Future()
        self._submit(("lora", answer, what, arg))
        # Shielded: a timeout or a cancelled caller must not cancel the Future the engine thread will answer.
        reply = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(answer)), timeout)
        if "error" in reply:
            raise ValueError(reply["error"])
        return reply["result"]

    def _submit(self, *commands: tuple[Any, ...]) -> None:
        with self._cond:
            self._inbox.extend(commands)
        self._notify()

    def _notify(self) -> None:
        """Wakes the engine thread, whether it sleeps on the condition or waits in an engine core's step."""
        with self._cond:
            self._cond.notify()
        self._wake_engine()

    # --- requests (asyncio side) ------------------------------------------------------------------------------
    async def generate(self, requests: list[EngineRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yields (tag, output) for the DELTA outputs of `requests` (merged while unread), until all finish.

        Raises RequestRefused / EngineStepError / EngineDeadError /
        EngineDraining for the first request that fails (the others are
        aborted). Leaving early (the client went away: the task is cancelled,
        or the consumer stops) aborts the unfinished requests, which frees
        their blocks.
        """
        if self.draining:
            raise EngineDraining("the server is shutting down and takes no new requests")
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        collector = RequestOutputCollector()
        self._collectors.add(collector)
        pending = {r.request_id for r in requests}
        self._num_active += 1
        self._idle.clear()
        self._submit(*(("add", r, collector) for r in requests))
        try:
            while pending:
                for tag, request_id, item in await collector.get():
                    if isinstance(item, BaseException):
                        pending.discard(request_id)  # the engine thread has dropped it already
                        raise item
                    if item.finished:
                        pending.discard(request_id)
                    yield tag, item
        finally:
            if pending:
                self._submit(*(("abort", rid) for rid in pending))
            self._collectors.discard(collector)
            self._num_active -= 1
            if not self._num_active:
                self._idle.set()

    # --- the engine thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._loop_once():
                pass
        except BaseException as e:  # a bug outside step(): fail everyone rather than hang them
            logger.exception("the engine thread died")
            self._die(f"the engine thread died: {e!r}", [])
        else:
            self.dead_reason = self.dead_reason or "the server is shutting down"
        with self._cond:  # requests that came in while the thread was stopping: nobody will run them
            late = [c for c in self._inbox if c[0] == "add"]
            asked = [c[1] for c in self._inbox if c[0] in ("inspect", "lora")]
            self._inbox.clear()
        error = EngineDeadError(self.dead_reason)
        for answer in asked:
            if not answer.done():
                answer.set_exception(error)
        self._deliver([(collector, req.tag, req.request_id, error) for _, req, collector in late])

    def _loop_once(self) -> bool:
        """Applies queued commands, runs one step, delivers its outputs. False once shutting down."""
        engine = self.engine
        deliveries: list[Delivery] = []
        idle = not self._inbox and not self._stopping and not engine.has_unfinished_requests()
        if idle and self._engine_wait_idle is not None:
            self._wait_on_engine(deliveries)  # a command wakes it through engine.wake()
            if self.dead_reason is not None:  # the commands still queued get the error from _run
                self._deliver(deliveries)
                return False
        with self._cond:
            if idle and self._engine_wait_idle is None and not self._inbox and not self._stopping:
                self._cond.wait(self._idle_wake_s)
            commands = list(self._inbox)
            self._inbox.clear()
            stopping = self._stopping
        for command in commands:
            self._apply(command, deliveries)
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

    def _apply(self, command: tuple[Any, ...], deliveries: list[Delivery]) -> None:
        if command[0] == "add":
            self._add(command[1], command[2], deliveries)
        elif command[0] == "abort":
            self._abort(command[1])
        elif command[0] == "inspect":
            ask = getattr(self.engine, "request_inspection", None)
            if ask is not None:
                ask(command[1], command[2])  # answered when the core's reply is read
            else:
                command[1].set_result(self.engine.kv_snapshot() if command[2] == "kv_snapshot"
                                      else self.engine.inspect())
        elif command[0] == "lora":
            self._lora(*command[1:], deliveries)
        else:  # abort_all: the drain ran out of time
            self._fail_all(EngineDraining(command[1]), "abort", deliveries)

    def _lora(self, answer: Future, what: str, lora: LoRARequest | None, deliveries: list[Delivery]) -> None:
        """add_lora / remove_lora / list_loras of the engine; `answer` gets {"result": ...} or {"error": reason}."""
        arg: Any = lora
        if what == "remove_lora":
            self._abort_lora_streams(lora, deliveries)
            self._unloaded_loras.add(lora.lora_int_id)
            arg = lora.lora_int_id
        ask = getattr(self.engine, "request_inspection", None)
        if ask is not None:
            ask(answer, what, arg)  # the core runs it; answered when its reply is read
        else:
            answer.set_result(self.engine.lora_call(what, arg))

    def _abort_lora_streams(self, lora: LoRARequest, deliveries: list[Delivery]) -> None:
        """Ends the requests running with `lora` (its engine requests aborted first: the engine's remove_lora
        would end them without an output)."""
        error = RequestRefused(f"The model `{lora.lora_name:.200}` was unloaded while the request ran.", "model", 404)
        for request_id, stream in list(self._streams.items()):
            if stream.lora is not None and stream.lora.lora_int_id == lora.lora_int_id:
                self._abort(request_id)
                deliveries.append((stream.collector, stream.tag, request_id, error))

    def _add(self, req: EngineRequest, collector: RequestOutputCollector, deliveries: list[Delivery]) -> None:
        prompt = {"prompt_token_ids": req.prompt_token_ids, "prompt": req.prompt}
        lora = req.lora_request
        try:
            if lora is not None and lora.lora_int_id in self._unloaded_loras:  # unloaded while it was checked
                raise RequestRefused(f"The model `{lora.lora_name:.200}` does not exist.", "model", 404)
            self.engine.add_request(req.request_id, prompt, req.params, arrival_time=req.arrival_time,
                                    cache_salt=req.cache_salt, output_kind=OutputKind.DELTA, lora_request=lora)
        except RequestRefused as e:
            deliveries.append((collector, req.tag, req.request_id, e))
            return
        except ValueError as e:
            refused = RequestRefused(str(e), getattr(e, "param", "prompt"))
            deliveries.append((collector, req.tag, req.request_id, refused))
            return
        self._streams[req.request_id] = _Stream(collector, req.tag, lora)
        if self.metrics is not None:
            self.metrics.request_started(req.request_id, False)

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is None:
            return  # finished (or failed) in the meantime
        self.engine.abort_request(request_id)
        if self.metrics is not None:
            self.metrics.request_ended(request_id, "abort")

    def _step(self, deliveries: list[Delivery]) -> None:
        try:
            outputs = self.engine.step()
        except EngineDeadError as e:
            logger.error("%s", e)
            self._die(str(e), deliveries)
            return
        except Exception as e:  # the engine's own bookkeeping failed: its state can no longer be trusted
            logger.exception("the engine failed outside a model step")
            self._die(f"the engine failed outside a model step: {e!r}", deliveries)
            return
        now = time.time()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.error is not None:  # the engine failed this request (and only the step's requests)
                del self._streams[output.request_id]
                if self.metrics is not None:
                    self.metrics.request_ended(output.request_id, "error")
                deliveries.append((stream.collector, stream.tag, output.request_id, EngineStepError(output.error)))
                continue
            if self.metrics is not None:
                self.metrics.request_output(output, now)
            deliveries.append((stream.collector, stream.tag, output.request_id, output))
            if output.finished:
                del self._streams[output.request_id]

    def _wait_on_engine(self, deliveries: list[Delivery]) -> None:
        """Idle, with the core in another process: wait for its news (stats, its death) or for a command. A
        core that died while idle is reported at once, not at the next request."""
        try:
            self._engine_wait_idle(self._idle_wake_s)
        except EngineDeadError as e:
            logger.error("%s", e)
            self._die(str(e), deliveries)
            return
        self.stats = self.engine.get_stats()

    def _die(self, reason: str, deliveries: list[Delivery]) -> None:
        """The engine cannot step again: everyone gets EngineDeadError, and the server is told."""
        self.dead_reason, self.crashed = reason, True
        self._fail_all(EngineDeadError(reason), "error", deliveries)
        if self.on_dead is not None:
            try:
                self.on_dead(reason)
            except Exception:
                logger.exception("on_dead failed")

    def _fail_all(self, error: BaseException, reason: str, deliveries: list[Delivery] | None = None) -> None:
        """Aborts every request in the engine and hands `error` to each of their streams."""
        out = deliveries if deliveries is not None else []
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # the engine may be in a bad state after a failed step; still answer everyone
                logger.exception("abort of %s failed", request_id)
            if self.metrics is not None:
                self.metrics.request_ended(request_id, reason)
            out.append((stream.collector, stream.tag, request_id, error))
        self._streams.clear()
        if deliveries is None:
            self._deliver(out)
        try:
            self.stats = self.engine.get_stats()
        except Exception:
            logger.exception("get_stats failed")

    def _deliver(self, deliveries: list[Delivery]) -> None:
        """Hands a step's outputs to the event loop in one wake-up (not one per request)."""
        if not deliveries or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(_put_all, deliveries)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def _put_all(deliveries: list[Delivery]) -> None:
    for collector, tag, request_id, item in deliveries:
        collector.put(tag, request_id, item)
