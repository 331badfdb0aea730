"""The serving path's share of a streamed token: the engine's step time beside the client's ITL.

    python benchmarks/serve_gap.py                                   # this checkout, 1 and 16 streams
    python benchmarks/serve_gap.py --system base=/work/main/.venv/bin/python \
        --system new=.venv/bin/python --concurrency 1,4,16 --rounds 2   # A/B, interleaved
    python benchmarks/serve_gap.py --system plain=.venv/bin/python --system spin=.venv/bin/python \
        --env spin:GOMP_SPINCOUNT=10000                                   # OpenMP spinning A/B

Each `--system NAME=PYTHON` is a `kvmesh serve` started as `stream_cost.py` starts it (built-in
model, `--dtype bfloat16`, max_num_seqs 16, prefix caching on, the allocator `kvmesh serve`
picks), with this environment plus its `--env NAME:VAR=VALUE` settings. At each concurrency C, C streams each send `--requests` requests one after another, the
body `vllm bench serve --backend openai --endpoint /v1/completions --ignore-eos` sends
(a `--prompt-tokens` random-token prompt, `--output-tokens` out, `repetition_penalty` 1,
include_usage, and no temperature: the server's default 1.0 sampling unless `--temperature`).
The systems take turns point by point (A, B, then B, A in the next round).

Per system and concurrency it prints the client's ITL (p50, p90, mean: the gaps between
streamed chunks that carry text, as vLLM's benchmark counts them); the engine's own timers read
from /metrics: `step` and `forward`, means per step (`kvmesh:engine_step_seconds_total`,
`kvmesh:engine_forward_seconds_total` over `kvmesh:engine_steps_total`; prefill steps included,
so at C > 1 a mean step is not a token's interval), and `eng ITL`, the engine's own mean
inter-token interval (`vllm:inter_token_latency_seconds`, taken as each step ends: step plus the
engine thread's time between steps, token-weighted as the client's); `gap` = client ITL mean -
eng ITL (what the hand-off, event loop, SSE and client add); and the server's CPU time per token
by thread (loop, engine, other: as `stream_cost.py`). Against an offline step at the same batch
(`profile_engine.py`), `eng ITL` shows what serving costs inside the engine thread, `gap` what it
costs after. CPU times hold on a shared machine; wall times only within one run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.servers import ServerProcess  # noqa: E402
from benchmarks.stream_cost import split, start_server, thread_cpu_s  # noqa: E402

TIMERS = ("kvmesh:engine_steps_total", "kvmesh:engine_step_seconds_total",
          "kvmesh:engine_forward_seconds_total", "vllm:inter_token_latency_seconds_sum",
          "vllm:inter_token_latency_seconds_count")


@dataclass(slots=True)
class Point:
    """One system at one concurrency, summed over the rounds."""
    itls_ms: list[float] = field(default_factory=list)
    tokens: int = 0
    steps: float = 0.0
    step_s: float = 0.0
    forward_s: float = 0.0
    engine_itl_s: float = 0.0      # the engine's own inter-token intervals (its ITL histogram)
    engine_itls: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("loop", "engine",
                                                                            "other"), 0.0))


@dataclass(slots=True)
class System:
    name: str
    python: str
    env: dict[str, str] = field(default_factory=dict)   # set for this server only (--env)
    server: ServerProcess | None = None
    points: dict[int, Point] = field(default_factory=dict)


def start(system: System, args: argparse.Namespace, log_dir: Path) -> None:
    system.server = start_server(system.name, system.python, args, log_dir,
                                 env={**os.environ, **system.env})


def parse_envs(specs: list[str], names: list[str]) -> dict[str, dict[str, str]]:
    """--env NAME:VAR=VALUE settings by system name; ValueError for a bad one."""
    out: dict[str, dict[str, str]] = {n: {} for n in names}
    for spec in specs:
        name, _, assignment = spec.partition(":")
        var, eq, value = assignment.partition("=")
        if name not in out or not var or not eq:
            raise ValueError(f"--env {spec!r}: NAME:VAR=VALUE with NAME one of {names}")
        out[name][var] = value
    return out


def read_timers(text: str) -> dict[str, float]:
    """The engine's step counters from a /metrics page (0 for a counter it lacks)."""
    out = dict.fromkeys(TIMERS, 0.0)
    for name in TIMERS:
        m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
        if m:
            out[name] = float(m[1])
    return out


def request_body(prompt: list[int], output_tokens: int, temperature: float | None) -> dict:
    """What `vllm bench serve` posts to /v1/completions (its openai backend, --ignore-eos)."""
    body = {"model": "kvmesh", "prompt": prompt, "repetition_penalty": 1.0,
            "max_tokens": output_tokens, "logprobs": None, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    if temperature is not None:
        body["temperature"] = temperature
    return body


async def one_stream(client: httpx.AsyncClient, url: str, body: dict) -> tuple[list[float], int]:
    """One streamed completion: (gaps between chunks with text in ms, chunks with text)."""
    stamps: list[float] = []
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    return [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])], len(stamps)


async def run_point(url: str, concurrency: int, requests: int, prompts: list[list[int]],
                    args: argparse.Namespace) -> tuple[list[float], int]:
    """`concurrency` streams, each sending `requests` requests in turn."""
    itls: list[float] = []
    tokens = 0

    async def stream(s: int) -> None:
        nonlocal tokens
        for r in range(requests):
            body = request_body(prompts[s * requests + r], args.output_tokens, args.temperature)
            gaps, n = await one_stream(client, url, body)
            itls.extend(gaps)
            tokens += n

    limits = httpx.Limits(max_connections=concurrency + 1)
    async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
        await asyncio.gather(*(stream(s) for s in range(concurrency)))
    return itls, tokens


