"""`kvmesh operator` flags reach kopf.run, and the operator package stays free of torch and the engine."""
from __future__ import annotations

import subprocess
import sys
from typing import Any

import kopf
import pytest

from kvmesh.operator import main as operator_main


@pytest.mark.parametrize(("argv", "expected"), [
    ([], {"standalone": False, "clusterwide": True, "namespaces": [], "liveness_endpoint": None}),
    (["--namespace", "llm", "-n", "team-a", "--standalone", "--liveness", "http://0.0.0.0:8080/healthz"],
     {"standalone": True, "clusterwide": False, "namespaces": ["llm", "team-a"],
      "liveness_endpoint": "http://0.0.0.0:8080/healthz"}),
    (["--all-namespaces", "--verbose", "--resync-seconds", "5"],
     {"standalone": False, "clusterwide": True, "namespaces": [], "liveness_endpoint": None}),
])
def test_main_passes_flags_to_kopf(monkeypatch: pytest.MonkeyPatch, argv: list[str], expected: dict[str, Any]) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(kopf, "run", lambda **kw: seen.update(kw))
    monkeypatch.setattr(kopf, "configure", lambda **kw: seen.update(configure=kw))
    assert operator_main.main(argv) == 0
    registry = seen.pop("registry")
    assert isinstance(registry, kopf.OperatorRegistry)
    assert seen.pop("configure")["verbose"] is ("--verbose" in argv)
    assert seen == expected


def test_namespace_and_all_namespaces_exclude_each_other() -> None:
    with pytest.raises(SystemExit):
        operator_main.build_parser().parse_args(["--namespace", "a", "--all-namespaces"])


def test_operator_imports_neither_torch_nor_the_engine() -> None:
    code = ("import sys, kvmesh.operator.main, kvmesh.operator.handlers; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('kvmesh.engine')]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_operator_namespace_defaults_to_the_pods(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAMESPACE", "kvmesh-system")
    assert operator_main.build_parser().parse_args([]).operator_namespace == "kvmesh-system"
    assert operator_main.build_parser().parse_args(["--operator-namespace", "ops"]).operator_namespace == "ops"
    monkeypatch.delenv("POD_NAMESPACE")
    assert operator_main.build_parser().parse_args([]).operator_namespace is None


def test_watch_secrets_registers_the_secret_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    def handlers(argv: list[str]) -> list[str]:
        seen: dict[str, Any] = {}
        monkeypatch.setattr(kopf, "run", lambda **kw: seen.update(kw))
        monkeypatch.setattr(kopf, "configure", lambda **kw: None)
        operator_main.main(argv)
        return sorted(h.id for h in seen["registry"]._watching.get_all_handlers())
    assert handlers([]) == []
    assert handlers(["--watch-secrets"]) == ["redis-auth-watch"]
