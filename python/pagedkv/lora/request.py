"""LoRARequest: which adapter a request runs with (vLLM's class and field names)."""

from __future__ import annotations

import json
from dataclasses import dataclass

MAX_LORA_NAME_CHARS = 256


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors or .bin) to run a request with.

    lora_int_id: a positive id naming the adapter inside the engine (two requests with the same id share one
    loaded copy, and its cached prefix blocks); lora_name: the name clients use (the server's `model` field);
    base_model_name: the model it was trained on (reported by /v1/models; not checked).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not 0 < len(self.lora_name) <= MAX_LORA_NAME_CHARS:
            raise ValueError(f"lora_name must be a non-empty string of at most {MAX_LORA_NAME_CHARS} characters, "
                             f"got {self.lora_name!r:.80}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must name the adapter's folder, got {self.lora_path!r}")

    @property
    def prefix_cache_key(self) -> bytes:
        """The prefix-cache extra key of its requests: its id, name and folder (a block computed under one adapter
        is reused only under the same one, also from a disk tier written by an earlier process), as bytes, so
        that no cache_salt string can equal it. KV events read the id and name back (`lora_of_extra_keys`)."""
        return _KEY_PREFIX + json.dumps([self.lora_int_id, self.lora_name, self.lora_path]).encode()


_KEY_PREFIX = b"lora:"


def lora_of_extra_keys(extra_keys) -> tuple[int, str] | None:
    """(lora_int_id, lora_name) of the adapter whose `prefix_cache_key` is among a request's extra keys, or None."""
    for key in extra_keys or ():
        if isinstance(key, bytes) and key.startswith(_KEY_PREFIX):
            lora_id, name, _ = json.loads(key[len(_KEY_PREFIX):])
            return lora_id, name
    return None
