"""pagedkv: paged KV-cache memory management for LLM inference.

`import pagedkv` loads the compiled core, which registers the kernels as
`torch.ops.pagedkv.*`; `pagedkv.ops` holds typed wrappers and
`pagedkv.reference` pure-PyTorch versions of every op. `LLM` and
`SamplingParams` are the offline inference API (vLLM's names); `LLM.embed`
with `PoolingParams` returns embeddings.
"""

import torch  # noqa: F401  (loads libtorch before our extension)

from pagedkv import (  # noqa: F401
    _C,  # noqa: F401  (registers torch.ops.pagedkv.*)
    ops,
    reference,
)

__version__ = "0.1.0"
built_with_cuda: bool = bool(_C.built_with_cuda)

from pagedkv.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence  # noqa: E402
from pagedkv.config import EngineArgs  # noqa: E402
from pagedkv.engine import LLMEngine  # noqa: E402
from pagedkv.llm import LLM  # noqa: E402
from pagedkv.lora import LoRARequest  # noqa: E402
from pagedkv.outputs import (  # noqa: E402
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from pagedkv.pooling_params import PoolingParams  # noqa: E402
from pagedkv.sampling_params import SamplingParams  # noqa: E402
from pagedkv.structured_outputs import StructuredOutputsParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "StructuredOutputsParams", "LoRARequest",
           "RequestOutput", "CompletionOutput", "PoolingParams", "PoolingOutput", "PoolingRequestOutput",
           "EmbeddingOutput", "EmbeddingRequestOutput", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence",
           "ops", "reference", "built_with_cuda", "__version__"]
