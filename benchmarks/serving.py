"""kvmesh and vLLM measured with the field's own load generators (issue 28).

    python benchmarks/serving.py run                  # every system x tool x workload, a sweep
    python benchmarks/serving.py run --systems kvmesh,vllm --tools guidellm --workloads fixed \
        --concurrency 1,2,4 --num-requests 24 --prompt-tokens 32 --output-tokens 32
    python benchmarks/serving.py scenarios            # the seeds' load scenarios as inference-perf
    python benchmarks/serving.py scenarios --run      #   configs; --run replays them per policy

`run` starts each system in turn (`kvmesh serve`; the kvmesh router in front of two engines;
vLLM's CPU build, `vllm serve`; see serving_systems.py: same weights, dtype, max_num_seqs,
max_model_len), then runs each tool against it: `guidellm run`, `inference-perf`, and
`vllm bench serve` (serving_tools.py), on synthetic prompts of fixed lengths (`fixed`) and of
lengths uniform in mean * (1 -+ spread) (`varied`), at each load point of the sweep (concurrent
requests, or arrival rates with --rate). Each tool's own report is kept under --out; all are
read into one table (serving_reports.py) written as results.json, summary.md (with every command
that ran, exactly) and latency_vs_throughput_<workload>.png.

The tools live in venvs of their own (serving_tools.py says where and how to install each); a
missing tool, or a server that does not start, ends the run with a message and exit status 2.
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    # NOTE: run as a script: make `benchmarks` importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import inference_perf_config as ipc  # noqa: E402
from benchmarks.servers import ServerError  # noqa: E402
from benchmarks.serving_reports import (LoadPointRow, ReportError, parse_guidellm,  # noqa: E402
                                        parse_inference_perf, parse_vllm_bench)
from benchmarks.serving_summary import plot, write_results  # noqa: E402
from benchmarks.serving_systems import (MODEL_NAME, SYSTEMS, EngineSettings,  # noqa: E402
                                        start_system)
from benchmarks.serving_tools import (TOOLS, LoadPoint, Target, ToolMissing, Workload,  # noqa: E402
                                      guidellm_command, inference_perf_command, shell_line,
                                      tool_env, tool_prefix, vllm_bench_command)

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ("fixed", "varied")


@dataclass(slots=True)
class ToolRun:
    """One tool invocation: its command, where its log and report go, and how to read it."""

    tool: str
    workload: Workload
    argv: list[str]
    log: Path
    report: Path
    files: dict[str, str] | None = None     # files written before it runs (name -> text)


def cpu_model() -> str:
    flags = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                 if ln.startswith("model name")), "unknown CPU")
    have = next((ln.split(":", 1)[1].split() for ln in text.splitlines()
                 if ln.startswith("flags")), [])
    simd = [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                        "amx_bf16", "amx_int8") if f in have]
    flags = ", ".join(simd) or "no AVX2"
    return f"{name}, {os.cpu_count()} vCPUs ({flags})"


# ---- planning ---------------------------------------------------------------------------------
def workloads(args: argparse.Namespace) -> list[Workload]:
    out = []
    for name in args.workloads:
        out.append(Workload(name, args.prompt_tokens, args.output_tokens,
                            0.0 if name == "fixed" else args.spread))
    return out


def load_points(args: argparse.Namespace) -> list[LoadPoint]:
    if args.rate:
        return [LoadPoint("rate", r, args.num_requests) for r in args.rate]
    return [LoadPoint("concurrency", c, args.num_requests) for c in args.concurrency]


def plan_tools(system: str, target: Target, args: argparse.Namespace, prefixes: dict[str, list[str]],
               out: Path) -> list[ToolRun]:
    runs: list[ToolRun] = []
    points = load_points(args)
    for w in workloads(args):
        for tool in args.tools:
            d = out / system / tool / w.name
            if tool == "guidellm":
                report = d / "guidellm.json"
                runs.append(ToolRun(tool, w, guidellm_command(prefixes[tool], target, w, points,
                                                              report, args.seed),
                                    d / "guidellm.log", report))
            elif tool == "inference-perf":
                cfg_path, reports = d / "config.yaml", d / "reports"
                cfg = ipc.sweep_config(target, w, points, reports, args.seed)
                runs.append(ToolRun(tool, w, inference_perf_command(prefixes[tool], cfg_path),
                                    d / "inference-perf.log", reports,
                                    {str(cfg_path): ipc.dump_yaml(cfg)}))
            else:
                for p in points:
                    name = f"{p.label.replace('=', '-')}.json"
                    runs.append(ToolRun(tool, w, vllm_bench_command(prefixes[tool], target, w, p,
                                                                    d, name, args.seed),
                                        d / f"{p.label.replace('=', '-')}.log", d / name))
    return runs


def parse_report(run: ToolRun, system: str) -> list[LoadPointRow]:
    if run.tool == "guidellm":
        return parse_guidellm(run.report, system, run.workload.name)
    if run.tool == "inference-perf":
        return parse_inference_perf(run.report, system, run.workload.name)
    return parse_vllm_bench(run.report, system, run.workload.name)


def execute(run: ToolRun, timeout_s: float) -> int:
    run.log.parent.mkdir(parents=True, exist_ok=True)
    for path, text in (run.files or {}).items():
        Path(path).write_text(text)
    with open(run.log, "w") as log:
        try:
            return subprocess.run(run.argv, stdout=log, stderr=subprocess.STDOUT, env=tool_env(),
                                  cwd=run.log.parent, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            return 124


def warm_up(url: str, model: str, n: int = 2) -> None:
    """A few unmeasured requests, so no tool's first point pays a first-request cost."""
    import httpx
    for i in range(n):
        httpx.post(f"{url}/v1/completions", timeout=600, json={
            "model": model, "prompt": f"Warm-up request {i}: tell me about the sea.",
            "max_tokens": 8, "ignore_eos": True}).raise_for_status()


