"""Helpers: render the chart offline (helm-python-sdk) and build the plain manifests from it.

`manifests/operator.yaml` and `manifests/rbac.yaml` are the chart rendered with default values as
release `kvmesh` in namespace `kvmesh-system`, minus Helm's own labels. Regenerate them with
`.venv/bin/python tests/packaging/render.py`; a test keeps them in sync.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvmesh"
MANIFESTS = ROOT / "manifests"
RELEASE, NAMESPACE = "kvmesh", "kvmesh-system"
HELM_ONLY_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by")
HEADER = "# Generated from helm/kvmesh by `python tests/packaging/render.py`; do not edit by hand.\n"


def render(values: dict[str, Any] | None = None, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    """Every object the chart renders (templates only; CRDs come from crds/)."""
    import helm_python as helm

    with helm.Chart.load(CHART) as chart:
        files = chart.render(values=values, name=RELEASE, namespace=namespace, is_install=True)
    objects = []
    for path, text in sorted(files.items()):
        if path.endswith(".txt"):
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def _strip_helm(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_helm(v) for k, v in value.items()
                if not (k in HELM_ONLY_LABELS and isinstance(v, str))}
    if isinstance(value, list):
        return [_strip_helm(v) for v in value]
    return value


def plain_manifests() -> dict[str, str]:
    """File name → content of the generated plain manifests."""
    objects = [_strip_helm(o) for o in render()]
    rbac = [o for o in objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")]
    namespace = {"apiVersion": "v1", "kind": "Namespace",
                 "metadata": {"name": NAMESPACE, "labels": {"app.kubernetes.io/part-of": "kvmesh"}}}
    operator = [namespace] + [o for o in objects if o not in rbac]

    def dump(docs: list[dict[str, Any]]) -> str:
        return HEADER + "---\n".join(yaml.safe_dump(d, sort_keys=False, width=120) for d in docs)

    return {"operator.yaml": dump(operator), "rbac.yaml": dump(rbac)}


if __name__ == "__main__":
    for name, text in plain_manifests().items():
        (MANIFESTS / name).write_text(text)
        print(f"wrote manifests/{name}")
