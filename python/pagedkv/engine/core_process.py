"""The engine core in its own process: scheduler, block manager and model runner in a busy loop.

    while the front end lives:
        take every message waiting (new requests, aborts, stop-string finishes)
        step (schedule -> run -> update) if anything is unfinished
        send what the step produced, with the stats after it

It never waits on the front end: outputs are pushed as they come, and the
front end detokenizes them while the next step computes. It has no
tokenizer (prompts arrive as ids; EOS ids that only the tokenizer knows come
in the front end's first message, TokenizerEos). Its compute threads can be
pinned (`cpu_binding`).

Faults: a step that fails fails its own requests (they come back with an
error) and the loop goes on; an engine that cannot step again sends
`CoreDied` with the reason and exits with status 1. The core never outlives
the front end: when its parent is gone (even after `kill -9`) it exits at
the next iteration, at most `PARENT_POLL_S` later when idle.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from dataclasses import dataclass, replace
from typing import Any

import zmq

from pagedkv.beam_search import beam_params_from_wire
from pagedkv.config import EngineArgs
from pagedkv.core.sequence import OutputKind
from pagedkv.engine.core_messages import (
    AbortRequests,
    AddRequest,
    CoreDied,
    FinishSamples,
    GrammarVocab,
    Inspect,
    Inspection,
    RequestDelta,
    SampleDelta,
    Shutdown,
    StepOutputs,
    TokenizerEos,
    WireStats,
    encoder,
    logprobs_to_wire,
    lora_from_wire,
    metrics_to_wire,
    pack_ids,
    pack_vector,
    params_from_wire,
    pooling_from_wire,
    prompt_logprobs_to_wire,
    to_core_decoder,
    unpack_ids,
)
from pagedkv.engine.cpu_binding import apply_core_binding
from pagedkv.engine.llm_engine import EngineStats, LLMEngine
from pagedkv.errors import EngineDeadError
from pagedkv.outputs import RequestMetrics, RequestOutput
from pagedkv.structured_outputs import load_grammar, load_vocab

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.5  # the longest an idle core sleeps before checking that its parent is alive


@dataclass(slots=True)
class CoreFacts:
    """What the front end learns from the core at start-up (sent once, pickled): the model's and the engine's
    settings its request checks and the server need."""

    model_name: str
    model_config: Any
    scheduler_config: Any
    cache_config: Any
    default_sampling: dict[str, Any]
    eos_token_ids: set[int]
    dtype: str
    device: str
    num_gpu_blocks: int
    kv_spec: Any  # memory_pool's KVCacheSpec: bytes a token and a block
    pid: int
    cpu_binding: list[int] | None
    pooler: Any = None  # pagedkv.pooler.Pooler: the front end checks pooling requests with it
    runner_type: str = "auto"  # the engine's runner for this model (pagedkv.pooler.resolve_runner)


@dataclass(slots=True)
class CoreStart:
    """Everything the spawned core needs: the engine's arguments and where to talk."""

    args: EngineArgs
    input_address: str
    output_address: str
    parent_pid: int
    cpu_binding: list[int] | None
    log_level: int