def run_tools(system: str, url: str, settings: EngineSettings, args: argparse.Namespace,
              prefixes: dict[str, list[str]], out: Path, commands: list[str],
              errors: list[str]) -> list[LoadPointRow]:
    """Every planned tool run against one started system; what went wrong goes to `errors`
    (a tool's exit status, an unreadable report, failed requests) and the run goes on."""
    rows: list[LoadPointRow] = []
    try:
        warm_up(url, MODEL_NAME)
    except Exception as e:  # noqa: BLE001 - a server that cannot answer ends its turn
        errors.append(f"{system}: the warm-up request failed: {e}")
        return rows
    target = Target(url, MODEL_NAME, settings.model_dir)
    for run in plan_tools(system, target, args, prefixes, out):
        commands.append(shell_line(run.argv))
        print(f"# {system} / {run.tool} / {run.workload.name}: {run.log}", flush=True)
        where = f"{system} / {run.tool} / {run.workload.name}"
        code = execute(run, args.tool_timeout)
        if code != 0:
            errors.append(f"{where}: exit status {code}; see {run.log}")
            continue
        try:
            got = parse_report(run, system)
        except ReportError as e:
            errors.append(str(e))
            continue
        for r in got:
            print(f"  {r.load}: {r.completed} ok, {r.failed} failed, {r.request_per_s:.2f} req/s, "
                  f"{r.output_tok_per_s:.1f} tok/s, TTFT p90 {r.ttft_ms.p90:.0f} ms, "
                  f"ITL p90 {r.itl_ms.p90:.1f} ms", flush=True)
            if r.failed:
                errors.append(f"{where} / {r.load}: {r.failed} failed requests; see {run.log}")
        rows += got
    return rows


# ---- run ----------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        prefixes = {t: tool_prefix(t) for t in args.tools}
    except ToolMissing as e:
        print(f"serving.py: error: {e}", file=sys.stderr)
        return 2
    settings = engine_settings(args)
    meta = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpu": cpu_model(),
            "loadavg_before": os.getloadavg(), "argv": sys.argv, "errors": [],
            "settings": {"dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
                         "max_model_len": args.max_model_len,
                         "max_num_batched_tokens": args.max_num_batched_tokens,
                         "model_dir": str(settings.model_dir),
                         "vllm_enforce_eager": args.vllm_enforce_eager,
                         "num_requests": args.num_requests, "prompt_tokens": args.prompt_tokens,
                         "output_tokens": args.output_tokens, "spread": args.spread},
            "exit_codes": {}}
    rows: list[LoadPointRow] = []
    commands: list[str] = []
    for system in args.systems:
        print(f"# {system}: starting", flush=True)
        t0 = time.monotonic()
        try:
            running = start_system(system, settings, out / system / "logs")
        except ServerError as e:
            print(f"serving.py: error: {e}", file=sys.stderr)
            meta["errors"].append(str(e).splitlines()[0])
            write_results(rows, meta, commands, out)
            return 2
        print(f"# {system}: ready in {time.monotonic() - t0:.0f} s at {running.url}", flush=True)
        commands += [f"# {system}", *running.commands]
        try:
            rows += run_tools(system, running.url, settings, args, prefixes, out, commands,
                              meta["errors"])
        finally:
            meta["exit_codes"][system] = running.stop()
    meta["loadavg_after"] = os.getloadavg()
    write_results(rows, meta, commands, out)
    paths = plot(rows, out) if rows else []
    print((out / "summary.md").read_text())
    for p in paths:
        print(f"wrote {p}")
    return 1 if meta["errors"] else 0


def engine_settings(args: argparse.Namespace) -> EngineSettings:
    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        from kvmesh.engine.hf_export import builtin_hf_dir
        model_dir = builtin_hf_dir(args.dtype)
    from benchmarks.peer import default_venv
    return EngineSettings(model_dir, args.dtype, args.max_num_seqs, args.max_model_len,
                          args.max_num_batched_tokens,
                          Path(args.vllm_venv) if args.vllm_venv else default_venv(),
                          args.vllm_enforce_eager, args.ready_timeout)


