"""Serving LoRA adapters: a LoRARequest names one per request; the engine keeps them in slots beside the model.

`request` (LoRARequest), `adapter` (reading PEFT folders), `layers` (the slots of each projection and the
step's map), `manager` (host copies, slots, the map of a step).
"""

from pagedkv.lora.request import LoRARequest

__all__ = ["LoRARequest"]
