"""Helpers for the LoRA tests: PEFT adapters of the default model, made and saved on the fly."""

from __future__ import annotations

import torch


def _save_adapter(base_dir, out_dir, seed: int, **lora_kwargs) -> str:
    """A PEFT LoRA adapter of the default model with random (non-zero) A and B, saved to out_dir."""
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = peft.LoraConfig(init_lora_weights=False, **lora_kwargs)
    wrapped = peft.get_peft_model(model, config)
    with torch.no_grad():  # small enough that greedy outputs move but stay text-like
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.mul_(0.5)
    wrapped.save_pretrained(str(out_dir))
    return str(out_dir)
