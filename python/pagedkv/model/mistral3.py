"""The text model of a Mistral 3 checkpoint (Mistral3ForConditionalGeneration: Mistral Small 3.1 / 3.2,
Ministral 3), for text prompts.

Its text model is a Mistral (Mistral Small) or a Ministral 3 (YaRN, and queries scaled by position:
`ModelConfig.query_position_scale`), which the Llama family runs. The tensors sit under `language_model.`
(`model.language_model.` in transformers 5's own names); the vision tower and the projector are not loaded
(`decoder.TextOfMultimodal`; pagedkv takes no image inputs).
"""

from __future__ import annotations

from pagedkv.model.decoder import TextOfMultimodal
from pagedkv.model.llama import LlamaForCausalLM


class Mistral3ForConditionalGeneration(TextOfMultimodal, LlamaForCausalLM):
    pass
