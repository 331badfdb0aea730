"""benchmarks/load_scenarios.py end to end at its smallest size: real `kvmesh serve` processes.

One run of the real driver (two policies, one scenario, five requests of at most 10 output
tokens, ~15 s on 2 CPU cores), shared by every test below; the tests then read what it wrote
under --out: results.json (raw per-request results), summary.md (the comparison table) and the
two PNG plots.
"""
from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from benchmarks.load_stats import (RequestResult, build_summary, cap_requests, format_table,
                                   priority_for)
from benchmarks.workload import CLASS_NAMES, generate_requests

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "load_scenarios.py"
POLICIES = ("fcfs", "sjf")
SCENARIO, SEED, SCALE, MAX_LEN, MAX_REQUESTS = "high", 3, 1600.0, 72, 5
# NOTE: with this seed and scale the first five "high" arrivals cover all four length classes
# with tiny requests (MAX_LEN >= 72: the driver's warm-up sends up to 64 + 8 tokens).
# (length_class, prompt_len, output_len) of those five, in arrival order.
EXPECTED_WORK = [(1, 2, 2), (2, 1, 1), (3, 7, 6), (3, 11, 10), (0, 1, 1)]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("load")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--scenarios", SCENARIO,
         "--policies", ",".join(POLICIES), "--seed", str(SEED), "--scale", str(SCALE),
         "--max-total-len", str(MAX_LEN), "--max-requests", str(MAX_REQUESTS),
         "--time-scale", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd="/")
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in out.glob("server-*.log"))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs}"
    data = json.loads((out / "results.json").read_text())
    return proc, out, data


def _results(data) -> list[RequestResult]:
    fields = RequestResult.__dataclass_fields__
    return [RequestResult(**{k: v for k, v in row.items() if k in fields}) for row in data["results"]]


def _table_rows(summary: str) -> list[list[str]]:
    """The comparison table's data rows (the first table of summary.md), cells stripped."""
    table = summary.split("\n\n")[0].splitlines()
    assert table[0].startswith("| scenario | policy | class |")
    return [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]


def _triple(cell: str) -> list[float]:
    return [float(x) for x in cell.split(" / ")]


# ------------------------------------------------------------------------------ the workload


def test_the_expected_deterministic_workload_was_sent(run):
    _, _, data = run
    work = cap_requests(generate_requests(SCENARIO, SEED, SCALE, MAX_LEN), MAX_REQUESTS)
    assert [(w.length_class, w.prompt_len, w.output_len) for w in work] == EXPECTED_WORK
    assert data["meta"]["counts"] == {SCENARIO: MAX_REQUESTS}
    for policy in POLICIES:
        rows = sorted((r for r in data["results"] if r["policy"] == policy), key=lambda r: r["index"])
        assert [r["index"] for r in rows] == list(range(MAX_REQUESTS))
        assert [(r["length_class"], r["prompt_len"], r["output_len"]) for r in rows] == EXPECTED_WORK
        assert [r["priority"] for r in rows] == [priority_for(c) for c, _, _ in EXPECTED_WORK]
        assert [r["arrival_s"] for r in rows] == pytest.approx([w.arrival_s for w in work])
        assert all(r["scenario"] == SCENARIO for r in rows)


# ------------------------------------------------------------------------------ success


def test_every_request_succeeded_and_servers_exited_cleanly(run):
    _, _, data = run
    results = _results(data)
    sent = len(POLICIES) * MAX_REQUESTS
    assert len(results) == sent
    assert sum(r.ok for r in results) == sent, [r.error for r in results if not r.ok]
    for r in results:
        assert r.output_tokens == r.output_len          # forced length honoured exactly
        assert r.ttft_s is not None and r.e2e_s is not None
        assert 0 < r.ttft_s <= r.e2e_s
        assert r.sent_s >= r.arrival_s - 1e-6           # never sent early
    runs = data["meta"]["runs"]
    assert {r["policy"]: r["server_exit_code"] for r in runs if "server_exit_code" in r} == \
        {p: 0 for p in POLICIES}
    scen_runs = [r for r in runs if "scenario" in r]
    assert [(r["scenario"], r["policy"], r["requests"]) for r in scen_runs] == \
        [(SCENARIO, p, MAX_REQUESTS) for p in POLICIES]
    assert all(r["wall_s"] > 0 for r in scen_runs)


