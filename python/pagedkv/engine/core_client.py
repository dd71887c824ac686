"""Starting, talking to and watching the engine-core process (the front end's side of the sockets).

Two ZeroMQ sockets over ipc:// in a private (0700) directory: PUSH to the
core, PULL from it. The core is spawned (a fresh interpreter: no inherited
threads or CUDA state) and not daemonic (it starts tensor-parallel ranks of
its own); it exits when its parent does (see core_process). Its death is
seen at once: a watcher thread waits on the process's sentinel and wakes
the front end, whose next `recv` raises EngineDeadError naming the exit
code or signal.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait

import msgspec
import zmq

from pagedkv.engine.core_messages import CoreDied, FromCore, Shutdown, ToCore, encoder, from_core_decoder
from pagedkv.engine.core_process import CoreFacts, CoreStart, run_engine_core
from pagedkv.errors import EngineDeadError

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = float(os.environ.get("PAGEDKV_CORE_STARTUP_TIMEOUT", "600"))
SHUTDOWN_TIMEOUT_S = 15.0
_LIVENESS_POLL_S = 1.0  # the longest a waiting recv goes without checking that the core is alive


class CoreStartError(RuntimeError):
    """The engine core failed while starting (its log has the traceback)."""


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


class EngineCoreClient:
    """One engine-core process and the sockets to it. Not thread-safe: one thread sends and receives."""

    def __init__(self, start: CoreStart, process: multiprocessing.Process, context: zmq.Context,
                 to_core: zmq.Socket, from_core: zmq.Socket, folder: str, facts: CoreFacts) -> None:
        self.start_args, self.process, self.facts = start, process, facts
        self._context, self._to_core, self._from_core, self._folder = context, to_core, from_core, folder
        self._encoder, self._decoder = encoder(), from_core_decoder()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(from_core, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._closed = False
        self.dead_reason: str | None = None
        self._death_logged = False
        self.on_death: Callable[[], None] | None = None  # called from the watcher thread
        threading.Thread(target=self._watch, name="pagedkv-core-watch", daemon=True).start()
        atexit.register(_close_at_exit, weakref.ref(self))

    @classmethod
    def start(cls, start_fields: dict, while_starting: Callable[[], None] | None = None) -> EngineCoreClient:
        """Spawns the core with CoreStart(**start_fields, addresses filled in), runs `while_starting` (the front
        end's own set-up: loading the tokenizer takes seconds, as does the core's model) and waits until the
        core is ready. Raises ValueError / CoreStartError with the core's own message if it could not start, or
        what `while_starting` raised (the core is stopped then)."""
        folder = tempfile.mkdtemp(prefix="pagedkv-core-")  # 0700: only this user can reach the sockets
        context = zmq.Context(1)
        to_core, from_core = context.socket(zmq.PUSH), context.socket(zmq.PULL)
        to_core.bind(f"ipc://{folder}/in")
        from_core.bind(f"ipc://{folder}/out")
        start = CoreStart(input_address=f"ipc://{folder}/in", output_address=f"ipc://{folder}/out",
                          parent_pid=os.getpid(), **start_fields)
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe(duplex=False)
        process = ctx.Process(target=run_engine_core, args=(start, theirs), name="pagedkv-engine-core")
        t0 = time.perf_counter()
        process.start()
        theirs.close()
        try:
            if while_starting is not None:
                while_starting()
            facts = _wait_ready(process, ours)
        except BaseException:
            _stop(process, 5.0)
            context.destroy(linger=0)
            shutil.rmtree(folder, ignore_errors=True)
            raise
        logger.info("engine core ready (pid %d) in %.1f s", process.pid, time.perf_counter() - t0)
        return cls(start, process, context, to_core, from_core, folder, facts)

    # --- messages ----------------------------------------------------------------------------------------------
    def send(self, message: ToCore) -> None:
        """Queues a message for the core; raises EngineDeadError if it is gone (or this client is closed), and
        ValueError (nothing sent) for a message its encoding refuses (e.g. an int past 64 bits): that request's
        fault, never the engine's."""
        if self._closed:
            raise EngineDeadError("the engine core was shut down")
        self.check_alive()
        try:
            frame = self._encoder.encode(message)
        except (OverflowError, TypeError, msgspec.EncodeError) as e:
            raise ValueError(f"the request cannot be sent to the engine core: {e}") from e
        self._to_core.send(frame, copy=False)

    def recv(self, timeout_s: float | None) -> list[FromCore]:
        """Every message waiting, after waiting up to `timeout_s` (None: until one comes) for the first, or
        until `wake()`. Raises EngineDeadError if the core died or sent CoreDied."""
        self.check_alive()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:  # in slices, so a missed wake-up can never leave it waiting for ever
            left = _LIVENESS_POLL_S if deadline is None else min(_LIVENESS_POLL_S, deadline - time.monotonic())
            try:
                events = dict(self._poller.poll(max(0, int(left * 1000))))
            except (zmq.ZMQError, OSError) as e:
                if self._closed:  # closed under a waiting thread (interpreter exit, shutdown)
                    raise EngineDeadError("the engine core was shut down") from e
                raise
            if events or (deadline is not None and time.monotonic() >= deadline):
                break
            self.check_alive()
        if self._wake_r in events:
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
        messages: list[FromCore] = []
        while True:
            try:
                frame = self._from_core.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            message = self._decoder.decode(frame.buffer)
            if isinstance(message, CoreDied):
                self.dead_reason = f"the engine core failed: {message.reason}"
                raise EngineDeadError(self.dead_reason)
            messages.append(message)
        if not messages:
            self.check_alive()
        return messages

    def wake(self) -> None:
        """Ends a `recv` that is waiting (from any thread): new commands are queued for the front end."""
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake-up is pending already, or closed

    # --- life ---------------------------------------------------------------------------------------------------
    def check_alive(self) -> None:
        """Raises EngineDeadError if the core died (or said it cannot go on); the cause is logged once."""
        if self.dead_reason is None and self.process.exitcode is not None:
            self.dead_reason = f"the engine core process died: {describe_exit(self.process.exitcode)}"
        if self.dead_reason is not None:
            if not self._death_logged:
                self._death_logged = True
                logger.error("%s", self.dead_reason)
            raise EngineDeadError(self.dead_reason)

    def _watch(self) -> None:
        wait([self.process.sentinel])
        # The sentinel closes as the process exits, a moment before it can be reaped: wait for the exit code
        # here, so that check_alive never sees a dead core as alive once this thread has woken the front end.
        self.process.join()
        if not self._closed:
            self.dead_reason = self.dead_reason or (f"the engine core process died: "
                                                    f"{describe_exit(self.process.exitcode)}")
            self.wake()
            callback = self.on_death
            if callback is not None:
                try:
                    callback()
                except Exception:
                    logger.exception("on_death failed")

    @property
    def is_alive(self) -> bool:
        return self.process.exitcode is None and self.dead_reason is None

    def close(self) -> None:
        """Asks the core to stop, waits for it (then SIGTERM, then SIGKILL), and removes the sockets."""
        if self._closed:
            return
        self._closed = True
        if self.process.exitcode is None:
            try:
                self._to_core.send(self._encoder.encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            _stop(self.process, SHUTDOWN_TIMEOUT_S)
        self._context.destroy(linger=0)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self._folder, ignore_errors=True)


