"""SamplingParams: how to pick each token and when to stop (vLLM's names and defaults).

Everything that can be checked without the model is checked here, so an
offline user gets the same refusals as a server client; what needs the
model (top_k and stop token ids against the vocabulary, logprobs against
`max_logprobs`, n against `max_num_seqs`) is checked by the engine when the
request is added. A refusal is a `SamplingParamsError` (a ValueError) that
names the field.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from pagedkv.errors import SamplingParamsError
from pagedkv.structured_outputs import StructuredOutputsParams

__all__ = ["SamplingParams", "SamplingParamsError", "StructuredOutputsParams"]

logger = logging.getLogger(__name__)

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# A temperature this low overflows float32 logits (x / 1e-30 is inf): vLLM raises such values to 0.01 too.
MIN_TEMPERATURE = 1e-2
# Bounds on what one request may ask for: each stop string is searched for after every token, and the
# stop token ids are banned per row before min_tokens, so their sizes are per-step costs.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 256  # each is matched against the output's tail after every token
MAX_BAD_WORD_TOKENS = 64
MAX_LOGIT_BIAS = 1024  # entries of a request's logit_bias, added to its row every step
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a bias: [-100, 100]
PENALTY_LIMIT = 2.0  # presence / frequency penalties in [-2, 2], OpenAI's and vLLM's range
MAX_CACHE_SALT_CHARS = 1024  # a request's cache_salt (checked by the engine and the server's protocol)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(name: str, x: object) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise SamplingParamsError(name, f"{name} must be a finite number, got {x!r}")
    return float(x)


def _stop_strings(stop: list[str] | str | None) -> list[str]:
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if len(strings) > MAX_STOP_STRINGS:
        raise SamplingParamsError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
    for s in strings:
        if not isinstance(s, str) or not s:
            raise SamplingParamsError("stop", f"stop strings must be non-empty strings, got {s!r}")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise SamplingParamsError("stop", f"a stop string has at most {MAX_STOP_STRING_CHARS} characters, "
                                              f"got one of {len(s)}")
    return strings


def _logit_bias(bias: dict | None) -> dict[int, float] | None:
    """{token id: bias}: ids ints >= 0 (ints or strings of ints, as JSON keys arrive), biases finite numbers in
    [-100, 100]. The vocabulary bound is the engine's check."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise SamplingParamsError("logit_bias", f"logit_bias must be a dict of token id -> bias, got {bias!r:.80}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise SamplingParamsError("logit_bias", f"logit_bias has at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    out = {}
    for key, value in bias.items():
        token = _token_id_key(key)
        if token is None:
            raise SamplingParamsError("logit_bias", f"logit_bias keys must be token ids (ints >= 0), got {key!r:.80}")
        value = _finite("logit_bias", value)
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise SamplingParamsError("logit_bias", f"logit_bias values must be in [-100, 100], got {value!r} for "
                                                    f"token {token}")
        out[token] = value
    return out or None


def _is_token_id(t: object) -> bool:
    """An int in [0, int64 max] (the vocabulary bound is the engine's check)."""
    return _is_int(t) and 0 <= t <= INT64_MAX


def _first_bad_token_id(ids: list) -> object | None:
    return next((t for t in ids if not _is_token_id(t)), None)


def _token_id_key(key: object) -> int | None:
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19:
        key = int(key)
    return key if _is_token_id(key) else None


def _allowed_token_ids(ids: list[int] | None) -> list[int] | None:
    if ids is None:
        return None
    ids = list(ids)
    if not ids:
        raise SamplingParamsError("allowed_token_ids", "allowed_token_ids must not be empty (None: every token)")
    bad = _first_bad_token_id(ids)
    if bad is not None:
        raise SamplingParamsError("allowed_token_ids", f"allowed token ids must be ints >= 0, got {bad!r}")
    return ids


def _bad_words(words: list[str] | None) -> list[str] | None:
    if words is None:
        return None
    if isinstance(words, str) or not isinstance(words, (list, tuple)):
        raise SamplingParamsError("bad_words", f"bad_words must be a list of strings, got {words!r:.80}")
    if len(words) > MAX_BAD_WORDS:
        raise SamplingParamsError("bad_words", f"at most {MAX_BAD_WORDS} bad words, got {len(words)}")
    for w in words:
        if not isinstance(w, str) or not w.strip() or len(w) > MAX_STOP_STRING_CHARS:
            raise SamplingParamsError("bad_words", f"bad words must be non-blank strings of at most "
                                                   f"{MAX_STOP_STRING_CHARS} characters, got {w!r:.80}")
    return list(words) or None


def _bad_words_token_ids(seqs: list[list[int]] | None) -> list[list[int]] | None:
    if seqs is None:
        return None
    if not isinstance(seqs, (list, tuple)) or len(seqs) > 2 * MAX_BAD_WORDS:
        raise SamplingParamsError("bad_words", f"bad_words_token_ids must be a list of at most {2 * MAX_BAD_WORDS} "
                                               f"token-id lists, got {seqs!r:.80}")
    out = []
    for ids in seqs:
        if not isinstance(ids, (list, tuple)) or not ids or len(ids) > MAX_BAD_WORD_TOKENS:
            raise SamplingParamsError("bad_words", f"each bad word is 1 to {MAX_BAD_WORD_TOKENS} token ids, got "
                                                   f"{ids!r:.80}")
        bad = _first_bad_token_id(list(ids))
        if bad is not None:
            raise SamplingParamsError("bad_words", f"bad word token ids must be ints >= 0, got {bad!r}")
        out.append(list(ids))
    return out


