"""Prometheus metrics under vLLM's names, and the periodic stats log line.

Existing vLLM dashboards query `vllm:*` series labelled `model_name` (and
`engine`), so the names, types and labels here are vLLM's. Two sources:

- engine-wide state (running/waiting requests, KV-cache usage, prefix-cache
  and preemption counters) comes from `LLMEngine.get_stats()` snapshots that
  the engine thread hands to `record_stats`; a custom collector turns the
  latest snapshot into gauges and counters when /metrics is scraped;
- per-request latencies are observed by the engine thread as each request's
  outputs leave the engine (`request_output`): time to first token, the
  interval between consecutive outputs (inter-token latency), time per output
  token, end-to-end latency, queue / prefill / decode / inference time, prompt
  and generation lengths;
- the engine's cache settings, once: `vllm:cache_config_info`, a gauge of 1
  whose labels are the CacheConfig fields (`cache_dtype`, `block_size`,
  `num_gpu_blocks`, ...) and `engine`, as vLLM's;
- with LoRA on, vLLM's `vllm:lora_requests_info`: labels `max_lora`,
  `running_lora_adapters` and `waiting_lora_adapters` (adapter names,
  comma-joined), its value the time the snapshot was taken (vLLM's
  set_to_current_time). Only the latest label set is exposed.

Everything is registered in a per-server registry, so several servers (tests)
can live in one process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedkv.engine.kv_advice import AdviceLog
from pagedkv.engine.llm_engine import EngineStats
from pagedkv.outputs import RequestOutput

logger = logging.getLogger(__name__)
# No `*_created` series next to every counter and histogram: vLLM turns them off too, and dashboards ignore them.
disable_created_metrics()

# Bucket bounds (seconds / tokens) chosen for CPU and GPU serving of small and mid-sized models.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


def _token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(float(m * scale))
        scale *= 10


@dataclass(slots=True)
class _RequestTiming:
    cumulative: bool  # outputs carry everything so far (else only the new tokens)
    num_tokens: int = 0
    last_output_time: float | None = None


class _EngineStatsCollector(Collector):
    """Gauges and counters read from the latest EngineStats snapshot at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        s, labels = self.metrics.stats, self.metrics.labels
        if s is None:
            return
        names, values = list(labels), list(labels.values())
        gauges = [("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running),
                  ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting),
                  ("vllm:num_requests_swapped", "Number of requests swapped to CPU.", s.num_swapped),
                  ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage),
                  ("vllm:gpu_cache_usage_perc", "KV-cache usage (older name of vllm:kv_cache_usage_perc).",
                   s.kv_cache_usage),
                  ("vllm:num_gpu_blocks", "KV-cache blocks in the pool.", s.num_gpu_blocks)]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, float(value))
            yield g
        counters = [("vllm:prefix_cache_queries", "Prefix-cache queries, in terms of number of queried tokens.",
                     s.prefix_cache_queries),
                    ("vllm:prefix_cache_hits", "Prefix-cache hits, in terms of number of cached tokens.",
                     s.prefix_cache_hits),
                    ("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", s.num_preemptions),
                    ("vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens)]
        counters += [
            ("vllm:external_prefix_cache_queries", "Prompt tokens looked up in the prefix cache's host and disk tiers "
             "(below the pool).", s.tier_queries),
            ("vllm:external_prefix_cache_hits", "Prompt tokens restored from the host and disk tiers.",
             s.tier_hits_host + s.tier_hits_disk),
            ("pagedkv:kv_offload_blocks", "Cached blocks copied from the pool to the host tier on eviction.",
             s.kv_offloaded_blocks),
            ("pagedkv:kv_offload_host_bytes", "Bytes moved between the pool and the host tier, both ways.",
             s.kv_host_bytes_moved),
            ("vllm:kv_offload_tiering_write_bytes", "Bytes of block files written to the KV cache directory.",
             s.kv_disk_bytes_written),
            ("vllm:kv_offload_tiering_read_bytes", "Bytes of block files read back from the KV cache directory.",
             s.kv_disk_bytes_read),
            ("vllm:kv_offload_tiering_read_time", "Seconds spent reading and verifying block files.",
             s.kv_disk_load_seconds),
            ("pagedkv:kv_disk_files_rejected", "Block files that failed their checks (corrupt, truncated, foreign) "
             "and were not used.", s.kv_disk_files_rejected),
            ("pagedkv:kv_disk_write_errors", "Block files the disk tier failed to write (disk full, read-only).",
             s.kv_disk_write_errors)]
        if self.metrics.speculative:  # vLLM's spec-decode counters (the per-position one below)
            counters += [("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", s.spec_num_drafts),
                         ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", s.spec_num_draft_tokens),
                         ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                          s.spec_num_accepted_tokens)]
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, float(value))
            yield c
        by_source = CounterMetricFamily("vllm:prompt_tokens_cached_by_source", "Prefix-cache hit tokens by the "
                                        "tier that supplied them: device (the pool), host, disk.",
                                        labels=[*names, "source"])
        for source, value in (("device", s.prefix_cache_hits), ("host", s.tier_hits_host),
                              ("disk", s.tier_hits_disk)):
            by_source.add_metric([*values, source], float(value))
        yield by_source
        if self.metrics.speculative:
            per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                          "Accepted tokens per draft position.", labels=[*names, "position"])
            for pos, value in enumerate(s.spec_accepted_per_pos):
                per_pos.add_metric([*values, str(pos)], float(value))
            yield per_pos
        if self.metrics.max_loras is not None:
            lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                     labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            lora.add_metric([str(self.metrics.max_loras), s.waiting_lora_adapters, s.running_lora_adapters],
                            self.metrics.stats_time)
            yield lora