def test_csv_has_the_same_rows_as_json(run):
    _, out, data = run
    lines = (out / "results.csv").read_text().splitlines()
    assert lines[0].split(",")[:3] == ["scenario", "policy", "index"]
    assert len(lines) == 1 + len(data["results"])


# ------------------------------------------------------------------------------ the table


def test_table_has_a_row_per_policy_and_length_class(run):
    proc, out, data = run
    summary = (out / "summary.md").read_text()
    assert summary in proc.stdout                       # printed as well as written
    rows = _table_rows(summary)
    classes = sorted({c for c, _, _ in EXPECTED_WORK})
    expected = [(SCENARIO, p, name) for p in POLICIES
                for name in [CLASS_NAMES[c] for c in classes] + ["**all**"]]
    assert [tuple(r[:3]) for r in rows] == expected
    per_class = {CLASS_NAMES[c]: sum(w[0] == c for w in EXPECTED_WORK) for c in classes}
    for r in rows:
        n, fail = int(r[3]), int(r[4])
        assert fail == 0
        assert n == (MAX_REQUESTS if r[2] == "**all**" else per_class[r[2]])
    # the runs table: one line per (scenario, policy)
    assert sum(line.startswith(f"| {SCENARIO} | {p} | {MAX_REQUESTS} |")
               for p in POLICIES for line in summary.splitlines()) == len(POLICIES)
    assert "server exit codes: fcfs=0, sjf=0" in summary


def test_table_percentiles_are_ordered_and_ttft_below_e2e(run):
    _, out, _ = run
    for r in _table_rows((out / "summary.md").read_text()):
        ttft, e2e = _triple(r[5]), _triple(r[7])
        assert ttft[0] <= ttft[1] <= ttft[2], r
        assert e2e[0] <= e2e[1] <= e2e[2], r
        assert all(t <= e for t, e in zip(ttft, e2e)), r
        if r[6] != "- / - / -":                          # TPOT: none for 1-token outputs
            tpot = _triple(r[6])
            assert tpot[0] <= tpot[1] <= tpot[2], r
        assert float(r[8]) > 0                           # output tokens / s


def test_written_results_reproduce_the_table(run):
    """Percentiles recomputed from results.json: ordered, TTFT <= e2e, and the same table."""
    _, out, data = run
    results = _results(data)
    walls = {(r["scenario"], r["policy"]): r["wall_s"] for r in data["meta"]["runs"] if "scenario" in r}
    rows = build_summary(results, walls)
    for row in rows:
        assert row.failed == 0
        for metric in (row.ttft, row.e2e):
            assert None not in metric and metric[0] <= metric[1] <= metric[2], row
        assert all(t <= e for t, e in zip(row.ttft, row.e2e)), row
        if row.tpot[0] is not None:
            assert row.tpot[0] <= row.tpot[1] <= row.tpot[2], row
    summary = (out / "summary.md").read_text()
    assert summary.startswith(format_table(rows) + "\n\n")


# ------------------------------------------------------------------------------ the plots


def _png_size(data: bytes) -> tuple[int, int]:
    """Check the signature, the IHDR chunk and its CRC, and the IEND trailer; return (w, h)."""
    assert data[:8] == PNG_SIGNATURE
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    body = data[16:16 + length]
    (crc,) = struct.unpack(">I", data[16 + length:20 + length])
    assert crc == zlib.crc32(kind + body)
    assert data[-12:] == b"\x00\x00\x00\x00IEND\xaeB`\x82"
    return struct.unpack(">II", body[:8])


@pytest.mark.parametrize("name", ["ttft_p90.png", "e2e_cdf.png"])
def test_plots_are_valid_pngs(run, name):
    proc, out, _ = run
    path = out / name
    assert path.is_file()
    width, height = _png_size(path.read_bytes())
    assert width > 100 and height > 100
    assert re.search(rf"^wrote .*{re.escape(name)}$", proc.stdout, re.M)
