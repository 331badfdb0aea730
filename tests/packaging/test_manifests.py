"""manifests/: the chart as plain YAML (kept in sync), every object valid, examples valid."""
from __future__ import annotations

from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvmesh.operator.schema import crd_manifest

from .render import MANIFESTS, plain_manifests

K8S_VERSION = "1.32.0"


def test_plain_manifests_match_the_chart() -> None:
    for name, text in plain_manifests().items():
        assert (MANIFESTS / name).read_text() == text, \
            f"manifests/{name} is stale: run .venv/bin/python tests/packaging/render.py"


@pytest.mark.parametrize("name", ["crd.yaml", "operator.yaml", "rbac.yaml"])
def test_every_manifest_is_valid_kubernetes(name: str) -> None:
    docs = [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d]
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_operator_manifest_contents() -> None:
    docs = [d for d in yaml.safe_load_all((MANIFESTS / "operator.yaml").read_text()) if d]
    assert [(d["kind"], d["metadata"]["name"]) for d in docs] == [
        ("Namespace", "kvmesh-system"), ("Deployment", "kvmesh-operator"), ("ServiceAccount", "kvmesh")]
    assert "helm.sh/chart" not in str(docs)


@pytest.mark.parametrize("path", sorted((MANIFESTS / "examples").glob("*.yaml")), ids=lambda p: Path(p).name)
def test_examples_match_the_crd_schema(path: Path) -> None:
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.Draft4Validator(schema).validate(yaml.safe_load(path.read_text()))