class ServerMetrics:
    """The server's Prometheus registry; the `record_*` / `request_*` methods run on the engine thread."""

    def __init__(self, model_name: str, max_model_len: int, log_interval_s: float = 10.0,
                 cache_info: dict[str, str] | None = None, max_loras: int | None = None,
                 speculative: bool = False) -> None:
        """cache_info: `CacheConfig.metrics_info()`, the labels of vllm:cache_config_info (None: no such gauge).
        max_loras: the engine's, with LoRA on (None: no vllm:lora_requests_info).
        speculative: the engine decodes speculatively (vllm:spec_decode_* counters)."""
        self.labels = {"model_name": model_name, "engine": "0"}
        self.stats: EngineStats | None = None
        self.stats_time = 0.0  # when `stats` was recorded (time.time())
        self.max_loras = max_loras
        self.speculative = speculative
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(self))
        names = list(self.labels)
        reg = self.registry
        if cache_info is not None:
            # vLLM's info gauge: the settings ride in the labels (engine, not model_name, as vLLM labels it).
            info = {**cache_info, "engine": self.labels["engine"]}
            Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info),
                  registry=reg).labels(**info).set(1)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=reg).labels(**self.labels)

        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", names,
                                     registry=reg).labels(**self.labels)
        self.prompt_tokens_cached = Counter("vllm:prompt_tokens_cached", "Prompt tokens served from the prefix "
                                            "cache.", names, registry=reg).labels(**self.labels)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          names + ["finished_reason"], registry=reg)
        self.request_success = {r: success.labels(**self.labels, finished_reason=r) for r in FINISH_REASONS}
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              LATENCY_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             TOKEN_LATENCY_BUCKETS)
        self.tpot_legacy = histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in "
                                     "seconds (older name of vllm:inter_token_latency_seconds).",
                                     TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.", LATENCY_BUCKETS)
        token_buckets = _token_buckets(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        self._timings: dict[str, _RequestTiming] = {}
        self._num_prompt_tokens = 0  # for the log line's prompt throughput
        self._log = _StatsLog(log_interval_s)
        self.advice_log: AdviceLog | None = None  # the engine's tuning advice (set by whoever builds the server)

    # --- engine thread --------------------------------------------------------------------------------------------
    def record_stats(self, stats: EngineStats) -> None:
        self.stats, self.stats_time = stats, time.time()
        self._log.maybe_log(stats, self._num_prompt_tokens)
        for advice in self.advice_log.update(stats, time.time()) if self.advice_log is not None else ():
            logger.warning("KV cache tuning advice (%s): %s", advice.flag, advice.message)  # once per advice

    def request_started(self, request_id: str, cumulative: bool) -> None:
        self._timings[request_id] = _RequestTiming(cumulative)

    def request_output(self, output: RequestOutput, now: float) -> None:
        """One step's output of a request: first token, inter-token interval, and at the end its totals."""
        timing = self._timings.get(output.request_id)
        if timing is None:
            return
        total = sum(len(c.token_ids) for c in output.outputs)
        new = total - timing.num_tokens if timing.cumulative else total
        timing.num_tokens += new
        m = output.metrics
        if timing.last_output_time is None:
            self._num_prompt_tokens += len(output.prompt_token_ids)
            self.prompt_tokens.inc(len(output.prompt_token_ids))
            self.prompt_tokens_cached.inc(output.num_cached_tokens)
            self.ttft.observe(max(0.0, (m.first_token_time or now) - m.arrival_time))
            if m.first_scheduled_time is not None:
                self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        elif new:
            self.itl.observe(now - timing.last_output_time)
            self.tpot_legacy.observe(now - timing.last_output_time)
        timing.last_output_time = now
        if output.finished:
            del self._timings[output.request_id]
            self._finished(output, timing.num_tokens, now)

    def request_ended(self, request_id: str, reason: str) -> None:
        """A request that left without a final output (aborted, or failed with the engine)."""
        if self._timings.pop(request_id, None) is not None:
            self.request_success[reason].inc()

    def _finished(self, output: RequestOutput, num_tokens: int, now: float) -> None:
        m = output.metrics
        reasons = {c.finish_reason for c in output.outputs}
        reason = next((r for r in FINISH_REASONS if r in reasons), "stop")
        self.request_success[reason].inc()
        end = m.finished_time or now
        self.e2e.observe(max(0.0, end - m.arrival_time))
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(num_tokens)
        per_sample = num_tokens / max(1, len(output.outputs))
        if m.first_token_time is not None:
            if per_sample > 1:
                self.tpot.observe(max(0.0, end - m.first_token_time) / (per_sample - 1))
            self.decode_time.observe(max(0.0, end - m.first_token_time))
            if m.first_scheduled_time is not None:
                self.prefill_time.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
        if m.first_scheduled_time is not None:
            self.inference_time.observe(max(0.0, end - m.first_scheduled_time))

    # --- asyncio thread ---------------------------------------------------------------------------------------
    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (prometheus_client's metrics are thread-safe)."""
        return generate_latest(self.registry)


class _StatsLog:
    """vLLM's periodic log line: throughput since the last line, running/waiting, KV usage, prefix hits.

    Silent while the server is idle, so an unused server does not fill its log.
    """

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last_time = time.monotonic()
        # prompt tokens, generation tokens, prefix-cache queries, hits, hits from the tiers below the pool
        self._last: tuple[int, ...] = (0, 0, 0, 0, 0)

    def maybe_log(self, s: EngineStats, prompt_tokens: int) -> None:
        now = time.monotonic()
        if self.interval_s <= 0 or now - self._last_time < self.interval_s:
            return
        current = (prompt_tokens, s.generation_tokens, s.prefix_cache_queries, s.prefix_cache_hits,
                   s.tier_hits_host + s.tier_hits_disk)
        last, elapsed = self._last, now - self._last_time
        self._last_time, self._last = now, current
        if current == last and s.num_running == 0 and s.num_waiting == 0:
            return
        queries = current[2] - last[2]
        hit_rate = 100.0 * (current[3] - last[3]) / queries if queries else 0.0
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d "
                    "reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                    (current[0] - last[0]) / elapsed, (current[1] - last[1]) / elapsed, s.num_running,
                    s.num_waiting, 100.0 * s.kv_cache_usage, hit_rate)
        if s.tier_queries:  # the tiers' share of the interval's lookups, beside the pool's
            tier_rate = 100.0 * (current[4] - last[4]) / queries if queries else 0.0
            logger.info("KV offloading: tier hit rate %.1f%% of the interval's prompt tokens (host %d, disk %d "
                        "tokens since start); %d blocks offloaded, %d disk files written, %d rejected",
                        tier_rate, s.tier_hits_host, s.tier_hits_disk, s.kv_offloaded_blocks,
                        s.kv_disk_files_written, s.kv_disk_files_rejected)
        if s.spec_num_draft_tokens:  # since start, as the counters are
            logger.info("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, Drafted: %d tokens, "
                        "Draft acceptance rate: %.1f%%", 1 + s.spec_num_accepted_tokens / s.spec_num_drafts,
                        s.spec_num_accepted_tokens, s.spec_num_draft_tokens,
                        100.0 * s.spec_num_accepted_tokens / s.spec_num_draft_tokens)
