"""Seed 001's load-scenario experiment as one command: scheduling policies under low/medium/high load.

    python benchmarks/load_scenarios.py                # the default run (~15-20 min on 2 CPU cores)
    python benchmarks/load_scenarios.py --quick        # smoke test (~1-2 min)
    python benchmarks/load_scenarios.py --scenarios low,high --policies fcfs,sjf --scale 20 \
        --time-scale 2 --max-requests 64 --out benchmarks/results/load

For each policy: start ONE `kvmesh serve` subprocess (built-in SmolLM2-135M, the same small KV
cache and limits for every policy), wait for /ready, replay each scenario's requests (from
benchmarks/workload.py, seeded, so every policy gets the same list) at their arrival times divided
by --time-scale, over the OpenAI completions API with the `AsyncOpenAI` client, streaming:

  * prompt: exact token ids (identical for every policy);
  * output: forced length, max_tokens = min_tokens = output_len, ignore_eos, greedy;
  * priority: `load_stats.priority_for(length_class)`: short 0 < medium 1 < long 2 < very_long 3
    (lower is served first; sent to every policy, used by priority and dynamic).

Per request: TTFT (first chunk with text), TPOT = (e2e - TTFT) / (tokens - 1), e2e latency,
failures. Then SIGTERM and check exit code 0. Outputs under --out: results.json / results.csv
(raw), summary.md (the seed's comparison table), ttft_p90.png, e2e_cdf.png, server-*.log.
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

if __package__ in (None, ""):
    # NOTE: run as a script (`python benchmarks/load_scenarios.py`): make `benchmarks` importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.load_stats import (RequestResult, build_summary, cap_requests,  # noqa: E402
                                   format_runs, format_table, percentile, priority_for, replay,
                                   send_offsets)
from benchmarks.servers import ServerProcess, free_port  # noqa: E402
from benchmarks.workload import (CLASS_NAMES, SCENARIOS, WorkloadRequest,  # noqa: E402
                                 generate_requests, make_prompt_ids)

POLICIES = ("fcfs", "priority", "sjf", "dynamic")

# NOTE: the default scaling, chosen so the 12 runs finish in ~15-20 min on a 2-core CPU
# (SmolLM2-135M, ~100-300 tok/s aggregate) while keeping the seed's load ordering:
# low is well under capacity, medium around it, high far over it (see docs/benchmarks).
DEFAULTS = dict(scale=20.0, max_total_len=256, time_scale=2.0, max_requests=64,
                num_kv_blocks=48, max_num_seqs=16, max_num_batched_tokens=256)
QUICK = dict(scale=40.0, max_total_len=128, time_scale=8.0, max_requests=8,
             num_kv_blocks=24, max_num_seqs=8, max_num_batched_tokens=128)


@dataclass(slots=True)
class Job:
    """One request ready to send: the workload entry, its prompt ids and its send offset."""
    index: int
    work: WorkloadRequest
    prompt_ids: list[int]
    offset_s: float


# ---------------------------------------------------------------------------------- server


class Server:
    """One `kvmesh serve` subprocess on a free loopback port (a `servers.ServerProcess`)."""

    def __init__(self, policy: str, args: argparse.Namespace, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "kvmesh.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--scheduling-policy", policy,
               "--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs", str(args.max_num_seqs),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens),
               "--max-model-len", str(args.max_total_len), "--log-level", "warning"]
        self.cmd = cmd
        env = dict(os.environ)
        if args.server_threads:
            # NOTE: on a shared 2-core machine torch's default intra-op threads spin against other
            # processes: one 64-token request took 37-46 s with 2 threads and 3.7 s with 1.
            env.update(OMP_NUM_THREADS=str(args.server_threads),
                       MKL_NUM_THREADS=str(args.server_threads))
        self.process = ServerProcess(f"kvmesh serve ({policy})", cmd, self.url, log_path,
                                     env=env).start()
        self.proc = self.process.proc

    def wait_ready(self, timeout: float = 300.0) -> None:
        self.process.wait_ready(timeout)

    def stop(self, timeout: float = 90.0) -> int:
        return self.process.stop(timeout)

    def counter(self, name: str) -> float | None:
        """One un-labelled counter sample from /metrics (e.g. kvmesh:num_preemptions)."""
        try:
            text = httpx.get(f"{self.url}/metrics", timeout=5.0).text
        except httpx.HTTPError:
            return None
        for line in text.splitlines():
            head = line.split("{", 1)[0].split(" ", 1)[0]
            if head in (name, name + "_total"):
                return float(line.rsplit(" ", 1)[1])
        return None


class _HttpTokenizer:
    """`encode` through the server's /tokenize: the client never loads the model."""

    def __init__(self, url: str):
        self.url = url

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        r = httpx.post(f"{self.url}/tokenize", json={"prompt": text,
                                                     "add_special_tokens": add_special_tokens})
        r.raise_for_status()
        return r.json()["tokens"]


