"""Incremental detokenization and stop strings.

Decoding a token alone can be wrong (a multi-byte character split across
tokens, a leading space that depends on the previous token), so each step
decodes a short window of recent tokens and emits only what became stable:
text ending in U+FFFD (an incomplete character) waits for the next token.
Only sequences that need text during generation (stop strings, streaming)
pay for this; the others are decoded once, when they finish.
"""

from __future__ import annotations

from pagedkv.core.sequence import Sequence


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
