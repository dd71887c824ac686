"""The text model of a Mistral 3 checkpoint (Mistral3ForConditionalGeneration: Mistral Small 3.1 / 3.2,
Ministral 3), for text prompts.

Its text model is a Mistral (Mistral Small) or a Ministral 3 (YaRN, and queries scaled by position:
`ModelConfig.query_position_scale`), which the Llama family runs. The tensors sit under `language_model.`
(`model.language_model.` in transformers 5's own names, with the LM head at `lm_head.` or
`language_model.lm_head.`); the vision tower and the projector are not loaded (pagedkv takes no image inputs).
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedkv.model.llama import LlamaForCausalLM


class Mistral3ForConditionalGeneration(LlamaForCausalLM):
    def split_checkpoint_tensor(self, name: str, tensor) -> Iterable[tuple[str, object, object]]:
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            return ()
        return super().split_checkpoint_tensor(name.removeprefix("language_model.").removeprefix("model."), tensor)
