"""Errors the engine raises across layers (sampling parameters, engine, tensor-parallel runtime, server)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine cannot run another step (a dead tensor-parallel rank, an unusable device, a crash outside a
    step). The server answers 503 and exits non-zero once it has answered what was in flight."""


class SamplingParamsError(ValueError):
    """A sampling parameter out of range; `param` names the field (the server's 400 reports it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
