"""Live tuning advice (pagedkv.engine.kv_advice): scripted EngineStats streams over fake time, then a real engine.

Each rule is driven by a workload script: it must fire once after a sustained
stretch, name its flag and numbers, stay quiet on a blip, not repeat every
interval, and fire again only after its condition cleared and came back.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
from pagedkv.config import CacheConfig, SchedulerConfig
from pagedkv.engine.kv_advice import AdviceLog, AdvisorSettings, IntervalStats, KVAdvisor
from pagedkv.engine.kv_advice_rules import RULES, Configs, Observation, Stretch
from pagedkv.engine.llm_engine import EngineStats

SETTINGS = AdvisorSettings(interval_s=1.0, sustain_intervals=3, sustain_s=5.0, refire_s=60.0)


def make_stats(**fields) -> EngineStats:
    base = dict(num_running=0, num_waiting=0, num_swapped=0, num_gpu_blocks=100, num_used_gpu_blocks=0,
                kv_cache_usage=0.0, prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                prompt_tokens=0, generation_tokens=0)
    return EngineStats(**(base | fields))


class Workload:
    """A scripted engine: one `tick` is one second of engine time; counters accumulate as an engine's do."""

    def __init__(self, block_size: int = 16, max_num_seqs: int = 8, **cache) -> None:
        self.advisor = KVAdvisor(CacheConfig(block_size=block_size, **cache),
                                 SchedulerConfig(max_num_seqs=max_num_seqs), SETTINGS)
        self.now = 1000.0
        self.stats = make_stats()
        self.raised: list = []
        self.advisor.observe(self.stats, self.now)  # the baseline

    def tick(self, usage: float = 0.5, running: int = 4, waiting: int = 0, preemptions: int = 0, queries: int = 0,
             hits: int = 0, tier_hits: int = 0, divergence: int = 0, seq_lens=(), positions=None) -> list:
        s = self.stats
        self.stats = dataclasses.replace(
            s, kv_cache_usage=usage, num_running=running, num_waiting=waiting,
            num_preemptions=s.num_preemptions + preemptions, prefix_cache_queries=s.prefix_cache_queries + queries,
            prefix_cache_hits=s.prefix_cache_hits + hits, tier_hits_host=s.tier_hits_host + tier_hits,
            prefix_divergence_warnings=s.prefix_divergence_warnings + divergence,
            generation_tokens=s.generation_tokens + running)
        self.now += 1.0
        new = self.advisor.observe(self.stats, self.now, seq_lens, divergence_positions=positions)
        self.raised.extend(new)
        return new

    def run(self, n: int, **kw) -> list:
        return [a for _ in range(n) for a in self.tick(**kw)]


# --- IntervalStats ---------------------------------------------------------------------------------------------
def test_interval_stats_between_takes_differences_and_end_gauges():
    prev = make_stats(prompt_tokens=100, generation_tokens=50, prefix_cache_queries=400, prefix_cache_hits=100,
                      num_preemptions=2, tier_hits_host=10, tier_hits_disk=5)
    cur = make_stats(prompt_tokens=300, generation_tokens=90, prefix_cache_queries=600, prefix_cache_hits=150,
                     num_preemptions=5, tier_hits_host=30, tier_hits_disk=35, kv_cache_usage=0.8, num_running=3,
                     num_waiting=7)
    iv = IntervalStats.between(prev, cur, 4.0)
    assert (iv.seconds, iv.prompt_tokens, iv.generation_tokens) == (4.0, 200, 40)
    assert (iv.prompt_tokens_per_s, iv.generation_tokens_per_s) == (50.0, 10.0)
    assert (iv.prefix_cache_queries, iv.prefix_cache_hits) == (200, 50 + 20 + 30)  # tier hits count as hits
    assert iv.prefix_cache_hit_rate == pytest.approx(0.5)
    assert (iv.num_preemptions, iv.kv_cache_usage, iv.num_running, iv.num_waiting) == (3, 0.8, 3, 7)
    empty = IntervalStats.between(cur, cur, 0.0)
    assert (empty.prefix_cache_hit_rate, empty.prompt_tokens_per_s) == (0.0, 0.0)


