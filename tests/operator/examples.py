"""Example specs shared by the unit tests (the YAML examples live in manifests/examples/)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]


def load_example(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "manifests" / "examples" / name).read_text())