# ---------------------------------------------------------------------------------- replay


def build_jobs(scenario: str, args: argparse.Namespace, tokenizer) -> list[Job]:
    work = generate_requests(scenario, seed=args.seed, scale=args.scale,
                             max_total_len=args.max_total_len, prompt_fraction=args.prompt_fraction)
    work = cap_requests(work, args.max_requests)
    offsets = send_offsets(work, args.time_scale)
    rng = np.random.default_rng(args.seed)
    return [Job(i, w, make_prompt_ids(tokenizer, w.prompt_len, rng), off)
            for i, (w, off) in enumerate(zip(work, offsets))]


async def _send(client, model: str, scenario: str, policy: str, job: Job, t0: float,
                results: list[RequestResult], bar) -> None:
    w = job.work
    prio = priority_for(w.length_class)
    sent = time.perf_counter()
    ttft = e2e = None
    tokens, error = 0, None
    try:
        stream = await client.completions.create(
            model=model, prompt=job.prompt_ids, max_tokens=w.output_len, temperature=0.0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "min_tokens": w.output_len, "priority": prio})
        async for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].text:
                ttft = time.perf_counter() - sent
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        e2e = time.perf_counter() - sent
        if tokens != w.output_len:
            error = f"got {tokens} of {w.output_len} output tokens"
    except Exception as e:  # noqa: BLE001 - every failure is a result, not a crash
        error = f"{type(e).__name__}: {e}"[:300]
    results.append(RequestResult(scenario, policy, job.index, w.user_id, w.length_class, prio,
                                 w.prompt_len, w.output_len, job.offset_s, sent - t0, ttft, e2e,
                                 tokens if error is None else 0, error))
    bar.update(1)


async def run_scenario(server: Server, model: str, scenario: str, policy: str, jobs: list[Job],
                       bar) -> tuple[list[RequestResult], float]:
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=1800)
    results: list[RequestResult] = []
    bar.set_postfix_str(f"{policy}/{scenario}")

    async def send(i: int, t0: float) -> None:
        await _send(client, model, scenario, policy, jobs[i], t0, results, bar)

    t0 = await replay([j.offset_s for j in jobs], send, time.perf_counter, asyncio.sleep)
    wall = time.perf_counter() - t0
    await client.close()
    return sorted(results, key=lambda r: r.index), wall


async def warm_up(server: Server, model: str, n: int = 4) -> None:
    """A few unmeasured concurrent requests, so no policy pays first-request costs in a scenario.

    NOTE: fcfs always runs first; without this its first scenario looked slower for no reason.
    """
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)
    await asyncio.gather(*[client.completions.create(
        model=model, prompt=list(range(1000 + 97 * i, 1000 + 97 * i + 16 * (i + 1))), max_tokens=8,
        temperature=0.0, extra_body={"ignore_eos": True}) for i in range(n)])
    await client.close()


# ---------------------------------------------------------------------------------- outputs