def test_observe_is_throttled_to_its_interval():
    advisor = KVAdvisor(CacheConfig(), SchedulerConfig(), AdvisorSettings(interval_s=1.0))
    assert advisor.due(0.0)
    advisor.observe(make_stats(), 0.0)
    assert not advisor.due(0.5) and advisor.observe(make_stats(generation_tokens=9), 0.5) == []
    assert advisor.last_interval is None  # the early call was skipped, not folded in
    advisor.observe(make_stats(generation_tokens=10), 1.0)
    assert advisor.last_interval.generation_tokens == 10
    assert advisor.due(0.2)  # a clock that went back: the next call takes a new baseline


# --- rule 1: under-used pool while requests wait ---------------------------------------------------------------
def test_underused_fires_once_after_the_stretch_and_names_max_num_seqs():
    w = Workload(max_num_seqs=8)
    assert w.run(4, usage=0.4, running=8, waiting=5) == []  # 4 s < sustain_s
    new = w.tick(usage=0.4, running=8, waiting=5)
    assert [a.rule for a in new] == ["kv_underused"]
    a = new[0]
    assert a.flag == "max_num_seqs" and "raise max_num_seqs (now 8)" in a.message and "40%" in a.message
    assert a.numbers["max_num_seqs"] == 8 and a.numbers["waiting_max"] == 5
    assert a.numbers["kv_cache_usage_max"] == pytest.approx(0.4)
    assert a.since == pytest.approx(1000.0)  # the stretch's start
    assert w.run(20, usage=0.4, running=8, waiting=5) == []  # in force: not every interval


def test_underused_below_the_cap_points_at_the_token_budget():
    w = Workload(max_num_seqs=8)
    [a] = w.run(6, usage=0.3, running=2, waiting=4)
    assert a.flag == "max_num_batched_tokens" and "max_num_batched_tokens (now 2048)" in a.message


def test_underused_blip_does_not_fire():
    w = Workload()
    for _ in range(5):  # two intervals of it, then the queue drains, over and over
        w.run(2, usage=0.4, waiting=3)
        w.run(1, usage=0.4, waiting=0)
    assert w.raised == []


def test_cleared_condition_fires_again_only_after_refire_s():
    w = Workload(max_num_seqs=4)
    w.run(6, usage=0.4, running=4, waiting=2)
    assert len(w.raised) == 1 and w.advisor.current()[0]["active"]
    w.tick(usage=0.4, running=4, waiting=0)  # cleared
    assert not w.advisor.current()[0]["active"]
    w.run(10, usage=0.4, running=4, waiting=2)  # back and sustained, but within refire_s of the first
    assert len(w.raised) == 1
    w.run(50, usage=0.4, running=4, waiting=2)  # still holding once refire_s has passed: raised again
    assert len(w.raised) == 2 and w.raised[1].raised_at - w.raised[0].raised_at >= SETTINGS.refire_s


# --- rule 2: full pool with preemptions ------------------------------------------------------------------------
def test_pressure_fires_with_preemptions_and_names_memory_flags():
    w = Workload()
    for _ in range(3):
        w.tick(usage=0.97, preemptions=1)
        w.tick(usage=0.96)
    [a] = w.raised
    assert a.rule == "kv_pressure" and a.flag == "gpu_memory_utilization"
    assert "gpu_memory_utilization=0.9" in a.message and "max_num_batched_tokens (now 2048)" in a.message
    assert "prefix reuse" in a.message
    assert a.numbers["preemptions"] == 3 and a.numbers["kv_cache_usage_max"] == pytest.approx(0.97)
    assert w.run(10, usage=0.97, preemptions=1) == []


def test_full_pool_without_preemptions_is_fine():
    w = Workload()
    assert w.run(20, usage=0.99) == []


def test_pressure_names_kv_cache_memory_when_set():
    w = Workload(kv_cache_memory=1 << 20)
    [a] = w.run(6, usage=0.98, preemptions=2)
    assert a.flag == "kv_cache_memory" and a.numbers["kv_cache_memory"] == 1 << 20


def test_pressure_blip_does_not_fire():
    w = Workload()
    for _ in range(4):
        w.run(2, usage=0.98, preemptions=1)
        w.run(2, usage=0.6)
    assert w.raised == []


# --- rule 3: long sequences in small blocks --------------------------------------------------------------------
def test_long_sequences_at_block_size_16_suggest_32():
    w = Workload(block_size=16)
    [a] = w.run(8, seq_lens=[5000, 6000, 8000, 100])
    assert a.rule == "long_seqs_small_blocks" and a.flag == "block_size" and "try block_size 32" in a.message
    assert a.numbers["long_seq_share"] == pytest.approx(0.75) and a.numbers["longest_seq"] == 8000
    assert a.numbers["block_size"] == 16


