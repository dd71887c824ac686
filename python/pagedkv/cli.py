"""The `pagedkv` command line: `pagedkv generate` runs the engine on a few prompts, `pagedkv serve` serves it."""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import time

from pagedkv.kv_cache import KV_CACHE_DTYPES

DEFAULT_PROMPTS = [
    "The capital of France is",
    "Write a haiku about paged memory.",
    "Explain in one sentence why a KV cache speeds up text generation.",
    "List three prime numbers:",
]
SYSTEM_PROMPT = ("You are a concise assistant for engineers who run language models in production. "
                 "Answer in at most two sentences, and prefer concrete numbers to adjectives.")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags, under vLLM's names."""
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint folder (config.json + safetensors) or .gguf file; default: SmolLM2-135M-Instruct")
    p.add_argument("--model", dest="model_opt", default=None, help="same as the positional MODEL")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache (CPU default 4 GiB)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="most prompt tokens one sequence takes in a step (0: no cap)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32])
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV-cache storage: auto (the compute dtype), fp8 (= fp8_e4m3) or fp8_e5m2 with per-layer "
                        "scales, or int8/int4 with a (scale, zero) pair per token and KV head")
    p.add_argument("--calculate-kv-scales", action=argparse.BooleanOptionalAction, default=None,
                   help="fp8: compute the per-layer scales from the first batch (--no-calculate-kv-scales: the "
                        "checkpoint's or 1.0); default: computed only when the checkpoint has none")
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--swap-space", type=float, default=4, help="GiB of CPU memory for swapped-out blocks")
    p.add_argument("--kv-offloading-size", type=float, default=None,
                   help="GiB of host memory for prefix-cache blocks evicted from the pool (vLLM's; needs "
                        "--enable-prefix-caching)")
    p.add_argument("--kv-cache-dir", default=None,
                   help="directory of prefix-cache block files, written through and read back after a restart "
                        "(one subdirectory per model and cache setting; needs --enable-prefix-caching)")
    p.add_argument("--kv-events-config", default=None,
                   help="KV cache events for routers, vLLM's JSON: e.g. '{\"enable_kv_cache_events\": true, "
                        "\"endpoint\": \"tcp://*:5557\", \"topic\": \"kv\"}' (needs --enable-prefix-caching)")
    p.add_argument("--hf-overrides", default=None,
                   help="keys set over the checkpoint's config.json, a JSON object (vLLM's): e.g. '{\"rope_scaling\": "
                        "{\"rope_type\": \"yarn\", \"factor\": 4.0, \"original_max_position_embeddings\": 32768}}'")
    p.add_argument("--kv-cache-dir-size", type=float, default=None,
                   help="GiB the --kv-cache-dir may hold (least recently used files go first); default: no limit")
    p.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run every step eagerly (no captured decode graphs)")
    p.add_argument("--max-logprobs", type=int, default=20, help="most logprobs a request may ask for (vLLM's)")
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults: 'auto' (the checkpoint's generation_config.json), 'vllm' (vLLM's), "
                        "or a folder holding a generation_config.json")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="shard the model over this many ranks (GPUs, or processes on the CPU); under torchrun, "
                        "its WORLD_SIZE")
    p.add_argument("--engine-core", default="auto", choices=["auto", "process", "inproc"],
                   help="where the engine core runs: its own process (serve's default) or this one (generate's)")
    p.add_argument("--cpu-threads-bind", default=None,
                   help="the engine core's compute CPUs: auto, all, nobind, or a list like 0-3,6 (vLLM's "
                        "VLLM_CPU_OMP_THREADS_BIND); default $PAGEDKV_CPU_THREADS_BIND, else auto")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT folders) beside the model: a request names one (serve: its "
                        "`model`, see --lora-modules)")
    p.add_argument("--max-loras", type=int, default=1, help="most LoRA adapters in one step (each a device slot)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="highest LoRA rank served (sizes the slots)")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="LoRA adapters kept in host memory, least recently used dropped first (default --max-loras)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as a JSON object (vLLM\'s): {"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    p.add_argument("--runner", choices=["auto", "generate", "pooling"], default="auto",
                   help="which requests the engine serves: auto (generation and embeddings), generate, or pooling "
                        "(embeddings only, as vLLM runs an embedding model)")
    p.add_argument("--convert", choices=["auto", "none", "embed"], default="auto",
                   help="embed: run the checkpoint as an embedding model (= --runner pooling)")
    p.add_argument("--pooler-config", default=None, metavar="JSON",
                   help='how embeddings pool the final hidden states, as a JSON object (vLLM\'s): {"pooling_type": '
                        '"LAST" | "MEAN" | "CLS", "normalize": true, "dimensions": N}; default: the checkpoint\'s '
                        'sentence-transformers setting, else LAST, normalized')


def engine_kwargs(ns: argparse.Namespace) -> dict:
    return {"model": ns.model_opt or ns.model, "tokenizer": ns.tokenizer, "dtype": ns.dtype, "device": ns.device,
            "gpu_memory_utilization": ns.gpu_memory_utilization, "kv_cache_memory": ns.kv_cache_memory,
            "max_num_batched_tokens": ns.max_num_batched_tokens, "max_num_seqs": ns.max_num_seqs,
            "max_model_len": ns.max_model_len, "block_size": ns.block_size,
            "enable_prefix_caching": ns.enable_prefix_caching, "swap_space": ns.swap_space,
            "preemption_mode": ns.preemption_mode, "seed": ns.seed,
            "long_prefill_token_threshold": ns.long_prefill_token_threshold,
            "tensor_parallel_size": ns.tensor_parallel_size, "enforce_eager": ns.enforce_eager,
            "max_logprobs": ns.max_logprobs, "generation_config": ns.generation_config,
            "engine_core": ns.engine_core, "cpu_threads_bind": ns.cpu_threads_bind,
            "kv_cache_dtype": ns.kv_cache_dtype, "calculate_kv_scales": ns.calculate_kv_scales,
            "kv_offloading_size": ns.kv_offloading_size, "kv_cache_dir": ns.kv_cache_dir,
            "kv_cache_dir_size": ns.kv_cache_dir_size, "kv_events_config": ns.kv_events_config,
            "hf_overrides": ns.hf_overrides, "enable_lora": ns.enable_lora, "max_loras": ns.max_loras,
            "max_lora_rank": ns.max_lora_rank, "max_cpu_loras": ns.max_cpu_loras,
            "speculative_config": ns.speculative_config, "runner": ns.runner, "convert": ns.convert,
            "pooler_config": ns.pooler_config}


def cmd_generate(ns: argparse.Namespace) -> int:
    from pagedkv import LLM

    llm = LLM(**engine_kwargs(ns))
    trace = None
    try:
        trace = _start_kv_trace(llm, ns.kv_trace)
        _generate(llm, ns)
    finally:
        if trace is not None:
            trace.close()
            print(f"KV trace: {trace.num_records} snapshots in {trace.path} (view: pagedkv kv-view {trace.path})")
        llm.shutdown()
    return 0


def _start_kv_trace(llm, path: str | None):
    """--kv-trace FILE: a KVTraceRecorder on the engine (which must run in this process), or None."""
    if path is None:
        return None
    from pagedkv.engine.kv_trace import KVTraceRecorder
    from pagedkv.engine.llm_engine import LLMEngine

    if not isinstance(llm.llm_engine, LLMEngine):
        raise ValueError("--kv-trace records the engine in this process: use --engine-core inproc (the default)")
    llm.llm_engine.kv_trace = KVTraceRecorder(path)
    return llm.llm_engine.kv_trace


def _generate(llm, ns: argparse.Namespace) -> None:
    from pagedkv import SamplingParams

    params = SamplingParams(temperature=ns.temperature, top_p=ns.top_p, max_tokens=ns.max_tokens, seed=ns.seed)
    if ns.prompt:
        prompts = ns.prompt
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
    else:  # chat prompts that share a system prompt, so prefix caching has something to reuse
        tok = llm.get_tokenizer()
        prompts = DEFAULT_PROMPTS
        chats = [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}] for q in prompts]
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": tok.apply_chat_template(c, add_generation_prompt=True,
                                                                               tokenize=True, return_dict=False)}
                                for c in chats], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs, strict=True):
        print(f"\n>>> {prompt}")
        for c in out.outputs:
            print(f"{c.text.strip()}  [{len(c.token_ids)} tokens, {c.finish_reason}]")
        if out.error:
            print(f"error: {out.error}")
    print_stats(llm, outputs, elapsed)


