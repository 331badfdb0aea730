"""benchmarks/routing.py runs as a script: its imports resolve and its options are checked up front."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "routing.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=120, cwd="/")


def test_help_lists_the_options():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    for opt in ("--overload", "--rate", "--strategies", "--quick"):
        assert opt in r.stdout


def test_bad_options_are_refused_before_anything_starts():
    r = run("--overload", "0")
    assert r.returncode == 2 and "--overload must be positive" in r.stderr
    r = run("--strategies", "kv-aware,fastest")
    assert r.returncode == 2 and "unknown strategies ['fastest']" in r.stderr
