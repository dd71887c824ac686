"""Incremental detokenization and stop strings.

Decoding a token alone can be wrong (a multi-byte character split across
tokens, a leading space that depends on the previous token), so each step
decodes a short window of recent tokens and emits only what became stable:
text ending in U+FFFD (an incomplete character) waits for the next token.
Only sequences that need text during generation (stop strings, streaming)
pay for this; the others are decoded once, when they finish.
"""

from __future__ import annotations

import functools
from typing import Any

from pagedkv.core.sequence import OutputKind, Sequence
from pagedkv.outputs import CompletionOutput, Logprob
from pagedkv.sampling_params import SamplingParams

TOKEN_TEXT_CACHE = 1 << 16  # token ids whose own text is kept (a logprobs entry names k + 1 of them a step)


class TokenTexts:
    """Each token's own text, `Logprob.decoded_token` as vLLM fills it (the token decoded alone), decoded once
    per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._text = functools.lru_cache(maxsize=TOKEN_TEXT_CACHE)(lambda token: tokenizer.decode([token]))

    def fill(self, entry: dict[int, Logprob] | None) -> None:
        """Sets decoded_token on every Logprob of a logprobs entry that has none."""
        for token, lp in (entry or {}).items():
            if lp.decoded_token is None:
                lp.decoded_token = self._text(token)


def update_text(tokenizer, seq: Sequence, skip_special_tokens: bool = True) -> str:
    """Appends the newly stable text of `seq`'s output to seq.text; returns it.

    The tokens from prefix_offset to read_offset are the context already
    emitted; decoding them with the new ones and taking the difference gives
    the new text, correct across token merges.
    """
    out = seq.output_token_ids
    prefix = tokenizer.decode(out[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(out[seq.prefix_offset:], skip_special_tokens=skip_special_tokens)
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        return ""
    new = full[len(prefix):]
    seq.text += new
    seq.prefix_offset, seq.read_offset = seq.read_offset, len(out)
    return new


def find_stop_string(seq: Sequence, new_text_len: int, stops: list[str], include: bool) -> str | None:
    """If a stop string appears in the text (searching only where the new text could complete one),
    cuts seq.text there (keeping the string when `include`) and returns it."""
    if not stops or not new_text_len:
        return None
    for stop in stops:
        start = max(0, len(seq.text) - new_text_len - len(stop) + 1)
        at = seq.text.find(stop, start)
        if at != -1:
            seq.text = seq.text[:at + len(stop)] if include else seq.text[:at]
            return stop
    return None


def needs_text(params: SamplingParams, kind: OutputKind) -> bool:
    """Whether a sample needs its text while it runs: for stop strings, or for outputs sent before the end."""
    return bool(params.stop_strings) or kind is not OutputKind.FINAL_ONLY


def final_text(tokenizer, ids: list[int], params: SamplingParams, finish_reason: str | None,
               stop_reason: int | str | None) -> str:
    """The whole output's text, decoded once when it finished (no text was needed while it ran). The token
    that stopped it (EOS, a stop id) is not part of the text."""
    if stop_reason is not None or (finish_reason == "stop" and not params.ignore_eos):
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)


def completion_output(sample: Any, kind: OutputKind, holdback: int,
                      finish_reason: str | None = None) -> CompletionOutput:
    """One sample's CompletionOutput per its request's output kind; a DELTA output advances what was emitted.

    `sample` has index, output_token_ids, text, logprobs, cumulative_logprob, finish_reason, stop_reason,
    is_finished and the emitted counts (a Sequence, or the front end's SampleState). finish_reason
    overrides the sample's own (a failed request's samples end with "error").
    """
    ids, text, logprobs = sample.output_token_ids, sample.text, sample.logprobs
    if kind is OutputKind.DELTA:
        start = sample.num_emitted_tokens
        ids, logprobs = ids[start:], logprobs[start:] if logprobs else None
        text = _delta_text(sample, holdback)
        sample.num_emitted_tokens = len(sample.output_token_ids)
    return CompletionOutput(sample.index, text, list(ids),
                            sample.cumulative_logprob if sample.logprobs is not None else None,
                            list(logprobs) if logprobs is not None else None,
                            finish_reason or sample.finish_reason, sample.stop_reason)


def _delta_text(sample: Any, holdback: int) -> str:
    """The text a DELTA output may send now. Until the sample finishes, the last `holdback` (the longest stop
    string's length - 1) characters are kept back: they may be the start of a stop string that is cut out."""
    end = len(sample.text)
    if not sample.is_finished:
        end = max(sample.num_emitted_chars, end - holdback)
    text = sample.text[sample.num_emitted_chars:end]
    sample.num_emitted_chars = end
    return text
