"""The engine's counters as one snapshot (`EngineStats`), and the change between two of them (`IntervalStats`).

EngineStats is what logs, `/metrics`, the KV snapshot and the tuning advice read
(vLLM's names where it has them); it crosses the engine-core process boundary
as a tuple of its fields. IntervalStats turns two snapshots into the rates and
hit rate of the interval between them (the log line's and the advice's view).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineStats:
    """A snapshot for logs and metrics (vLLM's names where it has them)."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_gpu_blocks: int
    num_used_gpu_blocks: int
    kv_cache_usage: float  # fraction of blocks held by sequences
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of them, served from the cache
    num_preemptions: int
    prompt_tokens: int  # computed by the model (cache hits excluded)
    generation_tokens: int
    peak_used_gpu_blocks: int = 0
    prefix_divergence_warnings: int = 0  # prompts whose shared prefix a dynamic field breaks early
    # The prefix cache's tiers below the pool (pagedkv.engine.kv_offload; zeros when off). Tokens: prompt
    # tokens looked up beyond the pool (vLLM's external_prefix_cache_queries) and restored from each tier.
    tier_queries: int = 0
    tier_hits_host: int = 0
    tier_hits_disk: int = 0
    kv_offloaded_blocks: int = 0  # pool -> host copies of evicted cached blocks
    kv_restored_blocks_host: int = 0
    kv_restored_blocks_disk: int = 0
    kv_host_bytes_moved: int = 0
    kv_disk_files_written: int = 0
    kv_disk_bytes_written: int = 0
    kv_disk_bytes_read: int = 0
    kv_disk_load_seconds: float = 0.0
    kv_disk_files_rejected: int = 0  # corrupt, truncated or foreign files: never used
    kv_disk_write_errors: int = 0
    # LoRA adapters (vLLM's vllm:lora_requests_info labels): the names of those that requests now running / waiting
    # run with, sorted and comma-joined ("" without any, or without enable_lora).
    running_lora_adapters: str = ""
    waiting_lora_adapters: str = ""
    # Speculative decoding (vLLM's vllm:spec_decode_* counters; zeros when off): steps of a sequence that carried
    # drafts, the drafts, those accepted, and per draft position the accepted ones.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple = ()

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass(frozen=True, slots=True)
class IntervalStats:
    """What happened between two EngineStats snapshots `seconds` apart (counters as differences, gauges at the end)."""

    seconds: float
    prompt_tokens: int
    generation_tokens: int
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    prefix_cache_queries: int  # prompt tokens looked up in the interval
    prefix_cache_hits: int  # of them, served from the pool or from the host / disk tiers below it
    prefix_cache_hit_rate: float  # hits / queries of the interval (0.0 without queries)
    num_preemptions: int
    kv_cache_usage: float
    num_running: int
    num_waiting: int

    @classmethod
    def between(cls, prev: EngineStats, cur: EngineStats, seconds: float) -> IntervalStats:
        def delta(name: str) -> int:  # a counter that went back (a restarted source) counts from zero
            now, before = getattr(cur, name), getattr(prev, name)
            return now - before if now >= before else now

        prompt, gen = delta("prompt_tokens"), delta("generation_tokens")
        queries = delta("prefix_cache_queries")
        hits = delta("prefix_cache_hits") + delta("tier_hits_host") + delta("tier_hits_disk")
        per_s = 1.0 / seconds if seconds > 0 else 0.0
        return cls(seconds, prompt, gen, prompt * per_s, gen * per_s, queries, hits,
                   min(1.0, hits / queries) if queries else 0.0, delta("num_preemptions"), cur.kv_cache_usage,
                   cur.num_running, cur.num_waiting)
