"""The tuning rules of pagedkv.engine.kv_advice: when each holds, and what it advises.

A rule has two parts: `holds(observation, configs)` judges one interval
(True, False, or None when the interval says nothing about it, e.g. no prompt
was looked up in the prefix cache), and `advise(stretch, configs)` turns a
sustained stretch of intervals where it held into (flag, message, numbers),
or None when the stretch as a whole does not bear the advice out. The
advisor owns the timing (sustain, once per condition, re-fire); rules are
pure functions of the numbers.

The thresholds come from the design notes (shared/MISSION.md, "Monitoring",
the memory-pool table, "Pitfalls users hit" and "Prefix caching").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedkv.config import CacheConfig, SchedulerConfig
    from pagedkv.engine.engine_stats import IntervalStats

# Rule 1: "Under 70% cache usage for long: KV under-used, raise max_num_seqs" (Monitoring).
UNDERUSED_USAGE = 0.70
# Rule 2: "above 95% for long: more memory or better prefix reuse" (Monitoring). The scheduler preempts only when
# it cannot get a block, so an interval with a preemption had a full pool at that moment: it counts as above 95%.
PRESSURE_USAGE = 0.95
# Rule 3: "block_size 32 can pay off when sequences are mostly > 4K" (the pool table), and "tiny blocks on 8K
# sequences make block tables large and slow to move host->device" (Pitfalls). "Mostly": over half.
LONG_SEQ_TOKENS = 4096
LONG_SEQ_SHARE = 0.5
SMALL_BLOCK_SIZES = (8, 16)
LARGE_BLOCK_SIZE = 32
# Rule 4: "timestamps or random ids in a system prompt destroy the hit rate" (Prefix caching). Near zero: under 5%.
LOW_HIT_RATE = 0.05
# Prompt tokens the stretch must have looked up before its hit rate means anything (a few prompts' worth).
MIN_QUERIED_TOKENS = 512


@dataclass(slots=True)
class Configs:
    """The settings the rules name in their advice."""

    cache: CacheConfig
    scheduler: SchedulerConfig


@dataclass(slots=True)
class Observation:
    """One interval, plus what the advisor measured beside EngineStats at its end."""

    interval: IntervalStats
    long_share: float | None  # share of running sequences beyond LONG_SEQ_TOKENS (None: lengths not given)
    longest_seq: int
    new_divergence_warnings: int  # prompts the prefix-divergence detector flagged in the interval
    divergence_positions: Mapping[int, int] = field(default_factory=dict)  # token position -> prompts flagged


@dataclass(slots=True)
class Stretch:
    """The intervals in a row where a rule held, summed up."""

    start: float
    intervals: int = 0
    seconds: float = 0.0
    preemptions: int = 0
    queries: int = 0
    hits: int = 0
    usage_min: float = 1.0
    usage_max: float = 0.0
    usage_sum: float = 0.0
    waiting_max: int = 0
    running_max: int = 0
    long_share_sum: float = 0.0
    longest_seq: int = 0
    divergence_warnings: int = 0
    divergence_positions: Mapping[int, int] = field(default_factory=dict)

    def add(self, obs: Observation) -> None:
        iv = obs.interval
        self.intervals += 1
        self.seconds += iv.seconds
        self.preemptions += iv.num_preemptions
        self.queries += iv.prefix_cache_queries
        self.hits += iv.prefix_cache_hits
        self.usage_min = min(self.usage_min, iv.kv_cache_usage)
        self.usage_max = max(self.usage_max, iv.kv_cache_usage)
        self.usage_sum += iv.kv_cache_usage
        self.waiting_max = max(self.waiting_max, iv.num_waiting)
        self.running_max = max(self.running_max, iv.num_running)
        self.long_share_sum += obs.long_share or 0.0
        self.longest_seq = max(self.longest_seq, obs.longest_seq)
        self.divergence_warnings += obs.new_divergence_warnings
        self.divergence_positions = obs.divergence_positions

    @property
    def usage_mean(self) -> float:
        return self.usage_sum / self.intervals if self.intervals else 0.0

    @property
    def hit_rate(self) -> float:
        return min(1.0, self.hits / self.queries) if self.queries else 0.0


Found = tuple[str, str, dict[str, Any]]  # flag, message, numbers


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    holds: Callable[[Observation, Configs], bool | None]
    advise: Callable[[Stretch, Configs], Found | None]


# --- rule 1: the pool is under-used while requests wait ---------------------------------------------------------
def _underused_holds(obs: Observation, cfg: Configs) -> bool:
    iv = obs.interval
    return iv.kv_cache_usage < UNDERUSED_USAGE and iv.num_waiting > 0


def _underused_advise(s: Stretch, cfg: Configs) -> Found:
    sc = cfg.scheduler
    numbers = {"kv_cache_usage_max": round(s.usage_max, 4), "waiting_max": s.waiting_max,
               "running_max": s.running_max, "seconds": round(s.seconds, 1), "max_num_seqs": sc.max_num_seqs,
               "max_num_batched_tokens": sc.max_num_batched_tokens}
    head = (f"KV cache under-used: at most {s.usage_max:.0%} of its blocks in use for {s.seconds:.0f} s while up to "
            f"{s.waiting_max} requests waited")
    if s.running_max >= sc.max_num_seqs:  # the sequence cap, not the pool, kept them waiting
        return "max_num_seqs", (f"{head} and {s.running_max} ran (the cap): raise max_num_seqs (now "
                                f"{sc.max_num_seqs})"), numbers
    # Below the cap with blocks to spare: the step's token budget admits the waiting prompts too slowly.
    return "max_num_batched_tokens", (f"{head} with only {s.running_max} of max_num_seqs={sc.max_num_seqs} "
                                      f"running: the step's token budget admits prompts slowly: raise "
                                      f"max_num_batched_tokens (now {sc.max_num_batched_tokens})"), numbers


# --- rule 2: the pool is full and sequences get preempted -------------------------------------------------------
def _pressure_holds(obs: Observation, cfg: Configs) -> bool:
    iv = obs.interval
    return iv.kv_cache_usage >= PRESSURE_USAGE or iv.num_preemptions > 0


def _pressure_advise(s: Stretch, cfg: Configs) -> Found | None:
    if not s.preemptions:  # a full pool that preempts nobody is a well-used one
        return None
    cc, sc = cfg.cache, cfg.scheduler
    flag = "kv_cache_memory" if cc.kv_cache_memory is not None else "gpu_memory_utilization"
    memory = (f"kv_cache_memory={cc.kv_cache_memory} bytes" if cc.kv_cache_memory is not None
              else f"gpu_memory_utilization={cc.gpu_memory_utilization}")
    numbers = {"kv_cache_usage_max": round(s.usage_max, 4), "kv_cache_usage_mean": round(s.usage_mean, 4),
               "preemptions": s.preemptions, "seconds": round(s.seconds, 1), "num_gpu_blocks": cc.num_gpu_blocks,
               flag: cc.kv_cache_memory if cc.kv_cache_memory is not None else cc.gpu_memory_utilization,
               "max_num_batched_tokens": sc.max_num_batched_tokens, "prefix_cache_hit_rate": round(s.hit_rate, 4)}
    reuse = (f"better prefix reuse (hit rate {s.hit_rate:.0%})" if cc.enable_prefix_caching
             else "prefix reuse (enable_prefix_caching is off)")
    return flag, (f"KV cache full: {s.usage_max:.0%} of its {cc.num_gpu_blocks} blocks in use (mean "
                  f"{s.usage_mean:.0%}) for {s.seconds:.0f} s with {s.preemptions} preemptions: give it more memory "
                  f"({memory} now), a smaller max_num_batched_tokens (now {sc.max_num_batched_tokens}), or "
                  f"{reuse}"), numbers


# --- rule 3: long sequences in small blocks ---------------------------------------------------------------------
def _long_seqs_holds(obs: Observation, cfg: Configs) -> bool | None:
    if cfg.cache.block_size not in SMALL_BLOCK_SIZES:
        return False
    if obs.long_share is None:
        return None
    return obs.long_share > LONG_SEQ_SHARE


def _long_seqs_advise(s: Stretch, cfg: Configs) -> Found:
    bs = cfg.cache.block_size
    share = s.long_share_sum / s.intervals
    numbers = {"long_seq_share": round(share, 4), "long_seq_tokens": LONG_SEQ_TOKENS, "longest_seq": s.longest_seq,
               "block_size": bs, "seconds": round(s.seconds, 1)}
    return "block_size", (f"{share:.0%} of running sequences are beyond {LONG_SEQ_TOKENS} tokens (longest "
                          f"{s.longest_seq}) at block_size={bs}: each block table holds {LONG_SEQ_TOKENS // bs}+ "
                          f"entries to move host->device every step; try block_size {LARGE_BLOCK_SIZE}"), numbers


# --- rule 4: the prefix cache misses because a per-request field breaks shared prompts early --------------------
def _divergence_holds(obs: Observation, cfg: Configs) -> bool | None:
    iv = obs.interval
    if not iv.prefix_cache_queries:  # no prompt looked up: the interval says nothing about the hit rate
        return None
    return iv.prefix_cache_hit_rate < LOW_HIT_RATE


def _divergence_advise(s: Stretch, cfg: Configs) -> Found | None:
    if s.queries < MIN_QUERIED_TOKENS or s.hit_rate >= LOW_HIT_RATE or not s.divergence_warnings:
        return None
    bs = cfg.cache.block_size
    positions = s.divergence_positions
    position = max(positions, key=positions.__getitem__) if positions else None
    where = (f", most often at token position {position} (block {position // bs})" if position is not None else "")
    numbers = {"prefix_cache_hit_rate": round(s.hit_rate, 4), "prefix_cache_queries": s.queries,
               "divergence_warnings": s.divergence_warnings, "divergence_position": position,
               "seconds": round(s.seconds, 1)}
    return "enable_prefix_caching", (f"prefix cache hit rate {s.hit_rate:.1%} of {s.queries} prompt tokens over "
                                     f"{s.seconds:.0f} s, and {s.divergence_warnings} prompts shared a long prefix "
                                     f"broken early{where}: a per-request field (timestamp, id) there defeats the "
                                     f"cache: move the per-request field after the shared part"), numbers


RULES = (
    Rule("kv_underused", _underused_holds, _underused_advise),
    Rule("kv_pressure", _pressure_holds, _pressure_advise),
    Rule("long_seqs_small_blocks", _long_seqs_holds, _long_seqs_advise),
    Rule("prefix_divergence", _divergence_holds, _divergence_advise),
)