def print_stats(llm, outputs, elapsed: float) -> None:
    s = llm.get_stats()
    engine = llm.llm_engine
    bs = engine.cache_config.block_size
    gen = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    print("\nKV cache")
    print(f"  blocks: {s.num_gpu_blocks} x {bs} tokens, {engine.kv_spec.bytes_per_token} bytes a token "
          f"(kv_cache_dtype {engine.kv_spec.cache_dtype}); "
          f"peak in use {s.peak_used_gpu_blocks} ({100 * s.peak_used_gpu_blocks / s.num_gpu_blocks:.1f}%)")
    print(f"  prefix cache: {'on' if engine.cache_config.enable_prefix_caching else 'off'}, hit rate "
          f"{100 * s.prefix_cache_hit_rate:.1f}% ({s.prefix_cache_hits} of {s.prefix_cache_queries} prompt tokens; "
          f"{cached} served from cache)")
    if s.tier_queries:
        print(f"  tiers below the pool: {s.tier_hits_host} prompt tokens from host memory, {s.tier_hits_disk} from "
              f"disk ({s.kv_offloaded_blocks} blocks offloaded, {s.kv_host_bytes_moved / 2**20:.1f} MiB moved to "
              f"and from host; disk: {s.kv_disk_files_written} files written, {s.kv_disk_bytes_read / 2**20:.1f} "
              f"MiB read in {s.kv_disk_load_seconds:.3f} s, {s.kv_disk_files_rejected} rejected)")
    print(f"  prompt tokens computed {s.prompt_tokens}, generated {gen}, preemptions {s.num_preemptions}; "
          f"{gen / elapsed:.1f} output tok/s over {elapsed:.2f} s")
    if s.spec_num_drafts:
        print(f"  speculative decoding: {s.spec_num_accepted_tokens} of {s.spec_num_draft_tokens} draft tokens "
              f"accepted ({100 * s.spec_num_accepted_tokens / s.spec_num_draft_tokens:.1f}%), "
              f"{1 + s.spec_num_accepted_tokens / s.spec_num_drafts:.2f} tokens per speculating step")
    advisor = getattr(engine, "kv_advisor", None)  # in-process engines only: a core process keeps its own
    advice = advisor.current() if advisor is not None else []
    if advice:
        print("\nTuning advice:\n" + "\n".join(f"  [{a['flag']}] {a['message']}" for a in advice))


