"""spec.loraAdapters without a cluster: the engine flags it renders, the pod template it leaves
alone, the plan per pod, each adapter's status and AdaptersReady."""
from __future__ import annotations

import json
from typing import Any

import pytest

from kvmesh.operator import crd
from kvmesh.operator import lora as L
from kvmesh.operator import resources as R
from kvmesh.operator.crd import LoRAAdapterSpec as A

from .test_crd import _schema_errors

OWNER = R.Owner(name="x", uid="uid-1")
SQL, CHAT = A("sql", "s3://adapters/sql"), A("chat", "/opt/loras/chat")


def _svc(**spec: Any) -> crd.InferenceService:
    return crd.parse("x", "ns", {"model": {}, **spec})


def _engine(svc: crd.InferenceService) -> dict[str, Any]:
    return R.build_engine_deployment(svc, OWNER, 1)


def test_adapters_turn_lora_on_with_the_sizing_flags_in_the_engine_config() -> None:
    svc = _svc(engine={"maxLoras": 4, "maxLoraRank": 64, "maxCpuLoras": 8},
               loraAdapters=[{"name": "sql", "source": "s3://adapters/sql"}])
    config = R.engine_config(svc)
    assert {k: config[k] for k in ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")} == {
        "enable_lora": True, "max_loras": 4, "max_lora_rank": 64, "max_cpu_loras": 8}
    assert "sql" not in json.dumps(config)  # the adapters are loaded at run time, not configured
    assert svc.lora_adapters == (A("sql", "s3://adapters/sql"),)
    # without adapters nor enableLora: no LoRA key at all (the config hash of older specs stays)
    assert not [k for k in R.engine_config(_svc()) if "lora" in k]
    assert R.engine_config(_svc(engine={"enableLora": True}))["enable_lora"] is True


def test_the_engine_flags_are_accepted_by_kvmesh_serve(tmp_path: Any) -> None:
    from kvmesh.api.server import build_parser
    from kvmesh.common.config import config_file_defaults
    svc = _svc(engine={"maxLoras": 3, "maxCpuLoras": 5}, loraAdapters=[{"name": "sql", "source": "/a"}])
    (tmp_path / "engine.json").write_text(json.dumps(R.engine_config(svc)))
    defaults = config_file_defaults(build_parser(), str(tmp_path / "engine.json"))
    assert {k: defaults[k] for k in ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")} == {
        "enable_lora": True, "max_loras": 3, "max_lora_rank": 16, "max_cpu_loras": 5}


def test_changing_the_adapter_list_never_changes_the_pod_template() -> None:
    base = {"engine": {"enableLora": True}}
    specs = [base, {**base, "loraAdapters": [{"name": "sql", "source": "s3://adapters/sql"}]},
             {**base, "loraAdapters": [{"name": "chat", "source": "/opt/loras/chat"},
                                       {"name": "hf", "source": "hf://org/lora"}]}]
    templates = [_engine(_svc(**s))["spec"]["template"] for s in specs]
    assert templates[0] == templates[1] == templates[2]
    configs = [R.build_config_map(_svc(**s), OWNER) for s in specs]
    assert configs[0] == configs[1] == configs[2]
    # LoRA on: the model cache and the fetch variables are there for s3:// / hf:// adapters
    pod = templates[0]["spec"]
    engine = pod["containers"][0]
    assert {"name": "fetched-models", "emptyDir": {}} in pod["volumes"]
    assert {"name": "fetched-models", "mountPath": "/var/cache/kvmesh/models"} in engine["volumeMounts"]
    assert {"name": "KVMESH_MODEL_CACHE_DIR", "value": "/var/cache/kvmesh/models"} in engine["env"]
    assert "initContainers" not in pod  # the model itself is the image's: nothing to fetch first
    assert not [v for v in _engine(_svc())["spec"]["template"]["spec"]["volumes"] if v["name"] == "fetched-models"]


@pytest.mark.parametrize("name", ["-sql", "a b", "x/y", "", "a" * 129])
def test_bad_adapter_names_fail_the_schema(name: str) -> None:
    cr = {"apiVersion": "kvmesh.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": "x"},
          "spec": {"model": {}, "loraAdapters": [{"name": name, "source": "/a"}]}}
    assert len(_schema_errors(cr)) == 1
    with pytest.raises(crd.SpecError) as err:
        crd.parse("x", "ns", cr["spec"])
    assert err.value.problems[0].startswith("spec.loraAdapters[0].name ")


def test_an_adapter_needs_a_name_and_a_source() -> None:
    with pytest.raises(crd.SpecError) as err:
        crd.parse("x", "ns", {"model": {}, "loraAdapters": [{"name": "sql"}, {"source": "/a"}]})
    assert err.value.problems == ["spec.loraAdapters[0].source is required", "spec.loraAdapters[1].name is required"]


