"""`kvmesh serve`: the OpenAI-compatible server on one engine.

The HTTP server comes up at once (liveness answers while the model loads); /ready turns green
after the model is loaded and a one-token generation has succeeded. SIGTERM: uvicorn stops
accepting connections, in-flight requests get `--shutdown-timeout` seconds to finish, what is
left is aborted (its blocks freed), and the process exits 0. If the engine thread fails (a step
raised), every in-flight request gets a 503 `engine_dead` error, /health and /ready answer 503,
and the process exits 1 so that Kubernetes restarts the pod.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
import threading
from typing import Callable

import uvicorn

from kvmesh.api import tool_parsers
from kvmesh.api.app import ServerState, create_app, warm_up
from kvmesh.api.lora import LoRAModulePath, fetch_adapter
from kvmesh.api.lora_resolver import FilesystemResolver
from kvmesh.api.metrics import EngineMetrics
from kvmesh.common.gc_freeze import freeze_after_startup
from kvmesh.common.access_log import FLAG_HELP as ACCESS_LOG_HELP, keep_access_log_clean
from kvmesh.common.auth import open_bind_warning, resolve_api_key
from kvmesh.common.cache_salt import CacheSaltSource
from kvmesh.common.config import (EngineConfig, add_engine_args, engine_config_from_args,
                                  field_default, parse_args_with_config)
from kvmesh.common.http_server import run_until_signal
from kvmesh.common.openmp import process_thread_count, release_thread_team, spin_requested
from kvmesh.common.startup import startup_phase
from kvmesh.common.startup_times import get_startup_times, process_age_s, reset_startup_times
from kvmesh.common.storage import resolve_engine_model
from kvmesh.common.preload import loaded_allocator, reexec_with_allocator
from kvmesh.common.tracing import get_tracer, init_tracing, shutdown_tracing
from kvmesh.engine.async_engine import AsyncLLMEngine
from kvmesh.engine.limits import RequestLimits
from kvmesh.index import serve as kv_publishing
from kvmesh.kernels.ops import keep_triton_out
from kvmesh.engine.pooling_params import POOLING_TYPES, PoolingParams

logger = logging.getLogger("kvmesh.serve")

# Called with the built AsyncLLMEngine before it starts, to attach step / shutdown hooks.
EngineHook = Callable[[AsyncLLMEngine, argparse.Namespace, EngineMetrics], None]
ENGINE_HOOKS: list[EngineHook] = [kv_publishing.attach]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh serve", description="OpenAI-compatible server")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="JSON (or *.yaml) file of flag defaults: keys are the long flag names without "
                   "dashes ('max-num-seqs' or 'max_num_seqs'); flags on the command line override it")
    p.add_argument("--allocator", default=os.environ.get("KVMESH_ALLOCATOR", "auto"),
                   help="malloc to preload by restarting once with LD_PRELOAD: auto (tcmalloc, else "
                   "jemalloc, when installed), none, or a library path (also KVMESH_ALLOCATOR)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' "
                   "(also from KVMESH_API_KEY or --api-key-file)")
    p.add_argument("--api-key-file", default=None)
    p.add_argument("--admin-api-key", default=None,
                   help="key for admin endpoints (POST /reset_prefix_cache), required even when "
                   "--api-key is unset (also from KVMESH_ADMIN_API_KEY or --admin-api-key-file; "
                   "default: the --api-key)")
    p.add_argument("--admin-api-key-file", default=None)
    p.add_argument("--cache-salt-from", default=field_default(CacheSaltSource, "kind"),
                   metavar="none|api-key|header:NAME",
                   help="isolate the prefix cache per tenant: salt every request's blocks with "
                   "an HMAC of its Bearer key or of this header's value (a client's cache_salt "
                   "is appended, never replaces it); the router needs the same value")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="reject new requests with 429 once this many are waiting (0: no limit)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM")
    p.add_argument("--log-level", default="info")
    p.add_argument("--disable-uvicorn-access-log", action="store_true", help=ACCESS_LOG_HELP)
    p.add_argument("--tool-call-parser", default="auto", choices=tool_parsers.CHOICES,
                   help="how tool calls are read from the model's output: hermes "
                   "(<tool_call>...</tool_call>), llama3_json, mistral ([TOOL_CALLS]); auto: "
                   "from the chat template (hermes for templates without tools)")
    p.add_argument("--otlp-traces-endpoint", default=None,
                   help="send OpenTelemetry traces here (e.g. http://127.0.0.1:4318); also the "
                   "standard OTEL_EXPORTER_OTLP_* / OTEL_TRACES_* variables. Default: tracing off")
    p.add_argument("--pooling", default=field_default(PoolingParams, "pooling"), choices=POOLING_TYPES,
                   help="/v1/embeddings: pool the hidden states after the final norm by the last "
                   "token or the mean of all tokens (L2-normalised)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters served at start (needs --enable-lora): name=path, or JSON "
                   '{"name": ..., "path": ..., "base_model_name": ...}; each is a model name')
    p.add_argument("--lora-resolver-dir", default=None, metavar="DIR",
                   help="load a LoRA adapter a request names on demand from DIR/<name>/ when it "
                   "is a PEFT LoRA of this base model (needs --enable-lora; default: "
                   "$VLLM_LORA_RESOLVER_CACHE_DIR, else off)")
    _add_limit_args(p)
    kv_publishing.add_args(p)
    add_engine_args(p)
    return p


_LIMIT_HELP = {
    "max_request_body_bytes": "a larger request body is answered 413 before it is parsed",
    "max_prompts_per_request": "prompts in one /v1/completions request",
    "max_n": "samples per prompt (n)",
    "max_stop_strings": "stop strings per request",
    "max_stop_string_length": "characters in one stop string",
    "max_stop_token_ids": "stop_token_ids per request",
    "max_logprobs": "completions logprobs / chat top_logprobs",
    "max_tokens": "max_tokens a request may ask for (0: up to the context length); a request "
                  "that sends none gets at most this many",
    "max_pending_outputs": "outputs queued for a reader that has not taken them; a reader "
                           "this far behind is aborted (client_too_slow)",
}


def _add_limit_args(p: argparse.ArgumentParser) -> None:
    """One flag per RequestLimits field; over a limit, a request is answered 400 (413 for the
    body) naming the parameter."""
    g = p.add_argument_group("request limits")
    for f in dataclasses.fields(RequestLimits):
        g.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=int, default=f.default,
                       help=f"{_LIMIT_HELP[f.name]} (default: %(default)s)")


def limits_from_args(args: argparse.Namespace) -> RequestLimits:
    """ValueError naming the flag if one is out of range."""
    return RequestLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(RequestLimits)})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line over the --config file over the built-in defaults (errors exit 2)."""
    return parse_args_with_config(build_parser(), argv)


