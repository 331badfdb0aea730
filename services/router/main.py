"""`kvmesh router`: argv -> RouterConfig -> tokenizer -> uvicorn."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from kvmesh.common.access_log import FLAG_HELP as ACCESS_LOG_HELP, keep_access_log_clean
from kvmesh.common.auth import open_bind_warning, resolve_api_key
from kvmesh.common.http_server import run_until_signal
from kvmesh.common.model_files import BUILTIN_MODEL_NAME
from kvmesh.common.storage import is_uri, parse_source
from kvmesh.common.config import add_field_flag
from kvmesh.router.backends import BACKEND_KINDS
from kvmesh.router.config import RouterConfig
from kvmesh.router.routing_policy import STRATEGIES

logger = logging.getLogger("kvmesh.router")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh router",
                                description="KV-aware OpenAI-compatible router over kvmesh or vLLM engines")

    def flag(*names: str, **kwargs) -> None:      # a RouterConfig field: its default is the field's
        add_field_flag(p, RouterConfig, *names, **kwargs)

    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--redis-url", required=True, help="the shared prefix index, redis://host:port/db "
                   "(password from $KVMESH_REDIS_PASSWORD when set)")
    # NOTE: not required here: P/D mode names its engines by role instead; RouterConfig checks
    # that exactly one way is given
    where = p.add_mutually_exclusive_group()
    add_field_flag(where, RouterConfig, "--backends", nargs="+", metavar="[KIND=]URL",
                   help="engine base URLs; KIND=URL (vllm=http://10.0.0.5:8000) sets one "
                   "backend's kind")
    where.add_argument("--discover-headless-service", metavar="NAME",
                       help="resolve this DNS name (a headless Service) for engine pod IPs")
    pd = p.add_argument_group("prefill/decode disaggregation (instead of --backends; "
                              "docs/DISAGGREGATION.md)")
    add_field_flag(pd, RouterConfig, "--prefill-backends", nargs="+", metavar="[KIND=]URL",
                   help="P/D mode: engines started with a kv_producer --kv-transfer-config; each "
                   "request is prefilled on one (by prefix hits and load) with max_tokens 1")
    add_field_flag(pd, RouterConfig, "--decode-backends", nargs="+", metavar="[KIND=]URL",
                   help="P/D mode: kv_consumer engines; each request is decoded on one (by load "
                   "and free KV) with the prefill engine's kv_transfer_params")
    add_field_flag(pd, RouterConfig, "--discover-prefill-service", field_name="prefill_discover",
                   metavar="NAME", help="P/D mode: a headless Service of the prefill engines")
    add_field_flag(pd, RouterConfig, "--discover-decode-service", field_name="decode_discover",
                   metavar="NAME", help="P/D mode: a headless Service of the decode engines")
    flag("--backend-port", type=int, help="engine port for discovered IPs")
    flag("--backend-kind", choices=BACKEND_KINDS,
         help="the engines' software: kvmesh engines publish to --redis-url themselves; "
         "for vllm engines the router follows their ZMQ KV events (started with vLLM's "
         "--kv-events-config) and writes them to --redis-url (default: %(default)s)")
    flag("--kv-events-port", type=int,
         help="vLLM backends' KV event PUB port, on each backend's host (default: %(default)s)")
    flag("--kv-events-replay-port", type=int,
         help="vLLM backends' KV event replay port; 0: none (default: %(default)s)")
    flag("--kv-events-topic",
         help="vLLM backends' KV event topic (default: %(default)s)")
    flag("--strategy", choices=STRATEGIES)
    flag("--model", help="model path (HF dir or .gguf), an s3:// / hf:// / pvc:// source (fetched "
         "into the node's model cache) or the built-in model's name: the tokenizer the engines use "
         "(default: built-in)")
    flag("--tokenizer", help="tokenizer directory (overrides --model)")
    p.add_argument("--served-model-name", default=None,
                   help="model name for requests that name none (default: from --model)")
    flag("--block-size", type=int, help="must equal the engines' value")
    flag("--hash-seed", help="must equal the engines' value")
    flag("--api-key", help="require 'Authorization: Bearer KEY' "
         "(also from --api-key-file or $KVMESH_API_KEY)")
    p.add_argument("--api-key-file", default=None, metavar="FILE")
    flag("--expose-route-headers", action="store_true",
         help="add x-kvmesh-backend and x-kvmesh-route-reason to responses "
         "(diagnostics; they reveal backend addresses and cache hits)")
    flag("--cache-salt-from", metavar="none|api-key|header:NAME",
         help="must equal the engines' value: per-tenant cache salt, so prefix hits "
         "are looked up in the tenant's own blocks")
    flag("--session-header", metavar="NAME",
         help="sticky routing by this header's value, e.g. X-Session-Id")
    flag("--namespace", help="Redis key space (default $POD_NAMESPACE)")
    flag("--service", help="Redis key space (default $KVMESH_SERVICE)")
    flag("--lookup-timeout", field_name="lookup_timeout_s", type=float, metavar="SECONDS",
         help="a prefix lookup slower than this routes its request by load "
         "(reason fallback-slow-lookup)")
    flag("--hold-timeout", field_name="hold_timeout_s", type=float, metavar="SECONDS",
         help="while no engine is ready (a service scaled to zero), hold requests this long "
         "for one to become ready instead of answering 503 at once; 0: do not hold "
         "(default: %(default)s)")
    flag("--max-held-requests", type=int,
         help="requests held at once; more get a 503 with Retry-After (default: %(default)s)")
    flag("--lora-load-on-demand", action="store_true",
         help="send a request for a LoRA adapter that no backend lists (in /v1/models) to the "
         "best backend by prefix and load, whose engine loads it from its --lora-resolver-dir; "
         "default: such a request is a 404")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM (then their "
                   "connections are closed), as `kvmesh serve` gives them")
    p.add_argument("--log-level", default="info")
    p.add_argument("--disable-uvicorn-access-log", action="store_true", help=ACCESS_LOG_HELP)
    return p


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    return RouterConfig(
        redis_url=args.redis_url, backends=tuple(args.backends),
        discover=args.discover_headless_service, backend_port=args.backend_port,
        prefill_backends=tuple(args.prefill_backends), decode_backends=tuple(args.decode_backends),
        prefill_discover=args.prefill_discover, decode_discover=args.decode_discover,
        backend_kind=args.backend_kind, kv_events_port=args.kv_events_port,
        kv_events_replay_port=args.kv_events_replay_port, kv_events_topic=args.kv_events_topic,
        strategy=args.strategy, model=args.model, tokenizer=args.tokenizer,
        block_size=args.block_size, hash_seed=args.hash_seed,
        api_key=resolve_api_key(args.api_key, args.api_key_file),
        expose_route_headers=args.expose_route_headers, cache_salt_from=args.cache_salt_from,
        session_header=args.session_header, namespace=args.namespace, service=args.service,
        hold_timeout_s=args.hold_timeout_s, max_held_requests=args.max_held_requests,
        lookup_timeout_s=args.lookup_timeout_s, lora_load_on_demand=args.lora_load_on_demand,
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
    # NOTE: without a graceful-shutdown bound uvicorn waits for every open connection on SIGTERM:
    # one stream that never ends (a client or an engine that hangs) kept the router up for good
    config = uvicorn.Config(create_app(cfg, tokenizer, model_name), host=args.host,
                            port=args.port, log_level=args.log_level.lower(),
                            access_log=not args.disable_uvicorn_access_log,
                            timeout_graceful_shutdown=args.shutdown_timeout)
    keep_access_log_clean()
    run_until_signal(config)
    return 0


def _default_model_name(model: str | None) -> str:
    """The name the engines serve `model` under by default (kvmesh serve's rule)."""
    if not model:
        return BUILTIN_MODEL_NAME
    if is_uri(model):
        return parse_source(model).name
    from pathlib import Path  # noqa: PLC0415
    p = Path(model)
    return p.stem if p.suffix.lower() == ".gguf" else p.name


if __name__ == "__main__":
    sys.exit(main())
