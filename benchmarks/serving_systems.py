"""The systems the serving benchmark loads: one `kvmesh serve`, the kvmesh router in front of two
engines, and vLLM's CPU build (`vllm serve`), all on the same weights and settings.

Same weights: the built-in model as an HF directory (`kvmesh.engine.hf_export.builtin_hf_dir`),
which is also the tokenizer every tool loads. Same settings: dtype, max_num_seqs, max_model_len,
max_num_batched_tokens, prefix caching on, and a KV cache that holds max_num_seqs full-length
sequences (kvmesh: --num-kv-blocks; vLLM: VLLM_CPU_KVCACHE_SPACE, whole GiB, rounded up).
Threads: one engine gets every core (kvmesh: torch's default; vLLM: VLLM_CPU_OMP_THREADS_BIND
over all cores, none reserved); the two routed engines get one torch thread each.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from benchmarks.servers import ServerError, ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("kvmesh", "kvmesh-router", "vllm")
MODEL_NAME = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 16
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What every system is started with, so they serve the same model the same way."""

    model_dir: Path
    dtype: str
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    vllm_venv: Path
    vllm_enforce_eager: bool = False     # skip torch.compile (its first start compiles for minutes)
    ready_timeout_s: float = 900.0

    def kv_tokens(self) -> int:
        return self.max_num_seqs * self.max_model_len

    def num_kv_blocks(self) -> int:
        return math.ceil(self.kv_tokens() / BLOCK_SIZE)

    def kv_cache_gib(self) -> int:
        """vLLM's KV space for the same tokens: layers x 2 (K, V) x KV heads x head_dim x bytes."""
        cfg = json.loads((self.model_dir / "config.json").read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        per_token = (cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim
                     * _DTYPE_BYTES[self.dtype])
        return max(1, math.ceil(per_token * self.kv_tokens() / 2**30))

    def engine_args(self) -> list[str]:
        return ["--model", str(self.model_dir), "--served-model-name", MODEL_NAME,
                "--dtype", self.dtype, "--max-num-seqs", str(self.max_num_seqs),
                "--max-model-len", str(self.max_model_len),
                "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                "--enable-prefix-caching"]


@dataclass(slots=True)
class RunningSystem:
    """A started system: where to send requests, how it was started, how to stop it."""

    name: str
    url: str
    commands: list[str]                          # shell lines (environment first) that started it
    stop: Callable[[], list[int | None]]         # exit codes of its processes
    logs: list[Path] = field(default_factory=list)


def _shell(argv: list[str], env: dict[str, str] | None = None, keys: tuple[str, ...] = ()) -> str:
    prefix = " ".join(f"{k}={shlex.quote(env[k])}" for k in keys if env and k in env)
    return (prefix + " " if prefix else "") + shlex.join(argv)


def kvmesh_serve_argv(s: EngineSettings, port: int) -> list[str]:
    return [sys.executable, "-m", "kvmesh.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            *s.engine_args(), "--num-kv-blocks", str(s.num_kv_blocks()),
            "--block-size", str(BLOCK_SIZE), "--log-level", "warning"]


def vllm_serve_argv(s: EngineSettings, port: int) -> list[str]:
    return [str(s.vllm_venv / "bin" / "python"), str(ROOT / "benchmarks" / "vllm_cli.py"), "serve",
            *s.engine_args(), "--host", "127.0.0.1", "--port", str(port),
            *(["--enforce-eager"] if s.vllm_enforce_eager else [])]


def vllm_env(s: EngineSettings, base: dict[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """The environment `benchmarks/peer.py` documents for vLLM's CPU build, and its warnings.
    An OpenMP wait policy set for kvmesh (OMP_WAIT_POLICY, GOMP_SPINCOUNT) is not passed on:
    vLLM keeps its own Intel OpenMP default (spinning 200 ms after each parallel region)."""
    from benchmarks.peer import peer_env
    from benchmarks.serving_tools import without_openmp_wait
    return peer_env(s.vllm_venv, os.cpu_count() or 1, s.kv_cache_gib(), base=without_openmp_wait(base))


# NOTE: OpenMP's wait policy, when set, is part of kvmesh's command (kvmesh.common.openmp)
KVMESH_ENV_KEYS = ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
VLLM_ENV_KEYS = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
                 "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD", "HF_HUB_OFFLINE")


def _single(name: str, argv: list[str], env: dict[str, str], keys: tuple[str, ...], url: str,
            ready_path: str, log_path: Path, timeout: float) -> RunningSystem:
    proc = ServerProcess(name, argv, url, log_path, ready_path=ready_path, env=env).start()
    proc.wait_ready(timeout)
    return RunningSystem(name, url, [_shell(argv, env, keys)], lambda: [proc.stop()], [log_path])


def start_kvmesh(s: EngineSettings, log_dir: Path) -> RunningSystem:
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return _single("kvmesh", kvmesh_serve_argv(s, port), env, KVMESH_ENV_KEYS,
                   f"http://127.0.0.1:{port}", "/ready", log_dir / "kvmesh.log", s.ready_timeout_s)


def start_vllm(s: EngineSettings, log_dir: Path, log=print) -> RunningSystem:
    python = s.vllm_venv / "bin" / "python"
    if not python.is_file():
        raise ServerError(f"vllm: {python} not found; install vLLM's CPU build with "
                          f"`make {s.vllm_venv}/bin/vllm` (see benchmarks/peer.py)")
    env, warnings = vllm_env(s)
    for w in warnings:
        log(f"# warning: {w}")
    port = free_port()
    return _single("vllm", vllm_serve_argv(s, port), env, VLLM_ENV_KEYS,
                   f"http://127.0.0.1:{port}", "/health", log_dir / "vllm.log", s.ready_timeout_s)


def start_router(s: EngineSettings, log_dir: Path, engines: int = 2) -> RunningSystem:
    """Redis, `engines` kvmesh engines (one torch thread each) and the kv-aware router."""
    for p in (ROOT, ROOT / "tests" / "support"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    from tests.e2e.router_fixtures import start_cluster

    engine_args = (*s.engine_args(), "--num-kv-blocks", str(s.num_kv_blocks()),
                   "--block-size", str(BLOCK_SIZE))
    try:
        cluster = start_cluster(log_dir / "router", engines, engine_args=engine_args,
                                router_args=("--block-size", str(BLOCK_SIZE)),
                                ready_timeout=s.ready_timeout_s)
    except (AssertionError, RuntimeError, OSError) as e:
        # NOTE: the test fixture reports a failed start as AssertionError (Redis: RuntimeError)
        raise ServerError(f"kvmesh-router: {e}") from None
    # NOTE: the environment router_fixtures gives them (engines: one torch thread each)
    offline = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    one = {**offline, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    commands = [f"# redis-server on 127.0.0.1:{cluster.redis.port} (tests/support/processes.py)",
                *(_shell(list(e.proc.args), one, tuple(one)) for e in cluster.engines),
                _shell(list(cluster.router.proc.args), offline, tuple(offline))]
    return RunningSystem("kvmesh-router", cluster.router.url, commands,
                         lambda: cluster.stop(60),
                         [p.log_path for p in (*cluster.engines, cluster.router)])


def start_system(name: str, s: EngineSettings, log_dir: Path, log=print) -> RunningSystem:
    log_dir.mkdir(parents=True, exist_ok=True)
    if name == "kvmesh":
        return start_kvmesh(s, log_dir)
    if name == "kvmesh-router":
        return start_router(s, log_dir)
    if name == "vllm":
        return start_vllm(s, log_dir, log)
    raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")