def plot(results: list[RequestResult], scenarios: list[str], policies: list[str], out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(1, len(scenarios), figsize=(5 * len(scenarios), 4), squeeze=False)
    width = 0.8 / len(policies)
    for ax, sc in zip(axes[0], scenarios):
        for k, pol in enumerate(policies):
            vals = []
            for c in range(len(CLASS_NAMES)):
                v = percentile([r.ttft_s for r in results if r.scenario == sc and r.policy == pol
                                and r.length_class == c and r.ok], 90)
                vals.append(np.nan if v is None else v)
            ax.bar(np.arange(len(CLASS_NAMES)) + (k - (len(policies) - 1) / 2) * width, vals,
                   width, label=pol)
        n = [sum(r.scenario == sc and r.policy == policies[0] and r.length_class == c
                 for r in results) for c in range(len(CLASS_NAMES))]
        ax.set_xticks(np.arange(len(CLASS_NAMES)), [f"{c}\n(n={k})" for c, k in zip(CLASS_NAMES, n)])
        ax.set_title(f"{sc}: TTFT p90 by length class")
        ax.set_ylabel("TTFT p90 (s)")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    paths.append(out / "ttft_p90.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(scenarios), figsize=(5 * len(scenarios), 4), squeeze=False)
    for ax, sc in zip(axes[0], scenarios):
        for pol in policies:
            xs = np.sort([r.e2e_s for r in results if r.scenario == sc and r.policy == pol and r.ok])
            if len(xs):
                ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=pol)
        ax.set_title(f"{sc}: e2e latency CDF")
        ax.set_xlabel("end-to-end latency (s)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    paths.append(out / "e2e_cdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_raw(results: list[RequestResult], meta: dict, out: Path) -> None:
    rows = [dict(asdict(r), tpot_s=r.tpot_s) for r in results]
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["scenario"])
        writer.writeheader()
        writer.writerows(rows)


# ---------------------------------------------------------------------------------- driver


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default="low,medium,high")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--quick", action="store_true", help="smoke test: few short requests")
    p.add_argument("--scale", type=float, help=f"divides the seed's class means (default {DEFAULTS['scale']})")
    p.add_argument("--max-total-len", type=int, help="cap on prompt + output tokens; also --max-model-len")
    p.add_argument("--time-scale", type=float, help="arrival times are divided by this")
    p.add_argument("--max-requests", type=int, help="first N arrivals of each scenario")
    p.add_argument("--prompt-fraction", type=float, default=0.5)
    p.add_argument("--num-kv-blocks", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-threads", type=int, default=1,
                   help="OMP_NUM_THREADS of the server (0: torch's default)")
    p.add_argument("--out", default="benchmarks/results/load")
    args = p.parse_args(argv)
    base = QUICK if args.quick else DEFAULTS
    for k, v in base.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    args.policies = [s for s in args.policies.split(",") if s]
    bad = [s for s in args.policies if s not in POLICIES]
    if bad:
        p.error(f"unknown policy {bad[0]!r}; choose from {', '.join(POLICIES)}")
    bad = [s for s in args.scenarios if s not in SCENARIOS]
    if bad:
        p.error(f"unknown scenario {bad[0]!r}; choose from {', '.join(SCENARIOS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    started = time.time()
    results: list[RequestResult] = []
    walls: dict[tuple[str, str], float] = {}
    runs: list[dict] = []
    counts = {sc: len(cap_requests(generate_requests(sc, args.seed, args.scale, args.max_total_len,
                                                     args.prompt_fraction), args.max_requests))
              for sc in args.scenarios}
    bar = tqdm(total=sum(counts.values()) * len(args.policies), unit="req", dynamic_ncols=True)
    for policy in args.policies:
        server = Server(policy, args, out / f"server-{policy}.log")
        try:
            server.wait_ready()
            model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
            tokenizer = _HttpTokenizer(server.url)
            asyncio.run(warm_up(server, model))
            for sc in args.scenarios:
                jobs = build_jobs(sc, args, tokenizer)
                pre = server.counter("kvmesh:num_preemptions")
                res, wall = asyncio.run(run_scenario(server, model, sc, policy, jobs, bar))
                post = server.counter("kvmesh:num_preemptions")
                results += res
                walls[(sc, policy)] = wall
                runs.append({"scenario": sc, "policy": policy, "requests": len(res), "wall_s": wall,
                             "preemptions": None if pre is None or post is None else post - pre,
                             "max_lateness_s": max((r.sent_s - r.arrival_s for r in res), default=0)})
        finally:
            code = server.stop()
            runs.append({"policy": policy, "server_exit_code": code})
            if code != 0:
                bar.write(f"WARNING: {policy} server exited with {code}; see {server.log_path}")
    bar.close()
    meta = {"args": {k: v for k, v in vars(args).items()}, "server_cmd_example": server.cmd,
            "runs": runs, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "elapsed_s": time.time() - started, "counts": counts}
    write_raw(results, meta, out)
    table = format_table(build_summary(results, walls))
    runs_md = format_runs([r for r in runs if "scenario" in r])
    exits = ", ".join(f"{r['policy']}={r['server_exit_code']}" for r in runs if "server_exit_code" in r)
    summary = (f"{table}\n\n{runs_md}\n\nserver exit codes: {exits}; load average before "
               f"{load_before[0]:.2f} / after {meta['loadavg_after'][0]:.2f}; "
               f"elapsed {meta['elapsed_s']:.0f} s\n")
    (out / "summary.md").write_text(summary)
    print(summary)
    for path in plot(results, args.scenarios, args.policies, out):
        print(f"wrote {path}")
    failed = sum(not r.ok for r in results)
    bad_exit = any(r.get("server_exit_code", 0) != 0 for r in runs)
    return 1 if bad_exit or failed == len(results) else 0


if __name__ == "__main__":
    sys.exit(main())
