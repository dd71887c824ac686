"""The request checks at their edges: the last value each limit allows passes, the next is refused, naming
the parameter (pagedkv.engine.request_checks; the engine and server tests send values far past the limits)."""

from __future__ import annotations

import pytest
from pagedkv.beam_search import BeamSearchParams
from pagedkv.engine.request_checks import RequestLimits, check_cache_salt, tokenize_prompt
from pagedkv.sampling_params import INT64_MAX, MAX_CACHE_SALT_CHARS, SamplingParams, SamplingParamsError

VOCAB, MAX_LEN, MAX_SEQS, MAX_LOGPROBS = 100, 32, 4, 5
LIMITS = RequestLimits(vocab_size=VOCAB, max_model_len=MAX_LEN, max_num_seqs=MAX_SEQS, max_logprobs=MAX_LOGPROBS)


def refused(param: str, check, *args, **kwargs) -> None:
    with pytest.raises(SamplingParamsError) as e:
        check(*args, **kwargs)
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
    ("logit_bias", {"logit_bias": {0: 1.0, VOCAB - 1: 1.0}}, {"logit_bias": {0: 1.0, VOCAB: 1.0}}),
    ("allowed_token_ids", {"allowed_token_ids": [VOCAB - 1]}, {"allowed_token_ids": [0, VOCAB]}),
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


# --- SamplingParams' own checks, at their edges ------------------------------------------------------------------

@pytest.mark.parametrize("param, allowed, refused_value", [
    ("n", {"n": 1}, {"n": 0}),
    ("n", {"n": 2}, {"n": True}),  # a bool is no count
    ("temperature", {"temperature": 0.0}, {"temperature": -1e-9}),
    ("top_p", {"top_p": 1.0}, {"top_p": 0.0}),
    ("top_p", {"top_p": 1e-9}, {"top_p": 1.0 + 1e-9}),
    ("min_p", {"min_p": 0.0}, {"min_p": -1e-9}),
    ("min_p", {"min_p": 1.0}, {"min_p": 1.0 + 1e-9}),
    ("repetition_penalty", {"repetition_penalty": 1e-9}, {"repetition_penalty": 0.0}),
    ("top_k", {"top_k": -1}, {"top_k": -2}),
    ("seed", {"seed": INT64_MAX}, {"seed": INT64_MAX + 1}),
    ("seed", {"seed": -INT64_MAX - 1}, {"seed": -INT64_MAX - 2}),
    ("max_tokens", {"max_tokens": 1}, {"max_tokens": 0}),
    ("min_tokens", {"min_tokens": 0}, {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 5, "max_tokens": 5}, {"min_tokens": 6, "max_tokens": 5}),
    ("logprobs", {"logprobs": 0}, {"logprobs": -1}),
    ("stop_token_ids", {"stop_token_ids": [0, INT64_MAX]}, {"stop_token_ids": [INT64_MAX + 1]}),
    ("stop_token_ids", {"stop_token_ids": [0]}, {"stop_token_ids": [-1]}),
    ("stop_token_ids", {"stop_token_ids": [1] * 1024}, {"stop_token_ids": [1] * 1025}),
    ("presence_penalty", {"presence_penalty": 2.0}, {"presence_penalty": 2.0 + 1e-9}),
    ("presence_penalty", {"presence_penalty": -2.0}, {"presence_penalty": -2.0 - 1e-9}),
    ("frequency_penalty", {"frequency_penalty": 2.0}, {"frequency_penalty": 2.0 + 1e-9}),
    ("frequency_penalty", {"frequency_penalty": -2.0}, {"frequency_penalty": -2.0 - 1e-9}),
    ("logit_bias", {"logit_bias": {1: 100.0}}, {"logit_bias": {1: 100.0 + 1e-9}}),
    ("logit_bias", {"logit_bias": {1: -100.0}}, {"logit_bias": {1: -100.0 - 1e-9}}),
    ("logit_bias", {"logit_bias": {INT64_MAX: 1.0}}, {"logit_bias": {INT64_MAX + 1: 1.0}}),
    ("logit_bias", {"logit_bias": {"0": 1.0}}, {"logit_bias": {"+1": 1.0}}),
    ("logit_bias", {"logit_bias": dict.fromkeys(range(1024), 1.0)}, {"logit_bias": dict.fromkeys(range(1025), 1.0)}),
    ("allowed_token_ids", {"allowed_token_ids": [0]}, {"allowed_token_ids": []}),
    ("allowed_token_ids", {"allowed_token_ids": [INT64_MAX]}, {"allowed_token_ids": [-1]}),
    ("stop", {"stop": ["s"] * 64}, {"stop": ["s"] * 65}),
    ("stop", {"stop": ["s" * 1024]}, {"stop": ["s" * 1025]}),
    ("stop", {"stop": "s"}, {"stop": [""]}),
])
def test_sampling_params_at_their_edges(param, allowed, refused_value):
    SamplingParams(**allowed)
    refused(param, SamplingParams, **refused_value)


@pytest.mark.parametrize("value", [True, float("nan"), float("inf"), "1.0", None])
def test_float_params_must_be_finite_numbers(value):
    with pytest.raises(SamplingParamsError, match="finite number"):
        SamplingParams(temperature=value)


def test_sampling_params_normalize():
    assert SamplingParams(temperature=1e-5).temperature == 1e-2  # float32 logits would overflow below
    assert SamplingParams(temperature=0.0).temperature == 0.0 and SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    assert SamplingParams(temperature=0.5).temperature == 0.5
    assert SamplingParams(temperature=2).temperature == 2.0
    assert SamplingParams(top_k=-1).top_k == 0
    defaults = SamplingParams()
    assert (defaults.n, defaults.top_k, defaults.max_tokens, defaults.min_tokens, defaults.ignore_eos,
            defaults.skip_special_tokens, defaults.include_stop_str_in_output) == (1, 0, 16, 0, False, True, False)
    assert SamplingParams(stop_token_ids=[7, 7, 9]).all_stop_token_ids == frozenset({7, 9})
    for derived in ({"all_stop_token_ids": frozenset({1})}, {"stop_strings": ["x"]}):  # derived, not arguments
        with pytest.raises(TypeError):
            SamplingParams(**derived)
    # A streamed output holds back all but one character of its longest stop string, and nothing without one.
    assert SamplingParams().stop_holdback == 0
    assert SamplingParams(stop=["ab", "xyz1"]).stop_holdback == 3
