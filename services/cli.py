"""The `kvmesh` command: generate and fetch (here), serve, router and operator (delegated)."""
from __future__ import annotations

import argparse
import json
import sys


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvmesh.common.config import engine_config_from_args
    from kvmesh.engine.engine import LLMEngine
    from kvmesh.engine.sampling_params import SamplingParams

    from kvmesh.kernels.ops import keep_triton_out

    try:
        config = engine_config_from_args(args)
        keep_triton_out(config.device, config.attention_backend)
        engine = LLMEngine(config)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                seed=args.sampling_seed)
        prompt = args.prompt
        if args.chat:
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        engine.add_request("cli-0", prompt, params)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvmesh generate: error: {e}", file=sys.stderr)
        return 2
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                sys.stdout.write(out.outputs[0].delta_text)
                sys.stdout.flush()
                if out.finished:
                    sys.stdout.write("\n")
                    if args.json:
                        o = out.outputs[0]
                        print(json.dumps({"text": o.text, "token_ids": o.token_ids,
                                          "finish_reason": o.finish_reason}))
    finally:
        engine.shutdown()           # tensor parallelism: stop the worker processes
    return 0


def _cmd_fetch(args: argparse.Namespace) -> int:
    import logging
    import time
    from pathlib import Path

    from kvmesh.common.storage import FetchOptions, fetch
    from kvmesh.common.storage.cache import parse_size
    from kvmesh.common.storage.summary import FetchSummary, model_bytes

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("botocore").setLevel(logging.WARNING)    # "Found credentials in ..."
    try:
        if args.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {args.workers}")
        options = FetchOptions(
            cache_dir=Path(args.cache_dir).expanduser() if args.cache_dir else None,
            max_bytes=parse_size(args.max_size) if args.max_size else None,
            workers=args.workers, chunk_bytes=parse_size(args.chunk_size))
        if options.chunk_bytes < 1:
            raise ValueError("--chunk-size must be at least 1 byte")
        t0 = time.monotonic()
        fetched = fetch(args.uri, options)
        seconds = time.monotonic() - t0
        print(fetched.path)
    except ValueError as e:          # FetchError is one: it names the URI, never a secret
        print(f"kvmesh fetch: error: {e}", file=sys.stderr)
        return 2
    if args.summary_file:
        summary = FetchSummary(args.uri, model_bytes(fetched.path), fetched.fetched_bytes, seconds)
        try:
            Path(args.summary_file).write_text(summary.to_json())
        except OSError as e:         # the model is fetched: a summary that cannot be written is no failure
            logging.getLogger("kvmesh.fetch").warning("cannot write the summary to %s: %s",
                                                      args.summary_file, e)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kvmesh.common.config import add_engine_args

    parser = argparse.ArgumentParser(prog="kvmesh", description="Kubernetes-native LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate once, offline, and print the text")
    add_engine_args(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="also print the result as JSON")

    fetch = sub.add_parser("fetch", help="fetch a model into the node cache and print its local path")
    fetch.add_argument("uri", help="s3://bucket/prefix, hf://org/name[@revision], pvc://claim/path "
                       "or a local path")
    fetch.add_argument("--cache-dir", default=None, help="the model cache (default: "
                       "$KVMESH_MODEL_CACHE_DIR, else $KVMESH_CACHE_DIR/models, i.e. "
                       "~/.cache/kvmesh/models)")
    fetch.add_argument("--max-size", default=None, help="bound the cache, e.g. 100G: least "
                       "recently used models are evicted (default: $KVMESH_MODEL_CACHE_MAX_SIZE, "
                       "else no bound)")
    fetch.add_argument("--workers", type=int, default=8, help="parallel ranged reads (default: 8)")
    fetch.add_argument("--chunk-size", default="16Mi", help="bytes one ranged read asks for "
                       "(default: 16Mi)")
    fetch.add_argument("--summary-file", default=None, metavar="PATH",
                       help="when done, write the model's size and the fetch's time there as JSON "
                       "(sizeBytes, fetchedBytes, fetchSeconds); the operator's init container "
                       "passes its termination log, /dev/termination-log")

    sub.add_parser("serve", help="serve the OpenAI-compatible API (kvmesh serve --help)", add_help=False)
    sub.add_parser("router", help="run the KV-aware router (kvmesh router --help)", add_help=False)
    sub.add_parser("operator", help="run the Kubernetes operator (kvmesh operator --help)", add_help=False)
    return parser


# Sub-commands with their own argument parsers: `kvmesh NAME ...` -> module.main(argv).
_DELEGATED = {
    "serve": "kvmesh.api.server",
    "router": "kvmesh.router.main",
    "operator": "kvmesh.operator.main",
}


def _restart_with_allocator_early(argv: list[str]) -> None:
    """`kvmesh serve`'s restart with tcmalloc / jemalloc preloaded, before the server's imports
    (torch: seconds of every cold start, paid twice when the server restarts itself after them).
    Where the command line alone cannot tell the choice, or names a library that is not there,
    the server does it after its full parse, as before (and reports the error)."""
    import os

    from kvmesh.common import preload

    choice = preload.early_choice(argv[1:], dict(os.environ))
    if choice is None:
        return
    try:
        preload.reexec_with_allocator(choice, ["-m", "kvmesh.cli", *argv])
    except ValueError:
        return


def main(argv: list[str] | None = None) -> int:
    entry = argv is None          # the process's own command line (not a caller's list)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATED:
        import importlib
        if argv[0] == "serve" and entry:
            _restart_with_allocator_early(argv)
        module = importlib.import_module(_DELEGATED[argv[0]])
        if argv[0] == "serve":
            return module.main(argv[1:], reexec=entry)
        return module.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate":
        return _cmd_generate(args)
    if args.command == "fetch":
        return _cmd_fetch(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