@pytest.mark.parametrize("block_size,lens", [(32, [5000, 6000, 8000]), (16, [5000, 6000, 100, 200])])
def test_long_sequences_rule_stays_quiet(block_size, lens):
    w = Workload(block_size=block_size)
    assert w.run(10, seq_lens=lens) == []  # already 32 / only half beyond 4K


def test_long_sequences_without_lengths_say_nothing():
    w = Workload(block_size=8)
    assert w.run(10) == []


# --- rule 4: prefix cache defeated by an early per-request field -----------------------------------------------
def test_divergence_with_near_zero_hit_rate_names_the_position():
    w = Workload()
    for _ in range(3):
        w.tick(queries=300, hits=0, divergence=2, positions={12: 6, 40: 1})
        w.tick(queries=0)  # decode only: no evidence, the stretch goes on
    [a] = w.raised
    assert a.rule == "prefix_divergence" and a.flag == "enable_prefix_caching"
    assert "token position 12 (block 0)" in a.message
    assert "move the per-request field after the shared part" in a.message
    assert a.numbers["divergence_position"] == 12 and a.numbers["prefix_cache_queries"] == 900
    assert a.numbers["prefix_cache_hit_rate"] == 0.0


def test_low_hit_rate_without_divergence_or_with_tier_hits_is_quiet():
    w = Workload()
    assert w.run(10, queries=300, hits=0) == []  # no divergence found: another cause, no advice
    w = Workload()
    assert w.run(10, queries=300, hits=0, tier_hits=200, divergence=1) == []  # the tiers serve the prefixes
    w = Workload()
    assert w.run(10, queries=20, divergence=1) == []  # too few tokens looked up to judge


# --- current(), the server's log -------------------------------------------------------------------------------
# --- the rules themselves, at their thresholds (pure functions of one interval or one stretch) ----------------
RULE = {r.name: r for r in RULES}


def interval(**fields) -> IntervalStats:
    base = dict(seconds=1.0, prompt_tokens=0, generation_tokens=0, prompt_tokens_per_s=0.0,
                generation_tokens_per_s=0.0, prefix_cache_queries=0, prefix_cache_hits=0, prefix_cache_hit_rate=0.0,
                num_preemptions=0, kv_cache_usage=0.5, num_running=1, num_waiting=0)
    return IntervalStats(**(base | fields))


def observation(long_share=None, longest_seq=0, warnings=0, positions=None, **fields) -> Observation:
    return Observation(interval(**fields), long_share, longest_seq, warnings, positions or {})


def configs(block_size: int = 16, **cache) -> Configs:
    return Configs(CacheConfig(block_size=block_size, **cache), SchedulerConfig(max_num_seqs=8))


@pytest.mark.parametrize("rule,fields,held", [
    ("kv_underused", dict(kv_cache_usage=0.6999, num_waiting=1), True),
    ("kv_underused", dict(kv_cache_usage=0.70, num_waiting=1), False),  # "under 70%"
    ("kv_underused", dict(kv_cache_usage=0.1, num_waiting=0), False),  # nobody waits: nothing to admit
    ("kv_pressure", dict(kv_cache_usage=0.95), True),  # "above 95%", the boundary included
    ("kv_pressure", dict(kv_cache_usage=0.9499), False),
    ("kv_pressure", dict(kv_cache_usage=0.5, num_preemptions=1), True),  # a preemption means a full pool
    ("prefix_divergence", dict(prefix_cache_queries=100, prefix_cache_hit_rate=0.0499), True),
    ("prefix_divergence", dict(prefix_cache_queries=100, prefix_cache_hit_rate=0.05), False),
    ("prefix_divergence", dict(prefix_cache_queries=0), None),  # no prompt looked up: says nothing
])
def test_each_rule_holds_on_its_side_of_the_threshold(rule, fields, held):
    assert RULE[rule].holds(observation(**fields), configs()) is held


@pytest.mark.parametrize("block_size,share,held", [(8, 0.6, True), (16, 0.51, True), (16, 0.5, False),
                                                   (32, 0.9, False), (16, None, None)])
