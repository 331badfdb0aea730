"""/openapi.json states the deployment's own request limits (the --max-* flags), so a client
(or schemathesis) reads the bounds this server enforces, not built-in defaults."""
from __future__ import annotations

import asyncio
import dataclasses

import httpx

from kvmesh.api.app import ServerState, create_app
from kvmesh.engine.limits import RequestLimits


def test_the_schema_carries_the_configured_limits():
    limits = dataclasses.replace(RequestLimits(), max_n=3, max_stop_strings=4,
                                 max_stop_string_length=7, max_logprobs=5, max_stop_token_ids=9)
    app = create_app(ServerState(limits=limits))

    async def fetch() -> dict:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as client:
            return (await client.get("/openapi.json")).json()

    schemas = asyncio.run(fetch())["components"]["schemas"]
    comp, chat = schemas["CompletionRequest"]["properties"], schemas["ChatCompletionRequest"]["properties"]
    for props in (comp, chat):
        assert props["n"]["maximum"] == 3
        text, array = [v for v in props["stop"]["anyOf"] if v.get("type") != "null"]
        assert (text["maxLength"], array["maxItems"], array["items"]["maxLength"]) == (7, 4, 7)
    assert [v["maximum"] for v in comp["logprobs"]["anyOf"] if v.get("type") == "integer"] == [5]
    assert [v["maximum"] for v in chat["top_logprobs"]["anyOf"]
            if v.get("type") == "integer"] == [5]
    assert [v["maxItems"] for v in comp["stop_token_ids"]["anyOf"]
            if v.get("type") == "array"] == [9]
