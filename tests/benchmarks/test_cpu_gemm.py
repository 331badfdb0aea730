"""benchmarks/cpu_gemm.py runs end to end on a small model and prints one row per row count."""
from __future__ import annotations

from benchmarks import cpu_gemm


def test_prints_a_row_per_row_count_with_a_ratio(capsys):
    cpu_gemm.main(["--rows", "1,3", "--reps", "1", "--layers", "2", "--vocab", "512"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "3"]
    assert all(r.rstrip(" |").endswith("x") for r in rows)
    diff = float(out.split("on the probe: ")[1].split()[0])
    assert diff < 1e-4
