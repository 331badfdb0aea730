"""`benchmarks/` is a top-level folder, not part of the installed `kvmesh` package."""
import sys
from pathlib import Path

# NOTE: pytest runs with --import-mode=importlib, which does not put the repository root on
# sys.path; the benchmark scripts are importable as `benchmarks.*` only from there.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
