"""The engine: LLMEngine (step loop), device_setup (model, KV-cache plan and ModelRunner of one rank),
ModelRunner (one step on the model), memory-pool sizing, and a tensor-parallel worker's loop."""

from pagedkv.engine.llm_engine import EngineStats, LLMEngine

__all__ = ["EngineStats", "LLMEngine"]
