"""Request and response bodies of the OpenAI-compatible API (pydantic models).

The field names, defaults and shapes are OpenAI's, plus vLLM's extra sampling
fields (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`stop_token_ids`, `bad_words`, `min_tokens`, `skip_special_tokens`,
`include_stop_str_in_output`, `cache_salt`, `prompt_logprobs`, `structured_outputs`, and beam search's
`use_beam_search` and `length_penalty`), so that the official `openai`
client and vLLM's benchmark client work unchanged. Range checks live on the
fields, so a bad value comes back as a 400 naming its field: floats must be
finite (JSON's NaN / Infinity extensions are refused), ints of seeds fit int64,
strings must be valid Unicode (a lone surrogate, which JSON can spell as
"\ud800", is refused: no tokenizer can encode it). Checks that need the model
or the server's settings (top_k and token ids against the vocabulary,
logprobs against --max-logprobs, n against max_num_seqs) are made by the
serving layer. Unknown fields are accepted and ignored (as vLLM does); the
server logs each new name once, at debug level.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from pagedkv.sampling_params import INT64_MAX, INT64_MIN, MAX_CACHE_SALT_CHARS


def _valid_unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the string is not valid Unicode (a lone surrogate at character {e.start})") from None
    return s


Text = Annotated[str, AfterValidator(_valid_unicode)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @property
    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class _SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat completions. None: the checkpoint's generation config, else vLLM's."""

    model: Text | None = None  # None: the first served model name (vLLM accepts that too)
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: Text | list[Text] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0  # [-2, 2], checked by SamplingParams (a 400 naming the field)
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (a string of digits) -> bias in [-100, 100]
    user: Text | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[Text] | None = None
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: Text | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # vLLM's: each prompt token's logprob and the top ones there (not with stream; at most --max-logprobs).
    prompt_logprobs: int | None = Field(None, ge=0)
    # OpenAI's {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}, and
    # vLLM's structured_outputs {json | regex | choice | grammar | json_object, disable_any_whitespace}.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's beam search fields: n is the beam width (and the number of choices returned, best first).
    use_beam_search: bool = False
    length_penalty: float = 1.0  # a beam's score: cumulative logprob / (its length in tokens) ** length_penalty


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. prompt: a string, a list of strings, token ids, or a list of token-id lists."""

    prompt: Text | list[Text] | list[int] | list[list[int]]
    # OpenAI's default; None: up to max_model_len; 0 only with echo (the prompt alone, e.g. to score it).
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0)  # at most --max-logprobs (checked by the server)
    # The prompt comes back before the completion; with logprobs, its tokens' logprobs too (the first token's
    # are null), as prompt_logprobs=logprobs would give.
    echo: bool = False
    suffix: Text | None = None
    best_of: int | None = Field(None, ge=1)


class ContentPart(OpenAIBaseModel):
    type: Text
    text: Text | None = None


class ChatMessage(OpenAIBaseModel):
    role: Text
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls (passed to the chat template)
    tool_call_id: Text | None = None  # a "tool" turn: the call it answers


# OpenAI's rule for function names.
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
MAX_TOOLS = 128


class FunctionDefinition(OpenAIBaseModel):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: any object
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: FunctionName


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions: the messages go through the checkpoint's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)  # at most --max-logprobs (checked by the server)
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    # None: "auto" when tools are given (OpenAI's default), else "none" (pagedkv.server.tool_calls).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True


class EmbeddingRequest(OpenAIBaseModel):
    """POST /v1/embeddings. input: a string, a list of strings, token ids, or a list of token-id lists.
    encoding_format "base64" sends each vector as little-endian float32 bytes in base64 (what the openai client
    asks for by default). dimensions: the first so many values, renormalized (Matryoshka models only). vLLM's
    extras: truncate_prompt_tokens (keep the last k tokens; -1: max_model_len), normalize (or use_activation),
    add_special_tokens."""

    model: Text | None = None
    input: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=INT64_MAX)
    user: Text | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)
    normalize: bool | None = None
    use_activation: bool | None = None  # vLLM's newer name for normalize
    add_special_tokens: bool = True


class TokenizeRequest(OpenAIBaseModel):
    """POST /tokenize (vLLM's extra route; its benchmark client uses it to check prompt lengths)."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIBaseModel):
    model: Text | None = None
    tokens: list[TokenId]


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """POST /v1/load_lora_adapter (vLLM's; with $PAGEDKV_ALLOW_RUNTIME_LORA_UPDATING): both fields are needed (a
    missing one is a 400 naming it, as vLLM answers)."""

    lora_name: Text | None = None
    lora_path: Text | None = None


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """POST /v1/unload_lora_adapter (vLLM's): the adapter by name (lora_int_id, if given, must be its id)."""

    lora_name: Text | None = None
    lora_int_id: int | None = Field(None, ge=1)


# --- responses ------------------------------------------------------------------------------------------------

class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # a str with encoding_format "base64"


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: _now())
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs object: parallel lists, one entry per output token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry for one candidate token: its logprob, rank, and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt token {token id: PromptLogprob} (the prompt token and the top ones), None for the first token.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's extra: the stop string or token that ended the choice
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extra, with prompt_logprobs (or echo and logprobs)


def _now() -> int:
    return int(time.time())


class CompletionResponse(BaseModel):
    """A whole completion, or one stream chunk (the same object with partial choices)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(ToolCall):
    index: int  # the call's place in the reply (a stream sends each call whole, once)


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extra, with prompt_logprobs


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pagedkv"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[dict[str, Any]] = Field(default_factory=list)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class APIError(Exception):
    """An error answered as an OpenAI error body with this HTTP status."""

    def __init__(self, message: str, status_code: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.status_code, self.type, self.param, self.code = status_code, type, param, code

    def response_body(self) -> dict[str, Any]:
        # A message may quote the client's input: escape what UTF-8 cannot carry, so the answer always encodes.
        message = str(self).encode("utf-8", "backslashreplace").decode("utf-8")
        info = ErrorInfo(message=message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()
