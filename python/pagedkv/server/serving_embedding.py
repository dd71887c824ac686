"""POST /v1/embeddings: inputs in, one vector each out (OpenAI's API, vLLM's extra fields).

Each input (a string, or token ids) runs as a pooling request in the engine
(pagedkv.pooler) beside the generation requests, and the answer comes when
all of them are done, in input order. `encoding_format` "base64" sends each
vector as its little-endian float32 bytes in base64: what the official
`openai` client asks for unless told otherwise, and a quarter of the JSON.
usage counts the prompt tokens (an embedding has no completion tokens).
"""

from __future__ import annotations

import base64
import contextlib
import time

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse

from pagedkv.errors import SamplingParamsError
from pagedkv.pooling_params import PoolingParams
from pagedkv.server.protocol import APIError, EmbeddingData, EmbeddingRequest, EmbeddingResponse, UsageInfo
from pagedkv.server.serving import ENGINE_ERRORS, OpenAIServing, engine_error, random_id, unless_disconnected


def encode_vector(vector, encoding_format: str) -> list[float] | str:
    """A float32 vector as the response carries it: a list of floats, or base64 of its little-endian bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector.tolist()


class OpenAIServingEmbedding(OpenAIServing):
    async def create(self, req: EmbeddingRequest, raw: Request) -> JSONResponse:
        arrival = time.time()
        lora = self.check_model(req.model)
        self._log_ignored(req.ignored_fields)
        params = self._pooling_params(req)
        inputs = await self.prompt_inputs(req.input, "input", req.add_special_tokens)
        inputs = [(text, self._check_input(params.truncate(ids, self.max_model_len))) for text, ids in inputs]
        request_id = random_id("embd")
        requests = self.engine_requests(request_id, inputs, [params] * len(inputs), None, arrival, lora)
        outputs = await self.start(raw, requests, False)

        async def run() -> EmbeddingResponse:
            vectors: list = [None] * len(inputs)
            try:
                async with contextlib.aclosing(outputs):
                    async for tag, out in outputs:
                        if out.finished:
                            vectors[tag] = out.pooled
            except ENGINE_ERRORS as e:
                raise engine_error(e) from e
            missing = [i for i, v in enumerate(vectors) if v is None]
            if missing:  # the engine ended them without a vector (e.g. an abort while draining)
                raise APIError(f"the engine returned no embedding for input {missing[0]}", 500, type="server_error")
            data = [EmbeddingData(index=i, embedding=encode_vector(v, req.encoding_format))
                    for i, v in enumerate(vectors)]
            tokens = sum(len(ids) for _, ids in inputs)
            return EmbeddingResponse(id=request_id, model=self.response_model(req.model), data=data,
                                     usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens))

        response = await unless_disconnected(raw, run)
        return JSONResponse(response.model_dump())

    def _pooling_params(self, req: EmbeddingRequest) -> PoolingParams:
        """The request's PoolingParams, checked against the model (a 400 naming the field)."""
        try:
            params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize,
                                   truncate_prompt_tokens=req.truncate_prompt_tokens, use_activation=req.use_activation)
            self.validate_params(params)
        except SamplingParamsError as e:
            raise APIError(str(e), param=e.param) from e
        return params

    def _check_input(self, token_ids: list[int]) -> list[int]:
        """An input the engine can pool: not empty, in the vocabulary, at most max_model_len tokens."""
        self.check_token_ids(token_ids, "input", what="input")
        if len(token_ids) > self.max_model_len:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                           f"input has {len(token_ids)} tokens. Please reduce the input, or set "
                           f"truncate_prompt_tokens.", param="input", code="context_length_exceeded")
        return token_ids
