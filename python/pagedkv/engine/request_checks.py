"""The checks a request must pass before any engine queues it, in one place.

Both engines use them: `LLMEngine` (in-process) and the front end of an
engine core in its own process (`FrontendEngine`), which refuses a request
before it crosses to the core. They read fixed limits only, so any thread
may call them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedkv.beam_search import BeamSearchParams
from pagedkv.pooler import Pooler
from pagedkv.pooling_params import PoolingParams
from pagedkv.sampling_params import MAX_CACHE_SALT_CHARS, SamplingParams, SamplingParamsError

PromptType = str | list[int] | dict[str, Any]


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the model and the engine's settings allow a request."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_logprobs: int
    runner: str = "auto"  # EngineArgs.runner: "generate" / "pooling" refuse the other kind of request
    pooler: Pooler | None = None  # the engine's pooling setting (None: no pooling request runs)

    def check_params(self, params: SamplingParams | BeamSearchParams | PoolingParams) -> None:
        """Refuses what the model or the engine's limits rule out (the params checked the rest themselves)."""
        if isinstance(params, PoolingParams):
            self.check_pooling_params(params)
            return
        if self.runner == "pooling":
            raise SamplingParamsError("model", "this engine runs pooling requests only (runner='pooling'): "
                                               "use LLM.embed or /v1/embeddings")
        if isinstance(params, BeamSearchParams):
            self.check_beam_params(params)
            return
        vocab = self.vocab_size
        if params.top_k > vocab:
            raise SamplingParamsError("top_k", f"top_k must be -1, 0 or in [1, {vocab}] (the vocabulary), "
                                               f"got {params.top_k}")
        bad_words = [t for ids in params.bad_words_token_ids or () for t in ids]
        for name, what, ids in (("stop_token_ids", "stop token id", params.stop_token_ids),
                                ("logit_bias", "logit_bias token id", params.logit_bias or ()),
                                ("allowed_token_ids", "allowed_token_ids token id", params.allowed_token_ids or ()),
                                ("bad_words", "bad word token id", bad_words)):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise SamplingParamsError(name, f"{what} {bad} is outside the vocabulary [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise SamplingParamsError(name, f"requested {value} {name}, more than the {self.max_logprobs} "
                                                f"allowed (max_logprobs)")
        if params.n > self.max_num_seqs:
            raise SamplingParamsError("n", f"n={params.n} is more than max_num_seqs={self.max_num_seqs}")

    def check_pooling_params(self, params: PoolingParams) -> None:
        if self.runner == "generate":
            raise SamplingParamsError("model", "this engine runs generation requests only (runner='generate')")
        if self.pooler is None:
            raise SamplingParamsError("model", "this engine runs no pooling requests")
        self.pooler.check(params)

    def check_prompt(self, token_ids: list[int], room: int = 1) -> None:
        """room: tokens the request needs past its prompt (1: an output token; 0: a pooling request)."""
        if not token_ids:
            raise ValueError("the prompt is empty (0 tokens)")
        vocab = self.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        limit = self.max_model_len
        if len(token_ids) > limit - room:
            leave = " to leave room for one output token" if room else ""
            raise ValueError(f"the prompt has {len(token_ids)} tokens, but max_model_len is {limit}: it must be at "
                             f"most {limit - room}{leave}")

    def check_beam_params(self, params: BeamSearchParams) -> None:
        """A beam search's width against the engine's limits (BeamSearchParams checked the rest itself)."""
        if params.beam_width > self.max_num_seqs:
            raise SamplingParamsError("beam_width", f"beam_width={params.beam_width} is more than max_num_seqs="
                                                    f"{self.max_num_seqs}: every beam is a running sequence")

    def check_beams_fit(self, num_prompt_tokens: int, params: BeamSearchParams, num_blocks: int,
                        block_size: int) -> None:
        """A beam search's beams fit in a pool of `num_blocks` even if none shared a block (a preempted group
        may be recomputed without sharing)."""
        length = min(num_prompt_tokens + params.max_tokens, self.max_model_len)
        need = params.beam_width * -(-length // block_size)
        if need > num_blocks:
            raise SamplingParamsError("beam_width", f"beam_width={params.beam_width} beams of up to {length} "
                                                    f"tokens need up to {need} KV blocks; the cache has {num_blocks}")

    def check_request(self, token_ids: list[int], params: SamplingParams | BeamSearchParams | PoolingParams,
                      cache_salt: str | None, num_blocks: int | None = None, block_size: int = 16) -> None:
        """Everything about one request: its prompt, its sampling (beam search, pooling) parameters, its cache
        salt; with the pool's size (`num_blocks`), also that a beam search's beams fit in it."""
        self.check_prompt(token_ids, room=0 if isinstance(params, PoolingParams) else 1)
        self.check_params(params)
        check_cache_salt(cache_salt)
        if num_blocks is not None and isinstance(params, BeamSearchParams):
            self.check_beams_fit(len(token_ids), params, num_blocks, block_size)


def check_cache_salt(cache_salt: str | None) -> None:
    salt_ok = isinstance(cache_salt, str) and 0 < len(cache_salt) <= MAX_CACHE_SALT_CHARS
    if cache_salt is not None and not salt_ok:
        raise SamplingParamsError("cache_salt", f"cache_salt must be a non-empty string of at most "
                                                f"{MAX_CACHE_SALT_CHARS} characters, got {cache_salt!r:.80}")


def tokenize_prompt(tokenizer: Any, prompt: PromptType) -> tuple[str | None, list[int]]:
    """(text, token ids) of a prompt given as text, token ids, or {"prompt_token_ids": [...]} / {"prompt": str}."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError(f"a prompt dict needs 'prompt_token_ids' or 'prompt', got keys {sorted(prompt)}")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer (skip_tokenizer_init=True): pass token ids")
        try:
            return prompt, tokenizer.encode(prompt)
        except (UnicodeError, TypeError) as e:  # e.g. a lone surrogate, which no tokenizer can encode
            raise ValueError(f"the prompt is not valid text: {e}") from e
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, list(prompt)
    raise ValueError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}")