def measure(system: System, concurrency: int, prompts: list[list[int]],
            args: argparse.Namespace) -> None:
    url = system.server.url
    pid = system.server.proc.pid
    before_t = read_timers(httpx.get(url + "/metrics", timeout=30).text)
    before_cpu = thread_cpu_s(pid)
    itls, tokens = asyncio.run(run_point(url, concurrency, args.requests, prompts, args))
    after_cpu = thread_cpu_s(pid)
    after_t = read_timers(httpx.get(url + "/metrics", timeout=30).text)
    p = system.points.setdefault(concurrency, Point())
    p.itls_ms += itls
    p.tokens += tokens
    p.steps += after_t[TIMERS[0]] - before_t[TIMERS[0]]
    p.step_s += after_t[TIMERS[1]] - before_t[TIMERS[1]]
    p.forward_s += after_t[TIMERS[2]] - before_t[TIMERS[2]]
    p.engine_itl_s += after_t[TIMERS[3]] - before_t[TIMERS[3]]
    p.engine_itls += after_t[TIMERS[4]] - before_t[TIMERS[4]]
    for k, v in split(pid, before_cpu, after_cpu).items():
        p.cpu_s[k] += v


def report(systems: list[System]) -> list[str]:
    lines = [f"{'system':<10} {'C':>3} {'tokens':>6} {'ITL p50':>8} {'p90':>7} {'mean':>7} "
             f"{'step':>7} {'forward':>8} {'eng ITL':>8} {'gap':>7} {'CPU ms/tok: loop':>17} "
             f"{'engine':>7} "
             f"{'other':>6}"]
    for s in systems:
        for c, p in sorted(s.points.items()):
            if len(p.itls_ms) < 2:
                lines.append(f"{s.name:<10} {c:>3} {p.tokens:>6}  (too few tokens)")
                continue
            q = statistics.quantiles(p.itls_ms, n=10)
            mean = statistics.fmean(p.itls_ms)
            if p.steps and p.step_s:
                timers = f"{1e3 * p.step_s / p.steps:>7.2f} {1e3 * p.forward_s / p.steps:>8.2f}"
            else:       # NOTE: a checkout from before the timers (an A/B's baseline)
                timers = f"{'n/a':>7} {'n/a':>8}"
            if p.engine_itls:
                eng = 1e3 * p.engine_itl_s / p.engine_itls
                timers += f" {eng:>8.2f} {mean - eng:>7.2f}"
            else:
                timers += f" {'n/a':>8} {'n/a':>7}"
            per = {k: 1e3 * v / max(1, p.tokens) for k, v in p.cpu_s.items()}
            lines.append(f"{s.name:<10} {c:>3} {p.tokens:>6} {statistics.median(p.itls_ms):>8.2f} "
                         f"{q[8]:>7.2f} {mean:>7.2f} {timers} "
                         f"{per['loop']:>17.2f} {per['engine']:>7.2f} {per['other']:>6.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--system", action="append", default=[],
                   help="NAME=PYTHON (repeat for an A/B); default: this interpreter")
    p.add_argument("--concurrency", default="1,16", help="comma-separated stream counts")
    p.add_argument("--requests", type=int, default=2, help="requests per stream per round")
    p.add_argument("--rounds", type=int, default=1, help="passes over every point")
    p.add_argument("--warmup", type=int, default=2, help="requests per system before measuring")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None,
                   help="send this temperature (default: none, as vllm bench serve)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--env", action="append", default=[], metavar="NAME:VAR=VALUE",
                   help="an environment variable for one system's server (repeatable)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="one more `kvmesh serve` argument for every system (repeatable)")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/kvmesh-serve-gap"))
    args = p.parse_args(argv)
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        p.error(f"--concurrency: comma-separated integers, got {args.concurrency!r}")
    if min(levels) < 1 or args.requests < 1 or args.rounds < 1:
        p.error("--concurrency, --requests and --rounds must be >= 1")

    specs = args.system or [f"kvmesh={sys.executable}"]
    systems = [System(*s.split("=", 1)) for s in specs]
    try:
        envs = parse_envs(args.env, [s.name for s in systems])
    except ValueError as e:
        p.error(str(e))
    for s in systems:
        s.env = envs[s.name]
    rng = random.Random(0)

    def prompts(n: int) -> list[list[int]]:
        # NOTE: distinct random prompts (no prefix-cache hits), the same ones for every system
        return [[rng.randrange(100, 40000) for _ in range(args.prompt_tokens)] for _ in range(n)]

    for s in systems:
        start(s, args, args.log_dir)
    try:
        for s in systems:
            s.server.wait_ready(900)
        warm = prompts(args.warmup)
        for s in systems:
            asyncio.run(run_point(s.server.url, 1, args.warmup, warm, args))
        for r in range(args.rounds):
            for c in levels:
                batch = prompts(c * args.requests)
                for s in (systems if r % 2 == 0 else systems[::-1]):
                    measure(s, c, batch, args)
    finally:
        for s in systems:
            if s.server is not None:
                s.server.stop()
    print("\n".join(report(systems)))
    print("(ms; step, forward: means per engine step; eng ITL: the engine's own inter-token "
          "mean (vllm:inter_token_latency_seconds); gap = client ITL mean - eng ITL)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
