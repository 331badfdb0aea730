"""The CRD's CEL rules (x-kubernetes-validations) evaluated with cel-python the way the API server
runs them: on the defaulted object, at the node that declares them, only where that node exists.
They must agree with the operator's own validator (`crd.parse`) on every good and bad example."""
from __future__ import annotations

from typing import Any, Iterator

import celpy
import pytest

from kvmesh.operator import crd

from .examples import load_example
from .test_crd import CROSS_FIELD, _apply_defaults, _schema

_ENV = celpy.Environment()


def _rules(schema: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], str, str]]:
    for r in schema.get("x-kubernetes-validations", []):
        yield path, r["rule"], r["message"]
    for key, prop in schema.get("properties", {}).items():
        yield from _rules(prop, (*path, key))


RULES = [(path, _ENV.program(_ENV.compile(rule)), message) for path, rule, message in _rules(_schema())]


def _node(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return None
        obj = obj[key]
    return obj


def failures(cr: dict[str, Any]) -> list[str]:
    """The messages of the rules the API server would reject `cr` with."""
    defaulted = _apply_defaults(_schema(), cr)
    out = []
    for path, program, message in RULES:
        node = _node(defaulted, path)
        if node is not None and not bool(program.evaluate({"self": celpy.json_to_cel(node)})):
            out.append(message)
    return out


def _cr(spec: dict[str, Any], name: str = "x") -> dict[str, Any]:
    return {"apiVersion": "kvmesh.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": "ns"}, "spec": spec}


def test_the_crd_declares_every_cross_field_rule() -> None:
    assert len(RULES) == 30


@pytest.mark.parametrize("spec", [
    load_example("minimal.yaml")["spec"],
    load_example("full.yaml")["spec"],
    load_example("vllm.yaml")["spec"],
    load_example("inference-pool.yaml")["spec"],
    {"model": {}, "gpu": {"count": 4}, "engine": {"tensorParallelSize": 2}},
    {"model": {}, "gpu": {"count": 0}, "engine": {"tensorParallelSize": 1}},
    {"model": {"source": "uri", "uri": "/m"}, "image": "vllm/vllm-cpu:v0.11.0", "gpu": {"count": 0},
     "engine": {"runtime": "vllm", "blockSize": 32}},
    {"model": {"source": "pvc", "pvc": {"claimName": "w"}, "tokenizer": "/models/tok"},
     "router": {"mode": "inference-pool"}},
    {"model": {"source": "uri", "uri": "/opt/models/m.gguf", "tokenizer": "/opt/models/tok"}},
    {"model": {}, "engine": {"maxNumSeqs": 64, "maxNumBatchedTokens": 64}},
    {"model": {}, "autoscaling": {"minReplicas": 2, "maxReplicas": 2}},
], ids=["minimal", "full", "vllm", "inference-pool", "tp-2-of-4", "tp-1-on-cpu", "vllm-cpu-block-32", "pool-tokenizer-on-pvc",
        "local-paths", "equal-seqs-and-tokens", "equal-min-max"])
def test_good_specs_pass_every_rule(spec: dict[str, Any]) -> None:
    crd.parse("x", "ns", spec)                              # the operator agrees
    assert failures(_cr(spec)) == []


@pytest.mark.parametrize(("spec", "problems"), CROSS_FIELD)
def test_bad_specs_fail_as_many_rules_as_the_operator_reports(spec: dict[str, Any],
                                                              problems: list[str]) -> None:
    assert len(failures(_cr(spec))) == len(problems) >= 1


def test_a_long_name_fails_the_name_rule_alone() -> None:
    (message,) = failures(_cr({"model": {}}, name="x" * 46))
    assert "45" in message
    assert failures(_cr({"model": {}}, name="x" * 45)) == []


def test_child_like_names_fail_the_suffix_rule_alone() -> None:
    (message,) = failures(_cr({"model": {}}, name="foo-engine"))
    assert "collide" in message
    assert failures(_cr({"model": {}}, name="foo-engines")) == []


def test_redis_url_schemes_are_limited_by_a_rule_too() -> None:
    assert failures(_cr({"model": {}, "redis": {"url": "unix:///run/redis.sock"}})) == [
        "redis.url must start with redis:// or rediss:// (no unix sockets or other schemes)"]
    assert failures(_cr({"model": {}, "redis": {"url": "rediss://r:6380/0"}})) == []


def test_every_rule_rejects_some_example() -> None:
    seen = {m for spec, _ in CROSS_FIELD for m in failures(_cr(spec))}
    seen |= set(failures(_cr({"model": {}}, name="x" * 46)))
    seen |= set(failures(_cr({"model": {}}, name="foo-redis")))
    seen |= set(failures(_cr({"model": {}, "redis": {"url": "unix:///run/redis.sock"}})))
    assert seen == {message for _, _, message in RULES}


def test_tensor_parallel_rules_name_the_problem() -> None:
    assert failures(_cr({"model": {}, "gpu": {"count": 4}, "engine": {"tensorParallelSize": 3}})) == [
        "engine.tensorParallelSize must divide gpu.count"]
    assert failures(_cr({"model": {}, "gpu": {"count": 2}, "engine": {"tensorParallelSize": 4}})) == [
        "engine.tensorParallelSize must divide gpu.count"]
    assert failures(_cr({"model": {}, "gpu": {"count": 0}, "engine": {"tensorParallelSize": 2}})) == [
        "engine.tensorParallelSize > 1 needs GPUs (gpu.count > 0)"]
    for count, size in ((8, 8), (8, 4), (8, 2), (8, 1), (1, 1), (6, 3)):
        assert failures(_cr({"model": {}, "gpu": {"count": count}, "engine": {"tensorParallelSize": size}})) == []


def test_vllm_runtime_needs_an_image_after_defaulting() -> None:
    """spec.image has no schema default: with runtime vllm the API server refuses a spec without one."""
    spec = {"model": {"source": "uri", "uri": "/m"}, "engine": {"runtime": "vllm"}}
    assert failures(_cr(spec)) == [
        "spec.image is required with engine.runtime vllm (a vLLM image, e.g. vllm/vllm-openai:v0.11.0)"]
    assert failures(_cr({**spec, "image": "vllm/vllm-openai:v0.11.0"})) == []
