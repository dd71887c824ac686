"""The engine: LLMEngine (step loop), ModelRunner (one step on the model), memory-pool sizing."""

from pagedkv.engine.llm_engine import EngineStats, LLMEngine

__all__ = ["EngineStats", "LLMEngine"]
