"""LLMEngine: requests in, tokens out, one step at a time.

    step = schedule -> execute -> update

`add_request` tokenizes and queues a prompt; `step` asks the scheduler for
a batch, runs it on the model and samples, hands the sampled tokens back to
the scheduler (`update_from_output`: it appends them, stops the sequences
that are done by id or length and frees their blocks), then applies text
(incremental detokenization, stop strings) and returns the outputs of the
requests that moved. vLLM's LLMEngine has the same surface.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedkv.bad_words import bad_words_token_ids
from pagedkv.beam_search import BeamSearchParams
from pagedkv.config import EngineArgs, GiB, KVEventsConfig, ModelConfig
from pagedkv.core.beam_search import BeamGroup
from pagedkv.core.prefix_diagnostics import PrefixDivergenceDetector
from pagedkv.core.scheduler import Scheduler, SchedulerOutput, StepUpdate
from pagedkv.core.sequence import OutputKind, Request, Sequence, SequenceStatus
from pagedkv.distributed.launch import start_tensor_parallel
from pagedkv.distributed.runtime import TPRuntime
from pagedkv.engine.detokenizer import (
    TokenTexts,
    completion_output,
    final_text,
    find_stop_string,
    needs_text,
    update_text,
)
from pagedkv.engine.device_setup import build_device_side
from pagedkv.engine.engine_stats import EngineStats
from pagedkv.engine.kv_advice import KVAdvisor
from pagedkv.engine.kv_events import MEDIUM_CPU, KVEventEmitter
from pagedkv.engine.kv_offload import KVOffload
from pagedkv.engine.kv_snapshot import build_snapshot
from pagedkv.engine.memory_pool import KVCachePlan
from pagedkv.engine.prompt_logprobs import PromptLogits, max_scored_tokens
from pagedkv.engine.prompt_logprobs import take_for_output as take_prompt_logprobs
from pagedkv.engine.request_checks import PromptType, RequestLimits, tokenize_prompt
from pagedkv.engine.worker import serve_steps
from pagedkv.errors import EngineDeadError
from pagedkv.lora.request import LoRARequest
from pagedkv.model.loader import LoadedModel, generation_defaults, read_hf_config, resolve_model
from pagedkv.outputs import CompletionOutput, RequestMetrics, RequestOutput, SamplerOutput
from pagedkv.pooler import PoolingState, checkpoint_pooler, resolve_runner
from pagedkv.pooling_params import PoolingParams, placeholder_sampling_params
from pagedkv.sampling_params import SamplingParams
from pagedkv.structured_outputs import GrammarCompiler, new_matcher

logger = logging.getLogger(__name__)

MAX_STEP_TIMES = 1 << 16



@dataclass(slots=True)
class _Counters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    peak_used_blocks: int = 0
    num_steps: int = 0
    num_failed_steps: int = 0
    # The latest steps' forward + sampling times (bounded: a server steps forever). Benchmarks take the last
    # `num_steps - before` entries of a run.
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_STEP_TIMES))


def _start_tensor_parallel(args: EngineArgs, loaded: LoadedModel | None) -> TPRuntime | None:
    """Checks the size against the model, then starts (or joins) the ranks; None on one device."""
    tp = args.tensor_parallel_size
    if tp == 1:
        return None
    if loaded is not None:
        raise ValueError("loaded_model cannot serve a tensor-parallel engine: each rank loads its own shard")
    source = resolve_model(args.model)
    if source.gguf_file:
        raise ValueError("tensor parallelism loads safetensors checkpoints shard by shard; a GGUF file would be "
                         "dequantized whole on every rank: save it as safetensors first")
    ModelConfig.from_hf(read_hf_config(source, args.hf_overrides)).check_tensor_parallel_size(tp)
    return start_tensor_parallel(tp, args.device, functools.partial(serve_steps, args))


class LLMEngine:
    """The paged-KV inference engine: a model, its KV-cache pool, a block manager, a scheduler."""

    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None) -> None:
        """loaded: a model already in memory (not with tensor parallelism, where each rank loads its shard)."""
        if not isinstance(args.max_logprobs, int) or args.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an int >= 0, got {args.max_logprobs!r}")
        self._check_generation_config(args)
        self.args = args
        self.tp = _start_tensor_parallel(args, loaded)
        try:
            self._build(args, loaded)
        except BaseException:
            if self.tp is not None:
                self.tp.abort()
            raise

    def _build(self, args: EngineArgs, loaded: LoadedModel | None) -> None:
        device_side = build_device_side(args, self.tp, loaded)
        loaded = device_side.loaded
        self.model, self.tokenizer, self.model_name = loaded.model, loaded.tokenizer, loaded.name
        self.dtype, self.device, self.eos_token_ids = loaded.dtype, loaded.device, loaded.eos_token_ids
        self.model_config = self.model.config
        self.cache_config, self.scheduler_config = device_side.cache_config, device_side.scheduler_config
        self.default_sampling = self._sampling_defaults(args, loaded)
        self.kv_spec = device_side.plan.spec
        self.pooler = checkpoint_pooler(loaded.source_path, args.hf_overrides, self.model_config.hidden_size,
                                        args.pooler_config)
        self.runner_type = resolve_runner(args.runner, self.model_config.has_lm_head)
        if self.runner_type == "pooling" or args.pooler_config is not None:
            logger.info("runner %s: %s", self.runner_type, self.pooler.describe())
        self.limits = RequestLimits(self.model_config.vocab_size, self.scheduler_config.max_model_len,
                                    self.scheduler_config.max_num_seqs, args.max_logprobs, self.runner_type,
                                    self.pooler)
        self.block_manager, self.runner = device_side.block_manager, device_side.runner
        lora_config = args.lora_config()
        self.scheduler = Scheduler(self.scheduler_config, self.cache_config, self.block_manager, self.eos_token_ids,
                                   max_scored_tokens(self.model_config.vocab_size, self.cache_config.block_size),
                                   max_loras=lora_config.max_loras if lora_config is not None else None,
                                   speculative=args.speculative_config)
        self._log_cache(device_side.plan)
        self._request_ids = itertools.count()
        # The EOS a beam search's candidates finish on: the tokenizer's, as in vLLM (a core process without a
        # tokenizer gets it with each request).
        self.beam_eos_token_id = getattr(self.tokenizer, "eos_token_id", None)
        self.requests: dict[str, Request] = {}
        self.counters = _Counters()
        self.prefix_diagnostics = (PrefixDivergenceDetector(self.cache_config.block_size)
                                   if self.cache_config.enable_prefix_caching else None)
        self.kv_offload = KVOffload.build(self.cache_config, self.kv_spec, self.block_manager, self.runner,
                                          self.model_config, self.dtype, loaded.source_path)
        events = KVEventsConfig.parse(args.kv_events_config)
        self.kv_events: KVEventEmitter | None = None
        if events is not None and events.enabled:
            self.block_manager.enable_kv_events()
            self.kv_events = KVEventEmitter(events, self.cache_config.block_size)
        self.kv_advisor = KVAdvisor(self.cache_config, self.scheduler_config)
        self._grammar_compiler: GrammarCompiler | None = None  # structured outputs: built when first needed
        # Logprob.decoded_token of the logprobs it returns (none without a tokenizer: an engine core's front end
        # fills them).
        self.token_texts = TokenTexts(self.tokenizer) if self.tokenizer is not None else None
        self.kv_trace = None  # a KVTraceRecorder (pagedkv.engine.kv_trace): snapshots after steps, e.g. --kv-trace

    @staticmethod
    def _check_generation_config(args: EngineArgs) -> None:
        """A generation_config folder without the file is refused before anything loads."""
        folder = args.generation_config
        if folder not in ("auto", "vllm") and not (Path(folder) / "generation_config.json").is_file():
            raise ValueError(f"generation_config={folder!r}: no generation_config.json there "
                             f"(use 'auto' for the checkpoint's, 'vllm' for vLLM's defaults, or a folder)")

    @staticmethod
    def _sampling_defaults(args: EngineArgs, loaded: LoadedModel) -> dict[str, Any]:
        if args.generation_config == "vllm":
            return {}
        folder = loaded.source_path if args.generation_config == "auto" else Path(args.generation_config)
        defaults = generation_defaults(folder)
        if defaults:
            logger.info("sampling defaults from %s/generation_config.json: %s", folder, defaults)
        return defaults

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation-config defaults (vLLM's defaults where it sets none)."""
        return SamplingParams(**self.default_sampling)

    # --- set-up -----------------------------------------------------------------
    def _log_cache(self, plan: KVCachePlan) -> None:
        cc, sc, spec = self.cache_config, self.scheduler_config, plan.spec
        tokens = plan.num_blocks * cc.block_size
        per_device = f" per device (x{self.tp.world_size} ranks)" if self.tp else ""
        logger.info("KV cache%s: kv_cache_dtype %s, %d blocks x %d tokens = %d tokens, %d bytes a token (%.2f GiB); "
                    "max concurrency at max_model_len=%d: %.1fx; swap: %d CPU blocks; prefix caching %s", per_device,
                    spec.cache_dtype, plan.num_blocks, cc.block_size, tokens, spec.bytes_per_token,
                    plan.num_blocks * spec.bytes_per_block / GiB, sc.max_model_len, tokens / sc.max_model_len,
                    plan.num_cpu_blocks,
                    "on" if cc.enable_prefix_caching else "off")

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers (a no-op on one device). The engine cannot step afterwards."""
        if self.kv_offload is not None:
            self.kv_offload.close()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.tp is not None:
            self.tp.shutdown()

    # --- requests -----------------------------------------------------------------
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text, token ids, or {"prompt_token_ids": [...]} / {"prompt": str}."""
        return tokenize_prompt(self.tokenizer, prompt)

    def validate_params(self, params: SamplingParams | BeamSearchParams | PoolingParams) -> None:
        """Refuses what the model or the engine's limits rule out (SamplingParams checked the rest itself)."""
        self.limits.check_params(params)

    def _validate(self, request_id: str, token_ids: list[int],
                  params: SamplingParams | BeamSearchParams | PoolingParams, cache_salt: str | None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.limits.check_request(token_ids, params, cache_salt, self.block_manager.num_total_gpu_blocks,
                                  self.cache_config.block_size)

    def add_request(self, request_id: str | None, prompt: PromptType,
                    params: SamplingParams | BeamSearchParams | PoolingParams | None = None,
                    arrival_time: float | None = None,
                    cache_salt: str | None = None, output_kind: OutputKind = OutputKind.CUMULATIVE,
                    beam_eos_token_id: int | None = None, grammar: Any = None,
                    lora_request: LoRARequest | None = None) -> Request:
        """Queues a prompt. Raises ValueError (and queues nothing) for a request that can never run.

        params: a BeamSearchParams runs a beam search (pagedkv.core.beam_search), whose one output comes when
        it finishes: its best hypotheses, best first. A PoolingParams runs a pooling request (pagedkv.pooler):
        its prompt is computed and its one output, when done, carries the pooled vector (`RequestOutput.pooled`).
        beam_eos_token_id: the EOS its candidates finish on (default: the tokenizer's). grammar:
        params.structured_outputs already compiled (an engine core gets it from its front end); else it is
        compiled here. lora_request: the LoRA adapter to run it with (the engine
        needs enable_lora; the adapter is read now, so one that cannot run is refused here).
        """
        params = params or self.get_default_sampling_params()
        request_id = str(next(self._request_ids)) if request_id is None else str(request_id)
        text, token_ids = self.tokenize(prompt)
        if isinstance(params, PoolingParams):
            token_ids = params.truncate(token_ids, self.scheduler_config.max_model_len)
        self._validate(request_id, token_ids, params, cache_salt)
        if lora_request is not None:
            self.add_lora(lora_request)
        pooling = None
        if isinstance(params, PoolingParams):  # its prompt only
            pooling = PoolingState(self.pooler, params, len(token_ids))
            params = placeholder_sampling_params()
        if isinstance(params, SamplingParams) and params.structured_outputs is not None and grammar is None:
            grammar = self._grammars().compile(params.structured_outputs)
        bad_words = (bad_words_token_ids(self.tokenizer, params.bad_words, params.bad_words_token_ids)
                     if isinstance(params, SamplingParams) else None)
        beam = None
        if isinstance(params, BeamSearchParams):
            eos = self.beam_eos_token_id if beam_eos_token_id is None else beam_eos_token_id
            beam = BeamGroup(params, eos, len(token_ids))
            params = params.to_sampling_params()
        extra = (cache_salt,) if cache_salt is not None else ()
        if lora_request is not None:  # blocks computed under an adapter are shared only under the same one
            extra += (lora_request.prefix_cache_key,)
        if self.prefix_diagnostics is not None:
            self.prefix_diagnostics.observe(token_ids, extra)
        req = Request(request_id, text, token_ids, params, RequestMetrics(arrival_time or time.time()),
                      output_kind, extra, beam=beam, bad_words_ids=bad_words, lora_request=lora_request,
                      pooling=pooling)
        for i in range(params.n):
            gen = None
            if params.seed is not None:  # seed + i may pass INT64_MAX: the generator takes any uint64
                gen = torch.Generator(device=self.device).manual_seed((params.seed + i) % (1 << 64))
            seq = Sequence(self.scheduler.next_seq_id(), req, i, list(token_ids), gen)
            if grammar is not None:  # each sample follows the grammar on its own
                seq.grammar = new_matcher(grammar, sorted(self.eos_token_ids))
            if i:
                seq.status = SequenceStatus.FORK_PENDING
            req.seqs.append(seq)
        self.requests[request_id] = req
        self.scheduler.add(req.seqs[0])
        return req

    # --- LoRA adapters (vLLM's methods) ------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Reads an adapter and keeps it in host memory (up to max_cpu_loras; the least recently used go first).
        Raises ValueError when the engine has no enable_lora or the adapter cannot run (the message says why)."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if self.runner.lora is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r}: the engine was started without LoRA "
                             "(enable_lora=True, --enable-lora)")
        self.runner.lora.register(lora_request, keep=self._live_lora_ids)
        return True

    def _live_lora_ids(self) -> set[int]:
        """The adapters of unfinished requests (their host copies stay)."""
        return {r.lora_request.lora_int_id for r in self.requests.values() if r.lora_request is not None}

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forgets an adapter: its host copy and its slot (False if not held). As in vLLM, requests still running
        with it are not stopped: the next step that schedules one reads the adapter again."""
        if self.runner.lora is None:
            return False
        return self.runner.lora.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters held in host memory."""
        return set(self.runner.lora.loaded_ids) if self.runner.lora is not None else set()

    def lora_call(self, what: str, arg: Any) -> dict:
        """add_lora(arg) / remove_lora(arg) / list_loras() as a reply for a front end: {"result": ...}, or
        {"error": reason} for an adapter that cannot run (the engine-core process and the server's engine thread
        answer their callers with it)."""
        try:
            if what == "add_lora":
                return {"result": self.add_lora(arg)}
            if what == "remove_lora":
                return {"result": self.remove_lora(arg)}
            if what == "list_loras":
                return {"result": sorted(self.list_loras())}
        except ValueError as e:
            return {"error": str(e)}
        return {"error": f"unknown LoRA call {what!r}"}

    def _grammars(self) -> GrammarCompiler:
        """The structured-outputs compiler, built at the first request that needs it (~0.2 s)."""
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        return self._grammar_compiler

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stops requests now (finish reason "abort") and frees their blocks; unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            req = self.requests.pop(rid, None)
            if req is not None:
                self._finish_request(req, "abort")

    def finish_sequence(self, request_id: str, index: int, stop_reason: str | int | None = None) -> None:
        """Finishes sample `index` of a request now, with finish reason "stop" (and `stop_reason`), and frees its
        blocks: for a front end that found a stop string itself. The request finishes when all its samples have
        (no output is made for it here: the caller has the one it found the stop in). Unknown ids are ignored.

        Raises ValueError for a request whose samples have not forked yet (n > 1, its prompt not yet computed):
        none of them has any output to stop.
        """
        req = self.requests.get(request_id)
        if req is None or req.beam is not None or not 0 <= index < len(req.seqs) or req.seqs[index].is_finished:
            return  # a beam search's hypotheses have no stop strings (and its beams are not samples)
        if any(s.status is SequenceStatus.FORK_PENDING for s in req.seqs):
            raise ValueError(f"request {request_id!r} has not sampled its first token yet: nothing to stop")
        self.scheduler.abort(req.seqs[index], "stop", stop_reason)
        if req.finished:
            req.metrics.finished_time = time.time()
            del self.requests[request_id]

    def _finish_request(self, req: Request, reason: str) -> None:
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.abort(seq, reason)
        req.metrics.finished_time = time.time()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # --- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one batch; returns the outputs of the requests that produced tokens (per their output kind).

        A step that fails fails only its own requests (their outputs come back
        finished with reason "error" and `.error` set) and drops the blocks it
        had offered to the prefix cache, whose KV it never wrote; the engine
        goes on. Raises EngineDeadError when the engine cannot step again (a
        dead tensor-parallel rank, a device that no longer runs anything).
        """
        if self.tp is not None:
            self.tp.check_workers()
        self.block_manager.begin_step()
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        t0 = time.perf_counter()
        try:
            rows, logits, prompt = self.runner.execute_model(out)
        except Exception as e:
            died = self.tp.diagnose(e) if self.tp is not None else None
            if died is not None:
                raise died from e
            failed = self._fail_step(out, e)
            self._publish_kv_events()  # its evictions happened; its new blocks were taken back, not stored
            return failed
        self._publish_kv_events()
        sampled, errors = self._sample(rows, logits) if rows else (SamplerOutput([], []), [])
        scoring_failed = self._score_prompts(prompt) if prompt is not None else {}
        now = time.time()
        update = self.scheduler.update_from_output(out, rows, sampled, errors, now)
        # The step wrote its blocks' KV (accepted drafts' too, indexed by the update): the disk tier may take them.
        if self.kv_offload is not None:
            self.kv_offload.after_step(self.block_manager.step_cached_entries())
        self._count(out, len(rows) - update.num_dropped_rows, t0)
        if self.kv_trace is not None:
            self.kv_trace.maybe_record(self)
        update.failed.update(scoring_failed)
        self._finish_pooling(update)
        outputs = self._process_outputs(update, now)
        self._observe_advice(now)
        return outputs

    def _observe_advice(self, now: float) -> None:
        """Feeds the tuning advisor (pagedkv.engine.kv_advice) about once a second: O(running) then, O(1) else."""
        if self.kv_advisor.due(now):
            diag = self.prefix_diagnostics
            lens = [len(s.token_ids) for s in self.scheduler.running if s.status is SequenceStatus.RUNNING]
            self.kv_advisor.observe(self.get_stats(), now, lens, diag.num_warnings if diag else 0,
                                    diag.positions if diag else None)

    def _count(self, out: SchedulerOutput, num_tokens: int, t0: float) -> None:
        """One step's counters: num_tokens sampled tokens kept (rejected drafts' rows are not output)."""
        c = self.counters
        c.num_steps += 1
        c.step_times.append(time.perf_counter() - t0)
        c.prompt_tokens += sum(out.prefill_lens)
        c.generation_tokens += num_tokens
        c.peak_used_blocks = max(c.peak_used_blocks, self.block_manager.num_used_gpu_blocks)

    def _sample(self, rows: list[Sequence], logits: torch.Tensor) -> tuple[SamplerOutput, list[Exception | None]]:
        try:
            return self.runner.sample(rows, logits), [None] * len(rows)
        except Exception:
            logger.exception("sampling a batch of %d rows failed; sampling row by row to find the rows at fault",
                             len(rows))
            return self.runner.sample_each(rows, logits)

    @staticmethod
    def _finish_pooling(update: StepUpdate) -> None:
        """The vectors of the pooling requests the step completed (cut, normalized); one that fails fails alone."""
        for seq in update.finished:
            state = seq.request.pooling
            if state is None:
                continue
            try:
                state.finish()
            except Exception as e:
                update.failed[seq.request.request_id] = (seq.request, e)

    def _score_prompts(self, prompt: PromptLogits) -> dict[str, tuple[Request, Exception]]:
        """Appends the step's prompt logprobs to their requests (with each token's text, given a tokenizer);
        returns the requests whose scoring failed."""
        failed = {}
        for req, result in prompt.score():
            if isinstance(result, Exception):
                failed[req.request_id] = (req, result)
                continue
            if self.token_texts is not None:
                for entry in result:
                    self.token_texts.fill(entry)
            req.prompt_logprobs.extend(result)
        return failed

    def _fail_step(self, out: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """The forward failed: its requests fail, the rest go on (the cause is unknown, so all of this step's)."""
        self.counters.num_failed_steps += 1
        dropped = self.block_manager.uncache_step_blocks()
        failed = {s.request.request_id: s.request for s in out.seqs}
        # Sequences swapped out or in this step: their blocks' bytes moved (or not) in the failed step.
        for s in out.preempted:
            if s.status is SequenceStatus.SWAPPED:
                failed[s.request.request_id] = s.request
        logger.error("engine step failed (%d requests failed, %d blocks dropped from the prefix cache)",
                     len(failed), dropped, exc_info=error)
        outputs = self._fail_requests(list(failed.values()), f"the engine failed while running this request: "
                                                             f"{error!r}")
        self.check_health()
        return outputs

    def _fail_requests(self, requests: list[Request], message: str) -> list[RequestOutput]:
        outputs = []
        for req in requests:
            if self.requests.pop(req.request_id, None) is None:
                continue
            req.error = message
            self._finish_request(req, "error")
            output = self._make_output(req)
            if output is not None:
                outputs.append(output)
        return outputs

    def check_health(self) -> None:
        """Raises EngineDeadError unless the engine can still step: the ranks are alive, the device syncs, and
        (on one device) a one-token forward runs. It writes no KV (its slot is -1)."""
        try:
            if self.tp is not None:
                self.tp.check_workers()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # a device-side assert stays raised from here on
            if self.tp is None:
                self.runner.profile_run(1, 1)
        except EngineDeadError:
            raise
        except Exception as e:
            raise EngineDeadError(f"the engine cannot run a step any more: {e!r}") from e

    # --- after update_from_output: text, failures, outputs ----------------------------
    def _process_outputs(self, update: StepUpdate, now: float) -> list[RequestOutput]:
        """Text for the rows that got a token, then the outputs: failed requests first, then those that moved."""
        failed = dict(update.failed)
        self._apply_text(update.appended, failed, update.num_new)
        outputs = []
        for req, error in failed.values():
            logger.error("request %s failed in this step", req.request_id, exc_info=error)
            outputs.extend(self._fail_requests([req], f"the engine failed while running this request: {error!r}"))
        for rid, req in update.requests.items():
            if rid in failed:
                continue
            if req.finished:
                req.metrics.finished_time = now
                self.requests.pop(rid, None)
            output = self._make_output(req)
            if output is not None:
                outputs.append(output)
        return outputs

    def _apply_text(self, appended: list[Sequence], failed: dict[str, tuple[Request, Exception]],
                    num_new: dict[int, int]) -> None:
        """Each row's text, in row order; a row whose text raises (e.g. its tokenizer cannot decode it) fails its
        request alone, and that request's samples from that row on end with "error". num_new: tokens taken by
        the sequences that took more than one (speculative decoding)."""
        if self.tokenizer is None:
            return
        for i, seq in enumerate(appended):
            req = seq.request
            if req.request_id in failed or req.beam is not None or req.pooling is not None:
                # a beam search's text comes when it ends; a pooling request has none
                continue
            try:
                if seq.logprobs:
                    for entry in seq.logprobs[-num_new.get(seq.seq_id, 1):]:
                        self.token_texts.fill(entry)
                self._update_text(seq)
            except Exception as e:
                failed[req.request_id] = (req, e)
                # As when text came before the stop rules: these samples did not end by their own rule.
                for later in appended[i:]:
                    if later.request is req:
                        self.scheduler.finish(later, "error")

    def _update_text(self, seq: Sequence) -> None:
        """Streaming text and stop strings while the sequence runs; the whole text, once, when the others finish."""
        p = seq.request.params
        if needs_text(p, seq.request.output_kind):
            if seq.finish_reason == "stop":  # an id ended it: nothing of it is text
                return
            new = update_text(self.tokenizer, seq, p.skip_special_tokens)
            stop = find_stop_string(seq, len(new), p.stop_strings, p.include_stop_str_in_output)
            if stop is not None:  # also on the token that ended it by length: the stop string is the reason
                self.scheduler.finish(seq, "stop", stop)
        elif seq.is_finished:
            seq.text = final_text(self.tokenizer, seq.output_token_ids, p, seq.finish_reason, seq.stop_reason)

    def _make_output(self, req: Request) -> RequestOutput | None:
        kind = req.output_kind
        if (kind is OutputKind.FINAL_ONLY or req.beam is not None) and not req.finished:
            return None
        if req.beam is not None and req.beam.results is not None:
            completions = self._beam_completions(req)
        else:
            holdback = req.params.stop_holdback
            completions = [completion_output(seq, kind, holdback) for seq in req.seqs
                           if seq.status is not SequenceStatus.FORK_PENDING]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions, req.finished,
                             req.metrics, req.metrics.num_cached_tokens, req.error,
                             take_prompt_logprobs(req, req.num_prompt_tokens, kind),
                             req.pooling.result if req.pooling is not None else None)

    def _beam_completions(self, req: Request) -> list[CompletionOutput]:
        """A finished beam search's hypotheses, best first (text without the EOS, when there is a tokenizer)."""
        p = req.params
        for h in req.beam.results:
            if self.tokenizer is not None:
                h.text = final_text(self.tokenizer, h.output_token_ids, p, h.finish_reason, h.stop_reason)
        return [completion_output(h, OutputKind.FINAL_ONLY, 0) for h in req.beam.results]

    def inspect(self) -> dict[str, Any]:
        """What the engine holds right now, for tests and debugging (plain values, so it crosses a process
        boundary): requests, queues, per-request prompt progress, the block manager's sequences and blocks,
        per-sequence prefix-cache state, the EOS ids it stops on, and whether the block manager's invariants
        hold."""
        bm, sched = self.block_manager, self.scheduler
        try:
            bm.check_invariants()
            invariants = None
        except Exception as e:  # reported, not raised: the caller asks what is wrong
            invariants = repr(e)
        progress = [[s.num_computed_tokens, s.num_prompt_tokens] for s in sched.running if not s.is_finished]
        return {"requests": sorted(self.requests),
                "waiting": len(sched.waiting), "swapped": len(sched.swapped),
                "running_unfinished": sum(1 for s in sched.running if not s.is_finished),
                "prompt_progress": progress, "block_manager_seqs": list(bm.seq_ids()),
                "used_blocks": bm.num_used_gpu_blocks, "prefix_cache_seqs": bm.num_prefix_cache_seqs,
                # Table entries the sliding window released (0 without one): held blocks = tables - these.
                "dropped_blocks": sum(bm.num_dropped_blocks(s) for s in bm.seq_ids()),
                "eos_token_ids": sorted(self.eos_token_ids), "beam_eos_token_id": self.beam_eos_token_id,
                "invariants_error": invariants}

    def _publish_kv_events(self) -> None:
        """The step's changes to the prefix index as one KV event batch (pagedkv.engine.kv_events)."""
        if self.kv_events is None:
            return
        log = self.block_manager.take_kv_events()
        if log.cleared:
            self.kv_events.cleared()
        self.kv_events.removed(log.removed)
        self.kv_events.removed(log.removed_host, MEDIUM_CPU)
        self.kv_events.stored(log.stored, log.stored_extra_keys)
        self.kv_events.stored_host(log.stored_host)
        self.kv_events.flush()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block (running requests keep theirs; the host tier empties, disk files stay) and
        zeroes the hit counters; publishes AllBlocksCleared with KV events on. vLLM's method; True when done."""
        self.block_manager.reset_prefix_cache()
        self._publish_kv_events()
        return True

    def kv_snapshot(self) -> dict[str, Any]:
        """The KV cache now (block states, tables, queues, stats) as a JSON-able dict: pagedkv.engine.kv_snapshot."""
        return build_snapshot(self)

    # --- stats ---------------------------------------------------------------------------
    def _spec_fields(self) -> dict[str, Any]:
        spec = self.scheduler.spec_counts
        return {"spec_num_drafts": spec.num_drafts, "spec_num_draft_tokens": spec.num_draft_tokens,
                "spec_num_accepted_tokens": spec.num_accepted_tokens,
                "spec_accepted_per_pos": tuple(spec.accepted_per_pos)}

    def get_stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        pc = bm.prefix_cache_stats
        lora: dict[str, str] = {}
        if self.runner.lora is not None:  # the adapters of the running and waiting (or swapped) requests, by name

            def names(seqs: Iterable[Sequence]) -> str:
                return ",".join(sorted({s.request.lora_request.lora_name for s in seqs
                                        if s.request.lora_request is not None}))

            lora = {"running_lora_adapters": names(s for s in sched.running if s.status is SequenceStatus.RUNNING),
                    "waiting_lora_adapters": names(itertools.chain(sched.waiting, sched.swapped))}
        return EngineStats(
            num_running=sum(1 for s in sched.running if s.status is SequenceStatus.RUNNING),
            num_waiting=len(sched.waiting), num_swapped=len(sched.swapped),
            num_gpu_blocks=bm.num_total_gpu_blocks, num_used_gpu_blocks=bm.num_used_gpu_blocks,
            kv_cache_usage=bm.gpu_usage, prefix_cache_queries=pc.queries, prefix_cache_hits=pc.hits,
            num_preemptions=sched.num_preemptions, prompt_tokens=self.counters.prompt_tokens,
            generation_tokens=self.counters.generation_tokens, peak_used_gpu_blocks=self.counters.peak_used_blocks,
            prefix_divergence_warnings=self.prefix_diagnostics.num_warnings if self.prefix_diagnostics else 0,
            **self._spec_fields(),
            **(self.kv_offload.stats_fields() if self.kv_offload is not None else {}), **lora)
