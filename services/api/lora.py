"""The served LoRA adapters: `--lora-modules`, POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (vLLM's names and answers), and each adapter as a `model` name.

An adapter is registered here only once the engine has read, checked and cached it, so a
request naming it never meets a half-loaded adapter; a refused adapter changes nothing.
A `lora_path` may be a storage URI (s3://, hf://, pvc://, as `--model` takes): it is fetched
into the node's model cache first (`fetch_adapter`), with the model's credentials and cache.
"""
from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from kvmesh.api.errors import APIError
from kvmesh.common.storage import FetchError, FetchOptions, fetch, is_uri
from kvmesh.api.lora_resolver import FilesystemResolver
from kvmesh.engine.lora.request import LoRARequest

ADAPTER_CONFIG = "adapter_config.json"   # what a fetched adapter directory must hold


def fetch_adapter(path: str) -> str:
    """The local directory of a `lora_path`: a local path as it is, a storage URI fetched into
    the node's model cache first (blocking). FetchError, naming the URI, when it cannot be had."""
    if not is_uri(path):
        return path
    return str(fetch(path, FetchOptions(required_file=ADAPTER_CONFIG)).path)


@dataclass(frozen=True, slots=True)
class LoRAModulePath:
    """One `--lora-modules` entry: `name=path` or JSON {"name", "path", "base_model_name"}."""
    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, spec: str) -> LoRAModulePath:
        """ValueError with the accepted forms when `spec` is neither."""
        spec = spec.strip()
        if spec.startswith("{"):
            try:
                d = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules: invalid JSON {spec!r}: {e}") from None
            unknown = sorted(set(d) - {"name", "path", "base_model_name"})
            if unknown or not isinstance(d.get("name"), str) or not isinstance(d.get("path"), str):
                raise ValueError(f"--lora-modules: {spec!r} must be a JSON object with string "
                                 "\"name\" and \"path\" (and optional \"base_model_name\")")
            return cls(d["name"], d["path"], d.get("base_model_name"))
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules: {spec!r} must be name=path or a JSON object "
                             '{"name": ..., "path": ..., "base_model_name": ...}')
        return cls(name.strip(), path.strip())


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


@dataclass(slots=True)
class ServedLoRAs:
    """name -> LoRARequest of every adapter this server serves (read by the routes)."""
    base_model_name: str = ""
    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    # name -> the lora_path as the client gave it (a URI before its fetch): /v1/models' `root`,
    # which the operator compares with its spec
    roots: dict[str, str] = field(default_factory=dict)
    resolver: FilesystemResolver | None = None   # --lora-resolver-dir: adapters loaded on demand
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _lock: asyncio.Lock | None = None

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)

    def new_request(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        # NOTE: ids are never reused, so a slot or cached copy of an unloaded adapter can
        # never stand in for a new adapter of the same name
        return LoRARequest(name, next(self._ids), path, base_model_name or self.base_model_name)

    def _guard(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def _check_free(self, name: str) -> None:
        if name in self.adapters or name == self.base_model_name:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.",
                           code="lora_adapter_exists", param="lora_name")

    async def load(self, engine, body: LoadLoRAAdapterRequest) -> str:
        """400 when the name is taken (the base model's included), the adapter cannot be
        fetched or is refused."""
        name = body.lora_name
        self._check_free(name)
        # NOTE: fetched outside the lock: a slow download must not hold up other loads and
        # unloads; the name is checked again under the lock before it is registered
        try:
            local = await asyncio.to_thread(fetch_adapter, body.lora_path)
        except FetchError as e:
            raise APIError(400, f"cannot fetch the lora adapter '{name}': {e}",
                           code="invalid_lora_adapter", param="lora_path") from None
        async with self._guard():
            self._check_free(name)
            req = self.new_request(name, local)
            try:
                await engine.add_lora(req)
            except ValueError as e:       # LoRAAdapterError: nothing changed
                raise APIError(400, str(e), code="invalid_lora_adapter", param="lora_path") from None
            self.adapters[name] = req
            self.roots[name] = body.lora_path
            return f"Success: LoRA adapter '{name}' added successfully."

    async def resolve(self, engine, name: str) -> LoRARequest | None:
        """Adapter `name`, loaded from the resolver's directory if it is not served yet (as
        /v1/load_lora_adapter loads it); None when no resolver finds it; 400 when one is found
        and refused (nothing changes)."""
        if self.resolver is None or name == self.base_model_name:
            return self.adapters.get(name)
        async with self._guard():
            # NOTE: concurrent first requests for one adapter: the first loads it, the rest
            # find it registered once the lock is theirs
            if name in self.adapters:
                return self.adapters[name]
            path = self.resolver.find(name, self.base_model_name)
            if path is None:
                return None
            req = self.new_request(name, path)
            try:
                await engine.add_lora(req)
            except ValueError as e:       # LoRAAdapterError: nothing changed
                raise APIError(400, f"LoRA adapter '{name}' was found but could not be loaded: "
                               f"{e}", code="invalid_lora_adapter", param="model") from None
            self.adapters[name] = req
            return req

    async def unload(self, engine, body: UnloadLoRAAdapterRequest) -> str:
        """404 naming an adapter this server does not serve."""
        async with self._guard():
            req = self.adapters.get(body.lora_name)
            if req is None:
                raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.",
                               code="lora_adapter_not_found", param="lora_name")
            # NOTE: unregistered first: no new request names it; running ones finish with it
            del self.adapters[body.lora_name]
            self.roots.pop(body.lora_name, None)
            await engine.remove_lora(req.lora_int_id)
            return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    def model_cards(self, created: int, max_model_len: int) -> list[dict]:
        """/v1/models entries: each adapter with its `parent` (vLLM's `root` is its path)."""
        return [{"id": name, "object": "model", "created": created, "owned_by": "kvmesh",
                 "root": self.roots.get(name, req.lora_path), "parent": req.base_model_name,
                 "max_model_len": max_model_len}
                for name, req in self.adapters.items()]