def cmd_kv_calc(ns: argparse.Namespace) -> int:
    """Sizes the KV cache from a model's config.json (no weights loaded): see pagedkv.kv_calc."""
    from pagedkv.kv_calc import format_report, kv_calc, parse_bytes

    result = kv_calc(ns.model, ns.dtype, ns.block_size, ns.context,
                     None if ns.kv_cache_memory is None else parse_bytes(ns.kv_cache_memory),
                     None if ns.gpu_memory is None else parse_bytes(ns.gpu_memory), ns.gpu_memory_utilization,
                     ns.tensor_parallel_size, parse_bytes(ns.activation_memory), kv_cache_dtype=ns.kv_cache_dtype,
                     hf_overrides=ns.hf_overrides)
    print(result.to_json() if ns.json else format_report(result))
    return 0


def add_kv_calc_parser(sub) -> None:
    p = sub.add_parser("kv-calc", help="KV-cache bytes per token/block, blocks in a budget, max concurrency")
    p.add_argument("model", nargs="?", default=None,
                   help="HF config.json or checkpoint folder (only the config is read); default: SmolLM2-135M")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="compute dtype (weights, and the KV cache under --kv-cache-dtype auto); auto: the "
                        "checkpoint's (float16 when the config names none)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV-cache storage format (as pagedkv serve's); scale planes are counted")
    p.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32])
    p.add_argument("--context", type=int, default=None, help="tokens per sequence (default: the model's max)")
    p.add_argument("--kv-cache-memory", default=None, help="KV budget in bytes (e.g. 8GiB); overrides --gpu-memory")
    p.add_argument("--gpu-memory", default=None, help="device memory in bytes (e.g. 80GiB); weights are subtracted")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--activation-memory", default="0", help="bytes of activations to subtract too (default 0)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="devices; figures are per device")
    p.add_argument("--hf-overrides", default=None, help="keys set over the config.json, a JSON object (as serve's)")
    p.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    p.set_defaults(func=cmd_kv_calc)


