"""Prefill/decode disaggregation against colocated engines on one machine (issue 26's benchmark).

    python benchmarks/pd_disagg.py                      # the full run (~3 min + two start-ups)
    python benchmarks/pd_disagg.py --smoke              # a quick check (tiny random model, ~1 min)
    python benchmarks/pd_disagg.py --model random-300m --duration 120 --out DIR

Two systems, one after the other, each on the same two cores (`--cores`, one engine per core,
`taskset -c`, one torch thread each), the kvmesh router in front:

  pd         a prefill engine (kv_producer) on the first core, a decode engine (kv_consumer) on
             the second, the router in P/D mode (`--prefill-backends` / `--decode-backends`): the
             decode engine reads each prompt's KV over Mooncake's TCP transport
  colocated  two plain engines on the same cores, the router in its normal mode (`--backends`)

The router, Redis and this client run on the other cores when there are any (else unpinned).
Both get the same load (pd_load.py): steady decode streams plus bursts of long prompts, for
`--duration` seconds after an unmeasured warm-up. Reported per system: ITL p50/p99 of the
streams, TTFT p50/p99 of the bursts and of the streams, output tokens/s; for pd also the KV
transfer rates from the decode engine's `/metrics`: `kvmesh:kv_transfer_bytes_total` over
`kvmesh:kv_transfer_seconds_sum` (the whole load, side-channel round trips included) and over
`kvmesh:kv_transfer_read_seconds_total` (Mooncake's reads alone), against a numpy copy of as
many bytes per transfer, measured in this run (the issue's target: read >= 0.5 of the copy). The comparison: ITL p99 colocated / pd (the
issue's target is >= 2) and throughput pd / colocated (equal within 10 % for a fair reading).
Written to --out: results.json, summary.md, each process's log.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

if __package__ in (None, ""):
    # NOTE: run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.models import resolve_model  # noqa: E402
from benchmarks.pd_load import Load, Record, Summary, drive, prompt_ids, send_one, summarize  # noqa: E402
from benchmarks.pd_systems import BLOCK_SIZE, MODEL_NAME, System, start_system  # noqa: E402
from benchmarks.servers import ServerError  # noqa: E402
from kvmesh.common.model_files import cache_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("pd", "colocated")
KV_METRICS = ("kvmesh:kv_transfer_bytes_total", "kvmesh:kv_transfer_seconds_sum",
              "kvmesh:kv_transfer_seconds_count", "kvmesh:kv_transfer_read_seconds_total",
              "kvmesh:kv_transfer_failures_total",
              "kvmesh:kv_transfer_timeouts_total", "kvmesh:prompt_tokens_computed_total")
# NOTE: 2 x 1536 prompt tokens every 6 s (~510 tokens/s) stays under one core's prefill rate for
# the built-in model (a 512-token step took 486 ms in BENCHMARKS.md's 2026-11-22 run; faster
# since): an overloaded prefill queue would make TTFT measure the queue's growth on both systems,
# not the interference
FULL = dict(model="builtin", duration=60.0, streams=6, stream_prompt_tokens=32,
            stream_output_tokens=256, burst_every=6.0, burst_size=2, burst_prompt_tokens=1536,
            burst_output_tokens=8)
SMOKE = dict(model="random-tiny", duration=4.0, streams=2, stream_prompt_tokens=16,
             stream_output_tokens=24, burst_every=1.5, burst_size=2, burst_prompt_tokens=130,
             burst_output_tokens=2)


@dataclass(slots=True)
class SystemResult:
    name: str
    summary: Summary
    kv: dict[str, float]                     # KV_METRICS deltas over the window, summed over engines
    transfer_gbps: float | None              # decode engine's loads, side channel included (pd only)
    wire_gbps: float | None                  # the same bytes over Mooncake's reads alone
    copy_gbps: float | None                  # numpy copy of the same bytes per transfer


# ---- measuring ---------------------------------------------------------------------------------
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)", re.M)


def scrape(url: str) -> dict[str, float]:
    """KV_METRICS of one engine (summed over label sets; 0 when absent)."""
    out = dict.fromkeys(KV_METRICS, 0.0)
    for name, value in _SAMPLE.findall(httpx.get(f"{url}/metrics", timeout=10).text):
        if name in out:
            out[name] += float(value)
    return out


def scrape_all(system: System) -> dict[str, float]:
    pages = [scrape(u) for u in system.engines.values()]
    return {k: sum(p[k] for p in pages) for k in KV_METRICS}


def copy_gbps(nbytes: int, reps: int = 5) -> float:
    """A plain in-process memory copy of `nbytes` (numpy), best of `reps`, in GB/s (1e9 B/s)."""
    src = np.random.default_rng(0).integers(0, 255, max(nbytes, 1), dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return src.nbytes / best / 1e9


async def warm_up(url: str, load: Load) -> None:
    """Unmeasured: one long prompt and one stream (first-request costs, the P/D path's connections)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    rng = np.random.default_rng([load.seed, 9])
    records: list[Record] = []
    t0 = time.perf_counter()
    await asyncio.gather(
        send_one(client, MODEL_NAME, "burst", prompt_ids(rng, load.burst_prompt_tokens), 2, t0, records),
        send_one(client, MODEL_NAME, "stream", prompt_ids(rng, load.stream_prompt_tokens), 4, t0, records))
    await client.close()
    failed = [r.error for r in records if r.error or not r.done]
    if failed:
        raise ServerError(f"warm-up request failed: {failed[0]}")


def measure(system: System, load: Load) -> tuple[SystemResult, list[Record]]:
    asyncio.run(warm_up(system.url, load))
    before = scrape_all(system)
    records = asyncio.run(drive(system.url, MODEL_NAME, load))
    # NOTE: a cut request's abort may still be finishing: give the engines a moment to settle
    time.sleep(0.5)
    after = scrape_all(system)
    kv = {k: after[k] - before[k] for k in KV_METRICS}
    rate = wire = copy = None
    reads, nbytes = kv["kvmesh:kv_transfer_seconds_count"], kv["kvmesh:kv_transfer_bytes_total"]
    if reads > 0 and nbytes > 0:
        rate = nbytes / kv["kvmesh:kv_transfer_seconds_sum"] / 1e9
        if kv["kvmesh:kv_transfer_read_seconds_total"] > 0:
            wire = nbytes / kv["kvmesh:kv_transfer_read_seconds_total"] / 1e9
        copy = copy_gbps(int(nbytes / reads))
    return (SystemResult(system.name, summarize(records, load.duration_s), kv, rate, wire, copy),
            records)


def compare(results: dict[str, SystemResult], tolerance: float = 0.10) -> dict[str, object]:
    """The issue's reading: ITL p99 colocated / pd, throughput pd / colocated, and both checks."""
    if set(results) != set(SYSTEMS):
        return {}
    pd, co = results["pd"].summary, results["colocated"].summary
    itl = (co.itl_ms[1] / pd.itl_ms[1]) if pd.itl_ms[1] and co.itl_ms[1] else None
    tput = pd.output_tok_s / co.output_tok_s if co.output_tok_s else None
    equal = tput is not None and abs(tput - 1.0) <= tolerance
    out: dict[str, object] = {"itl_p99_colocated_over_pd": itl, "throughput_pd_over_colocated": tput,
                              "equal_throughput": equal,
                              "target_met": bool(equal and itl is not None and itl >= 2.0)}
    r = results["pd"]
    if r.wire_gbps and r.copy_gbps:
        out["transfer_over_copy"] = r.wire_gbps / r.copy_gbps
    return out


# ---- report ------------------------------------------------------------------------------------
def _ms(p: tuple[float | None, float | None]) -> str:
    return " / ".join("-" if v is None else f"{v:.1f}" for v in p)


def format_table(results: dict[str, SystemResult], comparison: dict[str, object]) -> str:
    lines = ["| system | ITL p50 / p99 (ms) | stream TTFT p50 / p99 (ms) | burst TTFT p50 / p99 (ms) "
             "| output tok/s | streams / bursts (answered) | errors "
             "| KV GB/s: load / Mooncake read / copy |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results.values():
        s = r.summary
        kv = "-" if r.transfer_gbps is None else " / ".join(
            "-" if v is None else f"{v:.3g}" for v in (r.transfer_gbps, r.wire_gbps, r.copy_gbps))
        lines.append(f"| {r.name} | {_ms(s.itl_ms)} | {_ms(s.stream_ttft_ms)} | {_ms(s.burst_ttft_ms)} "
                     f"| {s.output_tok_s:.1f} | {s.stream_requests} / {s.burst_requests} "
                     f"({s.bursts_answered}) | {s.errors} | {kv} |")
    if comparison:
        def f(k: str) -> str:
            v = comparison.get(k)
            return "-" if v is None else f"{v:.3g}"
        lines += ["", f"ITL p99 colocated / pd: {f('itl_p99_colocated_over_pd')} (target >= 2); "
                      f"throughput pd / colocated: {f('throughput_pd_over_colocated')} "
                      f"(equal: {comparison['equal_throughput']}); KV Mooncake read / copy: "
                      f"{f('transfer_over_copy')} (target >= 0.5); ITL target (>= 2x at equal "
                      f"throughput) met: {comparison['target_met']}"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="a quick check: " + ", ".join(
        f"{k}={v}" for k, v in SMOKE.items()) + " (each can still be overridden)")
    p.add_argument("--model", help=f"builtin, random-tiny, random-300m, ... or an HF directory "
                                   f"(default {FULL['model']}; --smoke: {SMOKE['model']})")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="which to run (default: both)")
    p.add_argument("--duration", type=float, help="measured seconds per system")
    p.add_argument("--streams", type=int, help="concurrent steady streams (closed loops)")
    p.add_argument("--stream-rate", type=float,
                   help="instead of closed loops: one new stream every 1/RATE s (open loop, the same "
                        "arrivals on both systems, for throughput that depends on the load alone)")
    p.add_argument("--stream-prompt-tokens", type=int)
    p.add_argument("--stream-output-tokens", type=int)
    p.add_argument("--burst-every", type=float, help="seconds between bursts")
    p.add_argument("--burst-size", type=int, help="long prompts per burst")
    p.add_argument("--burst-prompt-tokens", type=int)
    p.add_argument("--burst-output-tokens", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cores", default="0,1", help="the two cores the engines are pinned to")
    p.add_argument("--dtype", help="the engines' --dtype (default: theirs; --smoke: float32)")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="the engines' per-step token budget (default: theirs)")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--num-kv-blocks", type=int, help="per engine (default: the load's peak x 2)")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "pd_disagg")
    args = p.parse_args(argv)
    base = SMOKE if args.smoke else FULL
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.smoke and args.dtype is None:
        args.dtype = "float32"
    args.systems = [s for s in args.systems.split(",") if s]
    if not args.systems or set(args.systems) - set(SYSTEMS):
        p.error(f"--systems takes {', '.join(SYSTEMS)}; got {','.join(args.systems)!r}")
    try:
        args.cores = [int(c) for c in args.cores.split(",")]
    except ValueError:
        p.error(f"--cores takes two core numbers, e.g. 0,1; got {args.cores!r}")
    avail = sorted(os.sched_getaffinity(0))
    if len(args.cores) != 2 or len(set(args.cores)) != 2 or not set(args.cores) <= set(avail):
        p.error(f"--cores takes two distinct cores of this process's {avail}; got {args.cores}")
    args.other_cores = [c for c in avail if c not in args.cores] or None
    if args.stream_rate is not None and args.stream_rate <= 0:
        p.error(f"--stream-rate must be > 0; got {args.stream_rate}")
    args.max_model_len = max(args.stream_prompt_tokens + args.stream_output_tokens,
                             args.burst_prompt_tokens + args.burst_output_tokens) + BLOCK_SIZE
    if args.num_kv_blocks is None:
        # NOTE: every stream at full length plus two bursts in flight, twice over (never preempting)
        peak = (args.streams * (args.stream_prompt_tokens + args.stream_output_tokens)
                + 2 * args.burst_size * (args.burst_prompt_tokens + args.burst_output_tokens))
        args.num_kv_blocks = 2 * -(-peak // BLOCK_SIZE)
    return args


def load_of(args: argparse.Namespace) -> Load:
    return Load(args.duration, args.streams, args.stream_prompt_tokens, args.stream_output_tokens,
                args.burst_every, args.burst_size, args.burst_prompt_tokens,
                args.burst_output_tokens, args.seed, args.stream_rate)


def prebuild_kernels() -> None:
    """Build (or find cached) the engines' C++ CPU kernels here, on every core, before the engines
    start: pinned to one core each, their first start would compile for many minutes."""
    from kvmesh.kernels import cpu_kernels

    cpu_kernels.load()      # NOTE: the engines' own call; it logs why when they are unavailable


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # NOTE: `timeout` or a ^C: leave through the finally blocks, which stop every process started
    signal.signal(signal.SIGTERM, _exit_on_signal)
    load = load_of(args)
    model = resolve_model(args.model, cache_dir() / "bench-models")
    if not args.smoke:
        prebuild_kernels()
    if args.other_cores:
        os.sched_setaffinity(0, args.other_cores)      # the client stays off the engines' cores
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, SystemResult] = {}
    commands: dict[str, list[str]] = {}
    exit_codes: dict[str, list[int]] = {}
    for name in args.systems:
        print(f"# {name}: starting", flush=True)
        try:
            system = start_system(name, args, model, args.out)
        except ServerError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        try:
            print(f"# {name}: {load.duration_s:g} s of load", flush=True)
            results[name], _ = measure(system, load)
        finally:
            codes = system.stop()
        commands[name], exit_codes[name] = system.commands, codes
        print(f"# {name}: stopped, exit codes {codes}", flush=True)
    comparison = compare(results)
    table = format_table(results, comparison)
    print(table)
    meta = {"argv": sys.argv if argv is None else ["benchmarks/pd_disagg.py", *argv],
            "model": args.model, "load": asdict(load), "cores": args.cores,
            "other_cores": args.other_cores, "dtype": args.dtype,
            "max_num_batched_tokens": args.max_num_batched_tokens, "num_kv_blocks": args.num_kv_blocks,
            "max_model_len": args.max_model_len, "cpu_count": os.cpu_count(),
            "loadavg": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    out = {"meta": meta, "commands": commands, "exit_codes": exit_codes, "comparison": comparison,
           "systems": {n: asdict(r) for n, r in results.items()}}
    (args.out / "results.json").write_text(json.dumps(out, indent=2))
    (args.out / "summary.md").write_text(table + "\n")
    print(f"# wrote {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