# ---- scenarios ----------------------------------------------------------------------------------
def cmd_scenarios(args: argparse.Namespace) -> int:
    from benchmarks.scenario_configs import run_scenarios, write_scenarios
    try:
        prefix = tool_prefix("inference-perf") if args.run else None
    except ToolMissing as e:
        print(f"serving.py: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if not args.run:
        for path in write_scenarios(args, out):
            print(f"wrote {path}")
        return 0
    try:
        return run_scenarios(args, out, prefix)
    except ServerError as e:
        print(f"serving.py: error: {e}", file=sys.stderr)
        return 2


# ---- arguments ----------------------------------------------------------------------------------
def _list(kind, choices=None):
    def parse(text: str):
        items = [kind(x.strip()) for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("give at least one value")
        bad = [x for x in items if choices and x not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad[0]!r}; choose from {', '.join(choices)}")
        if kind is not str and any(x <= 0 for x in items):
            raise argparse.ArgumentTypeError("values must be > 0")
        return items
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="serving.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    r = sub.add_parser("run", help="systems x tools x workloads x load points")
    r.add_argument("--systems", type=_list(str, SYSTEMS), default=list(SYSTEMS))
    r.add_argument("--tools", type=_list(str, TOOLS), default=list(TOOLS))
    r.add_argument("--workloads", type=_list(str, WORKLOADS), default=list(WORKLOADS))
    r.add_argument("--concurrency", type=_list(int), default=[1, 2, 4, 8, 16],
                   help="concurrent requests per load point (default 1,2,4,8,16)")
    r.add_argument("--rate", type=_list(float), default=None,
                   help="arrival rates (req/s) per load point, instead of --concurrency")
    r.add_argument("--num-requests", type=int, default=48, help="requests per load point")
    r.add_argument("--prompt-tokens", type=int, default=128)
    r.add_argument("--output-tokens", type=int, default=64)
    r.add_argument("--spread", type=float, default=0.75,
                   help="varied: lengths uniform in mean * (1 -+ spread)")
    r.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    r.add_argument("--max-num-seqs", type=int, default=16)
    r.add_argument("--max-model-len", type=int, default=1024)
    r.add_argument("--max-num-batched-tokens", type=int, default=1024)
    r.add_argument("--model-dir", help="HF model directory (default: the built-in model's)")
    r.add_argument("--vllm-venv", help="vLLM's venv (default $KVMESH_VLLM_VENV or "
                   "~/.cache/kvmesh/vllm-venv)")
    r.add_argument("--vllm-enforce-eager", action="store_true",
                   help="start vLLM without torch.compile (its first start compiles for minutes)")
    r.add_argument("--ready-timeout", type=float, default=900.0, help="seconds a server may take")
    r.add_argument("--tool-timeout", type=float, default=3600.0, help="seconds per tool run")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serving"))
    s = sub.add_parser("scenarios", help="the seeds' load scenarios as inference-perf configs")
    s.add_argument("--scenarios", type=_list(str, ("low", "medium", "high")),
                   default=["low", "medium", "high"])
    s.add_argument("--run", action="store_true", help="start kvmesh serve per policy (the "
                   "settings of load_scenarios.py) and replay each scenario with inference-perf")
    s.add_argument("--policies", type=_list(str, ("fcfs", "priority", "sjf", "dynamic")),
                   default=["fcfs", "priority", "sjf", "dynamic"])
    s.add_argument("--quick", action="store_true", help="load_scenarios.py's --quick sizes")
    s.add_argument("--url", default="http://127.0.0.1:8000",
                   help="server the written configs point at (without --run)")
    s.add_argument("--tokenizer", help="tokenizer directory (default: the built-in model's)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--tool-timeout", type=float, default=3600.0)
    s.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serving-scenarios"))
    args = p.parse_args(argv)
    if args.command is None:
        p.error("choose a command: run or scenarios")
    # NOTE: absolute: each tool runs in a folder of its own and reads the paths it is given there
    args.out = str(Path(args.out).resolve())
    if args.command == "run":
        for name in ("num_requests", "prompt_tokens", "output_tokens", "max_num_seqs",
                     "max_model_len", "max_num_batched_tokens"):
            if getattr(args, name) < 1:
                p.error(f"--{name.replace('_', '-')} must be >= 1")
        if not 0 <= args.spread < 1:
            p.error("--spread must be in [0, 1)")
        if args.prompt_tokens * (1 + args.spread) + args.output_tokens * (1 + args.spread) \
                > args.max_model_len:
            p.error("the longest request (prompt + output, with --spread) exceeds --max-model-len")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return cmd_run(args) if args.command == "run" else cmd_scenarios(args)


if __name__ == "__main__":
    sys.exit(main())
