"""LoRA adapter affinity: which backend serves which adapter, and how a request's `model` routes.

Each health round the router reads every healthy backend's `GET /v1/models`: an entry with a
`parent` is an adapter (kvmesh and vLLM list them the same way), one without is a base model.
A request whose `model` is an adapter then goes only to backends that hold it, and its prompt is
hashed with the adapter's name in block 0 (as the engines hash it) and looked up under the base
model's name (the name the engines publish their blocks under), so it only meets the adapter's
own blocks. An adapter no backend holds is a 404, or, with `--lora-load-on-demand`, goes to any
backend, whose engine loads it from its `--lora-resolver-dir`.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import httpx

from kvmesh.router.routing_policy import BackendState

logger = logging.getLogger("kvmesh.router")


@dataclass(frozen=True, slots=True)
class BackendModels:
    """One backend's `/v1/models`, as last read."""
    bases: tuple[str, ...]          # served base model names (entries without a parent)
    adapters: dict[str, str]        # adapter name -> its parent (the base it adapts)


def parse_models(body: object) -> BackendModels | None:
    """A `/v1/models` JSON body -> BackendModels; None when it is not a model list."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return None
    bases: list[str] = []
    adapters: dict[str, str] = {}
    for m in data:
        if not isinstance(m, dict) or not isinstance(m.get("id"), str):
            continue
        parent = m.get("parent")
        if isinstance(parent, str) and parent:
            adapters[m["id"]] = parent
        else:
            bases.append(m["id"])
    return BackendModels(tuple(bases), adapters)


@dataclass(frozen=True, slots=True)
class AdapterRoute:
    """Where a request's `model` may go and how its prompt is hashed and looked up."""
    lora_name: str | None           # block 0's extra key (None: a base-model request)
    index_model: str                # the model name its blocks are published under in Redis
    holders: frozenset[str] | None  # URLs of the backends that hold the adapter; None: any


class UnknownModel(LookupError):
    """No backend serves the model and on-demand loading is off: a 404."""


@dataclass(slots=True)
class AdapterDirectory:
    """URL -> BackendModels of each backend whose `/v1/models` answered its last poll."""
    models: dict[str, BackendModels] = field(default_factory=dict)

    async def refresh(self, http: httpx.AsyncClient, backends: list[BackendState],
                      headers: dict[str, str], timeout_s: float) -> None:
        """Poll every backend in `backends` at once; a backend that does not answer with a
        model list is forgotten (its adapters are unknown until it does), and so are backends
        no longer in `backends`."""
        results = await asyncio.gather(*(self._poll(http, b.url, headers, timeout_s)
                                         for b in backends))
        models = {b.url: m for b, m in zip(backends, results) if m is not None}
        for url, m in models.items():
            old = self.models.get(url)
            if old is None or old.adapters.keys() != m.adapters.keys():
                logger.info("backend %s serves LoRA adapters: %s", url,
                            ", ".join(sorted(m.adapters)) or "none")
        self.models = models

    @staticmethod
    async def _poll(http: httpx.AsyncClient, url: str, headers: dict[str, str],
                    timeout_s: float) -> BackendModels | None:
        try:
            r = await http.get(f"{url}/v1/models", headers=headers, timeout=timeout_s)
            if r.status_code != 200:
                return None
            return parse_models(r.json())
        except (httpx.HTTPError, ValueError):
            return None

    def route(self, model: str | None, default_model: str, on_demand: bool) -> AdapterRoute:
        """How a request naming `model` routes; UnknownModel when nothing can serve it.

        A base model's name, no name, or any name while no backend's models are known (the
        engines then answer for themselves) routes as before: no adapter, any backend."""
        name = model or default_model
        bases = {b for m in self.models.values() for b in m.bases}
        if not self.models or name == default_model or name in bases:
            return AdapterRoute(None, name, None)
        holders = frozenset(url for url, m in self.models.items() if name in m.adapters)
        if holders:
            # NOTE: an engine publishes every block, an adapter's too, under its served base
            # name; the adapter is in the hash (block 0's extra key), not in the key's model.
            url = min(holders)
            base = self.models[url].bases[0] if self.models[url].bases else default_model
            return AdapterRoute(name, base, holders)
        if on_demand:
            base = default_model if default_model in bases or not bases else min(bases)
            return AdapterRoute(name, base, None)
        raise UnknownModel(f"The model `{name}` does not exist.")
