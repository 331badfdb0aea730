"""Pure parts of the load-scenario benchmark: priority rule, replay timing, per-request metrics,
percentiles and the seed-001 comparison table. No server, no network, no clock of its own.

`benchmarks/load_scenarios.py` drives the real run; the tests check this module with fake results
and a fake clock.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable, Sequence

from benchmarks.workload import CLASS_NAMES, WorkloadRequest

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestResult:
    scenario: str
    policy: str
    index: int                 # position in the scenario's request list (same for every policy)
    user_id: int
    length_class: int          # index into CLASS_NAMES
    priority: int              # what was sent in the body (lower is served first)
    prompt_len: int
    output_len: int            # requested (forced) output tokens
    arrival_s: float           # scheduled send time, seconds after the scenario started (scaled)
    sent_s: float              # actual send time, same origin: lateness = sent_s - arrival_s
    ttft_s: float | None       # first streamed chunk with text, from sent_s
    e2e_s: float | None        # last byte of the stream, from sent_s
    output_tokens: int         # usage.completion_tokens (0 on failure)
    error: str | None = None   # None: success

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Standard TPOT: mean time between output tokens after the first one."""
        return tpot(self.ttft_s, self.e2e_s, self.output_tokens)


# ------------------------------------------------------------------------------ request rules


def priority_for(length_class: int) -> int:
    """Shorter length class = higher priority (lower number): short 0 ... very_long 3.

    NOTE: the seed's priority scheduling ranks requests by expected execution time; the length
    class is what a client knows before sending, so it is the priority every policy receives
    (fcfs and sjf ignore it; priority and dynamic order by it).
    """
    if length_class < 0:
        raise ValueError(f"length_class must be >= 0, got {length_class}")
    return int(length_class)


def cap_requests(requests: Sequence[WorkloadRequest], max_requests: int | None) -> list[WorkloadRequest]:
    """The first `max_requests` by arrival: keeps the scenario's arrival rate, shortens its span."""
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {max_requests}")
    reqs = sorted(requests, key=lambda r: (r.arrival_s, r.user_id))
    return reqs if max_requests is None else reqs[:max_requests]


def send_offsets(requests: Sequence[WorkloadRequest], time_scale: float) -> list[float]:
    """Seconds after the scenario start at which each request is sent (arrivals / time_scale)."""
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    return [r.arrival_s / time_scale for r in requests]


async def replay(offsets: Sequence[float], send: Callable[[int, float], Awaitable[None]],
                 clock: Callable[[], float], sleep: Callable[[float], Awaitable[None]]) -> float:
    """Start `send(i, t0)` for every i at t0 + offsets[i]; wait for all; return t0.

    `clock` and `sleep` are injected so tests can drive it with a fake clock. A request due
    while the loop is late is started at once (never skipped, never reordered).
    """
    order = sorted(range(len(offsets)), key=lambda i: offsets[i])
    t0 = clock()
    tasks = []
    for i in order:
        delay = t0 + offsets[i] - clock()
        if delay > 0:
            await sleep(delay)
        tasks.append(asyncio.ensure_future(send(i, t0)))
        # NOTE: yield once so the request really starts now, not at the next sleep.
        await asyncio.sleep(0)
    if tasks:
        await asyncio.gather(*tasks)
    return t0


# ------------------------------------------------------------------------------ metrics


def tpot(ttft_s: float | None, e2e_s: float | None, output_tokens: int) -> float | None:
    """(e2e - TTFT) / (output tokens - 1); None when undefined (failure or a single token)."""
    if ttft_s is None or e2e_s is None or output_tokens < 2:
        return None
    return max(e2e_s - ttft_s, 0.0) / (output_tokens - 1)


def percentile(values: Iterable[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default), None for no values."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(slots=True)
class SummaryRow:
    scenario: str
    policy: str
    length_class: str          # a CLASS_NAMES entry, or "all"
    count: int                 # successful requests
    failed: int
    ttft: tuple                # (p50, p90, p99) seconds, None entries when no data
    tpot: tuple                # (p50, p90, p99) seconds
    e2e: tuple                 # (p50, p90, p99) seconds
    throughput_tps: float      # output tokens of these requests / wall time of the scenario run
    seed_tps: float | None     # mean of output_tokens / e2e per request: what seed 001 calls TPOT


def _pcts(values: list[float]) -> tuple:
    return tuple(percentile(values, q) for q in PERCENTILES)


def summarize_group(scenario: str, policy: str, label: str, results: Sequence[RequestResult],
                    wall_s: float) -> SummaryRow:
    ok = [r for r in results if r.ok]
    per_req = [r.output_tokens / r.e2e_s for r in ok if r.e2e_s]
    return SummaryRow(
        scenario, policy, label, len(ok), len(results) - len(ok),
        _pcts([r.ttft_s for r in ok]), _pcts([r.tpot_s for r in ok]), _pcts([r.e2e_s for r in ok]),
        sum(r.output_tokens for r in ok) / wall_s if wall_s > 0 else 0.0,
        sum(per_req) / len(per_req) if per_req else None)


def build_summary(results: Sequence[RequestResult], walls: dict[tuple[str, str], float]) -> list[SummaryRow]:
    """One row per (scenario, policy, length class present) plus an "all" row per run.

    `walls[(scenario, policy)]` is the run's wall time (first send to last byte): throughput of a
    class is its output tokens over the whole run, so class rows add up to the "all" row.
    """
    rows: list[SummaryRow] = []
    runs: dict[tuple[str, str], list[RequestResult]] = {}
    for r in results:
        runs.setdefault((r.scenario, r.policy), []).append(r)
    for (scenario, policy), rs in runs.items():
        wall = walls[(scenario, policy)]
        for c, name in enumerate(CLASS_NAMES):
            group = [r for r in rs if r.length_class == c]
            if group:
                rows.append(summarize_group(scenario, policy, name, group, wall))
        rows.append(summarize_group(scenario, policy, "all", rs, wall))
    return rows


def _fmt(t: tuple, scale: float, digits: int) -> str:
    return " / ".join("-" if v is None else f"{v * scale:.{digits}f}" for v in t)


def format_table(rows: Sequence[SummaryRow]) -> str:
    """The seed's comparison table, regenerated: Markdown, one line per row."""
    head = ("| scenario | policy | class | n | fail | TTFT s p50 / p90 / p99 | TPOT ms p50 / p90 / p99 "
            "| e2e s p50 / p90 / p99 | out tok/s | seed 'TPOT' tok/s |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        seed = "-" if r.seed_tps is None else f"{r.seed_tps:.1f}"
        name = f"**{r.length_class}**" if r.length_class == "all" else r.length_class
        lines.append(f"| {r.scenario} | {r.policy} | {name} | {r.count} | {r.failed} "
                     f"| {_fmt(r.ttft, 1, 2)} | {_fmt(r.tpot, 1000, 0)} | {_fmt(r.e2e, 1, 2)} "
                     f"| {r.throughput_tps:.1f} | {seed} |")
    return "\n".join(lines)


def format_runs(runs: Sequence[dict]) -> str:
    """One line per (scenario, policy) run: wall time, preemptions, how late the replay loop was."""
    lines = ["| scenario | policy | requests | wall s | preemptions | max send lateness s |",
             "|---|---|---|---|---|---|"]
    for r in runs:
        pre = "-" if r.get("preemptions") is None else f"{r['preemptions']:.0f}"
        lines.append(f"| {r['scenario']} | {r['policy']} | {r['requests']} | {r['wall_s']:.1f} "
                     f"| {pre} | {r['max_lateness_s']:.2f} |")
    return "\n".join(lines)
