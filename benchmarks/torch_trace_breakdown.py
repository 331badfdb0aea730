"""vLLM's engine step, by category, from the Chrome trace its torch profiler writes.

    python benchmarks/torch_trace_breakdown.py TRACE.json[.gz]

The trace comes from `offline_throughput.py --systems vllm --vllm-profile DIR` (vLLM's
`profiler_config` with the torch profiler, `VLLM_CUSTOM_SCOPES_FOR_PROFILING=1`): one file per
worker, recording the worker thread's ops and vLLM's scopes. The table has the rows of
`profile_engine.py`, so the two engines' steps can be read side by side:

    gemm              _C::onednn_mm (and aten mm/addmm/linear) inside the forward
    lm_head           the same ops inside "gpu_model_runner: postprocess" (compute_logits)
    attention         _C::cpu_attention_with_kv_cache and its vllm::unified_attention wrapper
    kv_write          _C::cpu_attn_reshape_and_cache and its vllm::unified_kv_cache_update wrapper
    compiled_fused    the self time of "## Call CompiledFxGraph": the C++ loops inductor
                      generated for everything else in the layers (RMSNorm, residual adds,
                      rotary embedding, SiLU*up, embedding lookup), which vLLM fuses and
                      profile_engine times as norm / rope / activation / forward_other
    forward_other     the rest of "gpu_model_runner: forward" (Python around the graph)
    runner_input      "gpu_model_runner: preprocess" (input ids, positions, attention metadata)
    sampling          "gpu_model_runner: sample"
    output            postprocess, bookkeep and ModelRunnerOutput, logits excluded
    step_other        the rest of the worker's step (the "execute_..." scope and what else the
                      worker runs before the next one)
    outside_step      the time between steps no worker event covers: the engine core's
                      scheduler, its output processing and the inter-process hand-off

Each event's self time (its duration less its traced children's) goes to the category of the
nearest enclosing event that has one, so the rows add up to the wall time from the first step's
start to the last event's end; events before the first step (a dummy run, the profiler's own)
are left out.
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass

STEP_PATTERN = re.compile(r"^execute_context_\d+\(\d+\)_generation_\d+\(\d+\)$")
GEMM_OPS = {"_C::onednn_mm", "_C::onednn_scaled_mm", "aten::mm", "aten::addmm", "aten::linear",
            "aten::matmul", "aten::bmm"}
NAMED = {
    "_C::cpu_attention_with_kv_cache": "attention",
    "vllm::unified_attention_with_output": "attention",
    "vllm::unified_attention": "attention",
    "_C::cpu_attn_reshape_and_cache": "kv_write",
    "vllm::unified_kv_cache_update": "kv_write",
    "## Call CompiledFxGraph None ##": "compiled_fused",
    "gpu_model_runner: preprocess": "runner_input",
    "gpu_model_runner: forward": "forward_other",
    "gpu_model_runner: sample": "sampling",
    "gpu_model_runner: postprocess": "output",
    "gpu_model_runner: bookkeep": "output",
    "gpu_model_runner: eplb": "output",
    "gpu_model_runner: ModelRunnerOutput": "output",
}
ROWS = ("gemm", "lm_head", "attention", "kv_write", "compiled_fused", "forward_other",
        "runner_input", "sampling", "output", "step_other", "outside_step")


_OUTSIDE = "<before the first step>"   # not in the table


@dataclass
class Breakdown:
    seconds: dict[str, float]   # per row of ROWS
    wall_s: float               # the first step's start to the last event's end
    step_names: Counter         # the steps' scope names (batch shapes), counted

    @property
    def steps(self) -> int:
        return sum(self.step_names.values())


def category(name: str, parent: str | None) -> str | None:
    """The row an event opens, or None when it inherits its parent's."""
    if STEP_PATTERN.match(name):
        return "step_other"
    if name in GEMM_OPS:
        return "lm_head" if parent == "output" else "gemm"
    return NAMED.get(name)


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    if not events:
        raise ValueError(f"{path}: no complete ('X') events: not a torch profiler trace?")
    # NOTE: the worker's thread is the one with the most events (the profiler adds a "Spans" row)
    busiest = Counter((e.get("pid"), e.get("tid")) for e in events).most_common(1)[0][0]
    return [e for e in events if (e.get("pid"), e.get("tid")) == busiest]


def breakdown(events: list[dict]) -> Breakdown:
    # NOTE: events on one thread nest; sorted by start (the longer first on a tie), a stack of
    # the open events gives each its parent. vLLM's worker samples in a call of its own after
    # the step's execute_model (its "sample" and "bookkeep" scopes sit between two "execute_"
    # scopes), so a step runs from one "execute_" scope to the next: the events between belong
    # to it, and what no event covers there is the engine core's turn (outside_step).
    events = sorted(events, key=lambda e: (e["ts"], -e["dur"]))
    seconds: dict[str, float] = defaultdict(float)
    stack: list[tuple[float, str | None, list[float]]] = []   # (end, category, [child time])
    names: Counter = Counter()
    first = last = None           # the first step's start; the latest end of a counted event
    covered = 0.0                 # time the counted top-level events take

    def close(end_before: float) -> None:
        while stack and stack[-1][0] <= end_before:
            _, cat, child = stack.pop()
            if cat is not None:
                seconds[cat] += child[1] - child[0]

    for e in events:
        start, dur = float(e["ts"]), float(e["dur"])
        close(start)
        if stack:
            parent = stack[-1][1]
            cat = parent if parent == _OUTSIDE else (category(e["name"], parent) or parent)
            stack[-1][2][0] += dur           # the parent's traced children
        else:
            if STEP_PATTERN.match(e["name"]):
                names[e["name"]] += 1
                first = start if first is None else first
            if first is None:
                cat = _OUTSIDE    # before the first step: a dummy run, the profiler's start
            else:
                cat = category(e["name"], None) or "step_other"
                covered += dur
                last = max(last or start, start + dur)
        stack.append((start + dur, cat, [0.0, dur]))
    close(float("inf"))
    seconds.pop(_OUTSIDE, None)
    if first is None:
        raise ValueError("no engine steps in the trace (scopes named execute_context_..._generation_...)")
    wall_us = last - first
    seconds["outside_step"] = wall_us - covered
    return Breakdown({row: seconds.get(row, 0.0) / 1e6 for row in ROWS}, wall_us / 1e6, names)


def print_table(b: Breakdown, title: str) -> None:
    print(f"# {title}: {b.steps} steps, {b.wall_s:.2f} s from the first step's start to the last event's end")
    print("| part | seconds | share | ms per step |")
    print("|---|---:|---:|---:|")
    for row in ROWS:
        sec = b.seconds[row]
        print(f"| {row} | {sec:.4f} | {100 * sec / b.wall_s:.1f}% | {1000 * sec / b.steps:.3f} |")
    print(f"| **step total** | {b.wall_s:.4f} | 100% | {1000 * b.wall_s / b.steps:.2f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace", help="a Chrome trace (.json or .json.gz) of vLLM's torch profiler")
    args = p.parse_args(argv)
    try:
        b = breakdown(load_events(args.trace))
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_table(b, args.trace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
