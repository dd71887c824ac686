"""What pagedkv runs, in one place: architectures, head sizes, block sizes, dtypes.

The kernel sets mirror csrc/common/supported.h (the C++ checks and their error
messages use that copy). The architectures name the module under
`pagedkv.model` that implements each one; `pagedkv.model.registry` imports it
on demand, so reading this module costs nothing.
"""

from __future__ import annotations

import torch

SUPPORTED_HEAD_SIZES = (64, 80, 96, 112, 128, 256)
SUPPORTED_BLOCK_SIZES = (8, 16, 32)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# HF architecture name -> (module under pagedkv.model, class name).
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma", "Gemma3ForConditionalGeneration"),  # its text model
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "GraniteForCausalLM": ("llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "SmolLM3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Olmo3ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "OlmoeForCausalLM": ("olmoe", "OlmoeForCausalLM"),
    "GraniteMoeForCausalLM": ("granite_moe", "GraniteMoeForCausalLM"),
    "GraniteMoeSharedForCausalLM": ("granite_moe", "GraniteMoeForCausalLM"),
    "GlmForCausalLM": ("glm", "GlmForCausalLM"),
    "Glm4ForCausalLM": ("glm", "Glm4ForCausalLM"),
    "Starcoder2ForCausalLM": ("starcoder2", "Starcoder2ForCausalLM"),
    "StableLmForCausalLM": ("stablelm", "StableLmForCausalLM"),
    "PhiForCausalLM": ("phi", "PhiForCausalLM"),
    "GPTNeoXForCausalLM": ("gpt_neox", "GPTNeoXForCausalLM"),
    "CohereForCausalLM": ("cohere", "CohereForCausalLM"),
    "Cohere2ForCausalLM": ("cohere", "CohereForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "GPTBigCodeForCausalLM": ("gpt2", "GPTBigCodeForCausalLM"),
    "Ministral3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Mistral3ForConditionalGeneration": ("mistral3", "Mistral3ForConditionalGeneration"),  # its text model
    "Ernie4_5ForCausalLM": ("llama", "LlamaForCausalLM"),
    "HeliumForCausalLM": ("llama", "LlamaForCausalLM"),
    "SeedOssForCausalLM": ("llama", "LlamaForCausalLM"),
    "ArceeForCausalLM": ("arcee", "ArceeForCausalLM"),
    "Exaone4ForCausalLM": ("olmo2", "Exaone4ForCausalLM"),
    "Qwen2VLForConditionalGeneration": ("qwen_vl", "Qwen2VLForConditionalGeneration"),  # its text model
    "Qwen2_5_VLForConditionalGeneration": ("qwen_vl", "Qwen2VLForConditionalGeneration"),  # its text model
    "Qwen3VLForConditionalGeneration": ("qwen_vl", "Qwen3VLForConditionalGeneration"),  # its text model
    "GPTJForCausalLM": ("gptj", "GPTJForCausalLM"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "NemotronForCausalLM": ("nemotron", "NemotronForCausalLM"),
    "FalconForCausalLM": ("falcon", "FalconForCausalLM"),
}

# Base models without an LM head (embedding checkpoints saved from AutoModel, e.g. e5-mistral's MistralModel):
# built as the causal class, run as pooling models only (ModelConfig.has_lm_head False).
HEADLESS_ARCHITECTURES: dict[str, str] = {
    "LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM", "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}

# Multimodal architectures whose text model pagedkv runs (text prompts only): config.json nests it in `text_config`.
TEXT_OF_MULTIMODAL = ("Gemma3ForConditionalGeneration", "Mistral3ForConditionalGeneration",
                      "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                      "Qwen3VLForConditionalGeneration")

# config.json `model_type` -> architecture, for configs that do not name one.
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM", "mixtral": "MixtralForCausalLM", "smollm3": "SmolLM3ForCausalLM",
    "olmo3": "Olmo3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM", "granitemoeshared": "GraniteMoeSharedForCausalLM",
    "glm": "GlmForCausalLM", "glm4": "Glm4ForCausalLM", "starcoder2": "Starcoder2ForCausalLM",
    "stablelm": "StableLmForCausalLM", "phi": "PhiForCausalLM", "gpt_neox": "GPTNeoXForCausalLM",
    "cohere": "CohereForCausalLM", "cohere2": "Cohere2ForCausalLM", "gpt2": "GPT2LMHeadModel",
    "gpt_bigcode": "GPTBigCodeForCausalLM", "ministral3": "Ministral3ForCausalLM", "ernie4_5": "Ernie4_5ForCausalLM",
    "helium": "HeliumForCausalLM", "seed_oss": "SeedOssForCausalLM", "arcee": "ArceeForCausalLM",
    "exaone4": "Exaone4ForCausalLM", "gptj": "GPTJForCausalLM", "opt": "OPTForCausalLM",
    "nemotron": "NemotronForCausalLM", "falcon": "FalconForCausalLM",
}


def kv_cache_format_refusal(fmt, head_size: int, block_size: int) -> str | None:
    """Why the KV-cache format `fmt` (a pagedkv.kv_cache.KVCacheFormat) cannot store heads of `head_size` in blocks
    of `block_size` tokens, or None when it can.

    The one rule every caller shares (the engine at start, kv-calc): a head must be a whole number of stored
    elements (int4 packs two codes a byte), and the kernels' head and block sizes hold for every format.
    """
    name = f"kv_cache_dtype {fmt.name}"
    if head_size % fmt.values_per_element:
        return (f"{name} packs {fmt.values_per_element} values a byte, so head_size must be a multiple of "
                f"{fmt.values_per_element}; this model's is {head_size}")
    if head_size not in SUPPORTED_HEAD_SIZES:
        return f"{name}: head_size {head_size} is not supported (supported: {SUPPORTED_HEAD_SIZES})"
    if block_size not in SUPPORTED_BLOCK_SIZES:
        return f"{name}: block_size {block_size} is not supported (supported: {SUPPORTED_BLOCK_SIZES})"
    return None
