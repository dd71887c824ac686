"""Which engine a front end drives: the core in its own process, or in this one.

    "process"  FrontendEngine: the core (scheduler, block manager, model) in a
               process of its own; this process tokenizes, detokenizes and serves
    "inproc"   LLMEngine: everything in the caller's thread
    "auto"     the caller's default: the server runs the core in a process (its
               event loop and its clients must never stall the compute
               threads); offline `LLM` runs it in-process (the two measure level
               offline, bench/results/throughput_cpu.md, and in-process needs no
               second interpreter nor a __main__ guard)

A model already in memory (`loaded`) can only serve an in-process engine.
"""

from __future__ import annotations

from pagedkv.config import EngineArgs
from pagedkv.engine.frontend import FrontendEngine
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.model.loader import LoadedModel

ENGINE_CORES = ("auto", "process", "inproc")


def make_engine(args: EngineArgs, loaded: LoadedModel | None = None,
                default_core: str = "inproc") -> LLMEngine | FrontendEngine:
    """The engine `args.engine_core` asks for ("auto": `default_core`)."""
    if args.engine_core not in ENGINE_CORES:
        raise ValueError(f"engine_core must be one of {', '.join(ENGINE_CORES)}, got {args.engine_core!r}")
    core = default_core if args.engine_core == "auto" else args.engine_core
    if loaded is not None:
        if args.engine_core == "process":
            raise ValueError("engine_core='process' loads the model in the core's own process: it cannot use "
                             "loaded_model (a model in this process's memory)")
        core = "inproc"
    if core == "process":
        return FrontendEngine(args)
    return LLMEngine(args, loaded)
