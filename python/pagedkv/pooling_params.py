"""PoolingParams: what an embedding request asks for (vLLM's class and field names).

A pooling request runs its prompt through the model once (prefill only, no
token sampled) and returns one vector pooled from the final hidden states:
`LLM.embed`, `LLM.encode` and the server's /v1/embeddings. How the hidden
states are pooled (last token, mean, first token) and whether the vector is
L2-normalized by default is the engine's `pooler_config` (pagedkv.pooler);
a request may change the normalization and, on a Matryoshka model, keep only
the first `dimensions` values.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import SamplingParamsError
from pagedkv.sampling_params import INT64_MAX, SamplingParams, _is_int

POOLING_TASKS = ("embed",)


@dataclass(slots=True)
class PoolingParams:
    """dimensions: keep the first `dimensions` values, then normalize (Matryoshka models only). normalize: L2
    normalization of the vector (None: the pooler_config's; vLLM's newer `use_activation` sets it too).
    truncate_prompt_tokens: keep only the last k prompt tokens (-1: the last max_model_len). task: "embed" (one
    vector per prompt)."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str = "embed"
    use_activation: bool | None = None  # vLLM's newer name for normalize (an embedding's activation is it)

    def __post_init__(self) -> None:
        if self.use_activation is not None:
            if self.normalize is not None and self.normalize != self.use_activation:
                raise SamplingParamsError("use_activation", "use_activation and normalize disagree (they are the "
                                                            "same setting for embeddings)")
            self.normalize, self.use_activation = self.use_activation, None
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise SamplingParamsError("dimensions", f"dimensions must be an int >= 1, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise SamplingParamsError("normalize", f"normalize must be true, false or null, got {self.normalize!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or (k < 1 and k != -1) or k > INT64_MAX):
            raise SamplingParamsError("truncate_prompt_tokens", f"truncate_prompt_tokens must be -1 or an int in "
                                                                f"[1, 2**63), got {k!r}")
        if self.task not in POOLING_TASKS:
            raise SamplingParamsError("task", f"task must be one of {list(POOLING_TASKS)}, got {self.task!r}")

    def truncate(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as the request keeps it: its last truncate_prompt_tokens tokens (-1: max_model_len)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return token_ids
        k = max_model_len if k == -1 else k
        return token_ids[-k:] if len(token_ids) > k else token_ids


def placeholder_sampling_params() -> SamplingParams:
    """What a pooling request carries as its SamplingParams inside the engines (one greedy sample of one token):
    never sampled; the scheduler's and the front end's bookkeeping (n, max_tokens) read it."""
    return SamplingParams(max_tokens=1, temperature=0.0)
