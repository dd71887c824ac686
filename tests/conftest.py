"""Session fixtures shared by the engine tests: the default model is loaded once per test session."""

from __future__ import annotations

import os

import pytest
import torch

# The engines the tests build would each commit their whole KV cache (4 GiB by default) from the background
# prefault thread, several alive at once; tests/test_host_memory.py turns it on where it is the subject.
os.environ.setdefault("PAGEDKV_CPU_KV_PREFAULT", "0")


@pytest.fixture(scope="session")
def default_model_dir():
    from pagedkv.model.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def loaded_model(default_model_dir):
    """The default model + tokenizer in float32 on the CPU, shared by every LLM a test builds."""
    from pagedkv.config import EngineArgs
    from pagedkv.model.loader import LoadedModel

    return LoadedModel.load(EngineArgs(model=str(default_model_dir), device="cpu", dtype="float32"))


@pytest.fixture(scope="session")
def hf_model(default_model_dir):
    """HF transformers' LlamaForCausalLM on the same weights: the reference the engine must match."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()
