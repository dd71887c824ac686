"""The front end's half of a request: text, stop strings and the outputs its caller asked for.

The engine core works in token ids only. For each request it sends what
every step added (`RequestDelta`: new ids per sample, how a sample ended by
EOS, stop id or length). Here, in the front end's process, those ids become
text (incremental detokenization, the same as the in-process engine's), the
stop strings are searched for, and the outputs are assembled per the
caller's `OutputKind`. A stop string ends its sample here at once; the
core is told (`FinishSamples`) and frees its blocks, and whatever it
produced for that sample in the meantime is dropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedkv.core.sequence import OutputKind
from pagedkv.engine.core_messages import (
    RequestDelta,
    logprobs_from_wire,
    metrics_from_wire,
    prompt_logprobs_from_wire,
    unpack_ids,
    unpack_vector,
)
from pagedkv.engine.detokenizer import (
    TokenTexts,
    completion_output,
    final_text,
    find_stop_string,
    needs_text,
    update_text,
)
from pagedkv.engine.prompt_logprobs import take_for_output as take_prompt_logprobs
from pagedkv.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedkv.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class SampleState:
    """One sample's text state. The field names are the detokenizer's (`update_text` reads them)."""

    index: int
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_emitted_tokens: int = 0  # DELTA outputs: tokens and characters already reported
    num_emitted_chars: int = 0

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True, eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: OutputKind
    metrics: RequestMetrics
    samples: dict[int, SampleState] = field(default_factory=dict)  # only those the core has started
    error: str | None = None
    core_finished: bool = False  # the core said so (a beam search returns fewer hypotheses than beam_width)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # whole, from the core's delta that had them
    prompt_logprobs_sent: bool = False
    pooled: Any = None  # a pooling request's vector (float32 tensor), from the core's delta that finished it

    @property
    def finished(self) -> bool:
        return self.error is not None or self.core_finished or (
            len(self.samples) == self.params.n and all(s.is_finished for s in self.samples.values()))

    @property
    def needs_text(self) -> bool:
        return needs_text(self.params, self.output_kind)


class OutputProcessor:
    """Turns the core's deltas into RequestOutputs. Not thread-safe: one caller (the front end's engine loop)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer) if tokenizer is not None else None  # Logprob.decoded_token
        self.requests: dict[str, RequestState] = {}

    def add(self, state: RequestState) -> None:
        self.requests[state.request_id] = state

    def abort(self, request_id: str) -> RequestState | None:
        return self.requests.pop(request_id, None)

    def process(self, deltas: list[RequestDelta]) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """(outputs for the requests that moved, samples the front end ended by a stop string)."""
        outputs: list[RequestOutput] = []
        stopped: list[tuple[str, int]] = []
        for delta in deltas:
            req = self.requests.get(delta.request_id)
            if req is None:
                continue  # finished or aborted here already: the core's late news
            req.metrics = metrics_from_wire(delta.metrics)
            if delta.prompt_logprobs is not None:
                req.prompt_logprobs = prompt_logprobs_from_wire(delta.prompt_logprobs)
                if self.token_texts is not None:
                    for entry in req.prompt_logprobs:
                        self.token_texts.fill(entry)
            if delta.pooled is not None:
                req.pooled = unpack_vector(delta.pooled)
            if delta.error is not None:
                req.error = delta.error
            else:
                self._apply(req, delta, stopped)
                req.core_finished = delta.finished
            if req.finished:
                del self.requests[req.request_id]
                if req.metrics.finished_time is None:
                    req.metrics.finished_time = time.time()
            output = self._make_output(req)
            if output is not None:
                outputs.append(output)
        return outputs, stopped

    def _apply(self, req: RequestState, delta: RequestDelta, stopped: list[tuple[str, int]]) -> None:
        for d in delta.samples:
            sample = req.samples.get(d.index)
            if sample is None:
                sample = req.samples[d.index] = SampleState(d.index)
            if sample.is_finished:
                continue
            ids = unpack_ids(d.token_ids)
            for i, token in enumerate(ids):
                last = i == len(ids) - 1
                self._append(req, sample, token, d.logprobs[i] if d.logprobs else None)
                core_reason = d.finish_reason if last else None
                if self._stop_string(req, sample, core_reason):
                    if core_reason is None:
                        stopped.append((req.request_id, sample.index))
                    break
                if core_reason is not None:
                    self._finish(req, sample, core_reason, d.stop_reason)
            if not ids and d.finish_reason is not None:
                self._finish(req, sample, d.finish_reason, d.stop_reason)

    def _append(self, req: RequestState, sample: SampleState, token: int, wire_logprobs) -> None:
        sample.output_token_ids.append(token)
        if wire_logprobs is not None:
            entry = logprobs_from_wire(wire_logprobs)
            if self.token_texts is not None:
                self.token_texts.fill(entry)
            if sample.logprobs is None:
                sample.logprobs = []
            sample.logprobs.append(entry)
            sample.cumulative_logprob += entry[token].logprob
        elif req.params.logprobs is not None and sample.logprobs is None:
            sample.logprobs = []

    def _stop_string(self, req: RequestState, sample: SampleState, core_reason: str | None) -> bool:
        """Updates the text for the token just appended; True when a stop string ended the sample. A token the
        core stopped on (EOS, a stop id) adds no text, as in the in-process engine."""
        if self.tokenizer is None or not req.needs_text or core_reason == "stop":
            return False
        p = req.params
        new = update_text(self.tokenizer, sample, p.skip_special_tokens)
        stop = find_stop_string(sample, len(new), p.stop_strings, p.include_stop_str_in_output)
        if stop is None:
            return False
        sample.finish_reason, sample.stop_reason = "stop", stop
        return True

    def _finish(self, req: RequestState, sample: SampleState, reason: str, stop_reason: int | None) -> None:
        sample.finish_reason, sample.stop_reason = reason, stop_reason
        if req.needs_text or self.tokenizer is None:
            return
        sample.text = final_text(self.tokenizer, sample.output_token_ids, req.params, reason, stop_reason)

    def _make_output(self, req: RequestState) -> RequestOutput | None:
        kind = req.output_kind
        finished = req.finished
        if kind is OutputKind.FINAL_ONLY and not finished:
            return None
        holdback, failed = req.params.stop_holdback, "error" if req.error is not None else None
        completions = [completion_output(req.samples[i], kind, holdback, failed) for i in sorted(req.samples)]
        if req.error is not None:
            completions = completions or [CompletionOutput(i, "", [], finish_reason="error")
                                          for i in range(req.params.n)]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions, finished,
                             req.metrics, req.metrics.num_cached_tokens, req.error,
                             take_prompt_logprobs(req, len(req.prompt_token_ids), kind), req.pooled)