def _api_key(args: argparse.Namespace) -> str | None:
    return resolve_api_key(args.api_key, args.api_key_file)


def _engine_failed(state: ServerState, loop: asyncio.AbstractEventLoop,
                   error: BaseException) -> None:
    """On the engine thread, after every client got its error: stop serving, exit non-zero."""
    state.engine_error = f"the engine failed: {error!r}"
    state.ready = False
    logger.error("engine failed (%r): stopping the server; the process exits 1", error)
    if state.stop_server is not None:
        with contextlib.suppress(RuntimeError):      # the loop is already closed
            loop.call_soon_threadsafe(state.stop_server)


def _load(state: ServerState, config: EngineConfig, args: argparse.Namespace,
          loop: asyncio.AbstractEventLoop) -> None:
    """Build the engine off the event loop, then warm it up on the loop."""
    from kvmesh.engine.engine import LLMEngine
    try:
        engine = LLMEngine(config, kv_connector=kv_publishing.kv_connector(args))
        _register_lora_modules(state, engine, getattr(args, "lora_module_paths", []))
        metrics = EngineMetrics(engine.model_name, engine, startup=get_startup_times())
        engine.add_observer(metrics)
        async_engine = AsyncLLMEngine(
            engine, max_waiting=args.max_waiting or None,
            on_dead=lambda e: _engine_failed(state, loop, e), limits=state.limits)
        if get_tracer() is not None:
            from kvmesh.engine.tracing_hooks import EngineTracer
            EngineTracer(get_tracer(), engine.model_name).attach(engine)
        for hook in ENGINE_HOOKS:
            hook(async_engine, args, metrics)
        async_engine.start()
        state.metrics, state.model_name = metrics, engine.model_name
        state.max_model_len = engine.max_model_len
        state.tool_parser = tool_parsers.get_tool_parser(args.tool_call_parser,
                                                         engine.tokenizer.chat_template)
        state.engine = async_engine
        with startup_phase("warm-up", "a one-token generation", phase="warmup"):
            asyncio.run_coroutine_threadsafe(warm_up(async_engine), loop).result()
        if spin_requested(dict(os.environ)):
            # NOTE: the event loop ran oneDNN at import: its parked OpenMP team would make
            # libgomp throttle the engine thread's spinning (kvmesh.common.openmp)
            asyncio.run_coroutine_threadsafe(_release_loop_openmp(), loop).result()
        frozen = freeze_after_startup()       # NOTE: no full-heap GC pauses while serving
        times = get_startup_times()
        times.total_s = process_age_s()
        state.ready = True
        logger.info("ready: model %s, max_model_len %d (%d start-up objects frozen out of the "
                    "garbage collector); start-up: %s", engine.model_name, engine.max_model_len,
                    frozen, times.summary())
    except Exception as e:  # noqa: BLE001 - shown by /health; the pod restarts
        logger.exception("model loading failed")
        state.load_error = f"model loading failed: {e}"


