"""What the front end and the engine-core process say to each other, as msgspec structs over ZeroMQ.

    front end --(PUSH: TokenizerEos | GrammarVocab | AddRequest | AbortRequests | FinishSamples | Inspect |
                 Shutdown)--> core
    front end <--(PULL: StepOutputs | Inspection | CoreDied)---------------------------------- core

Everything is msgpack (`msgspec.msgpack`), decoded into typed structs on the
other side. Token ids travel as packed int32 arrays (`bytes`), never as
lists of Python objects; a decode step's message is one small struct per
request that moved. SamplingParams travel as the tuple of their
constructor's fields, so the core re-runs the same checks.
"""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import torch

from pagedkv.lora.request import LoRARequest
from pagedkv.outputs import Logprob, RequestMetrics
from pagedkv.pooling_params import PoolingParams
from pagedkv.sampling_params import SamplingParams

_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.init)
_POOLING_FIELDS = tuple(f.name for f in dataclasses.fields(PoolingParams))


def pack_ids(ids: list[int] | np.ndarray) -> bytes:
    """Token ids as a packed little-endian int32 array."""
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_ids(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<i4").tolist()


def lora_to_wire(request: LoRARequest | None) -> tuple | None:
    return None if request is None else dataclasses.astuple(request)


def lora_from_wire(fields: tuple | None) -> LoRARequest | None:
    return None if fields is None else LoRARequest(*fields)


def params_to_wire(params: SamplingParams) -> tuple:
    return tuple(getattr(params, name) for name in _PARAM_FIELDS)


def params_from_wire(fields: tuple) -> SamplingParams:
    return SamplingParams(**dict(zip(_PARAM_FIELDS, fields, strict=True)))


def pooling_to_wire(params: PoolingParams) -> tuple:
    return tuple(getattr(params, name) for name in _POOLING_FIELDS)


def pooling_from_wire(fields: tuple) -> PoolingParams:
    return PoolingParams(**dict(zip(_POOLING_FIELDS, fields, strict=True)))


def pack_vector(vector: torch.Tensor) -> bytes:
    """A pooled vector (float32 tensor) as packed little-endian float32."""
    return vector.numpy().astype("<f4", copy=False).tobytes()


def unpack_vector(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype="<f4").copy())


class TokenizerEos(msgspec.Struct, tag="eos", array_like=True):
    """The EOS ids of the front end's tokenizer, which the core (no tokenizer) cannot read itself: sent once,
    first of all messages, since the tokenizer loads while the core starts. They end sequences beside the
    checkpoint's own, and the smallest is the EOS beam search finishes on."""

    token_ids: list[int]


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    """A tokenized request for the core. output_kind is always DELTA in the core: the front end assembles the
    kind its caller asked for."""

    request_id: str
    prompt_token_ids: bytes  # int32 [prompt_len]
    params: tuple  # params_to_wire(SamplingParams)
    arrival_time: float
    cache_salt: str | None = None
    beam: tuple | None = None  # beam_params_to_wire(BeamSearchParams): a beam search (params is then unused)
    grammar: str | None = None  # params.structured_outputs compiled by the front end (serialized; GrammarVocab first)
    lora: tuple | None = None  # lora_to_wire(LoRARequest): the adapter it runs with (the core reads the folder)
    pooling: tuple | None = None  # pooling_to_wire(PoolingParams): a pooling request (params is then unused)


class GrammarVocab(msgspec.Struct, tag="grammar_vocab", array_like=True):
    """The tokenizer's vocabulary as structured outputs' grammars see it (pagedkv.structured_outputs), sent once,
    before the first request with a compiled grammar: the core, which has no tokenizer, loads grammars with it."""

    vocab: str


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    """Stop these requests now (finish reason "abort") and free their blocks; unknown ids are ignored."""

    request_ids: list[str]


class FinishSamples(msgspec.Struct, tag="finish", array_like=True):
    """The front end found a stop string: end these samples (request id, sample index) with reason "stop"."""

    samples: list[tuple[str, int]]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class Inspect(msgspec.Struct, tag="inspect", array_like=True):
    """Asks for `LLMEngine.inspect()` (what="state") or `LLMEngine.kv_snapshot()` (what="kv_snapshot"), or runs
    `add_lora` / `remove_lora` / `list_loras` with `arg` (a wire LoRARequest, a lora_int_id); answered with an
    Inspection after the core's current step (the LoRA ones: {"result": ...} or {"error": message})."""

    what: str = "state"
    arg: tuple | int | None = None


class Inspection(msgspec.Struct, tag="inspection", array_like=True):
    state: dict


class WireLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    rank: int | None


class SampleDelta(msgspec.Struct, array_like=True):
    """What one step added to one sample: its new token ids (and their logprobs), how it ended if it did."""

    index: int
    token_ids: bytes  # int32 [new tokens]
    logprobs: list[list[WireLogprob]] | None = None  # per new token: the sampled one first, then the top ones
    finish_reason: str | None = None
    stop_reason: int | None = None  # a stop token id (stop strings are the front end's)


class RequestDelta(msgspec.Struct, array_like=True):
    """One request that moved in a step."""

    request_id: str
    samples: list[SampleDelta]
    finished: bool
    metrics: tuple  # RequestMetrics fields, in order
    error: str | None = None  # the core refused or failed it
    # With prompt_logprobs: the whole list (None for the first token), once, in the step that completes it.
    prompt_logprobs: list[list[WireLogprob] | None] | None = None
    pooled: bytes | None = None  # a pooling request's vector (pack_vector), in the step that finishes it


class WireStats(msgspec.Struct, array_like=True):
    """EngineStats' fields, in order."""

    values: tuple


class StepOutputs(msgspec.Struct, tag="step", array_like=True):
    """Everything one core iteration produced: the requests that moved, and the engine's stats after it."""

    outputs: list[RequestDelta]
    stats: WireStats | None = None


class CoreDied(msgspec.Struct, tag="died", array_like=True):
    """The core's last message: it cannot step any more (EngineDeadError in the front end)."""

    reason: str


ToCore = TokenizerEos | GrammarVocab | AddRequest | AbortRequests | FinishSamples | Inspect | Shutdown
FromCore = StepOutputs | Inspection | CoreDied

_METRIC_FIELDS = tuple(f.name for f in dataclasses.fields(RequestMetrics))


def metrics_to_wire(m: RequestMetrics) -> tuple:
    return tuple(getattr(m, name) for name in _METRIC_FIELDS)


def metrics_from_wire(values: tuple) -> RequestMetrics:
    return RequestMetrics(*values)


def logprobs_to_wire(entry: dict[int, Logprob]) -> list[WireLogprob]:
    return [WireLogprob(t, lp.logprob, lp.rank) for t, lp in entry.items()]


def logprobs_from_wire(entry: list[WireLogprob]) -> dict[int, Logprob]:
    return {w.token_id: Logprob(w.logprob, w.rank) for w in entry}


def prompt_logprobs_to_wire(entries: list[dict[int, Logprob] | None] | None) -> list[list[WireLogprob] | None] | None:
    return None if entries is None else [None if e is None else logprobs_to_wire(e) for e in entries]


def prompt_logprobs_from_wire(entries: list[list[WireLogprob] | None]) -> list[dict[int, Logprob] | None]:
    return [None if e is None else logprobs_from_wire(e) for e in entries]


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def to_core_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ToCore)


def from_core_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(FromCore)
