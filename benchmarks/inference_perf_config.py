"""inference-perf configs: a sweep of load points, and the seeds' load scenarios as traces.

    sweep_config(target, workload, points, report_dir)     -> dict (one stage per load point)
    scenario_trace(requests)                               -> CSV text (Azure trace format)
    scenario_config(target, trace_path, report_dir)        -> dict (replays the trace)
    dump_yaml(config)                                      -> the file's text

The load scenarios (`low / medium / high`) come from ONE place: `workload.generate_requests`
with `load_scenarios.DEFAULTS` (scale, length cap, time scale, request cap), the same list
`load_scenarios.py` replays. inference-perf's `trace_replay` load sends each trace line at its
timestamp with exactly its prompt and output token counts, so the standard tool replays the
same arrivals and lengths (its prompts are random vocabulary tokens, not the corpus text).
"""
from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Sequence

from benchmarks.serving_tools import LoadPoint, Target, Workload
from benchmarks.workload import WorkloadRequest

# NOTE: any fixed origin works: the tool subtracts the first line's timestamp.
_TRACE_T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
TRACE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


def _distribution(w: Workload, mean: int, count: int) -> dict:
    lo, hi = w.bounds(mean)
    if not w.spread:
        return {"type": "fixed", "min": mean, "max": mean, "mean": mean, "std_dev": 0,
                "total_count": count}
    return {"type": "uniform", "min": lo, "max": hi, "mean": mean, "std_dev": w.stdev(mean),
            "total_count": count}


def _common(target: Target, report_dir: Path, seed: int) -> dict:
    return {
        "api": {"type": "completion", "streaming": True},
        "server": {"type": "vllm", "model_name": target.model, "base_url": target.url,
                   "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(target.tokenizer)},
        "storage": {"local_storage": {"path": str(report_dir)}},
        "report": {"request_lifecycle": {"summary": True, "per_stage": True,
                                         "percentiles": [50, 90, 99]},
                   "prometheus": None},
        "_seed": seed,
    }


def _finish(cfg: dict, load: dict) -> dict:
    seed = cfg.pop("_seed")
    # NOTE: one worker process: the client shares this machine's cores with the server, and a
    # worker holds up to 100 requests in flight, more than any point here asks for.
    cfg["load"] = {**load, "num_workers": 1, "base_seed": seed}
    return cfg


def sweep_config(target: Target, w: Workload, points: Sequence[LoadPoint], report_dir: Path,
                 seed: int = 0) -> dict:
    """One inference-perf run over `points`, in order: one stage each."""
    kinds = {p.kind for p in points}
    if len(kinds) != 1:
        raise ValueError("one inference-perf run takes points of one kind")
    count = max(p.num_requests for p in points)
    cfg = _common(target, report_dir, seed)
    cfg["data"] = {"type": "random",
                   "input_distribution": _distribution(w, w.prompt_tokens, count),
                   "output_distribution": _distribution(w, w.output_tokens, count)}
    if kinds == {"concurrency"}:
        stages = [{"num_requests": p.num_requests, "concurrency_level": int(p.value)}
                  for p in points]
        return _finish(cfg, {"type": "concurrent", "stages": stages})
    # a rate stage lasts as long as its requests take to arrive
    stages = [{"rate": p.value, "duration": max(1, math.ceil(p.num_requests / p.value))}
              for p in points]
    return _finish(cfg, {"type": "constant", "stages": stages})


def scenario_trace(requests: Sequence[WorkloadRequest], time_scale: float = 1.0) -> str:
    """The requests as an Azure-format trace: arrival (divided by time_scale), prompt, output."""
    lines = [TRACE_HEADER]
    for r in requests:
        t = _TRACE_T0 + timedelta(seconds=round(r.arrival_s / time_scale, 6))
        lines.append(f"{t.strftime('%Y-%m-%d %H:%M:%S.%f')},{r.prompt_len},{r.output_len}")
    return "\n".join(lines) + "\n"


def scenario_config(target: Target, trace: Path, report_dir: Path, seed: int = 0) -> dict:
    """Replay `trace` once: its timestamps set the arrivals, its lengths the requests."""
    cfg = _common(target, report_dir, seed)
    cfg["data"] = {"type": "random", "trace": {"file": str(trace), "format": "AzurePublicDataset"}}
    # NOTE: a trace_replay stage needs a rate and a duration, which the trace overrides (the
    # request count and times come from the file).
    return _finish(cfg, {"type": "trace_replay", "stages": [{"rate": 1, "duration": 1}],
                         "trace": {"file": str(trace), "format": "AzurePublicDataset"}})


def dump_yaml(cfg: dict) -> str:
    import yaml
    return yaml.safe_dump(cfg, sort_keys=False, default_flow_style=False)
