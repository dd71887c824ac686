"""Live tuning advice from the design notes: what the last stretch of serving says about the engine's flags.

`KVAdvisor.observe(stats, now, ...)` takes an `EngineStats` snapshot about
once a second (`AdvisorSettings.interval_s`; an earlier call returns [] at
once), turns the change since the previous one into an `IntervalStats`, and
runs the rules of pagedkv.engine.kv_advice_rules on it:

    kv_underused            usage < 70% while requests wait -> max_num_seqs (or max_num_batched_tokens)
    kv_pressure             usage > 95% with preemptions -> gpu_memory_utilization / kv_cache_memory,
                            a smaller max_num_batched_tokens, or better prefix reuse
    long_seqs_small_blocks  most running sequences beyond 4K tokens at block_size 8/16 -> block_size 32
    prefix_divergence       prefix hit rate < 5% while the divergence detector flags prompts -> move the
                            per-request field after the shared part

A rule raises its advice once per condition: only after it held for a
sustained stretch (`sustain_intervals` intervals in a row and `sustain_s`
seconds, so a blip does not trigger it), and again only after the condition
cleared, came back and held again, and at least `refire_s` after the last
time. `current()` lists each rule's latest advice as JSON-able dicts (rule,
flag, message, numbers, since, active) for the KV snapshot and the dashboard;
`AdviceLog` hands a server's log each newly raised advice once.

Not covered: prefix caching off while prompts look shared (the divergence
detector, the cheap way to tell, only runs with the cache on).

Cost: O(1) per `observe` call between intervals; once an interval, O(running)
for the sequence lengths the caller passes and a few arithmetic rules.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedkv.engine.engine_stats import EngineStats, IntervalStats
from pagedkv.engine.kv_advice_rules import LONG_SEQ_TOKENS, RULES, Configs, Observation, Rule, Stretch

if TYPE_CHECKING:
    from pagedkv.config import CacheConfig, SchedulerConfig

HISTORY = 64  # raised advice kept for AdviceLog (a few per hour at most: plenty)


@dataclass(frozen=True, slots=True)
class Advice:
    """One piece of advice: the rule, the flag it names, what to do and the measured numbers behind it."""

    rule: str
    flag: str
    message: str
    numbers: dict[str, Any]
    since: float  # start of the stretch the condition held over (the caller's clock)
    raised_at: float

    def to_dict(self, active: bool) -> dict[str, Any]:
        return {"rule": self.rule, "flag": self.flag, "message": self.message, "numbers": dict(self.numbers),
                "since": self.since, "active": active}


@dataclass(frozen=True, slots=True)
class AdvisorSettings:
    """When an observation counts and a condition counts as sustained."""

    interval_s: float = 1.0  # observations closer than this are skipped (the engine calls every step)
    sustain_intervals: int = 3  # a condition must hold this many intervals in a row ...
    sustain_s: float = 30.0  # ... spanning at least this long ("for long", the notes say)
    refire_s: float = 300.0  # a rule raises again at most this often, even if its condition flaps


@dataclass(slots=True)
class _RuleState:
    stretch: Stretch | None = None  # the intervals in a row the rule has held over, None while it does not hold
    active: bool = False  # raised and not cleared since
    last_raised: float | None = None


@dataclass(slots=True)
class _Previous:
    stats: EngineStats
    time: float
    divergence_warnings: int


def _long_share(seq_lens: Sequence[int]) -> tuple[float | None, int]:
    if not seq_lens:
        return None, 0
    return sum(1 for n in seq_lens if n > LONG_SEQ_TOKENS) / len(seq_lens), max(seq_lens)


class KVAdvisor:
    """Turns a stream of EngineStats snapshots into tuning advice (see the module docstring)."""

    def __init__(self, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                 settings: AdvisorSettings | None = None) -> None:
        self.configs = Configs(cache_config, scheduler_config)
        self.settings = settings or AdvisorSettings()
        self._prev: _Previous | None = None
        self._states = {rule.name: _RuleState() for rule in RULES}
        self._latest: dict[str, Advice] = {}  # per rule, the advice it raised last
        self.history: deque[Advice] = deque(maxlen=HISTORY)
        self.num_raised = 0
        self.last_interval: IntervalStats | None = None

    def due(self, now: float) -> bool:
        """Whether `observe(now)` would look at its snapshot (so a caller can skip building it)."""
        return self._prev is None or not 0 <= now - self._prev.time < self.settings.interval_s

    def observe(self, stats: EngineStats, now: float, seq_lens: Sequence[int] = (), divergence_warnings: int = 0,
                divergence_positions: Mapping[int, int] | None = None) -> list[Advice]:
        """Takes a snapshot at time `now`; returns the advice this observation newly raised.

        seq_lens: the running sequences' lengths (for the block-size rule; empty: that rule is skipped).
        divergence_warnings / divergence_positions: the prefix-divergence detector's count and positions
        (the count in `stats` is taken when larger).
        """
        if not self.due(now):
            return []
        warnings = max(divergence_warnings, stats.prefix_divergence_warnings)
        prev, self._prev = self._prev, _Previous(stats, now, warnings)
        if prev is None or now < prev.time:  # the first snapshot, or a clock that went back: a new baseline
            return []
        interval = IntervalStats.between(prev.stats, stats, now - prev.time)
        self.last_interval = interval
        share, longest = _long_share(seq_lens)
        obs = Observation(interval, share, longest, max(0, warnings - prev.divergence_warnings),
                          dict(divergence_positions or {}))
        return [advice for rule in RULES if (advice := self._apply(rule, obs, now)) is not None]

    def _apply(self, rule: Rule, obs: Observation, now: float) -> Advice | None:
        state = self._states[rule.name]
        holds = rule.holds(obs, self.configs)
        if holds is None:  # no evidence either way: the stretch neither grows nor breaks
            return None
        if not holds:
            state.stretch, state.active = None, False
            return None
        if state.stretch is None:
            state.stretch = Stretch(start=now - obs.interval.seconds)
        state.stretch.add(obs)
        if state.active or not self._sustained(state.stretch, now) or self._too_soon(state, now):
            return None
        found = rule.advise(state.stretch, self.configs)
        if found is None:
            return None
        flag, message, numbers = found
        advice = Advice(rule.name, flag, message, numbers, state.stretch.start, now)
        state.active, state.last_raised = True, now
        self._latest[rule.name] = advice
        self.history.append(advice)
        self.num_raised += 1
        return advice

    def _sustained(self, stretch: Stretch, now: float) -> bool:
        s = self.settings
        return stretch.intervals >= s.sustain_intervals and now - stretch.start >= s.sustain_s

    def _too_soon(self, state: _RuleState, now: float) -> bool:
        return state.last_raised is not None and now - state.last_raised < self.settings.refire_s

    def current(self) -> list[dict[str, Any]]:
        """Each rule's latest advice (raised so far; "active" while its condition still holds), JSON-able."""
        return [advice.to_dict(self._states[rule].active) for rule, advice in self._latest.items()]


@dataclass(slots=True)
class AdviceLog:
    """Hands a log each advice an advisor raises, once.

    feed: observe the snapshots given to `update` (an engine core in another process keeps its own advisor
    there; the front end sees only EngineStats, so the block-size rule, which needs sequence lengths, is out).
    """

    advisor: KVAdvisor
    feed: bool = False
    _seen: int = field(default=0)

    @classmethod
    def for_engine(cls, engine: Any) -> AdviceLog:
        """The engine's own advisor (an in-process LLMEngine), else one fed from the stats the caller sees."""
        advisor = getattr(engine, "kv_advisor", None)
        if advisor is not None:
            return cls(advisor)
        return cls(KVAdvisor(engine.cache_config, engine.scheduler_config), feed=True)

    def update(self, stats: EngineStats, now: float) -> list[Advice]:
        """The advice raised since the last call (feeding the advisor `stats` first when it is ours)."""
        if self.feed:
            self.advisor.observe(stats, now)
        new = self.advisor.num_raised - self._seen
        if not new:
            return []
        self._seen = self.advisor.num_raised
        return list(self.advisor.history)[-min(new, len(self.advisor.history)):]
