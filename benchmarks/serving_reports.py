"""Each load generator's own report, read into one common row per load point.

    parse_guidellm(path)               guidellm's `--output kind=json` report (all its benchmarks)
    parse_inference_perf(dir)          inference-perf's stage_<i>_lifecycle_metrics.json files
    parse_vllm_bench(path)             one `vllm bench serve --save-result` JSON

Latencies are in milliseconds, p50 / p90 / p99 as each tool computed them. ITL is each tool's
own definition: vLLM bench and inference-perf report the gaps between consecutive streamed
tokens; guidellm's inter_token_latency is per request, (e2e - TTFT) / (output tokens - 1).
A load point where no request succeeded is a row with its failures and NaN latencies (the tools
write zeros or nothing there). A report that lacks what a row needs raises ReportError naming the
file and the missing key.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path


class ReportError(ValueError):
    """A tool's report could not be read into rows."""


@dataclass(frozen=True, slots=True)
class Percentiles:
    p50: float
    p90: float
    p99: float


@dataclass(frozen=True, slots=True)
class LoadPointRow:
    """One load point of one tool against one system: the common table's row."""

    system: str
    tool: str
    workload: str
    load: str                 # "concurrency=4" or "rate=2"
    completed: int            # successful requests
    failed: int
    request_per_s: float
    output_tok_per_s: float
    ttft_ms: Percentiles
    itl_ms: Percentiles
    e2e_ms: Percentiles
    report: str               # the tool's own report this row was read from


NONE = Percentiles(math.nan, math.nan, math.nan)


def _load_json(path: Path) -> object:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ReportError(f"{path}: not a readable JSON report ({e})") from None


def _get(d: object, path: str, where: Path) -> object:
    cur = d
    for key in path.split("."):
        if not isinstance(cur, dict) or key not in cur or cur[key] is None:
            raise ReportError(f"{where}: the report has no {path!r}")
        cur = cur[key]
    return cur


def _num(d: object, path: str, where: Path, scale: float = 1.0) -> float:
    v = _get(d, path, where)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ReportError(f"{where}: {path!r} is not a number ({v!r})")
    return float(v) * scale


# ---- vllm bench serve -------------------------------------------------------------------------
def _vllm_load(raw: dict, where: Path) -> str:
    conc = raw.get("max_concurrency")
    if conc is not None:
        return f"concurrency={int(conc)}"
    rate = raw.get("request_rate")
    if rate is None:
        raise ReportError(f"{where}: the report has neither 'max_concurrency' nor 'request_rate'")
    return f"rate={float(rate):g}" if rate != "inf" else "rate=inf"


def parse_vllm_bench(path: Path, system: str, workload: str) -> list[LoadPointRow]:
    raw = _load_json(path)
    if not isinstance(raw, dict):
        raise ReportError(f"{path}: a vllm bench result is a JSON object")

    def pct(metric: str) -> Percentiles:
        return Percentiles(*(_num(raw, f"p{p}_{metric}_ms", path) for p in (50, 90, 99)))

    completed = int(_num(raw, "completed", path))
    ttft, itl, e2e = (pct(m) if completed else NONE for m in ("ttft", "itl", "e2el"))
    return [LoadPointRow(system, "vllm-bench", workload, _vllm_load(raw, path), completed,
                         int(raw.get("failed", 0) or 0), _num(raw, "request_throughput", path),
                         _num(raw, "output_throughput", path), ttft, itl, e2e, str(path))]


# ---- inference-perf ---------------------------------------------------------------------------
_STAGE = re.compile(r"stage_(\d+)_lifecycle_metrics\.json$")


def _ip_pct(summary: object, key: str, where: Path) -> Percentiles:
    base = f"successes.latency.{key}"
    return Percentiles(*(_num(summary, f"{base}.{p}", where, 1000.0)
                         for p in ("median", "p90", "p99")))


def _ip_load(summary: object, where: Path) -> str:
    load = _get(summary, "load_summary", where)
    assert isinstance(load, dict)
    if load.get("concurrency") is not None:
        return f"concurrency={int(load['concurrency'])}"
    if load.get("requested_rate") is not None:
        return f"rate={float(load['requested_rate']):g}"
    raise ReportError(f"{where}: load_summary has neither 'concurrency' nor 'requested_rate'")


def parse_inference_perf(report_dir: Path, system: str, workload: str,
                         load: str | None = None) -> list[LoadPointRow]:
    """One row per stage report, in stage order. `load` names the load point instead of the
    report (a trace replay's stage carries a placeholder rate)."""
    files = sorted(((int(m.group(1)), p) for p in Path(report_dir).glob("*lifecycle_metrics.json")
                    if (m := _STAGE.search(p.name)) and "session" not in p.name),
                   key=lambda t: t[0])
    if not files:
        raise ReportError(f"{report_dir}: no stage_<i>_lifecycle_metrics.json report in it")
    rows = []
    for _, path in files:
        s = _load_json(path)
        ok = int(_num(s, "successes.count", path))
        ttft, itl, e2e = (_ip_pct(s, k, path) if ok else NONE for k in (
            "time_to_first_token", "inter_token_latency", "request_latency"))
        rows.append(LoadPointRow(
            system, "inference-perf", workload, load or _ip_load(s, path), ok,
            int(_num(s, "failures.count", path)),
            _num(s, "successes.throughput.requests_per_sec", path),
            _num(s, "successes.throughput.output_tokens_per_sec", path), ttft, itl, e2e,
            str(path)))
    return rows


# ---- guidellm ---------------------------------------------------------------------------------
def _gl_load(bench: dict, where: Path) -> str:
    strategy = _get(bench, "config.strategy", where)
    assert isinstance(strategy, dict)
    kind = strategy.get("type_")
    if kind == "concurrent":
        return f"concurrency={int(_num(strategy, 'streams', where))}"
    if kind == "synchronous":
        return "concurrency=1"
    if kind in ("constant", "poisson"):
        return f"rate={_num(strategy, 'rate', where):g}"
    raise ReportError(f"{where}: guidellm strategy {kind!r} is not a load point this reads")


def _gl_pct(metrics: object, key: str, where: Path, scale: float = 1.0) -> Percentiles:
    return Percentiles(*(_num(metrics, f"{key}.successful.percentiles.p{p}", where, scale)
                         for p in (50, 90, 99)))


def parse_guidellm(path: Path, system: str, workload: str) -> list[LoadPointRow]:
    """One row per benchmark in the report (one per load point), in run order. Rates are
    guidellm's own means over the benchmark (what its console table prints)."""
    raw = _load_json(path)
    benches = _get(raw, "benchmarks", path)
    if not isinstance(benches, list) or not benches:
        raise ReportError(f"{path}: the report has no benchmarks")
    rows = []
    for b in benches:
        m = _get(b, "metrics", path)
        ok = int(_num(m, "request_totals.successful", path))
        ttft, itl, e2e = (_gl_pct(m, k, path, scale) if ok else NONE for k, scale in (
            ("time_to_first_token_ms", 1.0), ("inter_token_latency_ms", 1.0),
            ("request_latency", 1000.0)))
        rows.append(LoadPointRow(
            system, "guidellm", workload, _gl_load(b, path), ok,
            int(_num(m, "request_totals.errored", path) + _num(m, "request_totals.incomplete", path)),
            _num(m, "requests_per_second.successful.mean", path),
            _num(m, "output_tokens_per_second.successful.mean", path), ttft, itl, e2e, str(path)))
    return rows