def test_long_sequences_rule_wants_small_blocks_and_over_half_long(block_size, share, held):
    """"Mostly > 4K": over half the running sequences; only blocks of 8 and 16 are small; no lengths: no verdict."""
    assert RULE["long_seqs_small_blocks"].holds(observation(long_share=share), configs(block_size)) is held


def test_a_stretch_sums_counters_and_keeps_extremes():
    s = Stretch(start=0.0)
    s.add(observation(seconds=2.5, kv_cache_usage=0.4, num_waiting=0, num_running=0, num_preemptions=1,
                      prefix_cache_queries=100, prefix_cache_hits=10, long_share=0.25, longest_seq=9000, warnings=1,
                      positions={40: 1}))
    assert (s.waiting_max, s.running_max, s.usage_min, s.usage_max) == (0, 0, 0.4, 0.4)
    assert _stretch(observation(longest_seq=0)).longest_seq == 0
    s.add(observation(seconds=1.5, kv_cache_usage=0.8, num_waiting=3, num_running=5, num_preemptions=2,
                      prefix_cache_queries=300, prefix_cache_hits=30, longest_seq=5000, warnings=2,
                      positions={64: 3}))
    assert (s.intervals, s.seconds, s.preemptions, s.queries, s.hits) == (2, 4.0, 3, 400, 40)
    assert (s.usage_min, s.usage_max, s.usage_mean) == (0.4, 0.8, pytest.approx(0.6))
    assert (s.waiting_max, s.running_max, s.longest_seq, s.divergence_warnings) == (3, 5, 9000, 3)
    assert s.long_share_sum == 0.25 and s.hit_rate == pytest.approx(0.1)
    assert s.divergence_positions == {64: 3}  # the detector's running tally: the latest holds all
    assert Stretch(start=0.0).usage_mean == 0.0 and Stretch(start=0.0).hit_rate == 0.0


def _stretch(*observations: Observation) -> Stretch:
    s = Stretch(start=0.0)
    for obs in observations:
        s.add(obs)
    return s


def test_advice_numbers_are_rounded_for_reading():
    """Usages, shares and hit rates to 4 decimals, seconds to 1."""
    s = _stretch(observation(seconds=12.34, kv_cache_usage=0.123456, num_waiting=2, num_preemptions=1,
                             prefix_cache_queries=700, prefix_cache_hits=1, long_share=0.654321, warnings=1))
    cfg = configs(enable_prefix_caching=True, kv_cache_memory=1 << 30)
    _, _, under = RULE["kv_underused"].advise(s, cfg)
    assert (under["kv_cache_usage_max"], under["seconds"]) == (0.1235, 12.3)
    _, _, full = RULE["kv_pressure"].advise(s, cfg)
    assert (full["kv_cache_usage_max"], full["kv_cache_usage_mean"], full["prefix_cache_hit_rate"],
            full["seconds"]) == (0.1235, 0.1235, 0.0014, 12.3)
    _, _, long = RULE["long_seqs_small_blocks"].advise(s, cfg)
    assert (long["long_seq_share"], long["long_seq_tokens"], long["seconds"]) == (0.6543, 4096, 12.3)
    _, _, div = RULE["prefix_divergence"].advise(s, cfg)
    assert (div["prefix_cache_hit_rate"], div["seconds"]) == (0.0014, 12.3)


@pytest.mark.parametrize("queries,hits,warnings,fires", [(512, 0, 1, True), (511, 0, 1, False),
                                                         (1000, 50, 1, False), (1000, 49, 1, True),
                                                         (1000, 0, 0, False)])
def test_divergence_advice_needs_enough_prompts_a_low_rate_and_a_warning(queries, hits, warnings, fires):
    """At least 512 looked-up prompt tokens, a hit rate under 5% over the stretch, and the detector's word."""
    s = _stretch(observation(prefix_cache_queries=queries, prefix_cache_hits=hits, warnings=warnings))
    assert (RULE["prefix_divergence"].advise(s, configs()) is not None) is fires


def test_current_is_json_able_and_one_entry_per_rule():
    w = Workload(max_num_seqs=4)
    w.run(6, usage=0.4, running=4, waiting=2, seq_lens=[5000, 5000])
    cur = w.advisor.current()
    assert sorted(a["rule"] for a in cur) == ["kv_underused", "long_seqs_small_blocks"]
    assert set(cur[0]) == {"rule", "flag", "message", "numbers", "since", "active"}
    json.dumps(cur)