def cmd_serve(ns: argparse.Namespace) -> int:
    """`pagedkv serve`: the OpenAI-compatible server (pagedkv.server)."""
    from pagedkv.config import EngineArgs
    from pagedkv.server import run_server

    return run_server(EngineArgs(**engine_kwargs(ns)), ns)


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with Prometheus /metrics")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; the first labels the metrics (default: MODEL as given)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters to serve (with --enable-lora), read at start: each name=path or a JSON "
                        "object '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; a request's `model` "
                        "picks one by name. $PAGEDKV_ALLOW_RUNTIME_LORA_UPDATING=1 adds POST /v1/load_lora_adapter "
                        "and /v1/unload_lora_adapter")
    p.add_argument("--api-key", nargs="+", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health and /metrics; several keys "
                        "(space- or comma-separated) are all accepted (default: $PAGEDKV_API_KEY)")
    p.add_argument("--protect-metrics", action="store_true", help="with --api-key: /metrics wants a key too")
    p.add_argument("--max-request-body-bytes", type=int, default=16 << 20,
                   help="larger request bodies get 413 (default 16 MiB)")
    p.add_argument("--max-json-nesting-depth", type=int, default=64,
                   help="request bodies nesting JSON arrays/objects deeper get 400 (default 64)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let chat requests with tools use tool_choice 'auto' (the default when tools are given): "
                        "the model decides, and --tool-call-parser finds its calls in the text")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="how tool calls are written in the model's output (hermes: <tool_call>{...}</tool_call>, "
                        "Qwen 2.5 / 3 and Hermes models; llama3_json: a reply of JSON calls, Llama 3.1+)")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens (off by default: it tells one tenant "
                        "which prompt prefixes another sent)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds the requests in flight get after SIGTERM/SIGINT before they are ended")
    p.add_argument("--dashboard-interval", type=float, default=0.5,
                   help="seconds between the KV-cache snapshots /dashboard/stream sends (default 0.5)")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.set_defaults(func=cmd_serve)


def cmd_kv_view(ns: argparse.Namespace) -> int:
    """`pagedkv kv-view FILE`: the /dashboard page over a --kv-trace file, with a time slider."""
    from pagedkv.server.api_server import parse_api_keys
    from pagedkv.server.dashboard import run_kv_view

    return run_kv_view(ns.trace, ns.host, ns.port, parse_api_keys(ns.api_key))


def add_kv_view_parser(sub) -> None:
    p = sub.add_parser("kv-view", help="serve the KV-cache dashboard over a trace recorded with --kv-trace")
    p.add_argument("trace", help="a file written by `pagedkv generate --kv-trace FILE` (.jsonl or .jsonl.gz)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", nargs="+", default=None, help="require a key, as pagedkv serve's --api-key")
    p.set_defaults(func=cmd_kv_view)


def _is_torchrun_worker() -> bool:
    from pagedkv.distributed import torchrun_env

    env = torchrun_env()
    return env is not None and env[0] != 0


def _run_torchrun_worker(ns: argparse.Namespace) -> int:
    """Ranks > 0 under torchrun run the steps rank 0 sends; rank 0 generates or serves."""
    from pagedkv.config import EngineArgs
    from pagedkv.distributed.launch import run_torchrun_worker
    from pagedkv.engine.worker import serve_steps

    args = EngineArgs(**engine_kwargs(ns))
    return run_torchrun_worker(args.tensor_parallel_size, args.device, functools.partial(serve_steps, args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for a few prompts and print KV-cache statistics")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a few chat prompts")
    gen.add_argument("--max-tokens", type=int, default=48)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--kv-trace", default=None, metavar="FILE",
                     help="record KV-cache snapshots of the run (JSON lines, gzip if FILE ends in .gz), for kv-view")
    gen.set_defaults(func=cmd_generate)
    add_serve_parser(sub)
    add_kv_calc_parser(sub)
    add_kv_view_parser(sub)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if ns.command in ("generate", "serve") and _is_torchrun_worker():
            return _run_torchrun_worker(ns)
        return ns.func(ns)
    except ValueError as e:  # bad settings: one clear line, no traceback
        print(f"pagedkv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
