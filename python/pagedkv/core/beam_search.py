"""A beam group: the state of one beam-search request inside the scheduler.

The request's live beams are its sequences (`Request.seqs`), forked from
each other: they share every block they have in common by reference count,
and a beam's own new tokens copy only the shared last block on write. Each
step every live beam is one decode row of the flat batch; when the rows are
sampled, `select` applies vLLM's candidate rule (pagedkv.beam_search) and the
scheduler turns the winners into beams: a parent chosen once keeps its
sequence, a parent chosen k times forks k - 1 children, a parent not chosen
is freed at once. Candidates ending in EOS become finished hypotheses, kept
here as token lists only (they hold no blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.beam_search import BeamSearchParams, beam_search_score
from pagedkv.core.sequence import Sequence
from pagedkv.outputs import Logprob


@dataclass(slots=True, eq=False)
class BeamHypothesis:
    """A finished hypothesis, with the fields `completion_output` reads (like a finished Sequence)."""

    output_token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    cumulative_logprob: float
    finish_reason: str  # "stop": it ends in EOS; "length"
    stop_reason: int | None = None
    index: int = 0
    text: str = ""
    num_emitted_tokens: int = 0
    num_emitted_chars: int = 0

    @property
    def is_finished(self) -> bool:
        return True


@dataclass(slots=True)
class BeamChoice:
    """One surviving candidate: `parent` extended by `token` (its candidates' logprobs `entry`)."""

    parent: Sequence
    token: int
    entry: dict[int, Logprob]
    cumulative_logprob: float


@dataclass(slots=True, eq=False)
class BeamGroup:
    """params: the request's BeamSearchParams; eos_token_id: the EOS a candidate finishes on (None: none);
    completed: EOS hypotheses so far, in the order found; results: the best hypotheses, once finished."""

    params: BeamSearchParams
    eos_token_id: int | None
    num_prompt_tokens: int
    completed: list[BeamHypothesis] = field(default_factory=list)
    results: list[BeamHypothesis] | None = None
    num_steps: int = 0

    def _ends_in_eos(self, tokens: list[int]) -> bool:
        return bool(tokens) and tokens[-1] == self.eos_token_id

    def _score(self, h: BeamHypothesis) -> float:
        ids = h.output_token_ids
        return beam_search_score(self.num_prompt_tokens + len(ids), h.cumulative_logprob, self._ends_in_eos(ids),
                                 self.params.length_penalty)

    def select(self, scored: list[tuple[Sequence, dict[int, Logprob]]]) -> list[BeamChoice]:
        """The next beams from each live beam's candidates (`scored`: beam, {token: Logprob}, in beam order).

        A candidate ending in EOS (unless ignore_eos) joins `completed`; the
        others are ranked by score, stably (equal scores keep candidate
        order), and the best beam_width returned, best first.
        """
        self.num_steps += 1
        eos = None if self.params.ignore_eos else self.eos_token_id
        choices: list[BeamChoice] = []
        for seq, entry in scored:
            base = seq.cumulative_logprob
            for token, lp in entry.items():
                cum = base + lp.logprob
                if token == eos:
                    self.completed.append(BeamHypothesis(seq.output_token_ids + [token],
                                                         (seq.logprobs or []) + [entry], cum, "stop", token))
                else:
                    choices.append(BeamChoice(seq, token, entry, cum))
        # Every live candidate has the same length: the score orders them as their sums do, but the score is
        # what vLLM sorts by, and float division can tie sums that differ in the last bit.
        length = (scored[0][0].num_prompt_tokens + scored[0][0].num_output_tokens + 1) if scored else 1
        lp = self.params.length_penalty
        choices.sort(key=lambda c: beam_search_score(length, c.cumulative_logprob, False, lp), reverse=True)
        return choices[:self.params.beam_width]

    def finish(self, live: list[Sequence]) -> list[BeamHypothesis]:
        """Ends the search: the live beams join the finished hypotheses, and the best beam_width of all are
        the results (best first; equal scores keep the order found, the live beams last)."""
        for seq in live:
            ids = seq.output_token_ids
            eos = self._ends_in_eos(ids)
            self.completed.append(BeamHypothesis(list(ids), list(seq.logprobs or []), seq.cumulative_logprob,
                                                 "stop" if eos and not self.params.ignore_eos else "length",
                                                 ids[-1] if eos and not self.params.ignore_eos else None))
        ranked = sorted(self.completed, key=self._score, reverse=True)[:self.params.beam_width]
        for i, h in enumerate(ranked):
            h.index = i
        self.results = ranked
        self.completed = []
        return ranked
