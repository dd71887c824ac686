"""Beam search's public types (vLLM's names: `from pagedkv import BeamSearchParams`) and its scoring rule.

pagedkv runs beam search inside the engine (pagedkv.core.beam_search): a
request's beams are sequences forked from each other that share their
blocks, scored every step in the same flat batch as every other request.
The candidate rule is vLLM's (and HF's): per live beam the `2 * beam_width`
most likely next tokens (and, with temperature > 0, the token sampled at
that temperature), of which the best `beam_width` by cumulative log-
probability live on; a candidate ending in EOS is kept aside as a finished
hypothesis. After `max_tokens` steps the finished and the live beams are
ranked by `beam_search_score` and the best `beam_width` returned.
Log-probabilities are of the model's raw distribution (before temperature).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from pagedkv.outputs import Logprob
from pagedkv.sampling_params import SamplingParams, SamplingParamsError, _finite, _is_int


@dataclass(slots=True)
class BeamSearchParams:
    """How to run one beam search (vLLM's fields and defaults).

    beam_width: beams kept per step (and hypotheses returned). max_tokens:
    steps at most. ignore_eos: EOS is a token like any other (no beam
    finishes early). temperature: 0 takes the top candidates only; above 0
    one token sampled at that temperature joins each beam's candidates.
    length_penalty: a hypothesis' score is its cumulative logprob over
    (its length in tokens, prompt included) ** length_penalty.
    include_stop_str_in_output / skip_special_tokens: as in SamplingParams.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if not _is_int(self.beam_width) or self.beam_width < 1:
            raise SamplingParamsError("beam_width", f"beam_width must be an int >= 1, got {self.beam_width!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        self.temperature = _finite("temperature", self.temperature)
        if self.temperature < 0:
            raise SamplingParamsError("temperature", f"temperature must be >= 0, got {self.temperature!r}")
        self.length_penalty = _finite("length_penalty", self.length_penalty)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def num_candidates(self) -> int:
        """Top tokens scored per beam and step: 2 * beam_width, as in vLLM and HF."""
        return 2 * self.beam_width

    def to_sampling_params(self) -> SamplingParams:
        """What each beam's row asks of the sampler: the top-`num_candidates` raw logprobs (and a token drawn at
        the temperature). EOS and the length limit are the beam group's to handle, so the row itself never
        stops on them."""
        return SamplingParams(n=1, temperature=self.temperature, max_tokens=self.max_tokens,
                              logprobs=self.num_candidates, ignore_eos=True,
                              skip_special_tokens=self.skip_special_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output)


BEAM_PARAM_FIELDS = tuple(f.name for f in fields(BeamSearchParams))


def beam_params_to_wire(params: BeamSearchParams) -> tuple:
    return tuple(getattr(params, name) for name in BEAM_PARAM_FIELDS)


def beam_params_from_wire(values: tuple) -> BeamSearchParams:
    return BeamSearchParams(**dict(zip(BEAM_PARAM_FIELDS, values, strict=True)))


def beam_search_score(seq_len: int, cumulative_logprob: float, ends_in_eos: bool,
                      length_penalty: float = 1.0) -> float:
    """vLLM's (and HF's) score: cumulative logprob / length ** length_penalty, the length counting the prompt
    and not counting a final EOS."""
    if ends_in_eos:
        seq_len -= 1
    try:
        scale = max(seq_len, 1) ** length_penalty
    except OverflowError:  # a huge penalty: every long hypothesis scores 0 (and the ranking stays defined)
        scale = math.inf
    if scale == 0.0:  # a hugely negative one underflows: the sum's sign decides
        return math.copysign(math.inf, cumulative_logprob) if cumulative_logprob else 0.0
    return cumulative_logprob / scale


@dataclass
class BeamSearchSequence:
    """One hypothesis: every token (prompt included), the candidates' logprobs of each step, its score's sum.

    text: the decoded tokens, prompt included (as vLLM's). finish_reason:
    "stop" (it ended in EOS) or "length".
    """

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    lora_request: Any = None  # the LoRARequest it ran with
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best hypotheses of one prompt, best first (at most beam_width)."""

    sequences: list[BeamSearchSequence]
