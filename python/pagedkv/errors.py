"""Errors the engine raises across layers (engine, tensor-parallel runtime, server)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine cannot run another step (a dead tensor-parallel rank, an unusable device, a crash outside a
    step). The server answers 503 and exits non-zero once it has answered what was in flight."""
