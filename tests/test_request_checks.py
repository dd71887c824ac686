"""The request checks at their edges: the last value each limit allows passes, the next is refused, naming
the parameter (pagedkv.engine.request_checks; the engine and server tests send values far past the limits)."""

from __future__ import annotations

import pytest
from pagedkv.beam_search import BeamSearchParams
from pagedkv.engine.request_checks import RequestLimits, check_cache_salt, tokenize_prompt
from pagedkv.sampling_params import MAX_CACHE_SALT_CHARS, SamplingParams, SamplingParamsError

VOCAB, MAX_LEN, MAX_SEQS, MAX_LOGPROBS = 100, 32, 4, 5
LIMITS = RequestLimits(vocab_size=VOCAB, max_model_len=MAX_LEN, max_num_seqs=MAX_SEQS, max_logprobs=MAX_LOGPROBS)


def refused(param: str, check, *args) -> None:
    with pytest.raises(SamplingParamsError) as e:
        check(*args)
    assert e.value.param == param


def test_prompt_length_leaves_room_for_one_output_token():
    LIMITS.check_prompt([1] * (MAX_LEN - 1))
    with pytest.raises(ValueError, match=f"max_model_len is {MAX_LEN}"):
        LIMITS.check_prompt([1] * MAX_LEN)
    with pytest.raises(ValueError, match="empty"):
        LIMITS.check_prompt([])


@pytest.mark.parametrize("token", [-1, VOCAB, 10 ** 9])
def test_prompt_token_ids_stay_in_the_vocabulary(token):
    LIMITS.check_prompt([0, VOCAB - 1])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        LIMITS.check_prompt([0, token])


@pytest.mark.parametrize("param, allowed, refused_value", [
    ("top_k", {"top_k": VOCAB}, {"top_k": VOCAB + 1}),
    ("stop_token_ids", {"stop_token_ids": [VOCAB - 1]}, {"stop_token_ids": [VOCAB]}),
    ("logprobs", {"logprobs": MAX_LOGPROBS}, {"logprobs": MAX_LOGPROBS + 1}),
    ("n", {"n": MAX_SEQS}, {"n": MAX_SEQS + 1}),
])
def test_sampling_params_at_the_engine_limits(param, allowed, refused_value):
    LIMITS.check_params(SamplingParams(**allowed))
    refused(param, LIMITS.check_params, SamplingParams(**refused_value))


def test_beam_width_and_its_blocks():
    LIMITS.check_params(BeamSearchParams(beam_width=MAX_SEQS, max_tokens=4))
    refused("beam_width", LIMITS.check_params, BeamSearchParams(beam_width=MAX_SEQS + 1, max_tokens=4))
    # 2 beams of 10 prompt + 6 output tokens, 16-token blocks: one block each, none shared.
    params = BeamSearchParams(beam_width=2, max_tokens=6)
    LIMITS.check_request([1] * 10, params, None, num_blocks=2, block_size=16)
    refused("beam_width", LIMITS.check_request, [1] * 10, params, None, 1, 16)
    # 10 + 10 tokens: two blocks a beam, four in all.
    LIMITS.check_beams_fit(10, BeamSearchParams(beam_width=2, max_tokens=10), num_blocks=4, block_size=16)
    refused("beam_width", LIMITS.check_beams_fit, 10, BeamSearchParams(beam_width=2, max_tokens=10), 3, 16)
    # A sampling request never needs the pool to hold beams, however small it is.
    LIMITS.check_request([1] * 10, SamplingParams(n=MAX_SEQS, max_tokens=20), None, num_blocks=1, block_size=16)
    # Beams never outgrow max_model_len: 2 x ceil(32 / 16) blocks at most, however many steps are asked for.
    LIMITS.check_beams_fit(10, BeamSearchParams(beam_width=2, max_tokens=1000), num_blocks=4, block_size=16)


def test_cache_salt_bounds():
    check_cache_salt(None)
    check_cache_salt("s")
    check_cache_salt("s" * MAX_CACHE_SALT_CHARS)
    refused("cache_salt", check_cache_salt, "")
    refused("cache_salt", check_cache_salt, "s" * (MAX_CACHE_SALT_CHARS + 1))


class WordTokenizer:
    """One token per character, enough to see which prompts reach the tokenizer."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % VOCAB for c in text]


def test_prompt_forms():
    assert tokenize_prompt(None, [3, 4]) == (None, [3, 4])
    assert tokenize_prompt(None, (3, 4)) == (None, [3, 4])
    assert tokenize_prompt(None, {"prompt_token_ids": [5], "prompt": "x"}) == ("x", [5])
    assert tokenize_prompt(WordTokenizer(), {"prompt": "ab"}) == ("ab", [97, 98])
    assert tokenize_prompt(WordTokenizer(), "ab") == ("ab", [97, 98])
    with pytest.raises(ValueError, match="need a tokenizer"):
        tokenize_prompt(None, "ab")
    with pytest.raises(ValueError, match="prompt_token_ids' or 'prompt'"):
        tokenize_prompt(None, {"tokens": [1]})
    for bad in ([1, True], [1, 2.0], [1, "2"], 7):  # a bool or a float is no token id
        with pytest.raises(ValueError, match="a string, a list of token ids or a dict"):
            tokenize_prompt(None, bad)
