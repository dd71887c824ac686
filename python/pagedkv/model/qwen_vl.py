"""The text models of Qwen2-VL / Qwen2.5-VL (Qwen2's decoder) and Qwen3-VL (Qwen3's), for text prompts.

Their multimodal rotary (M-RoPE) gives an image patch three position
components; a text token's three are all its position, so for text prompts
the rotation is the plain one (ModelConfig drops the `mrope` scaling) and
the decoder is the family's own. Checkpoints keep the text model at
`model.` (Qwen2.5-VL as published) or `model.language_model.`
(transformers 5); the vision tower (`visual.`) is not loaded.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.qwen3 import Qwen3ForCausalLM

_VISION = ("visual.", "model.visual.")


def _text_name(name: str) -> str | None:
    """A checkpoint name (the loader has stripped one leading "model.") as the text model's, None for vision."""
    if name.startswith(_VISION):
        return None
    return name.removeprefix("language_model.")


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    def split_checkpoint_tensor(self, name: str, tensor) -> Iterable[tuple[str, object, object]]:
        text = _text_name(name)
        return () if text is None else super().split_checkpoint_tensor(text, tensor)


class Qwen3VLForConditionalGeneration(Qwen3ForCausalLM):
    def split_checkpoint_tensor(self, name: str, tensor) -> Iterable[tuple[str, object, object]]:
        text = _text_name(name)
        return () if text is None else super().split_checkpoint_tensor(text, tensor)
