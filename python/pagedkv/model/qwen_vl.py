"""The text models of Qwen2-VL / Qwen2.5-VL (Qwen2's decoder) and Qwen3-VL (Qwen3's), for text prompts.

Their multimodal rotary (M-RoPE) gives an image patch three position
components; a text token's three are all its position, so for text prompts
the rotation is the plain one (ModelConfig drops the `mrope` scaling) and
the decoder is the family's own. Checkpoints keep the text model at
`model.` (Qwen2.5-VL as published) or `model.language_model.`
(transformers 5); the vision tower (`visual.`) is not loaded
(`decoder.TextOfMultimodal`).
"""

from __future__ import annotations

from pagedkv.model.decoder import TextOfMultimodal
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.qwen3 import Qwen3ForCausalLM


class Qwen2VLForConditionalGeneration(TextOfMultimodal, LlamaForCausalLM):
    pass


class Qwen3VLForConditionalGeneration(TextOfMultimodal, Qwen3ForCausalLM):
    pass
