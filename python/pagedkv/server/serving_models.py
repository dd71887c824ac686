"""The names a request's `model` may take: the base model's served names and the LoRA adapters (vLLM's
`OpenAIServingModels`).

A base name runs the base model; an adapter's name runs that adapter (a
LoRARequest); anything else is a 404. Adapters come from `--lora-modules`
(read by the engine at start-up, ids 1, 2, ... in order) and, when
$PAGEDKV_ALLOW_RUNTIME_LORA_UPDATING is set, from POST /v1/load_lora_adapter;
POST /v1/unload_lora_adapter forgets one and ends its requests in flight.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
from dataclasses import dataclass

from pagedkv.lora.request import LoRARequest
from pagedkv.server.async_engine import AsyncEngine
from pagedkv.server.protocol import APIError, ModelCard

logger = logging.getLogger(__name__)

RUNTIME_LORA_ENV = "PAGEDKV_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating_allowed() -> bool:
    """$PAGEDKV_ALLOW_RUNTIME_LORA_UPDATING is "1" or "true" (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    return os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true")


@dataclass(frozen=True, slots=True)
class LoRAModulePath:
    """One --lora-modules entry (vLLM's): the name clients send as `model`, the adapter's folder, and the model it
    was trained on (shown as /v1/models' parent; default: the served model)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """`name=path`, or a JSON object {"name": ..., "path": ..., "base_model_name": ...} (vLLM's two forms)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            fields = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--lora-modules {text!r}: not a JSON object ({e})") from None
        unknown = sorted(set(fields) - {"name", "path", "base_model_name"}) if isinstance(fields, dict) else []
        if not isinstance(fields, dict) or unknown or not all(isinstance(fields.get(k), str) and fields[k]
                                                              for k in ("name", "path")):
            raise ValueError(f"--lora-modules {text!r}: expected a JSON object with \"name\" and \"path\" (strings) "
                             f"and optionally \"base_model_name\"" + (f"; unknown keys {unknown}" if unknown else ""))
        return LoRAModulePath(fields["name"], fields["path"], fields.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected name=path or a JSON object "
                         "{\"name\": ..., \"path\": ..., \"base_model_name\": ...}")
    return LoRAModulePath(name, path)


def load_lora_modules(engine, modules: list[LoRAModulePath], base_names: list[str]) -> list[LoRARequest]:
    """Has the engine (not yet driven by the server's thread) read each adapter; ids 1, 2, ... in order. Raises
    ValueError naming the adapter that cannot be served."""
    requests: list[LoRARequest] = []
    for lora_int_id, module in enumerate(modules, 1):
        where = f"--lora-modules {module.name}={module.path}"
        if module.name in base_names or any(r.lora_name == module.name for r in requests):
            raise ValueError(f"{where}: the name {module.name!r} is taken (by the served model or another adapter)")
        try:
            request = LoRARequest(module.name, lora_int_id, module.path, module.base_model_name)
            engine.add_lora(request)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        requests.append(request)
    return requests


class OpenAIServingModels:
    """The served names: the base model's, and the LoRA adapters' (changed only on the event loop)."""

    def __init__(self, async_engine: AsyncEngine, base_model_names: list[str], root: str, max_model_len: int,
                 lora_requests: list[LoRARequest] = ()) -> None:
        self.async_engine = async_engine
        self.base_model_names = base_model_names
        self.root = root  # the base model's checkpoint, /v1/models' root
        self.max_model_len = max_model_len
        self.lora_requests: dict[str, LoRARequest] = {r.lora_name: r for r in lora_requests}
        self._ids = itertools.count(max((r.lora_int_id for r in lora_requests), default=0) + 1)
        self._lock = asyncio.Lock()  # one load / unload at a time: the check and the change are one step

    @property
    def model_name(self) -> str:
        return self.base_model_names[0]

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names (None for the base model); 404 for a name that is not served."""
        if model is None or model in self.base_model_names:
            return None
        lora = self.lora_requests.get(model)
        if lora is None:
            raise APIError(f"The model `{model:.200}` does not exist.", 404, param="model", code="model_not_found")
        return lora

    def model_cards(self) -> list[ModelCard]:
        """GET /v1/models: the base model's names, then each adapter (parent: the model it adapts)."""
        cards = [ModelCard(id=name, root=self.root, max_model_len=self.max_model_len)
                 for name in self.base_model_names]
        return cards + [self._lora_card(r) for r in self.lora_requests.values()]

    def model_card(self, model: str) -> ModelCard:
        lora = self.resolve(model)
        return ModelCard(id=model, root=self.root, max_model_len=self.max_model_len) if lora is None \
            else self._lora_card(lora)

    def _lora_card(self, lora: LoRARequest) -> ModelCard:
        return ModelCard(id=lora.lora_name, root=lora.lora_path, parent=lora.base_model_name or self.model_name,
                         max_model_len=self.max_model_len)

    # --- runtime loading (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter) ---------------------------
    async def load_lora_adapter(self, lora_name: str | None, lora_path: str | None) -> str:
        """Has the engine read the adapter, then serves it; returns vLLM's success text. 400: a field missing, a
        name taken, an adapter the engine cannot run (its reason)."""
        if not lora_name or not lora_path:
            raise APIError("Both 'lora_name' and 'lora_path' must be provided.",
                           param="lora_path" if lora_name else "lora_name")
        # Shielded: a client that leaves mid-load must not leave the engine holding an adapter nobody serves.
        return await asyncio.shield(self._load(lora_name, lora_path))

    async def _load(self, lora_name: str, lora_path: str) -> str:
        async with self._lock:
            if lora_name in self.base_model_names:
                raise APIError(f"The name '{lora_name:.200}' is the served model's: an adapter needs another.",
                               param="lora_name", code="lora_adapter_exists")
            if lora_name in self.lora_requests:
                raise APIError(f"The lora adapter '{lora_name:.200}' has already been loaded.", param="lora_name",
                               code="lora_adapter_exists")
            try:
                lora = LoRARequest(lora_name, next(self._ids), lora_path)
            except ValueError as e:  # a name LoRARequest refuses (too long)
                raise APIError(str(e), param="lora_name") from None
            try:
                await self.async_engine.add_lora(lora)
            except ValueError as e:
                raise APIError(str(e), param="lora_path", code="lora_adapter_unloadable") from None
            self.lora_requests[lora_name] = lora
        logger.info("LoRA adapter %r (id %d) loaded from %s", lora_name, lora.lora_int_id, lora_path)
        return f"Success: LoRA adapter '{lora_name}' added successfully."

    async def unload_lora_adapter(self, lora_name: str | None, lora_int_id: int | None = None) -> str:
        """Stops serving the adapter (by name, or by id alone): its requests in flight end with a 404 error and
        the engine forgets it. 400: neither given; 404: not served."""
        if not lora_name and lora_int_id is None:
            raise APIError("either 'lora_name' or 'lora_int_id' needs to be provided.", param="lora_name")
        return await asyncio.shield(self._unload(lora_name, lora_int_id))

    async def _unload(self, lora_name: str | None, lora_int_id: int | None) -> str:
        async with self._lock:
            lora = (self.lora_requests.get(lora_name) if lora_name
                    else next((r for r in self.lora_requests.values() if r.lora_int_id == lora_int_id), None))
            if lora is None or (lora_int_id is not None and lora.lora_int_id != lora_int_id):
                what = f"'{lora_name:.200}'" if lora_name else f"with lora_int_id {lora_int_id}"
                raise APIError(f"The lora adapter {what} cannot be found.", 404, type="not_found_error",
                               param="lora_name", code="lora_adapter_not_found")
            del self.lora_requests[lora.lora_name]  # new requests get 404 from now on
            await self.async_engine.remove_lora(lora)
        logger.info("LoRA adapter %r (id %d) unloaded", lora.lora_name, lora.lora_int_id)
        return f"Success: LoRA adapter '{lora.lora_name}' removed successfully."
