"""FrontendEngine: LLMEngine's surface over an engine core in its own process.

    front end (this process)                      engine core (its own process)
    tokenize, check -> AddRequest  ----------->   schedule -> run -> update, in a busy loop
    detokenize, stop strings, outputs <-------    StepOutputs (new ids per sample, stats)
    a stop string found -> FinishSamples ----->   frees that sample's blocks

`LLM(engine_core="process")` and `pagedkv serve` drive it exactly as they
drive the in-process `LLMEngine`: `add_request`, `abort_request`, `step`
(which here waits for the core's next outputs instead of computing them),
`get_stats`. The core never waits on this side: while the front end
detokenizes one step's tokens, the core computes the next.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import torch

from pagedkv.bad_words import bad_words_token_ids
from pagedkv.beam_search import BeamSearchParams, beam_params_to_wire
from pagedkv.config import EngineArgs
from pagedkv.core.sequence import OutputKind
from pagedkv.engine.core_client import EngineCoreClient
from pagedkv.engine.core_messages import (
    AbortRequests,
    AddRequest,
    FinishSamples,
    GrammarVocab,
    Inspect,
    Inspection,
    StepOutputs,
    TokenizerEos,
    lora_to_wire,
    pack_ids,
    params_to_wire,
    pooling_to_wire,
)
from pagedkv.engine.core_process import stats_from_wire
from pagedkv.engine.cpu_binding import CpuBinding, plan_cpu_binding
from pagedkv.engine.llm_engine import EngineStats
from pagedkv.engine.output_processor import OutputProcessor, RequestState
from pagedkv.engine.request_checks import PromptType, RequestLimits, tokenize_prompt
from pagedkv.lora.request import LoRARequest
from pagedkv.model.loader import load_tokenizer, resolve_model
from pagedkv.outputs import RequestMetrics, RequestOutput
from pagedkv.pooling_params import PoolingParams, placeholder_sampling_params
from pagedkv.sampling_params import SamplingParams
from pagedkv.structured_outputs import GrammarCompiler, StructuredOutputsParams, dump_grammar

logger = logging.getLogger(__name__)


class FrontendEngine:
    """Requests in, outputs out, with the model in an engine-core process. Not thread-safe (one driver)."""

    def __init__(self, args: EngineArgs, cpu_binding: CpuBinding | None = None) -> None:
        """cpu_binding: where the core computes (default: `args.cpu_threads_bind`; nothing is pinned under
        tensor parallelism, whose ranks split the CPUs themselves)."""
        self.args = args
        source = resolve_model(args.model)
        self.tokenizer = None
        binding = cpu_binding or self._plan_binding(args)
        self.cpu_binding = binding

        def load_tokenizer_meanwhile() -> None:  # ~3 s for the default model: the core starts beside it
            if not args.skip_tokenizer_init:
                self.tokenizer = load_tokenizer(source, args.tokenizer)

        self.client = EngineCoreClient.start(
            dict(args=args, cpu_binding=list(binding.core) if binding.core else None,
                 log_level=logging.getLogger().level), while_starting=load_tokenizer_meanwhile)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.client.send(TokenizerEos([] if eos is None else [eos]))
        facts = self.client.facts
        self.model_name, self.model_config = facts.model_name, facts.model_config
        self.scheduler_config, self.cache_config = facts.scheduler_config, facts.cache_config
        self.default_sampling = facts.default_sampling
        self.eos_token_ids = facts.eos_token_ids | ({eos} if eos is not None else set())
        self.dtype = getattr(torch, facts.dtype.removeprefix("torch."))
        self.device = torch.device(facts.device)
        self.kv_spec = facts.kv_spec
        self.pooler, self.runner_type = facts.pooler, facts.runner_type
        self.limits = RequestLimits(self.model_config.vocab_size, self.scheduler_config.max_model_len,
                                    self.scheduler_config.max_num_seqs, args.max_logprobs, facts.runner_type,
                                    facts.pooler)
        self.processor = OutputProcessor(self.tokenizer)
        self._request_ids = itertools.count()
        self._stats = EngineStats(0, 0, 0, facts.num_gpu_blocks, 0, 0.0, 0, 0, 0, 0, 0)
        self._inspections: deque[Future] = deque()  # asked, not answered yet (the core answers in order)
        self._held: list[RequestOutput] = []  # outputs read while a LoRA call waited (pagedkv.engine.frontend._call)
        self._grammars: GrammarCompiler | None = None  # structured outputs: built at the first request needing it

    @staticmethod
    def _plan_binding(args: EngineArgs) -> CpuBinding:
        if args.tensor_parallel_size > 1 or args.device.startswith("cuda"):
            return CpuBinding(None, None)
        return plan_cpu_binding(args.cpu_threads_bind)

    # --- what LLMEngine offers too ------------------------------------------------------------------------------
    @property
    def requests(self) -> dict[str, RequestState]:
        return self.processor.requests

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.default_sampling)

    def validate_params(self, params: SamplingParams | BeamSearchParams | PoolingParams) -> None:
        self.limits.check_params(params)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

    def add_request(self, request_id: str | None, prompt: PromptType,
                    params: SamplingParams | BeamSearchParams | PoolingParams | None = None,
                    arrival_time: float | None = None,
                    cache_salt: str | None = None, output_kind: OutputKind = OutputKind.CUMULATIVE,
                    lora_request: LoRARequest | None = None) -> RequestState:
        """Checks and sends a prompt to the core. Raises ValueError (and sends nothing) for a request that can
        never run. A BeamSearchParams runs a beam search: one output, when it finishes (the core also checks
        that its beams fit in the pool). lora_request: the core reads the adapter; one that cannot run fails
        the request there (its output carries the reason). A PoolingParams runs a pooling request (its one
        output carries the vector: `RequestOutput.pooled`)."""
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        params = params or self.get_default_sampling_params()
        request_id = str(next(self._request_ids)) if request_id is None else str(request_id)
        if request_id in self.processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize(prompt)
        if isinstance(params, PoolingParams):
            return self._add_pooling(request_id, text, token_ids, params, arrival_time, cache_salt, output_kind,
                                     lora_request)
        self.limits.check_request(token_ids, params, cache_salt)
        beam = None
        if isinstance(params, BeamSearchParams):
            beam, params = beam_params_to_wire(params), params.to_sampling_params()
        grammar = self._compile(params.structured_outputs) if params.structured_outputs is not None else None
        if params.bad_words is not None and params.bad_words_token_ids is None:  # the core has no tokenizer
            params = dataclasses.replace(params, bad_words_token_ids=bad_words_token_ids(
                self.tokenizer, params.bad_words, None))
        arrival = arrival_time or time.time()
        state = RequestState(request_id, text, token_ids, params, output_kind, RequestMetrics(arrival))
        self.client.send(AddRequest(request_id, pack_ids(token_ids), params_to_wire(params), arrival, cache_salt,
                                    beam, grammar, lora_to_wire(lora_request)))
        self.processor.add(state)
        return state

    def _add_pooling(self, request_id: str, text: str | None, token_ids: list[int], params: PoolingParams,
                     arrival_time: float | None, cache_salt: str | None, output_kind: OutputKind,
                     lora_request: LoRARequest | None) -> RequestState:
        token_ids = params.truncate(token_ids, self.scheduler_config.max_model_len)
        self.limits.check_request(token_ids, params, cache_salt)
        arrival = arrival_time or time.time()
        # Its samples as the core reports them: one, ending with "stop" and no token.
        state = RequestState(request_id, text, token_ids, placeholder_sampling_params(), output_kind,
                             RequestMetrics(arrival))
        self.client.send(AddRequest(request_id, pack_ids(token_ids), (), arrival, cache_salt,
                                    lora=lora_to_wire(lora_request), pooling=pooling_to_wire(params)))
        self.processor.add(state)
        return state

    def _compile(self, constraint: StructuredOutputsParams) -> str:
        """structured_outputs compiled here, where the tokenizer is (serialized for the core); the core gets the
        grammar vocabulary once, before the first grammar."""
        if self._grammars is None:
            compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
            self.client.send(GrammarVocab(compiler.vocab_json()))
            self._grammars = compiler
        return dump_grammar(self._grammars.compile(constraint))

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        known = [rid for rid in ids if self.processor.abort(rid) is not None]
        if known and self.client.is_alive:  # a dead core holds no blocks any more
            self.client.send(AbortRequests(known))

    def has_unfinished_requests(self) -> bool:
        return bool(self.processor.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.processor.requests)

    def get_stats(self) -> EngineStats:
        return self._stats

    def step(self, timeout_s: float | None = None) -> list[RequestOutput]:
        """The outputs of the core's next steps: waits up to `timeout_s` (None: until some come, or `wake()`).
        With nothing unfinished it returns at once, unless a timeout is given: then it waits that long for the
        core's news (its stats after a finish or an abort). Raises EngineDeadError when the core died."""
        outputs, self._held = self._held, []  # what came while a LoRA call waited for its answer
        if not self.processor.requests and timeout_s is None:
            return outputs
        for message in self.client.recv(timeout_s):
            if isinstance(message, Inspection):
                if self._inspections:
                    self._inspections.popleft().set_result(message.state)
                continue
            if isinstance(message, StepOutputs):
                if message.stats is not None:
                    self._stats = stats_from_wire(message.stats.values)
                new, stopped = self.processor.process(message.outputs)
                outputs.extend(new)
                if stopped:
                    self.client.send(FinishSamples(stopped))
        return outputs

    def request_inspection(self, answer: Future, what: str = "state", arg: Any = None) -> None:
        """Asks the core for `LLMEngine.inspect()` (or, what="kv_snapshot", `kv_snapshot()`; or runs "add_lora",
        "remove_lora", "list_loras" with `arg`: pagedkv.engine.core_messages.Inspect); `answer` gets it when a
        later step reads the reply."""
        self._inspections.append(answer)
        self.client.send(Inspect(what, lora_to_wire(arg) if isinstance(arg, LoRARequest) else arg))

    # --- LoRA adapters, answered by the core (LLMEngine's methods) -----------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """The core reads the adapter; raises ValueError with the core's reason when it cannot run."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        return self._call("add_lora", lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._call("remove_lora", lora_int_id)

    def list_loras(self) -> set[int]:
        return set(self._call("list_loras", None))

    def _call(self, what: str, arg: Any, timeout_s: float = 300.0) -> Any:
        """Runs an engine method in the core from the thread that steps this front end (outputs that arrive
        meanwhile are kept for the next `step`)."""
        answer: Future = Future()
        self.request_inspection(answer, what, arg)
        deadline = time.monotonic() + timeout_s
        while not answer.done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine core did not answer {what} in {timeout_s:.0f} s")
            self._held = self.step(0.05)  # step returns the held outputs first
        reply = answer.result()
        if "error" in reply:
            raise ValueError(reply["error"])
        return reply["result"]

    def wake(self) -> None:
        """Ends a `step` that is waiting (any thread may call it)."""
        self.client.wake()

    def set_death_callback(self, callback: Callable[[], None]) -> None:
        """Called (from a watcher thread) as soon as the core process exits."""
        self.client.on_death = callback

    def wait_idle(self, timeout_s: float) -> None:
        """With nothing to step: takes the core's news (stats after an abort or a finish) for up to `timeout_s`
        or until `wake()`. Raises EngineDeadError if the core is gone."""
        self.step(timeout_s)

    def shutdown(self) -> None:
        """Stops the core (and the tensor-parallel ranks under it)."""
        self.client.close()

    @property
    def core_pid(self) -> int:
        return self.client.process.pid
