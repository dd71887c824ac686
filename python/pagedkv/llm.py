"""LLM: offline generation with vLLM's interface (`from pagedkv import LLM, SamplingParams`)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from pagedkv.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedkv.config import EngineArgs
from pagedkv.core.sequence import OutputKind
from pagedkv.engine.llm_engine import EngineStats
from pagedkv.engine.make_engine import make_engine
from pagedkv.engine.request_checks import PromptType
from pagedkv.lora.request import LoRARequest
from pagedkv.model.loader import LoadedModel
from pagedkv.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from pagedkv.pooling_params import PoolingParams
from pagedkv.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    """A model with a paged KV cache, for batched offline generation.

    model=None runs the built-in default model (SmolLM2-135M-Instruct). The
    other arguments are vLLM's: the cache gets `kv_cache_memory` bytes (CPU
    default 4 GiB) or, on CUDA, `gpu_memory_utilization` of the device minus
    weights and activations; a step batches up to `max_num_seqs` sequences and
    `max_num_batched_tokens` tokens (longer prompts are prefilled in chunks);
    `enable_prefix_caching` reuses the KV blocks of identical prompt
    prefixes; `preemption_mode` ("recompute" or "swap", with `swap_space` GiB
    of CPU memory) says how sequences give up blocks when the cache is full.
    `kv_cache_dtype` stores the cache as "auto" (the compute dtype), "fp8"
    (= "fp8_e4m3") or "fp8_e5m2" with per-layer scales (the checkpoint's, or
    computed from the first batch: `calculate_kv_scales`), or
    "int8_per_token_head" / "int4_per_token_head" with a (scale, zero) pair
    per token and KV head: 2x to 3.5x the blocks of bf16 in the same memory.
    `tensor_parallel_size` shards the model over that many ranks (GPUs, or
    processes on the CPU; call it under `if __name__ == "__main__":`).
    `loaded_model` reuses a model already in memory (`LoadedModel.load`).
    `engine_core="process"` runs the engine core in a process of its own (as
    `pagedkv serve` does; then call it under `if __name__ == "__main__":`);
    the default runs it in this process, which is faster offline.
    `enable_lora` serves LoRA adapters (PEFT folders) named per request with
    a `LoRARequest`: at most `max_loras` different adapters in one step, of
    rank up to `max_lora_rank`, `max_cpu_loras` kept in host memory.
    `speculative_config={"method": "ngram", "num_speculative_tokens": k}`
    lets a decoding sequence check up to k draft tokens a step, drafted by
    prompt lookup in its own tokens (`prompt_lookup_min/max`); outputs are
    unchanged (pagedkv.spec_decode).
    `embed` returns one vector per prompt, pooled from the final hidden
    states as `pooler_config` says (default: the checkpoint's
    sentence-transformers setting, else the last token, L2-normalized);
    `runner="pooling"` (or `convert="embed"`) serves pooling requests only,
    as vLLM does for an embedding model (pagedkv.pooler).
    """

    def __init__(self, model: str | None = None, tokenizer: str | None = None, dtype: str = "auto",
                 device: str = "auto", gpu_memory_utilization: float = 0.9, kv_cache_memory: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, block_size: int = 16,
                 enable_prefix_caching: bool = False, swap_space: float = 4, preemption_mode: str = "recompute",
                 max_model_len: int | None = None, seed: int = 0, tensor_parallel_size: int = 1,
                 loaded_model: LoadedModel | None = None, **kwargs: Any) -> None:
        args = EngineArgs(model=model, tokenizer=tokenizer, dtype=dtype, device=device,
                          gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory=kv_cache_memory,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                          swap_space=swap_space, preemption_mode=preemption_mode, max_model_len=max_model_len,
                          seed=seed, tensor_parallel_size=tensor_parallel_size, **kwargs)
        self.llm_engine = make_engine(args, loaded_model, default_core="inproc")
        self._ids = 0

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers, if any (also done at interpreter exit)."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The checkpoint's generation-config sampling defaults (vLLM's where it sets none): what
        `generate(prompts)` uses without SamplingParams."""
        return self.llm_engine.get_default_sampling_params()

    def get_stats(self) -> EngineStats:
        return self.llm_engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix block (vLLM's method; in-process engine core only)."""
        reset = getattr(self.llm_engine, "reset_prefix_cache", None)
        if reset is None:
            raise NotImplementedError("reset_prefix_cache runs on an in-process engine core (engine_core='inproc')")
        return reset()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, cache_salt: str | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generates for every prompt (text, token ids, or {"prompt_token_ids": [...]}); outputs in prompt order.

        A prompt the engine refuses (too long, empty, bad token ids, an
        adapter that cannot run) gets a finished output with finish_reason
        "abort" and the reason in `.error`; the others run. lora_request: one
        adapter for every prompt, or one (or None) per prompt.
        """
        prompts = _prompt_list(prompts)
        loras = _per_prompt("lora_request", lora_request, len(prompts))
        if isinstance(sampling_params, BeamSearchParams):
            raise TypeError("generate takes SamplingParams; a BeamSearchParams runs through LLM.beam_search")
        params = _params_list(sampling_params, SamplingParams, self.get_default_sampling_params(), len(prompts))
        return self._submit_and_run("gen", prompts, params, loras, use_tqdm, cache_salt=cache_salt)

    def _submit_and_run(self, prefix: str, prompts: list[PromptType], params: list, loras: list,
                        use_tqdm: bool, **kwargs: Any) -> list[RequestOutput]:
        """Adds one FINAL_ONLY request per prompt (a refused one gets its error output), runs them all; outputs in
        prompt order."""
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        for prompt, p, lora in zip(prompts, params, loras, strict=True):
            rid = f"{prefix}-{self._ids}"
            self._ids += 1
            order.append(rid)
            try:
                self.llm_engine.add_request(rid, prompt, p, output_kind=OutputKind.FINAL_ONLY, lora_request=lora,
                                            **kwargs)
            except ValueError as e:
                logger.warning("request %s refused: %s", rid, e)
                results[rid] = _refused(rid, prompt, p if isinstance(p, SamplingParams) else SamplingParams(), str(e))
        self._run(results, len(order) - len(results), use_tqdm)
        return [results[rid] for rid in order]

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, use_tqdm: bool = True,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`.outputs.embedding`, a list of floats), in prompt order.

        The prompts run as pooling requests beside any others: batched flat with
        no padding, long ones in chunks, sharing cached prefixes (LAST pooling).
        A prompt the engine refuses gets an output with `.error` set and an
        empty embedding; the others run.
        """
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.outputs.data.tolist()), o.prompt_token_ids,
                                       o.finished, o.error)
                for o in self.encode(prompts, pooling_params, use_tqdm, lora_request, truncate_prompt_tokens)]

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, use_tqdm: bool = True,
               lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
               truncate_prompt_tokens: int | None = None,
               pooling_task: str = "embed") -> list[PoolingRequestOutput]:
        """Pooling requests for every prompt; `.outputs.data` is each one's float32 vector (`embed` gives lists)."""
        prompts = _prompt_list(prompts)
        loras = _per_prompt("lora_request", lora_request, len(prompts))
        params = _params_list(pooling_params, PoolingParams, PoolingParams(task=pooling_task), len(prompts))
        if truncate_prompt_tokens is not None:
            params = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        return [_pooling_output(o) for o in self._submit_and_run("embd", prompts, params, loras, use_tqdm)]

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """Beam search for every prompt (vLLM's signature); outputs in prompt order, best hypothesis first.

        Each prompt is one request inside the engine: its beams are sequences
        that share their blocks, scored each step in one batch with the
        others. `concurrency_limit`: at most this many prompts run at once.
        A prompt the engine refuses raises ValueError (nothing runs).
        """
        prompts = _prompt_list(prompts)
        loras = _per_prompt("lora_request", lora_request, len(prompts))
        limit = concurrency_limit or max(len(prompts), 1)
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"concurrency_limit must be an int >= 1 (or None), got {concurrency_limit!r}")
        outputs: list[BeamSearchOutput] = []
        for start in range(0, len(prompts), limit):
            outputs.extend(self._beam_batch(prompts[start:start + limit], params, use_tqdm,
                                            loras[start:start + limit]))
        return outputs

    def _beam_batch(self, prompts: list[PromptType], params: BeamSearchParams, use_tqdm: bool,
                    loras: list[LoRARequest | None]) -> list[BeamSearchOutput]:
        order: list[str] = []
        try:
            for prompt, lora in zip(prompts, loras, strict=True):
                rid = f"beam-{self._ids}"
                self._ids += 1
                self.llm_engine.add_request(rid, prompt, params, output_kind=OutputKind.FINAL_ONLY,
                                            lora_request=lora)
                order.append(rid)
        except ValueError:
            self.llm_engine.abort_request(order)
            raise
        results: dict[str, RequestOutput] = {}
        self._run(results, len(order), use_tqdm)
        tok = self.llm_engine.tokenizer
        outputs = []
        for rid, lora in zip(order, loras, strict=True):
            out = results[rid]
            if out.error is not None:
                raise RuntimeError(f"beam search of request {rid} failed: {out.error}")
            prompt_ids = list(out.prompt_token_ids)
            seqs = []
            for c in out.outputs:
                tokens = prompt_ids + list(c.token_ids)
                text = tok.decode(tokens, skip_special_tokens=params.skip_special_tokens) if tok else None
                seqs.append(BeamSearchSequence(tokens, list(c.logprobs or []), lora, c.cumulative_logprob or 0.0,
                                               text, c.finish_reason, c.stop_reason))
            outputs.append(BeamSearchOutput(seqs))
        return outputs

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Applies the checkpoint's chat template to one conversation (or a list of them) and generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.llm_engine.tokenizer
        prompts = [{"prompt_token_ids": list(tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt,
                                                                    tokenize=True, return_dict=False)),
                    "prompt": tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _run(self, results: dict[str, RequestOutput], total: int, use_tqdm: bool) -> None:
        engine = self.llm_engine
        bar = None
        if use_tqdm and total:
            from tqdm.auto import tqdm
            bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
        start, out_tokens = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    results[output.request_id] = output
                    out_tokens += sum(len(c.token_ids) for c in output.outputs)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix_str(f"output {out_tokens / (time.perf_counter() - start):.1f} tok/s")
        if bar is not None:
            bar.close()


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (text, token ids, a dict) or a sequence of them, as a list of prompts."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _params_list(value, cls: type, default, n: int) -> list:
    """One params object (or None: `default`) for every prompt, or a sequence of n of them."""
    if value is None or isinstance(value, cls):
        return [value or default] * n
    params = list(value)
    if len(params) != n:
        raise ValueError(f"got {len(params)} {cls.__name__} for {n} prompts")
    return params


def _per_prompt(name: str, value, n: int) -> list:
    """One value for every prompt, or a list of n (one per prompt)."""
    if value is None or not isinstance(value, (list, tuple)):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"got {len(value)} {name}s for {n} prompts")
    return list(value)


def _pooling_output(out: RequestOutput) -> PoolingRequestOutput:
    data = out.pooled if out.pooled is not None else torch.empty(0)
    return PoolingRequestOutput(out.request_id, PoolingOutput(data), list(out.prompt_token_ids), out.finished,
                                out.error)


def _refused(rid: str, prompt: PromptType, params: SamplingParams, error: str) -> RequestOutput:
    text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
    ids = list(prompt) if isinstance(prompt, list) else list(prompt.get("prompt_token_ids", [])) if isinstance(
        prompt, dict) else []
    outputs = [CompletionOutput(i, "", [], finish_reason="abort") for i in range(params.n)]
    now = time.time()
    return RequestOutput(rid, text, ids, outputs, True, RequestMetrics(now, finished_time=now), error=error)