async def _release_loop_openmp() -> None:
    """On the event loop: its OpenMP team released, one thread for it from now on."""
    before = process_thread_count()
    if release_thread_team():
        logger.info("OpenMP: the event loop's team released (%d parked workers ended), so the "
                    "forward's workers spin as asked (GOMP_SPINCOUNT=%s, OMP_WAIT_POLICY=%s)",
                    before - process_thread_count(), os.environ.get("GOMP_SPINCOUNT", "-"),
                    os.environ.get("OMP_WAIT_POLICY", "-"))
    else:
        logger.warning("OpenMP: spinning asked for, but no libgomp team could be released")


def lora_module_paths(args: argparse.Namespace, config: EngineConfig) -> list[LoRAModulePath]:
    """--lora-modules parsed; ValueError for a bad entry, a repeated name or no --enable-lora."""
    modules = [LoRAModulePath.parse(s) for s in args.lora_modules or ()]
    if modules and not config.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    names = [m.name for m in modules]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"--lora-modules: adapter name {dup[0]!r} is given twice")
    return modules


def _register_lora_modules(state: ServerState, engine, modules: list[LoRAModulePath]) -> None:
    """Load the --lora-modules adapters before serving (a refused one, or a URI that cannot be
    fetched, fails the start-up)."""
    state.loras.base_model_name = engine.model_name
    for m in modules:
        req = state.loras.new_request(m.name, fetch_adapter(m.path), m.base_model_name)
        engine.add_lora(req)
        state.loras.adapters[m.name] = req
        state.loras.roots[m.name] = m.path
        logger.info("LoRA adapter %s loaded from %s", m.name, m.path)


def make_lifespan(state: ServerState, config: EngineConfig, args: argparse.Namespace):
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        loop = asyncio.get_running_loop()
        loader = threading.Thread(target=_load, args=(state, config, args, loop),
                                  name="kvmesh-load", daemon=True)
        loader.start()
        yield
        state.draining = True
        state.ready = False
        if state.engine is not None:
            state.engine.shutdown()
        shutdown_tracing()      # flushes the spans still queued
        logger.info("shut down")
    return lifespan


