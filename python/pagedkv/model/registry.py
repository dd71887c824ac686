"""Architecture name -> model class: the one table the loader consults (`pagedkv.supported.ARCHITECTURES`).

Each family lives in its own module under `pagedkv.model`, imported only when
a checkpoint of that family is loaded.
"""

from __future__ import annotations

import importlib

from pagedkv.model.protocol import CausalLM
from pagedkv.supported import ARCHITECTURES


def model_class(architecture: str) -> type[CausalLM]:
    """The class that runs `architecture`; ValueError naming the supported ones otherwise."""
    entry = ARCHITECTURES.get(architecture)
    if entry is None:
        raise ValueError(f"unsupported architecture {architecture!r}; pagedkv runs {', '.join(sorted(ARCHITECTURES))}")
    module, name = entry
    return getattr(importlib.import_module(f"pagedkv.model.{module}"), name)
