"""No import in `kvmesh` runs up the layers drawn in docs/ARCHITECTURE.md ("floors: ...").

The check reads every module's AST, so imports inside functions and under TYPE_CHECKING count,
and so does `importlib.import_module("kvmesh....")` with a literal name."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# the installed package's folders (pyproject's package-dir); `kvmesh/__init__.py` and cli.py are
# the top floor's facade
PACKAGE_DIRS = {"kvmesh": ROOT / "services", "kvmesh.kernels": ROOT / "kernels",
                "kvmesh.operator": ROOT / "operator" / "kvmesh_operator"}
FACADE = {"kvmesh", "kvmesh.cli", "kvmesh.__main__"}


def read_floors(text: str) -> dict[str, int]:
    """{part: floor} from the one `floors: a → b, c → d` line of the architecture document."""
    lines = [ln for ln in text.splitlines() if ln.startswith("floors: ")]
    assert len(lines) == 1, "docs/ARCHITECTURE.md needs exactly one 'floors: ...' line"
    floors = {}
    for level, group in enumerate(lines[0].removeprefix("floors: ").split("→")):
        for part in group.split(","):
            floors[part.strip()] = level
    return floors


def module_name(path: Path) -> str:
    for pkg, base in sorted(PACKAGE_DIRS.items(), key=lambda kv: -len(str(kv[1]))):
        if path.is_relative_to(base):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            return ".".join([pkg, *parts])
    raise ValueError(path)


def part_of(module: str) -> str:
    """kvmesh.engine.scheduler -> engine; kvmesh.cli -> cli; kvmesh -> cli (the facade)."""
    if module in FACADE:
        return "cli"
    return module.split(".")[1]


def imported_modules(source: str) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", ""))
              == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            out.append((node.lineno, node.args[0].value))
    return [(n, m) for n, m in out if m == "kvmesh" or m.startswith("kvmesh.")]


def violations(module: str, source: str, floors: dict[str, int]) -> list[str]:
    here = part_of(module)
    bad = []
    for lineno, target in imported_modules(source):
        there = part_of(target)
        if there == here:
            continue
        if floors[there] >= floors[here]:
            bad.append(f"{module}:{lineno} imports {target} ({here} may import only floors "
                       f"below {floors[here]}; {there} is on floor {floors[there]})")
    return bad


def package_modules() -> list[tuple[str, Path]]:
    files = set()
    for base in PACKAGE_DIRS.values():
        files.update(base.rglob("*.py"))
    return sorted((module_name(f), f) for f in files)


FLOORS = read_floors((ROOT / "docs" / "ARCHITECTURE.md").read_text())


def test_every_part_of_the_package_is_on_a_floor():
    parts = {part_of(m) for m, _ in package_modules()}
    assert parts - set(FLOORS) == set(), "add the new part to the 'floors:' line of ARCHITECTURE.md"
    assert FLOORS == {"common": 0, "kernels": 1, "prompt": 1, "engine": 2, "index": 3, "api": 4,
                      "router": 4, "operator": 4, "cli": 5}


def test_no_import_runs_up_the_layers():
    bad = []
    for module, path in package_modules():
        bad += violations(module, path.read_text(), FLOORS)
    assert bad == []


@pytest.mark.parametrize("module,source,expected", [
    ("kvmesh.engine.block_pool", "from kvmesh.index.events import BlockStored\n",
     ["kvmesh.engine.block_pool:1 imports kvmesh.index.events (engine may import only floors "
      "below 2; index is on floor 3)"]),
    ("kvmesh.index.serve", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
     "    from kvmesh.api.metrics import EngineMetrics\n",
     ["kvmesh.index.serve:3 imports kvmesh.api.metrics (index may import only floors below 3; "
      "api is on floor 4)"]),
    ("kvmesh.common.hf_export", "def f():\n    from kvmesh.prompt.sources import cache_key\n",
     ["kvmesh.common.hf_export:2 imports kvmesh.prompt.sources (common may import only floors "
      "below 0; prompt is on floor 1)"]),
    ("kvmesh.kernels.ops", "import importlib\nm = importlib.import_module('kvmesh.prompt.x')\n",
     ["kvmesh.kernels.ops:2 imports kvmesh.prompt.x (kernels may import only floors below 1; "
      "prompt is on floor 1)"]),
    ("kvmesh.router.app", "import kvmesh.api.app\n",
     ["kvmesh.router.app:1 imports kvmesh.api.app (router may import only floors below 4; "
      "api is on floor 4)"]),
    ("kvmesh.api.app", "from kvmesh.engine.engine import LLMEngine\nimport kvmesh.common.config\n", []),
    ("kvmesh.cli", "from kvmesh.operator.main import main\n", []),
])
def test_the_check_catches_each_kind_of_upward_import(module, source, expected):
    assert violations(module, source, FLOORS) == expected


def test_the_floors_line_is_parsed_as_drawn():
    assert read_floors("x\nfloors: a → b, c → d\n") == {"a": 0, "b": 1, "c": 1, "d": 2}
    with pytest.raises(AssertionError, match="exactly one"):
        read_floors("no line here")
