"""The seeds' load scenarios (low / medium / high) as inference-perf runs.

    python benchmarks/serving.py scenarios [--quick]          # write trace + config per scenario
    python benchmarks/serving.py scenarios --run [--policies fcfs,sjf]

One source of truth: the requests are `workload.generate_requests` with the parameters of
`load_scenarios.py` (its DEFAULTS or QUICK: scale, length cap, time scale, request cap, seed),
capped and timed exactly as that script replays them. Each scenario becomes an Azure-format trace
(arrival, prompt tokens, output tokens) and a `trace_replay` config (inference_perf_config.py).
With --run, each policy gets the `kvmesh serve` that `load_scenarios.py` starts (same KV cache,
limits and threads), and inference-perf replays every scenario against it.

NOTE: inference-perf sends no `priority` field, so the priority and dynamic policies see every
request at the same priority here; fcfs and sjf are reproduced as load_scenarios.py runs them.
Its reports are per scenario, not per length class.
"""
from __future__ import annotations

import argparse
import os
import shlex
import time
from pathlib import Path

from benchmarks import inference_perf_config as ipc
from benchmarks.load_stats import cap_requests
from benchmarks.serving_reports import LoadPointRow, ReportError, parse_inference_perf
from benchmarks.serving_tools import Target, inference_perf_command, shell_line, tool_env
from benchmarks.workload import generate_requests


def load_args(quick: bool, seed: int) -> argparse.Namespace:
    """load_scenarios.py's own settings (its parser fills DEFAULTS or QUICK)."""
    from benchmarks.load_scenarios import parse_args
    return parse_args([*(["--quick"] if quick else []), "--seed", str(seed)])


def scenario_requests(name: str, la: argparse.Namespace):
    reqs = generate_requests(name, seed=la.seed, scale=la.scale, max_total_len=la.max_total_len,
                             prompt_fraction=la.prompt_fraction)
    return cap_requests(reqs, la.max_requests)


def write_scenario(name: str, la: argparse.Namespace, target: Target, out: Path) -> tuple[Path, Path]:
    """trace_<name>.csv and inference_perf_<name>.yaml under `out`; their paths."""
    out.mkdir(parents=True, exist_ok=True)
    trace = out / f"trace_{name}.csv"
    trace.write_text(ipc.scenario_trace(scenario_requests(name, la), la.time_scale))
    config = out / f"inference_perf_{name}.yaml"
    cfg = ipc.scenario_config(target, trace.resolve(), (out / f"reports_{name}").resolve(), la.seed)
    config.write_text(ipc.dump_yaml(cfg))
    return trace, config


def _tokenizer(args: argparse.Namespace) -> Path:
    if args.tokenizer:
        return Path(args.tokenizer)
    from kvmesh.engine.hf_export import builtin_hf_dir
    return builtin_hf_dir("float32")


def write_scenarios(args: argparse.Namespace, out: Path) -> list[Path]:
    la = load_args(args.quick, args.seed)
    target = Target(args.url.rstrip("/"), "SmolLM2-135M-Instruct", _tokenizer(args))
    paths: list[Path] = []
    for name in args.scenarios:
        paths += write_scenario(name, la, target, out)
    return paths


def run_scenarios(args: argparse.Namespace, out: Path, prefix: list[str]) -> int:
    import subprocess

    import httpx

    from benchmarks.load_scenarios import Server
    from benchmarks.serving_summary import write_results

    la = load_args(args.quick, args.seed)
    tokenizer = _tokenizer(args)
    rows: list[LoadPointRow] = []
    commands: list[str] = []
    meta = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "loadavg_before": os.getloadavg(),
            "settings": {k: getattr(la, k) for k in ("scale", "max_total_len", "time_scale",
                                                      "max_requests", "num_kv_blocks",
                                                      "max_num_seqs", "max_num_batched_tokens",
                                                      "seed")},
            "errors": [], "exit_codes": {}}
    for policy in args.policies:
        server = Server(policy, la, out / policy / "server.log")
        try:
            server.wait_ready()
            model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
            threads = (f"OMP_NUM_THREADS={la.server_threads} MKL_NUM_THREADS={la.server_threads} "
                       if la.server_threads else "")
            commands.append(threads + shlex.join(server.cmd))
            target = Target(server.url, model, tokenizer)
            for name in args.scenarios:
                _, config = write_scenario(name, la, target, out / policy)
                argv = inference_perf_command(prefix, config)
                commands.append(shell_line(argv))
                log = out / policy / f"inference-perf-{name}.log"
                with open(log, "w") as f:
                    code = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=tool_env(),
                                          cwd=out / policy, timeout=args.tool_timeout).returncode
                if code != 0:
                    meta["errors"].append(f"{policy} / {name}: exit status {code}; see {log}")
                    continue
                try:
                    rows += parse_inference_perf(out / policy / f"reports_{name}",
                                                 f"kvmesh ({policy})", name, load="trace")
                except ReportError as e:
                    meta["errors"].append(str(e))
        finally:
            meta["exit_codes"][policy] = [server.stop()]
    meta["loadavg_after"] = os.getloadavg()
    write_results(rows, meta, commands, out)
    print((out / "summary.md").read_text())
    return 1 if meta["errors"] else 0