def _wait_ready(process: multiprocessing.Process, conn) -> CoreFacts:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        ready = wait([conn, process.sentinel], timeout=max(0.0, deadline - time.monotonic()))
        if conn in ready:
            try:
                message = conn.recv()
            except EOFError:
                message = None
            if message is not None and message[0] == "ready":
                return message[1]
            if message is not None:
                _, kind, text = message
                raise (ValueError if kind in ("ValueError", "SamplingParamsError") else CoreStartError)(text)
        if process.sentinel in ready or conn in ready:
            process.join(5.0)
            raise CoreStartError(f"the engine core process died while starting: {describe_exit(process.exitcode)}")
        if time.monotonic() >= deadline:
            raise CoreStartError(f"the engine core did not start within {STARTUP_TIMEOUT_S:.0f} s")


def _stop(process: multiprocessing.Process, timeout_s: float) -> None:
    """Waits up to `timeout_s` for the core to exit, then sends SIGTERM, then SIGKILL."""
    deadline = time.monotonic() + timeout_s
    while process.exitcode is None and time.monotonic() < deadline:
        process.join(min(0.1, max(0.0, deadline - time.monotonic())))
        if process.exitcode is None:
            # join returns once the process sentinel closes, which can come a moment before the exit status
            # can be collected: a core that is already exiting must not be signalled.
            time.sleep(0.01)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if process.exitcode is not None:
            return
        logger.warning("engine core (pid %s) did not stop: sending %s", process.pid, sig.name)
        try:
            os.kill(process.pid, sig)
        except ProcessLookupError:
            return
        process.join(5.0)


def _close_at_exit(ref: weakref.ref) -> None:
    client = ref()
    if client is not None:
        client.close()
