"""The serving benchmark's outputs: results.json, summary.md and latency-vs-throughput plots."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from benchmarks.serving_reports import LoadPointRow

HEADER = ("| system | tool | workload | load | ok / failed | req/s | output tok/s | "
          "TTFT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) | e2e p50 / p90 / p99 (ms) |")


def _pct(p) -> str:
    return f"{p.p50:.1f} / {p.p90:.1f} / {p.p99:.1f}"


def format_table(rows: Sequence[LoadPointRow]) -> str:
    lines = [HEADER, "|---|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.system} | {r.tool} | {r.workload} | {r.load} | {r.completed} / "
                     f"{r.failed} | {r.request_per_s:.3f} | {r.output_tok_per_s:.1f} | "
                     f"{_pct(r.ttft_ms)} | {_pct(r.itl_ms)} | {_pct(r.e2e_ms)} |")
    return "\n".join(lines)


def format_summary(rows: Sequence[LoadPointRow], meta: dict, commands: Sequence[str]) -> str:
    head = [f"# Serving benchmark ({meta.get('started', '')})", "",
            f"Machine: {meta.get('cpu', '?')}; load average before "
            f"{_load(meta.get('loadavg_before'))}, after {_load(meta.get('loadavg_after'))}.",
            f"Settings: {json.dumps(meta.get('settings', {}), sort_keys=True)}", "",
            format_table(rows), "",
            "ITL: vllm-bench and inference-perf report gaps between streamed tokens; guidellm "
            "reports (e2e - TTFT) / (tokens - 1) per request.", ""]
    if meta.get("errors"):
        head += ["## Errors", "", *[f"- {e}" for e in meta["errors"]], ""]
    head += ["## Commands", "", "```", *commands, "```", ""]
    return "\n".join(head)


def _load(v) -> str:
    return "?" if not v else " / ".join(f"{x:.2f}" for x in v)


def write_results(rows: Sequence[LoadPointRow], meta: dict, commands: Sequence[str],
                  out: Path) -> None:
    (out / "results.json").write_text(json.dumps(
        {"meta": meta, "commands": list(commands), "rows": [asdict(r) for r in rows]}, indent=1))
    (out / "summary.md").write_text(format_summary(rows, meta, commands))


def plot(rows: Sequence[LoadPointRow], out: Path) -> list[Path]:
    """Per workload: TTFT p90, ITL p90 and e2e p90 against output tok/s, one line per
    (system, tool) in load order."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for workload in dict.fromkeys(r.workload for r in rows):
        group = [r for r in rows if r.workload == workload]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        for (system, tool) in dict.fromkeys((r.system, r.tool) for r in group):
            line = [r for r in group if (r.system, r.tool) == (system, tool)]
            xs = [r.output_tok_per_s for r in line]
            for ax, attr in zip(axes, ("ttft_ms", "itl_ms", "e2e_ms")):
                ax.plot(xs, [getattr(r, attr).p90 for r in line], marker="o",
                        label=f"{system} ({tool})")
        for ax, name in zip(axes, ("TTFT", "ITL", "e2e latency")):
            ax.set_xlabel("output tokens/s")
            ax.set_ylabel(f"{name} p90 (ms)")
            ax.set_title(f"{workload}: {name} p90 vs throughput")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        path = out / f"latency_vs_throughput_{workload}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
