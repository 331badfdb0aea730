"""llama.cpp's `llama-server` as a benchmark peer: the same GGUF file, the same token ids.

`offline_throughput.py --systems llama.cpp` starts `llama-server -m FILE -np N -c N*CTX -t T`
(N = --max-num-seqs slots, continuous batching on, as llama.cpp serves concurrent users), waits
for `/health`, warms it up, then posts every request to `/completion` at once (token-id prompts,
so no BOS is added and the prompt is exactly kvmesh's; `n_predict` = the request's output length,
`ignore_eos`, temperature 0 = greedy, `cache_prompt` off so nothing is reused between requests,
`return_tokens` for the ids). Slots beyond N queue in the server, as kvmesh's waiting queue does.

Measured: wall time of the batch, the server process's CPU time over it (/proc: robust to other
load), its peak RSS (`VmHWM`), its start-up time (spawn to a healthy `/health`).

The binary: `--llama-server PATH`, else `$KVMESH_LLAMA_SERVER`, else the build this script's
`build_command()` describes under ~/.cache/kvmesh/llama.cpp (llama-cpp-python's sdist vendors
llama.cpp; its CMake picks AVX2 / AVX-512 from the build machine with GGML_NATIVE=ON).
NOTE: benchmark it on an idle machine only: its OpenMP-style worker threads spin and collapse when
another process holds a core.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

CACHE = Path("~/.cache/kvmesh/llama.cpp").expanduser()
SDIST = "llama_cpp_python-0.3.36"


def build_command() -> str:
    """How the default binary is built (about 10 min on two cores)."""
    src = CACHE / SDIST / "vendor" / "llama.cpp"
    return (f"pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d {CACHE} && "
            f"tar xzf {CACHE}/{SDIST}.tar.gz -C {CACHE} && "
            f"cmake -S {src} -B {src}/build -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF "
            f"-DLLAMA_BUILD_TESTS=OFF && cmake --build {src}/build -j2 --target llama-server")


def default_binary() -> Path:
    env = os.environ.get("KVMESH_LLAMA_SERVER")
    if env:
        return Path(env).expanduser()
    return CACHE / SDIST / "vendor" / "llama.cpp" / "build" / "bin" / "llama-server"


@dataclass(slots=True)
class LlamaRun:
    wall_s: float
    cpu_s: float              # the server process's user + system time over the timed batch
    outputs: list[list[int]]
    peak_rss_bytes: int
    start_s: float            # spawn to a healthy /health
    note: str


def server_command(binary: Path, gguf: Path, port: int, slots: int, ctx_per_slot: int,
                   threads: int, extra: tuple[str, ...] = ()) -> list[str]:
    """llama-server's argv; `extra` goes last (e.g. `--no-repack`: on the 2026-11-26 Intel Xeon
    with AMX, the build's AMX kernels for repacked Q4_1 died of SIGILL at their first tile op)."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-c", str(slots * ctx_per_slot), "-t", str(threads), "-tb", str(threads),
            "--cont-batching", "--no-webui", "--log-disable", *extra]


def completion_body(prompt_ids: list[int], n: int) -> dict:
    return {"prompt": list(prompt_ids), "n_predict": n, "ignore_eos": True, "temperature": 0.0,
            "cache_prompt": False, "return_tokens": True, "stream": False}


def parse_completion(body: dict, n: int) -> list[int]:
    """The generated ids of a `/completion` answer; its length checked against what was asked."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise RuntimeError(f"llama-server answered without token ids: {sorted(body)[:12]}")
    if len(tokens) != n:
        raise RuntimeError(f"llama-server made {len(tokens)} tokens, {n} were asked "
                           f"(stop_type={body.get('stop_type')!r})")
    return tokens


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, base: str, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode} while starting; see {log}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"llama-server not healthy after {timeout:.0f} s; see {log}")


def run(gguf: Path, requests: list[tuple[list[int], int]], warmup: list[tuple[list[int], int]],
        slots: int, threads: int, binary: Path | None = None, timeout: float = 3600.0,
        log: Path | None = None, extra: tuple[str, ...] = ()) -> LlamaRun:
    """Serve `gguf` with llama-server and time `requests` ((prompt ids, output length) each)."""
    binary = binary or default_binary()
    if not binary.is_file():
        raise FileNotFoundError(f"no llama-server at {binary}; build it with: {build_command()} "
                                "(or pass --llama-server / set KVMESH_LLAMA_SERVER)")
    longest = max(len(p) + n for p, n in requests + warmup)
    ctx = -(-longest // 256) * 256
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = log or Path(f"/tmp/llama-server-{port}.log")
    cmd = server_command(binary, gguf, port, slots, ctx, threads, extra)
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(proc, base, 600.0, log)
        start_s = time.perf_counter() - t0

        def go(batch: list[tuple[list[int], int]]) -> list[list[int]]:
            with ThreadPoolExecutor(max_workers=max(1, len(batch))) as pool:
                futs = [pool.submit(_post, f"{base}/completion", completion_body(p, n), timeout)
                        for p, n in batch]
                return [parse_completion(f.result(), n) for f, (_, n) in zip(futs, batch)]

        go(warmup)
        c0, w0 = _cpu_seconds(proc.pid), time.perf_counter()
        outs = go(requests)
        wall, cpu = time.perf_counter() - w0, _cpu_seconds(proc.pid) - c0
        peak = _peak_rss(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    note = (f"llama-server -np {slots} -c {slots * ctx} -t {threads}; start {start_s:.1f} s, "
            f"peak RSS {peak / 1e6:.0f} MB")
    return LlamaRun(wall, cpu, outs, peak, start_s, note)
