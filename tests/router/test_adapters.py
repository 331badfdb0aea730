"""The router's LoRA adapter directory (router/adapters.py): /v1/models read into base models and
adapters, and how a request's `model` routes (holders, index model, 404, on-demand)."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from kvmesh.router.adapters import (AdapterDirectory, AdapterRoute, BackendModels, UnknownModel,
                                    parse_models)
from kvmesh.router.app import create_app
from kvmesh.router.config import RouterConfig
from kvmesh.router.main import build_parser, config_from_args
from kvmesh.router.routing_policy import BackendState

from .conftest import UvicornThread, free_port


def _card(id_: str, parent: str | None = None) -> dict:
    card = {"id": id_, "object": "model", "created": 0, "owned_by": "kvmesh"}
    return card if parent is None else {**card, "parent": parent, "root": f"/a/{id_}"}


def test_parse_models_splits_bases_and_adapters():
    body = {"object": "list", "data": [_card("tiny"), _card("sql", "tiny"), _card("chat", "tiny-v0"),
                                       {"object": "model"}, "junk", _card("x", "")]}
    assert parse_models(body) == BackendModels(("tiny", "x"), {"sql": "tiny", "chat": "tiny-v0"})
    assert parse_models({"object": "list"}) is None
    assert parse_models(["tiny"]) is None


def _directory() -> AdapterDirectory:
    return AdapterDirectory({
        "http://a:1": BackendModels(("tiny",), {"sql": "tiny", "chat": "tiny"}),
        "http://b:1": BackendModels(("tiny",), {"chat": "tiny", "law": "tiny-v0"}),
        "http://c:1": BackendModels(("tiny",), {})})


def test_route_base_model_and_no_model_go_anywhere_unhashed():
    d = _directory()
    assert d.route("tiny", "tiny", False) == AdapterRoute(None, "tiny", None)
    assert d.route(None, "tiny", False) == AdapterRoute(None, "tiny", None)


def test_route_adapter_to_its_holders_under_the_base_name():
    d = _directory()
    assert d.route("sql", "tiny", False) == AdapterRoute("sql", "tiny", frozenset({"http://a:1"}))
    assert d.route("chat", "tiny", False) == \
        AdapterRoute("chat", "tiny", frozenset({"http://a:1", "http://b:1"}))
    # the index key is the holder's served base name, not the adapter's declared parent
    assert d.route("law", "tiny", True) == AdapterRoute("law", "tiny", frozenset({"http://b:1"}))


def test_route_unknown_adapter_is_404_unless_on_demand():
    d = _directory()
    with pytest.raises(UnknownModel, match=r"^The model `nope` does not exist\.$"):
        d.route("nope", "tiny", False)
    assert d.route("nope", "tiny", True) == AdapterRoute("nope", "tiny", None)


def test_route_passes_through_while_no_backend_is_known():
    """Before any backend answered /v1/models the engines judge the name themselves."""
    assert AdapterDirectory().route("nope", "tiny", False) == AdapterRoute(None, "nope", None)


def _app(status: int, body) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        if isinstance(body, str):
            return PlainTextResponse(body, status_code=status)
        return JSONResponse(body, status_code=status)
    return app


def test_refresh_keeps_only_backends_that_answer_a_model_list():
    """Fault injection: a 500, a body that is no JSON, a JSON that is no model list and a
    refused connection each leave their backend out (its adapters unknown); a backend gone
    from the pool is forgotten."""
    good = UvicornThread(_app(200, {"object": "list", "data": [_card("tiny"),
                                                               _card("sql", "tiny")]})).start()
    bad = [UvicornThread(_app(500, {"error": {"message": "boom"}})).start(),
           UvicornThread(_app(200, "not json")).start(),
           UvicornThread(_app(200, {"data": "x"})).start()]
    refused = f"http://127.0.0.1:{free_port()}"
    try:
        d = AdapterDirectory({"http://gone:1": BackendModels(("tiny",), {"old": "tiny"})})
        backends = [BackendState(s.url) for s in (good, *bad)] + [BackendState(refused)]

        async def run():
            async with httpx.AsyncClient() as http:
                await d.refresh(http, backends, {}, 2.0)
        asyncio.run(run())
        assert d.models == {good.url: BackendModels(("tiny",), {"sql": "tiny"})}
        with pytest.raises(UnknownModel):
            d.route("old", "tiny", False)
    finally:
        for s in (good, *bad):
            s.stop()


def _engine(name: str, adapters: tuple[str, ...]) -> FastAPI:
    """A fake engine (a stand-in: the real ones are in tests/lora/test_lora_router.py) serving
    base model m and `adapters`; every completion answers with its name."""
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_card("m"), *(_card(a, "m") for a in adapters)]}

    @app.post("/v1/completions")
    async def completions():
        return {"choices": [{"text": name}]}
    return app


def test_an_adapter_whose_holders_all_fail_is_a_503_naming_it():
    """Fault injection: the one backend holding `sql` stops listening after the router read its
    adapters; a request for `sql` is never sent to the backend without it (503 naming the
    adapter), while base-model requests still go there."""
    holder = UvicornThread(_engine("holder", ("sql",))).start()
    other = UvicornThread(_engine("other", ())).start()
    cfg = RouterConfig(backends=(holder.url, other.url), health_interval_s=60.0)
    router = UvicornThread(create_app(cfg, None, "m")).start()
    try:
        def ask(model: str) -> httpx.Response:
            return httpx.post(f"{router.url}/v1/completions", json={"model": model, "prompt": "x"})
        assert [ask("sql").json()["choices"][0]["text"] for _ in range(2)] == ["holder", "holder"]
        holder.stop()
        r = ask("sql")
        assert (r.status_code, r.json()["error"]["message"], r.json()["error"]["code"]) == \
            (503, "no healthy backend holds the LoRA adapter `sql`", "no_healthy_backend")
        assert ask("m").json()["choices"][0]["text"] == "other"
    finally:
        router.stop()
        other.stop()
        holder.stop()


def test_lora_load_on_demand_flag():
    base = ["--redis-url", "redis://127.0.0.1:1/0", "--backends", "http://127.0.0.1:9"]
    assert config_from_args(build_parser().parse_args(base)).lora_load_on_demand is False
    assert config_from_args(build_parser().parse_args(
        [*base, "--lora-load-on-demand"])).lora_load_on_demand is True