def test_server_metrics_log_each_advice_once(caplog):
    from pagedkv.server.metrics import ServerMetrics

    metrics = ServerMetrics("m", 128, log_interval_s=0)
    advisor = KVAdvisor(CacheConfig(), SchedulerConfig(max_num_seqs=2),
                        AdvisorSettings(interval_s=0, sustain_intervals=3, sustain_s=0))
    metrics.advice_log = AdviceLog(advisor, feed=True)
    with caplog.at_level(logging.WARNING, logger="pagedkv.server.metrics"):
        for _ in range(10):
            metrics.record_stats(make_stats(kv_cache_usage=0.2, num_running=2, num_waiting=3))
    logged = [r.getMessage() for r in caplog.records if "tuning advice" in r.getMessage()]
    assert len(logged) == 1 and "(max_num_seqs)" in logged[0] and "raise max_num_seqs (now 2)" in logged[0]


def test_log_line_hit_rate_is_the_intervals(monkeypatch, caplog):
    from pagedkv.server import metrics as metrics_module

    clock = iter([0.0, 10.0, 20.0])
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: next(clock))
    log = metrics_module._StatsLog(10.0)
    with caplog.at_level(logging.INFO, logger="pagedkv.server.metrics"):
        log.maybe_log(make_stats(prefix_cache_queries=100, prefix_cache_hits=100, num_running=1), 0)
        log.maybe_log(make_stats(prefix_cache_queries=300, prefix_cache_hits=100, num_running=1), 0)
    lines = [r.getMessage() for r in caplog.records]
    assert "Prefix cache hit rate: 100.0%" in lines[0] and "Prefix cache hit rate: 0.0%" in lines[1]


# --- a real engine: a tiny pool, many long outputs -------------------------------------------------------------
@pytest.fixture(scope="module")
def pressured(loaded_model):
    """6 requests of ~17 + 24 tokens (3 blocks each) on an 8-block pool: it fills and sequences get preempted.

    The engine steps until the advice is in (a few steps after the first preemption), then the rest is aborted:
    the test pays for the steps it needs, not for the whole workload.
    """
    from pagedkv import LLM, SamplingParams

    bytes_per_token = loaded_model.model.config.kv_bytes_per_token(loaded_model.dtype)
    llm = LLM(loaded_model=loaded_model, kv_cache_memory=8 * 16 * bytes_per_token, max_model_len=128,
              max_num_seqs=6, enable_prefix_caching=True)
    engine = llm.llm_engine
    assert isinstance(engine.kv_advisor, KVAdvisor)  # every engine has one (default settings)
    engine.kv_advisor = KVAdvisor(engine.cache_config, engine.scheduler_config,
                                  AdvisorSettings(interval_s=0, sustain_intervals=3, sustain_s=0))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i in range(6):
        engine.add_request(None, f"Request {i}: write a long story about the number {i} and its friends.", params)
    outputs = []
    for _ in range(200):
        outputs += [o for o in engine.step() if o.finished]
        if not engine.has_unfinished_requests() or engine.kv_advisor.num_raised:
            break
    engine.abort_request(list(engine.requests))
    return llm, outputs


def test_real_engine_under_pressure_raises_memory_advice(pressured):
    llm, outputs = pressured
    assert llm.get_stats().num_preemptions > 0
    advice = {a["rule"]: a for a in llm.llm_engine.kv_advisor.current()}
    assert "kv_pressure" in advice, advice
    a = advice["kv_pressure"]
    assert a["flag"] == "kv_cache_memory" and a["numbers"]["preemptions"] > 0
    assert a["numbers"]["kv_cache_usage_max"] >= 0.95
    assert llm.llm_engine.kv_snapshot()["advice"] == llm.llm_engine.kv_advisor.current()


def test_print_stats_prints_the_advice(pressured, capsys):
    from pagedkv.cli import print_stats

    llm, outputs = pressured
    print_stats(llm, outputs, 1.0)
    out = capsys.readouterr().out
    assert "Tuning advice:" in out and "[kv_cache_memory] KV cache full" in out
    engine = llm.llm_engine
    engine.kv_advisor = KVAdvisor(engine.cache_config, engine.scheduler_config)  # nothing raised: nothing printed
    print_stats(llm, outputs, 1.0)
    assert "Tuning advice" not in capsys.readouterr().out
