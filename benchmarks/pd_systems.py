"""The two systems pd_disagg.py compares, as processes on loopback: Redis, two `kvmesh serve`
engines pinned one per core (`taskset -c`, one torch thread each) and the kvmesh router in front.

    pd         engine 0 a prefill engine (kv_producer), engine 1 a decode engine (kv_consumer),
               the router with --prefill-backends / --decode-backends
    colocated  two plain engines, the router with --backends

`start_system` starts them all at once and waits until every one answers /ready; `System.stop`
ends exactly those processes (one SIGTERM each) and returns their exit codes.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.servers import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
MODEL_NAME = "pd-bench"
BLOCK_SIZE = 16


@dataclass(slots=True)
class System:
    """One started system: its processes, the URL the client sends to, its engines' URLs."""

    name: str
    url: str
    engines: dict[str, str]                  # engine name -> base URL
    procs: list[ServerProcess]
    redis: object                            # tests/support/processes.RedisServer
    commands: list[str] = field(default_factory=list)

    def stop(self) -> list[int]:
        # NOTE: every process told once, at once, then waited for: their shutdowns overlap (a
        # second SIGTERM during a shutdown would kill the process)
        for p in self.procs:
            if p.proc is not None and p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        codes = []
        for p in self.procs:
            try:
                codes.append(p.proc.wait(60) if p.proc is not None else 0)
            except subprocess.TimeoutExpired:
                codes.append(p.stop(0))             # SIGKILL to its process group
        self.redis.stop()
        return codes


def _pin(cores: list[int] | None) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, cores))] if cores else []


def _kv_config(role: str, engine_id: str) -> str:
    # NOTE: kv_port 0: two engines on one machine must not both bind the default bootstrap port
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role,
                       "engine_id": engine_id, "kv_port": 0})


def engine_argv(args: argparse.Namespace, model: str | None, port: int, redis_url: str, name: str,
                core: int, role: str | None) -> list[str]:
    argv = [*_pin([core]), sys.executable, "-m", "kvmesh.cli", "serve", "--host", "127.0.0.1",
            "--port", str(port), *(["--model", model] if model else []),
            "--served-model-name", MODEL_NAME, "--cpu-threads", "1",
            "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
            "--num-kv-blocks", str(args.num_kv_blocks), "--block-size", str(BLOCK_SIZE),
            "--redis-url", redis_url, "--pod-id", name,
            "--advertise-url", f"http://127.0.0.1:{port}", "--log-level", "warning"]
    if args.dtype:
        argv += ["--dtype", args.dtype]
    if args.max_num_batched_tokens:
        argv += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if role:
        argv += ["--kv-transfer-config", _kv_config(role, name)]
    return argv


def start_system(name: str, args: argparse.Namespace, model: str | None, log_dir: Path) -> System:
    """Redis, two engines pinned to --cores, the router; all ready, or ServerError."""
    for p in (ROOT, ROOT / "tests" / "support"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    from processes import RedisServer  # tests/support: the suite's redis-server helper

    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    if args.smoke:
        # NOTE: speed is not under test in a smoke run: the torch kernels spare a C++ build
        env.setdefault("KVMESH_CPU_KERNELS", "0")
    roles = ({"prefill-0": "kv_producer", "decode-0": "kv_consumer"} if name == "pd"
             else {"engine-0": None, "engine-1": None})
    redis = RedisServer()
    redis.start()
    procs: list[ServerProcess] = []
    try:
        engines = {}
        for (ename, role), core in zip(roles.items(), args.cores):
            port = free_port()
            argv = engine_argv(args, model, port, redis.url, ename, core, role)
            procs.append(ServerProcess(ename, argv, f"http://127.0.0.1:{port}",
                                       log_dir / name / f"{ename}.log", env=env).start())
            engines[ename] = procs[-1].url
        urls = list(engines.values())
        hops = (["--prefill-backends", urls[0], "--decode-backends", urls[1]] if name == "pd"
                else ["--backends", *urls])
        rport = free_port()
        router_argv = [*_pin(args.other_cores), sys.executable, "-m", "kvmesh.cli", "router",
                       "--host", "127.0.0.1", "--port", str(rport), "--redis-url", redis.url,
                       *(["--model", model] if model else []), *hops, "--log-level", "warning"]
        procs.append(ServerProcess("router", router_argv, f"http://127.0.0.1:{rport}",
                                   log_dir / name / "router.log", env=env).start())
        for p in procs:
            p.wait_ready(args.ready_timeout)
    except BaseException:
        for p in procs:
            p.stop(10)
        redis.stop()
        raise
    commands = [f"# redis-server on {redis.url} (tests/support/processes.py)",
                *("OMP_NUM_THREADS=1 " + shlex.join(p.argv) for p in procs)]
    return System(name, procs[-1].url, engines, procs, redis, commands)


