"""Which sequences speculate, their drafts, and how many of them the model accepted.

A decoding sequence that speculates runs its next token and up to
`num_speculative_tokens` drafts after it as one chunk of the step (the
attention reads its cache as for a prefill chunk), and every row of the
chunk is sampled with the request's own parameters. Row j's sample is the
token that follows draft j - 1 (row 0: the token that follows the sequence),
so the tokens kept are row 0's, then row j's for as long as row j - 1's
sample equals draft j - 1: the longest run of drafts the model agrees with,
plus one more token of its own (a correction, or a bonus when every draft
held).

For greedy requests this keeps exactly the tokens decoding one at a time
would give. For sampled ones it keeps the same distribution: the drafts of
a proposer without a model (n-gram lookup) are certain, q(x) = 1, and the
rule "accept draft x with probability p(x), else sample from p without x"
outputs x with probability p(x) and any other y with p(y), which is what
"sample y from p, keep the draft if y == x, else keep y" does.

Requests whose next-token rules depend on the tokens before each row
(repetition, presence and frequency penalties, bad words, a grammar, the
tokens banned before min_tokens, beam search) and requests with stop strings
(text is checked once per step) decode without drafts
(`Sequence.speculates`): speculation never changes what a request gets,
only how many steps it takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedkv.config import SpeculativeConfig
from pagedkv.spec_decode.ngram import propose


def num_accepted(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """Drafts the model agrees with: the length of the run where sampled[j] == drafts[j] (sampled has one row
    more than drafts: the token after the last draft)."""
    n = 0
    while n < len(drafts) and sampled[n] == drafts[n]:
        n += 1
    return n


@dataclass(slots=True)
class SpecDecodeCounts:
    """vLLM's spec-decode counters: steps with drafts, drafts, accepted drafts, and accepted per position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for j in range(accepted):
            self.accepted_per_pos[j] += 1


class NgramDrafter:
    """Drafts by prompt lookup (pagedkv.spec_decode.ngram) within a sequence's own tokens."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        # Its last token must still fit: drafts end one position before max_model_len.
        self.max_len = max_model_len - 1

    def drafts(self, token_ids: Sequence[int], limit: int) -> list[int]:
        """At most min(k, limit) drafts for the token after a sequence's `token_ids` ([] when none is found)."""
        k = min(self.k, limit)
        if k <= 0:
            return []
        return propose(token_ids, self.min_n, self.max_n, k, self.max_len)
