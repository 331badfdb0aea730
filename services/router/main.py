"""`kvmesh router`: argv -> RouterConfig -> tokenizer -> uvicorn."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from kvmesh.common.auth import open_bind_warning, resolve_api_key
from kvmesh.common.http_server import run_until_signal
from kvmesh.common.model_files import BUILTIN_MODEL_NAME
from kvmesh.router.config import RouterConfig
from kvmesh.router.routing_policy import STRATEGIES

logger = logging.getLogger("kvmesh.router")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh router",
                                description="KV-aware OpenAI-compatible router over kvmesh or vLLM engines")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--redis-url", required=True, help="the shared prefix index, redis://host:port/db "
                   "(password from $KVMESH_REDIS_PASSWORD when set)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--backends", nargs="+", metavar="[KIND=]URL",
                       help="engine base URLs; KIND=URL (vllm=http://10.0.0.5:8000) sets one "
                       "backend's kind")
    where.add_argument("--discover-headless-service", metavar="NAME",
                       help="resolve this DNS name (a headless Service) for engine pod IPs")
    p.add_argument("--backend-port", type=int, default=8000, help="engine port for discovered IPs")
    p.add_argument("--backend-kind", choices=("kvmesh", "vllm"), default="kvmesh",
                   help="the engines' software: kvmesh engines publish to --redis-url themselves; "
                   "for vllm engines the router follows their ZMQ KV events (started with vLLM's "
                   "--kv-events-config) and writes them to --redis-url (default: kvmesh)")
    p.add_argument("--kv-events-port", type=int, default=5557,
                   help="vLLM backends' KV event PUB port, on each backend's host (default: 5557)")
    p.add_argument("--kv-events-replay-port", type=int, default=5558,
                   help="vLLM backends' KV event replay port; 0: none (default: 5558)")
    p.add_argument("--kv-events-topic", default="kv-events",
                   help="vLLM backends' KV event topic (default: kv-events)")
    p.add_argument("--strategy", choices=STRATEGIES, default="kv-aware")
    p.add_argument("--model", default=None, help="model path (HF dir or .gguf) or the built-in "
                   "model's name: the tokenizer the engines use (default: built-in)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (overrides --model)")
    p.add_argument("--served-model-name", default=None,
                   help="model name for requests that name none (default: from --model)")
    p.add_argument("--block-size", type=int, default=16, help="must equal the engines' value")
    p.add_argument("--hash-seed", default="kvmesh", help="must equal the engines' value")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' "
                   "(also from --api-key-file or $KVMESH_API_KEY)")
    p.add_argument("--api-key-file", default=None, metavar="FILE")
    p.add_argument("--expose-route-headers", action="store_true",
                   help="add x-kvmesh-backend and x-kvmesh-route-reason to responses "
                        "(diagnostics; they reveal backend addresses and cache hits)")
    p.add_argument("--cache-salt-from", default="none", metavar="none|api-key|header:NAME",
                   help="must equal the engines' value: per-tenant cache salt, so prefix hits "
                   "are looked up in the tenant's own blocks")
    p.add_argument("--session-header", default=None, metavar="NAME",
                   help="sticky routing by this header's value, e.g. X-Session-Id")
    p.add_argument("--namespace", default=None, help="Redis key space (default $POD_NAMESPACE)")
    p.add_argument("--service", default=None, help="Redis key space (default $KVMESH_SERVICE)")
    p.add_argument("--lookup-timeout", type=float, default=0.25, metavar="SECONDS",
                   help="a prefix lookup slower than this routes its request by load "
                        "(reason fallback-slow-lookup)")
    p.add_argument("--log-level", default="info")
    return p


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        redis_url=args.redis_url, backends=tuple(args.backends or ()),
        discover=args.discover_headless_service, backend_port=args.backend_port,
        backend_kind=args.backend_kind, kv_events_port=args.kv_events_port,
        kv_events_replay_port=args.kv_events_replay_port, kv_events_topic=args.kv_events_topic,
        strategy=args.strategy, model=args.model, tokenizer=args.tokenizer,
        block_size=args.block_size, hash_seed=args.hash_seed,
        api_key=resolve_api_key(args.api_key, args.api_key_file),
        expose_route_headers=args.expose_route_headers, cache_salt_from=args.cache_salt_from,
        session_header=args.session_header, namespace=args.namespace, service=args.service,
        lookup_timeout_s=args.lookup_timeout,
        redis_password=os.environ.get("KVMESH_REDIS_PASSWORD") or None)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"kvmesh router: error: {e}", file=sys.stderr)
        return 2
    warning = open_bind_warning(args.host, cfg.api_key, "router")
    if warning:
        logger.warning(warning)
    tokenizer = None
    if cfg.strategy == "kv-aware":
        from kvmesh.prompt.sources import load_tokenizer  # noqa: PLC0415 (transformers is slow to import)
        try:
            tokenizer = load_tokenizer(cfg.model, cfg.tokenizer)
        except (FileNotFoundError, ValueError) as e:
            # NOTE: keep serving: without a tokenizer every request is routed by load.
            logger.warning("no tokenizer (%s): prefix-aware routing is off", e)
    model_name = args.served_model_name or _default_model_name(cfg.model)
    import uvicorn  # noqa: PLC0415

    from kvmesh.router.app import create_app  # noqa: PLC0415
    run_until_signal(uvicorn.Config(create_app(cfg, tokenizer, model_name), host=args.host,
                                    port=args.port, log_level=args.log_level.lower()))
    return 0


def _default_model_name(model: str | None) -> str:
    if not model:
        return BUILTIN_MODEL_NAME
    from pathlib import Path  # noqa: PLC0415
    p = Path(model)
    return p.stem if p.suffix.lower() == ".gguf" else p.name


if __name__ == "__main__":
    sys.exit(main())
