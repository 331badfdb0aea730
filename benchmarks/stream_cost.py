"""CPU time per streamed token of `kvmesh serve`, one streaming client at a time (issue 28).

    python benchmarks/stream_cost.py                                   # this checkout alone
    python benchmarks/stream_cost.py --system base=/work/main/.venv/bin/python \
        --system new=.venv/bin/python --requests 12                    # A/B, interleaved

Each `--system NAME=PYTHON` is a `kvmesh serve` started with that interpreter (so a second
checkout's venv is the baseline of an A/B), built-in model, `--dtype bfloat16`. All systems run
side by side; their requests alternate (A, B, B, A, ...), one at a time, each the shape of
`vllm bench serve`'s fixed workload at concurrency 1: a 128-token prompt (random token ids),
64 tokens out with `ignore_eos`, streamed /v1/completions through the official `openai` client.

For each system it prints, over the measured requests, the client's ITL p50 / p90 and the server's
CPU time per output token, split by thread: `loop` (the main thread: uvicorn's event loop),
`engine` (the thread with the most CPU time besides it: the step loop, which also drives the
forward's first OpenMP thread) and `other` (OpenMP workers, tokenizer threads). CPU time is read
from /proc, so it holds on a loaded machine where wall times do not; the ITLs are only
comparable between systems of the same run (interleaved), never across runs.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.servers import ServerProcess, free_port  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(slots=True)
class System:
    name: str
    python: str
    server: ServerProcess | None = None
    itls_ms: list[float] = field(default_factory=list)
    tokens: int = 0
    cpu_s: dict[str, float] = field(default_factory=lambda: {"loop": 0.0, "engine": 0.0,
                                                             "other": 0.0})


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of every thread of `pid`, by thread id."""
    out: dict[int, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def split(pid: int, before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    delta = {tid: t - before.get(tid, 0.0) for tid, t in after.items()}
    loop = delta.pop(pid, 0.0)
    engine_tid = max(delta, key=delta.get) if delta else None
    engine = delta.pop(engine_tid, 0.0) if engine_tid is not None else 0.0
    return {"loop": loop, "engine": engine, "other": sum(delta.values())}


def one_request(client, prompt: list[int], output_tokens: int) -> tuple[list[float], int]:
    """Stream one completion; (inter-token latencies in ms, tokens)."""
    stream = client.completions.create(model="kvmesh", prompt=prompt, max_tokens=output_tokens,
                                       temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    stamps = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
    return [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])], len(stamps)


def start_server(name: str, python: str, args: argparse.Namespace, log_dir: Path,
                 env: dict[str, str] | None = None) -> ServerProcess:
    """`kvmesh serve` (the built-in model) as both cost benchmarks start it; `env`: its whole
    environment (None: this process's)."""
    port = free_port()
    argv = [python, "-m", "kvmesh.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", "kvmesh", "--dtype", args.dtype, "--max-num-seqs", "16",
            "--max-model-len", "1024", "--max-num-batched-tokens", "1024",
            "--enable-prefix-caching", "--log-level", "warning", *args.serve_arg]
    return ServerProcess(name, argv, f"http://127.0.0.1:{port}", log_dir / f"{name}.log",
                         env=env).start()


def start(system: System, args: argparse.Namespace, log_dir: Path) -> None:
    system.server = start_server(system.name, system.python, args, log_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--system", action="append", default=[],
                   help="NAME=PYTHON (repeat for an A/B); default: this interpreter")
    p.add_argument("--requests", type=int, default=8, help="measured requests per system")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="one more `kvmesh serve` argument for every system (repeatable)")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/kvmesh-stream-cost"))
    args = p.parse_args(argv)
    import openai

    specs = args.system or [f"kvmesh={sys.executable}"]
    systems = [System(*s.split("=", 1)) for s in specs]
    for s in systems:
        start(s, args, args.log_dir)
    try:
        for s in systems:
            s.server.wait_ready(900)
        rng = random.Random(0)
        clients = {s.name: openai.OpenAI(base_url=s.server.url + "/v1", api_key="x",
                                         max_retries=0) for s in systems}
        for i in range(args.warmup + args.requests):
            order = systems if i % 2 == 0 else systems[::-1]
            # NOTE: distinct random prompts (no prefix-cache hits), the same one for every system
            prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]
            for s in order:
                pid = s.server.proc.pid
                before = thread_cpu_s(pid)
                itls, n = one_request(clients[s.name], prompt, args.output_tokens)
                after = thread_cpu_s(pid)
                if i < args.warmup:
                    continue
                s.itls_ms += itls
                s.tokens += n
                for k, v in split(pid, before, after).items():
                    s.cpu_s[k] += v
    finally:
        for s in systems:
            if s.server is not None:
                s.server.stop()
    print(f"{'system':<10} {'tokens':>6} {'ITL p50':>8} {'ITL p90':>8} {'CPU ms/tok':>10} "
          f"{'loop':>6} {'engine':>7} {'other':>6}")
    for s in systems:
        q = statistics.quantiles(s.itls_ms, n=10)
        per = {k: 1e3 * v / max(1, s.tokens) for k, v in s.cpu_s.items()}
        print(f"{s.name:<10} {s.tokens:>6} {statistics.median(s.itls_ms):>8.2f} {q[8]:>8.2f} "
              f"{sum(per.values()):>10.2f} {per['loop']:>6.2f} {per['engine']:>7.2f} "
              f"{per['other']:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
