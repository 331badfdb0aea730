"""P/D mode: prefill on one engine, decode on another, the KV cache handed over between them.

    client ─▶ router ─ body', max_tokens 1, stream false,                   ─▶ prefill engine
                     │ kv_transfer_params {do_remote_decode, transfer_id}       (kv_producer)
                     │ ◀─ answer's kv_transfer_params {do_remote_prefill, remote_engine_id,
                     │    remote_bootstrap_addr, remote_block_ids, transfer_id}
                     └ client's body + those kv_transfer_params ─▶ decode engine (kv_consumer)
                        ─▶ its answer, streamed or not, back to the client

The field names are vLLM's (its disaggregated serving proxies speak the same protocol), so
either engine may be kvmesh or vLLM. The prefill engine is chosen like a plain backend (prefix
hits and load); the decode engine by load and free KV (the plain proxy's path, `app.py`).

The prefill hop answers nobody: its one token is thrown away. So a prefill engine that fails in
any way (connection refused or broken, a 5xx or 429) is simply tried on another one, and when no
prefill engine is left the request goes to a decode engine alone, which prefills it itself.
Nothing reaches the client before the decode hop, which keeps the plain proxy's rules (a request
is re-sent only when it provably never ran). A 4xx from the prefill engine is the request's
own fault and goes back to the client as it is.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import Request
from fastapi.responses import Response

from kvmesh.common.disconnect import ClientDisconnected, until_disconnect
from kvmesh.router.backends import BackendPool
from kvmesh.router.metrics import DisaggMetrics
from kvmesh.router.routing_policy import choose

if TYPE_CHECKING:
    from kvmesh.router.app import RouterState

logger = logging.getLogger("kvmesh.router")

_PASS_THROUGH = ("content-type", "x-request-id")
_DISCONNECT_POLL_S = 0.25
# NOTE: fields the one-token prefill must not carry: it answers nobody (streaming options, extra
# samples), and min_tokens > 1 would contradict max_tokens 1.
_PREFILL_DROP = ("stream_options", "min_tokens", "n", "best_of", "max_completion_tokens")
# a prefill engine answering these is tried on another one (busy, loading, draining, broken)
_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


def new_transfer_id() -> str:
    """One hand-off's name on both engines."""
    return f"kvmesh-{uuid.uuid4().hex}"


def prefill_body(body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """The prefill hop's body: the client's, computing the prompt and one token, and asking the
    engine to keep the prompt's KV for a remote decode."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
    out["max_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id}
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode hop's body: the client's own, plus the prefill engine's kv_transfer_params
    (None: none came back; the decode engine prefills the prompt itself)."""
    if params is None:
        return body
    return {**body, "kv_transfer_params": params}


def local_prefill_reason(body: dict[str, Any]) -> str | None:
    """Why this request skips the prefill hop (None: it takes it)."""
    if body.get("prompt_logprobs") is not None:
        return "prompt_logprobs need the prompt computed where the answer comes from"
    if body.get("kv_transfer_params") is not None:
        return "the client sent its own kv_transfer_params"
    # NOTE: one hand-off carries one prompt's KV for one sample (the engines refuse more)
    if any(isinstance(body.get(k), int) and body[k] > 1 for k in ("n", "best_of")):
        return "several samples (n or best_of > 1)"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt):
        return "several prompts in one request"
    return None


@dataclass(slots=True)
class Handoff:
    """What the prefill hop hands the decode hop."""
    raw: bytes                      # the decode hop's body
    params: dict[str, Any] | None   # the prefill engine's kv_transfer_params (None: local prefill)
    prefill_backend: str | None     # the prefill engine that answered (None: none did)


@dataclass(slots=True)
class RoutingInputs:
    """The request's routing facts, computed once by the plain proxy."""
    hits: dict[str, int]            # prefix hits per pod id
    hashes: list[bytes]             # the prompt's block hashes
    num_blocks: int
    index_ok: bool                  # the prefix index answered
    fallback_reason: str            # the decision reason when it did not
    session_key: str | None


