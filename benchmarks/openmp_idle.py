"""CPU an idle `kvmesh serve` burns under each OpenMP wait policy (spec.engine.openmpWaitPolicy).

    python benchmarks/openmp_idle.py                                  # the policies below
    python benchmarks/openmp_idle.py --env OMP_WAIT_POLICY=ACTIVE --env ""

Each `--env` (KEY=VALUE, comma-separated for several, "" for none) starts the built-in model's
`kvmesh serve` with that in its environment, sends one short completion (so the forward's OpenMP
team exists), waits `--settle` seconds and reads the server's CPU time from /proc over
`--window` seconds of idleness: the share of one core the process spends while no request is in
flight. OMP_WAIT_POLICY=ACTIVE keeps libgomp's workers spinning forever; GOMP_SPINCOUNT bounds the
spin, after which they sleep.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_ENVS = ("", "OMP_WAIT_POLICY=ACTIVE", "GOMP_SPINCOUNT=20000000")


def parse_env(text: str) -> dict[str, str]:
    """"K=V,K2=V2" -> {K: V, K2: V2}; "" -> {}. A part without "=" is a ValueError."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ValueError(f"--env takes KEY=VALUE[,KEY=VALUE...], got {part!r}")
        out[key] = value
    return out


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads), from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_share(env: dict[str, str], settle_s: float, window_s: float, log_dir: Path) -> float:
    """The idle server's CPU time over `window_s`, as a share of one core."""
    from openai import OpenAI

    from benchmarks.servers import ServerProcess, free_port

    port = free_port()
    argv = [sys.executable, "-m", "kvmesh.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", "512", "--num-kv-blocks", "64", "--log-level", "warning"]
    name = ",".join(f"{k}={v}" for k, v in env.items()) or "default"
    proc = ServerProcess(name, argv, f"http://127.0.0.1:{port}", log_dir / f"{name}.log",
                         env={**os.environ, **env}).start()
    try:
        proc.wait_ready(600)
        client = OpenAI(base_url=f"{proc.url}/v1", api_key="none")
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello there", max_tokens=16)
        time.sleep(settle_s)
        before = process_cpu_s(proc.proc.pid)
        time.sleep(window_s)
        return (process_cpu_s(proc.proc.pid) - before) / window_s
    finally:
        proc.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", action="append", help="KEY=VALUE[,KEY=VALUE] for one server (repeatable)")
    p.add_argument("--settle", type=float, default=2.0, help="seconds after the request before measuring")
    p.add_argument("--window", type=float, default=5.0, help="seconds of idleness measured")
    p.add_argument("--log-dir", default="/tmp/kvmesh-openmp-idle")
    args = p.parse_args(argv)
    try:
        envs = [parse_env(e) for e in (args.env or DEFAULT_ENVS)]
    except ValueError as e:
        p.error(str(e))
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"| environment | idle CPU over {args.window:g} s (share of one core) |\n|---|---:|")
    for env in envs:
        share = idle_share(env, args.settle, args.window, log_dir)
        label = " ".join(f"`{k}={v}`" for k, v in env.items()) or "(none: libgomp's default)"
        print(f"| {label} | {share * 100:.0f} % |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
