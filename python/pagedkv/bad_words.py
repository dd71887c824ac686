"""Bad words (vLLM's `bad_words`): words a request's output must not contain.

Each word becomes token-id sequences: the word as it starts a text, and as
it follows a space when that spelling's first token differs but its length
does not (`tokenize_bad_words`, vLLM's rule). At every step, a sequence of
one token is banned outright, and a longer one's last token is banned when
the output so far ends with the tokens before it (`banned_next_tokens`); the
sampler gives the banned tokens -inf, beside the min_tokens ban. Only the
output counts, not the prompt, as in vLLM.
"""

from __future__ import annotations

from typing import Any

from pagedkv.errors import SamplingParamsError


def bad_words_token_ids(tokenizer: Any, bad_words: list[str] | None,
                        given: list[list[int]] | None) -> list[list[int]] | None:
    """A request's bad words as token-id sequences: `given` (SamplingParams.bad_words_token_ids, e.g. filled by a
    front end) as it is, else `bad_words` tokenized; None when it has neither."""
    if given is not None or bad_words is None:
        return given
    if tokenizer is None:
        raise SamplingParamsError("bad_words", "bad_words need a tokenizer (skip_tokenizer_init=True): pass "
                                               "bad_words_token_ids")
    return tokenize_bad_words(tokenizer, bad_words)


def tokenize_bad_words(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each word's token ids without special tokens: at the start of a text, and after a space when that adds a
    spelling of the same length whose first token differs (a leading space merges into the first token)."""
    out: list[list[int]] = []
    for word in words:
        word = word.lstrip()
        plain = list(tokenizer.encode(word, add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word, add_special_tokens=False))
        out.append(plain)
        if spaced and len(spaced) == len(plain) and spaced[0] != plain[0]:
            out.append(spaced)
    return [ids for ids in out if ids]


def banned_next_tokens(words: list[list[int]], token_ids: list[int], num_prompt_tokens: int) -> list[int]:
    """The tokens that would complete a bad word now: each word's last token where the output (token_ids after
    the prompt) ends with the word's other tokens; a one-token word always."""
    num_output = len(token_ids) - num_prompt_tokens
    banned = []
    for ids in words:
        head = len(ids) - 1
        if head == 0 or (head <= num_output and token_ids[len(token_ids) - head:] == ids[:-1]):
            banned.append(ids[-1])
    return banned