class Disaggregation:
    """The prefill engines and the prefill hop of every generation request."""

    def __init__(self, state: RouterState) -> None:
        cfg = state.cfg
        self.state = state
        self.pool = BackendPool(list(cfg.prefill_backends), cfg.prefill_discover,
                                cfg.backend_port, default_kind=cfg.backend_kind)
        self.metrics = DisaggMetrics(state.metrics.registry)

    async def prefill(self, request: Request, body: dict[str, Any], headers: dict[str, str],
                      path: str, inputs: RoutingInputs) -> Handoff | Response:
        """Run the prefill hop; the decode hop's body, or a response for the client (a 4xx the
        prefill engine gave, or 499 when the client left)."""
        why = local_prefill_reason(body)
        if why is None and not self.state.pool.healthy():
            # NOTE: no decode engine to hand the KV to (down, or scaled to zero and the request
            # about to be held): a prefill now would pin blocks nobody reads
            why = "no decode engine is ready"
        if why is not None:
            logger.debug("request prefilled on its decode engine: %s", why)
            return self._local(body, None)
        state = self.state
        transfer_id = new_transfer_id()
        raw = json.dumps(prefill_body(body, transfer_id)).encode()
        tried: set[str] = set()
        while True:
            candidates = [b for b in self.pool.states() if b.url not in tried]
            decision = choose(candidates, inputs.hits, inputs.num_blocks, state.cfg.strategy,
                              next(state.rr), state.rng, inputs.session_key, inputs.index_ok,
                              state.cfg.policy, inputs.fallback_reason)
            if decision is None:
                logger.warning("no prefill backend could take the request (%d tried): the "
                               "decode engine prefills it", len(tried))
                self.metrics.local_prefill_fallbacks.inc()
                return self._local(body, None)
            b = decision.backend
            if inputs.hashes and b.pod_id is not None:
                state.recent.record(b.pod_id, inputs.hashes, time.monotonic())
            b.in_flight += 1
            t0 = time.perf_counter()
            req = state.http.build_request("POST", b.url + path, content=raw, headers=headers)
            try:
                resp = await until_disconnect(request, state._send_and_read(req),
                                              _DISCONNECT_POLL_S)
            except ClientDisconnected:
                state.metrics.client_disconnects.inc()
                return Response(status_code=499)
            except httpx.HTTPError as e:
                # NOTE: safe to re-send anywhere: the prefill's token is never shown, and the
                # KV it may have pinned is freed by the engine's pin timeout.
                self.pool.mark_unhealthy(b.url, f"{type(e).__name__}: {e}")
                logger.warning("prefill backend %s failed (%s): trying another", b.url,
                               type(e).__name__)
                self.metrics.prefill_requests.labels("failed").inc()
                tried.add(b.url)
                continue
            finally:
                b.in_flight -= 1
            await resp.aclose()
            if resp.status_code in _RETRY_STATUS:
                logger.warning("prefill backend %s answered %d: trying another", b.url,
                               resp.status_code)
                self.metrics.prefill_requests.labels("failed").inc()
                tried.add(b.url)
                continue
            if resp.status_code != 200:
                self.metrics.prefill_requests.labels("refused").inc()
                return Response(resp.content, status_code=resp.status_code,
                                headers={k: resp.headers[k] for k in _PASS_THROUGH
                                         if k in resp.headers})
            self.metrics.prefill_seconds.observe(time.perf_counter() - t0)
            state.metrics.decisions.labels(decision.reason).inc()
            return self._handoff(body, resp, b.url)

    def _handoff(self, body: dict[str, Any], resp: httpx.Response, url: str) -> Handoff:
        try:
            params = resp.json().get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        if not isinstance(params, dict):
            # NOTE: an engine without a transfer for this prompt (or an older one) answers
            # without them: the decode engine then computes the prompt itself.
            self.metrics.prefill_requests.labels("no-params").inc()
            return self._local(body, url)
        self.metrics.prefill_requests.labels("handoff").inc()
        self.metrics.decode_requests.labels("remote-prefill").inc()
        return Handoff(json.dumps(decode_body(body, params)).encode(), params, url)

    def _local(self, body: dict[str, Any], prefill_backend: str | None) -> Handoff:
        self.metrics.decode_requests.labels("local-prefill").inc()
        return Handoff(json.dumps(body).encode(), None, prefill_backend)