def test_plan_loads_what_is_missing_and_unloads_what_is_gone_or_moved() -> None:
    assert L.plan([SQL, CHAT], {}) == L.Plan((), (SQL, CHAT))
    assert L.plan([SQL, CHAT], {"sql": "s3://adapters/sql", "chat": "/opt/loras/chat"}) == L.Plan((), ())
    # removed from the spec, and moved to another source under the same name
    assert L.plan([SQL], {"old": "/x", "sql": "s3://adapters/sql-v1"}) == L.Plan(("old", "sql"), (SQL,))
    # refused a moment ago: not tried again yet
    assert L.plan([SQL, CHAT], {}, frozenset({"sql"})) == L.Plan((), (CHAT,))


def test_served_reads_the_adapters_of_v1_models() -> None:
    models = {"object": "list", "data": [
        {"id": "tiny", "object": "model", "root": "/m", "parent": None},
        {"id": "sql", "object": "model", "root": "s3://adapters/sql", "parent": "tiny"}]}
    assert L.served(models) == {"sql": "s3://adapters/sql"}


RANK = "LoRA adapter 'big': rank 32 exceeds --max-lora-rank 16; raise --max-lora-rank"


@pytest.mark.parametrize(("message", "reason"), [
    (RANK, "RankTooLarge"),
    ("LoRA adapter 'x': target module(s) embed_tokens not in the base model (its adaptable modules: q_proj)",
     "UnsupportedTarget"),
    ("LoRA adapter 'x': q_proj has lora_A [8, 32] and lora_B [64, 8], the base model needs [8, 64] and [64, 8] "
     "(an adapter for another base model?)", "BaseModelMismatch"),
    ("LoRA adapter 'x': no adapter_config.json in '/a' (a PEFT adapter directory)", "NotFound"),
    ("cannot fetch the lora adapter 'x': s3://b/x: no objects under the prefix", "FetchFailed"),
    ("LoRA adapter 'x': DoRA (use_dora) is not supported", "Refused"),
])
def test_the_engines_refusals_get_reason_names(message: str, reason: str) -> None:
    assert L.reason_of(message) == reason


def test_statuses_and_condition_name_each_failing_adapter() -> None:
    big = A("big", "/opt/loras/big")
    pods = [L.PodOutcome("x-engine-a", loaded={"sql": "s3://adapters/sql"}, errors={"big": RANK}),
            L.PodOutcome("x-engine-b", loaded={"sql": "s3://adapters/sql"}, errors={"big": RANK})]
    statuses = L.adapter_statuses([SQL, big], pods)
    assert statuses == [
        {"name": "sql", "source": "s3://adapters/sql", "pods": ["x-engine-a", "x-engine-b"], "ready": True,
         "reason": "Loaded"},
        {"name": "big", "source": "/opt/loras/big", "pods": [], "ready": False, "reason": "RankTooLarge",
         "message": f"x-engine-a: {RANK}; x-engine-b: {RANK}"}]
    assert L.adapters_condition(statuses, 2) == {
        "type": "AdaptersReady", "status": "False", "reason": "RankTooLarge",
        "message": f"big (RankTooLarge): x-engine-a: {RANK}; x-engine-b: {RANK}"}
    assert L.adapters_condition(statuses[:1], 2) == {
        "type": "AdaptersReady", "status": "True", "reason": "AllAdaptersLoaded",
        "message": "1 adapter(s) on 2 ready engine pod(s)"}


def test_an_unreachable_pod_or_no_pod_is_not_ready() -> None:
    pods = [L.PodOutcome("a", loaded={"sql": "s3://adapters/sql"}),
            L.PodOutcome("b", unreachable="cannot read http://10.0.0.2:8000/v1/models: HTTP 503")]
    (status,) = L.adapter_statuses([SQL], pods)
    assert status == {"name": "sql", "source": "s3://adapters/sql", "pods": ["a"], "ready": False,
                      "reason": "PodUnreachable", "message": "b: cannot read http://10.0.0.2:8000/v1/models: HTTP 503"}
    waiting = L.adapter_statuses([SQL], [])
    assert waiting == [{"name": "sql", "source": "s3://adapters/sql", "pods": [], "ready": False, "reason": "Loading"}]
    assert L.adapters_condition(waiting, 0)["reason"] == "AwaitingPods"
    assert L.adapters_condition([], 0) == {"type": "AdaptersReady", "status": "True", "reason": "NoAdapters",
                                           "message": "no adapter in spec.loraAdapters"}
    assert L.adapters_condition(waiting, 0, ("SecretUnreadable", "m")) == {
        "type": "AdaptersReady", "status": "False", "reason": "SecretUnreadable", "message": "m"}


def test_s3_adapters_of_a_model_in_the_image_get_the_models_endpoint_and_credentials() -> None:
    svc = _svc(model={"source": "uri", "uri": "/opt/models/m", "endpoint": "http://minio:9000",
                      "credentials": {"secretName": "s3"}},
               loraAdapters=[{"name": "sql", "source": "s3://adapters/sql"}])
    env = _engine(svc)["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "AWS_ENDPOINT_URL", "value": "http://minio:9000"} in env
    assert {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"secretKeyRef": {
        "name": "s3", "key": "AWS_ACCESS_KEY_ID", "optional": True}}} in env
    assert "initContainers" not in _engine(svc)["spec"]["template"]["spec"]