def main(argv: list[str] | None = None, *, reexec: bool = False) -> int:
    """`kvmesh serve`. reexec: this process is the command's own (not a test calling main), so it
    may restart itself once with the allocator preloaded (see kvmesh.common.preload)."""
    args = parse_args(argv)
    reset_startup_times()        # NOTE: this server's phases only, also when a test calls main()
    if reexec:
        try:
            reexec_with_allocator(args.allocator, ["-m", "kvmesh.cli", "serve", *(argv or [])])
        except ValueError as e:
            print(f"kvmesh serve: error: {e}", file=sys.stderr)
            return 2
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.info("malloc: %s", loaded_allocator() or "the C library's (no tcmalloc / jemalloc loaded)")
    try:
        if args.kv_share and not args.redis_url:
            raise ValueError("--kv-share redis needs --redis-url")
        if args.max_waiting < 0:
            raise ValueError(f"--max-waiting must be >= 0 (0: no limit), got {args.max_waiting}")
        limits = limits_from_args(args)
        zmq_events = kv_publishing.kv_events_config(args)
        config = dataclasses.replace(engine_config_from_args(args),
                                     enable_kv_events=bool(args.redis_url) or zmq_events is not None)
        if args.kv_share and config.kv_transfer_config is not None:
            raise ValueError("--kv-share and --kv-transfer-config cannot be combined: an engine "
                             "has one KV connector")
        cache_salt_from = CacheSaltSource.parse(args.cache_salt_from)
        args.lora_module_paths = lora_module_paths(args, config)
        lora_resolver = FilesystemResolver.from_flag(args.lora_resolver_dir, (args.model or "",),
                                                     config.enable_lora)
        init_tracing(endpoint=args.otlp_traces_endpoint)
    except ValueError as e:
        print(f"kvmesh serve: error: {e}", file=sys.stderr)
        return 2
    keep_triton_out(config.device, config.attention_backend)
    try:
        # NOTE: s3:// / hf:// models are fetched before the server listens, so a failure is a
        # message and exit status 2 (in Kubernetes the operator's init container fetched it)
        config = resolve_engine_model(config)
    except ValueError as e:
        print(f"kvmesh serve: error: {e}", file=sys.stderr)
        return 2
    if config.model is not None and not os.path.exists(config.model):   # "" became None: built in
        print(f"kvmesh serve: error: model path does not exist: {config.model}", file=sys.stderr)
        return 2
    if config.tensor_parallel_size > 1:
        # NOTE: checked here from the config alone, so a size that does not fit the model is a
        # message and exit status 2, not a model-loading failure behind a 503.
        from kvmesh.engine.loader import read_model_config
        from kvmesh.engine.parallel.plan import validate_tensor_parallel
        try:
            validate_tensor_parallel(read_model_config(config.model), config.tensor_parallel_size)
        except ValueError as e:
            print(f"kvmesh serve: error: {e}", file=sys.stderr)
            return 2
    state = ServerState(api_key=_api_key(args), limits=limits, cache_salt_from=cache_salt_from,
                        pooling=PoolingParams(args.pooling),
                        admin_api_key=resolve_api_key(args.admin_api_key, args.admin_api_key_file,
                                                      "KVMESH_ADMIN_API_KEY"))
    state.loras.resolver = lora_resolver
    warning = open_bind_warning(args.host, state.api_key)
    if warning:
        logger.warning(warning)
    app = create_app(state, lifespan=make_lifespan(state, config, args))
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level.lower(),
        timeout_graceful_shutdown=args.shutdown_timeout,
        access_log=not args.disable_uvicorn_access_log))
    keep_access_log_clean()
    state.stop_server = lambda: setattr(server, "should_exit", True)
    run_until_signal(server)
    return 1 if state.engine_error else 0