def _stop_token_ids(ids: list[int] | None) -> list[int]:
    ids = list(ids or [])
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise SamplingParamsError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(ids)}")
    bad = _first_bad_token_id(ids)
    if bad is not None:
        raise SamplingParamsError("stop_token_ids", f"stop token ids must be ints >= 0, got {bad!r}")
    return ids


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping rules.

    n: samples per prompt (they share the prompt's KV blocks, copy-on-write).
    temperature: 0 is greedy (values in (0, 0.01) are raised to 0.01, as in
    vLLM). top_p in (0, 1], top_k (0 or -1: off), min_p in [0, 1]:
    filters applied after the temperature. seed: a per-request generator (an
    int64), so the output does not depend on the rest of the batch.
    max_tokens: new tokens at most (None: up to max_model_len). stop: strings
    that end the output (not included in the text); stop_token_ids: tokens
    that end it (included in token_ids, left out of the text). ignore_eos:
    keep going past EOS. logprobs: also return the log-probabilities of the
    top-`logprobs` tokens and of the sampled one. repetition_penalty > 1
    discourages tokens already in the prompt or output (as in HF/vLLM).
    presence_penalty / frequency_penalty in [-2, 2] (OpenAI's): subtracted
    from the logit of every token already in the output, once / once per
    occurrence (the prompt does not count, as in vLLM). logit_bias: {token
    id: bias in [-100, 100]} added to those logits every step.
    allowed_token_ids: only these may be sampled (vLLM's).
    prompt_logprobs: also return, for every prompt token after the first,
    its log-probability given the tokens before it and the top-
    `prompt_logprobs` tokens there (vLLM's; the raw distribution, as for
    `logprobs`). Such a prompt is computed whole: it reads nothing from the
    prefix cache (its blocks are still offered to it), as in vLLM.
    structured_outputs: a JSON schema, regex, choice or grammar the output
    must follow (pagedkv.structured_outputs; a dict of its fields is taken).
    bad_words: words the output must not contain (vLLM's): each is
    tokenized as it starts a text and after a space, and a sequence's last
    token is banned whenever the output ends with the ones before it.
    bad_words_token_ids: the same as token-id sequences (the engine fills it
    from bad_words with the tokenizer; it may also be given instead).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    stop_strings: list[str] = field(init=False, default_factory=list)
    # Set lookups for the per-token stop check (stop_token_ids stays the list the user gave).
    all_stop_token_ids: frozenset[int] = field(init=False, default=frozenset())

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise SamplingParamsError("n", f"n must be an int >= 1, got {self.n!r}")
        self._check_floats()
        if self.top_k == -1:
            self.top_k = 0
        if not _is_int(self.top_k) or self.top_k < 0:
            raise SamplingParamsError("top_k", f"top_k must be 0 or -1 (off) or a positive int, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise SamplingParamsError("seed", f"seed must be an int64 ([{INT64_MIN}, {INT64_MAX}]) or None, "
                                              f"got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise SamplingParamsError("max_tokens",
                                      f"max_tokens must be an int >= 1 (or None), got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0 or (
                self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise SamplingParamsError("min_tokens", f"min_tokens must be an int in [0, max_tokens="
                                                    f"{self.max_tokens}], got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise SamplingParamsError(name, f"{name} must be an int >= 0 (or None), got {value!r}")
        self.logit_bias = _logit_bias(self.logit_bias)
        self.allowed_token_ids = _allowed_token_ids(self.allowed_token_ids)
        self.stop_strings = _stop_strings(self.stop)
        self.stop_token_ids = _stop_token_ids(self.stop_token_ids)
        self.all_stop_token_ids = frozenset(self.stop_token_ids)
        self.bad_words = _bad_words(self.bad_words)
        self.bad_words_token_ids = _bad_words_token_ids(self.bad_words_token_ids)
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        if self.structured_outputs is not None and self.min_tokens:
            # A complete grammar allows only the end of the sequence, which min_tokens would ban: nothing is left.
            raise SamplingParamsError("min_tokens", "min_tokens cannot be combined with structured_outputs")

    def _check_floats(self) -> None:
        self.temperature = _finite("temperature", self.temperature)
        if self.temperature < 0:
            raise SamplingParamsError("temperature", f"temperature must be >= 0, got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("temperature %g is below %g, where float32 logits overflow: using %g", self.temperature,
                           MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        self.top_p = _finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        self.min_p = _finite("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        self.repetition_penalty = _finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise SamplingParamsError("repetition_penalty",
                                      f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _finite(name, getattr(self, name))
            if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise SamplingParamsError(name, f"{name} must be in [-2, 2], got {value!r}")
            setattr(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def shapes_logits(self) -> bool:
        """Whether anything changes the logits before the pick (penalties, biases, an allow-list, bad words)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.logit_bias is not None or self.allowed_token_ids is not None
                or self.bad_words is not None or self.bad_words_token_ids is not None)

    @property
    def stop_holdback(self) -> int:
        """Characters a streamed output keeps back while unfinished: they may be the start of a stop string."""
        return max((len(s) for s in self.stop_strings), default=1) - 1