class EngineCore:
    """An LLMEngine (without a tokenizer) driven by messages: requests in, per-step deltas out."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.decoder = to_core_decoder()
        self.encoder = encoder()
        self._refused: list[RequestDelta] = []
        self._inspections: list[str] = []  # what each Inspect asked for, in order
        self._grammar_vocab: Any = None  # structured outputs' vocabulary, from GrammarVocab

    def apply(self, message: Any) -> bool:
        """Applies one front-end message; False for Shutdown."""
        if isinstance(message, AddRequest):
            self._add(message)
        elif isinstance(message, TokenizerEos):
            self.engine.eos_token_ids.update(message.token_ids)  # the scheduler and the runner hold this set
            if message.token_ids:
                self.engine.beam_eos_token_id = min(message.token_ids)
        elif isinstance(message, GrammarVocab):
            self._grammar_vocab = load_vocab(message.vocab)
        elif isinstance(message, AbortRequests):
            self.engine.abort_request(message.request_ids)
        elif isinstance(message, FinishSamples):
            for request_id, index in message.samples:
                try:
                    self.engine.finish_sequence(request_id, index)
                except ValueError:  # not forked yet: the front end cannot have seen its text; nothing to stop
                    logger.warning("finish of %s sample %d before its first token: ignored", request_id, index)
        elif isinstance(message, Inspect):
            self._inspections.append((message.what, message.arg))
        elif isinstance(message, Shutdown):
            return False
        return True

    def take_inspections(self) -> list[Inspection]:
        """The answers to the Inspect messages applied since the last call (the engine as it is now)."""
        asked, self._inspections = self._inspections, []
        return [Inspection(self._answer(what, arg)) for what, arg in asked]

    def _answer(self, what: str, arg: Any) -> dict:
        engine = self.engine
        if what == "kv_snapshot":
            return engine.kv_snapshot()
        if what == "state":
            return engine.inspect()
        return engine.lora_call(what, lora_from_wire(arg) if what == "add_lora" else arg)

    def _load_grammar(self, grammar: str | None) -> Any:
        if grammar is None:
            return None
        if self._grammar_vocab is None:
            raise ValueError("a compiled grammar came before the grammar vocabulary (GrammarVocab)")
        try:
            return load_grammar(grammar, self._grammar_vocab)
        except Exception as e:  # xgrammar's own deserialization errors: this request fails alone
            raise ValueError(f"the compiled grammar could not be loaded: {e}") from e

    def _add(self, m: AddRequest) -> None:
        try:
            params = (pooling_from_wire(m.pooling) if m.pooling is not None
                      else params_from_wire(m.params) if m.beam is None else beam_params_from_wire(m.beam))
            self.engine.add_request(m.request_id, unpack_ids(m.prompt_token_ids), params,
                                    arrival_time=m.arrival_time, cache_salt=m.cache_salt,
                                    output_kind=OutputKind.DELTA, grammar=self._load_grammar(m.grammar),
                                    lora_request=lora_from_wire(m.lora))
        except ValueError as e:  # the front end checks first: this is a second opinion, answered as a failure
            metrics = metrics_to_wire(RequestMetrics(m.arrival_time))
            self._refused.append(RequestDelta(m.request_id, [], True, metrics, f"refused by the engine core: {e}"))

    def step(self) -> StepOutputs:
        """One engine step (if anything is unfinished) as a message; raises EngineDeadError."""
        outputs = [to_delta(o) for o in self.engine.step()] if self.engine.has_unfinished_requests() else []
        if self._refused:
            outputs = self._refused + outputs
            self._refused = []
        return StepOutputs(outputs, WireStats(stats_to_wire(self.engine.get_stats())))


def to_delta(output: RequestOutput) -> RequestDelta:
    """A DELTA RequestOutput as its wire form (token ids packed; text is the front end's)."""
    samples = []
    for c in output.outputs:
        if not c.token_ids and c.finish_reason is None:
            continue
        logprobs = [logprobs_to_wire(e) for e in c.logprobs] if c.logprobs else None
        stop = c.stop_reason if isinstance(c.stop_reason, int) else None
        samples.append(SampleDelta(c.index, pack_ids(c.token_ids), logprobs, c.finish_reason, stop))
    return RequestDelta(output.request_id, samples, output.finished, metrics_to_wire(output.metrics), output.error,
                        prompt_logprobs_to_wire(output.prompt_logprobs),
                        pack_vector(output.pooled) if output.pooled is not None else None)


def stats_to_wire(stats: EngineStats) -> tuple:
    return tuple(getattr(stats, name) for name in EngineStats.__slots__)


def stats_from_wire(values: tuple) -> EngineStats:
    return EngineStats(**dict(zip(EngineStats.__slots__, values, strict=True)))


def _parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid


def run_busy_loop(core: EngineCore, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int) -> str:
    """Serves until Shutdown or the parent is gone; returns why it stopped. Raises EngineDeadError."""
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    engine = core.engine
    while True:
        if not _parent_alive(parent_pid):
            return "the front end is gone"
        idle = not engine.has_unfinished_requests()
        if not poller.poll(PARENT_POLL_S * 1000 if idle else 0) and idle:
            continue
        applied = False
        while True:
            try:
                frame = inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            applied = True
            if not core.apply(core.decoder.decode(frame.buffer)):
                return "shutdown"
        if applied or engine.has_unfinished_requests():
            outbox.send(core.encoder.encode(core.step()), copy=False)
        for answer in core.take_inspections():
            outbox.send(core.encoder.encode(answer), copy=False)


def run_engine_core(start: CoreStart, ready) -> None:
    """The core process's entry point (spawned). `ready`: a Pipe end; gets ("ready", CoreFacts) or
    ("error", exception type name, message) once."""
    logging.basicConfig(level=start.log_level, format="%(levelname)s %(name)s [core]: %(message)s")
    # Ctrl-C reaches the whole process group: the front end decides when the core stops (Shutdown).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    context = zmq.Context(1)
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    engine = None
    status = 0
    try:
        placed = apply_core_binding(start.cpu_binding) if start.cpu_binding else None
        inbox.connect(start.input_address)
        outbox.connect(start.output_address)
        engine = LLMEngine(replace(start.args, skip_tokenizer_init=True))
        ready.send(("ready", CoreFacts(
            engine.model_name, engine.model_config, engine.scheduler_config, engine.cache_config,
            dict(engine.default_sampling), set(engine.eos_token_ids), str(engine.dtype), str(engine.device),
            engine.block_manager.num_total_gpu_blocks, engine.kv_spec, os.getpid(), placed, engine.pooler,
            engine.runner_type)))
    except BaseException as e:
        logger.error("the engine core failed to start:\n%s", traceback.format_exc())
        ready.send(("error", type(e).__name__, str(e)))
        _close(engine, context)
        sys.exit(1)
    try:
        why = run_busy_loop(EngineCore(engine), inbox, outbox, start.parent_pid)
        logger.info("engine core stops: %s", why)
    except EngineDeadError as e:
        status = _report_death(outbox, str(e))
    except BaseException as e:
        if isinstance(e, SystemExit) and not e.code:
            logger.info("engine core stops: SIGTERM")
        else:
            logger.exception("the engine core loop failed")
            status = _report_death(outbox, f"the engine core failed: {e!r}")
    _close(engine, context)
    sys.exit(status)


def _report_death(outbox: zmq.Socket, reason: str) -> int:
    logger.error("the engine core cannot go on: %s", reason)
    try:
        outbox.send(encoder().encode(CoreDied(reason)), zmq.NOBLOCK)
    except zmq.ZMQError:
        pass
    return 1


def _close(engine: LLMEngine | None, context: zmq.Context) -> None:
    if engine is not None:
        try:
            engine.shutdown()  # the tensor-parallel ranks under it
        except Exception:
            logger.exception("engine shutdown failed")
    context.destroy(linger=1000)  # the last outputs (a CoreDied) get a second to leave
