"""bad_words (vLLM's): the words' token sequences never complete in the output, on the default model.

The tokenization follows vLLM's rule (the word as it starts a text, and
after a space when that spelling is as long and starts differently); a
one-token word is banned at every step, a longer one's last token only
where the output ends with the tokens before it, and the prompt never
counts.
"""

from __future__ import annotations

import pytest
from pagedkv import LLM, SamplingParams
from pagedkv.bad_words import banned_next_tokens, tokenize_bad_words
from pagedkv.sampling_params import SamplingParamsError

PROMPTS = ["The capital of France is", "Q: What is the capital of Italy?\nA:"]


@pytest.fixture(scope="module")
def llm(loaded_model):
    return LLM(loaded_model=loaded_model, kv_cache_memory=64 << 20, max_model_len=256, max_num_seqs=8)


def contains(ids: list[int], word: list[int]) -> bool:
    return any(ids[i:i + len(word)] == word for i in range(len(ids) - len(word) + 1))


def test_tokenization_follows_vllms_rule(loaded_model):
    tok = loaded_model.tokenizer
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    assert tokenize_bad_words(tok, ["Paris"]) == [enc("Paris"), enc(" Paris")]
    assert tokenize_bad_words(tok, ["  the capital"]) == [enc("the capital"), enc(" the capital")]
    # A spelling after a space that is longer (the space a token of its own) is not added.
    word = next(w for w in ("Qx", "zzyzx", "Xylophonist") if len(enc(" " + w)) != len(enc(w)))
    assert tokenize_bad_words(tok, [word]) == [enc(word)]


def test_banned_next_tokens_needs_the_words_head_in_the_output():
    words = [[5], [7, 8, 9]]
    prompt = [7, 8]  # the head of [7, 8, 9] in the prompt does not count
    assert banned_next_tokens(words, prompt, 2) == [5]
    assert banned_next_tokens(words, prompt + [7, 8], 2) == [5, 9]
    assert banned_next_tokens(words, prompt + [1, 7, 8], 2) == [5, 9]
    assert banned_next_tokens(words, prompt + [8], 2) == [5]  # [7] is the prompt's
    assert banned_next_tokens([], prompt + [7, 8], 2) == []


def test_bad_words_never_complete_in_the_output(llm, loaded_model):
    tok = loaded_model.tokenizer
    free = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    paris = tokenize_bad_words(tok, ["Paris", "Rome"])
    assert any(contains(o.outputs[0].token_ids, w) for o in free for w in paris)  # what the ban must change
    words = ["Paris", "Rome", "the capital", "city"]
    seqs = tokenize_bad_words(tok, words)
    for params in (SamplingParams(temperature=0, max_tokens=24, bad_words=words),
                   SamplingParams(temperature=0.9, seed=4, max_tokens=24, n=3, bad_words=words),
                   SamplingParams(temperature=0, max_tokens=24, bad_words_token_ids=seqs)):
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        for o in outs:
            for c in o.outputs:
                assert not any(contains(c.token_ids, w) for w in seqs), (params, c.text)
    # Given as words or as their token ids, the same output.
    by_words = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, bad_words=words), use_tqdm=False)
    by_ids = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, bad_words_token_ids=seqs),
                          use_tqdm=False)
    assert [o.outputs[0].token_ids for o in by_words] == [o.outputs[0].token_ids for o in by_ids]


@pytest.mark.parametrize("fields", [
    {"bad_words": "Paris"}, {"bad_words": [""]}, {"bad_words": ["  "]}, {"bad_words": [3]},
    {"bad_words": ["x"] * 257}, {"bad_words_token_ids": [[]]}, {"bad_words_token_ids": [[-1]]},
    {"bad_words_token_ids": [list(range(65))]}, {"bad_words_token_ids": [5]},
])
def test_malformed_bad_words_are_refused(fields):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**fields)
    assert e.value.param == "bad_words"


def test_bad_word_ids_outside_the_vocabulary_are_refused(llm):
    with pytest.raises(SamplingParamsError, match="outside the vocabulary") as e:
        llm.llm_engine.validate_params(SamplingParams(bad_words_token_ids=[[1, 10 ** 9]]))
    assert e.value.param == "bad_words"
