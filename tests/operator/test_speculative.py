"""spec.engine.speculativeConfig: validated like `--speculative-config` (schema, CEL and the engine's own
validator), written into the kvmesh engines' config file and onto `vllm serve`'s command line."""
from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest

from kvmesh.api.server import build_parser
from kvmesh.common.config import config_file_defaults, engine_config_from_args
from kvmesh.common.speculative_config import SpeculativeConfig
from kvmesh.operator import crd
from kvmesh.operator import resources as R

from .test_crd import _schema_errors
from .test_runtimes import K8S_VERSION, OWNER, VLLM, _container

NGRAM = {"method": "ngram", "numSpeculativeTokens": 4, "promptLookupMax": 3, "disableByBatchSize": 8}


def _svc(spec: dict[str, Any]) -> crd.InferenceService:
    return crd.parse("qwen", "llm", spec)


def _cr(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "kvmesh.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "qwen", "namespace": "llm"}, "spec": spec}


def test_ngram_config_reaches_kvmesh_serve_through_the_config_file(tmp_path: Any) -> None:
    svc = _svc({"model": {}, "engine": {"speculativeConfig": NGRAM}})
    assert svc.engine.speculative_config == crd.SpeculativeSpec("ngram", 4, None, 3, None, 8)
    config = json.loads(R.build_config_map(svc, OWNER)["data"]["engine.json"])
    assert config["speculative_config"] == ('{"disable_by_batch_size":8,"method":"ngram",'
                                            '"num_speculative_tokens":4,"prompt_lookup_max":3}')
    # what `kvmesh serve --config engine.json` makes of it
    (tmp_path / "engine.json").write_text(json.dumps(config))
    parser = build_parser()
    parser.set_defaults(**config_file_defaults(parser, str(tmp_path / "engine.json")))
    engine = engine_config_from_args(parser.parse_args([]))
    assert engine.speculative_config == SpeculativeConfig("ngram", 4, 3, 3, None, 8)
    # a new speculative config is a new config hash (a rollout); none keeps the old one
    assert R.config_hash(svc) != R.config_hash(_svc({"model": {}}))
    assert "speculative_config" not in R.engine_config(_svc({"model": {}}))


def test_vllm_serve_gets_the_same_flag() -> None:
    draft = {"method": "draft_model", "numSpeculativeTokens": 3, "model": "/models/draft"}
    svc = _svc({**VLLM, "engine": {"runtime": "vllm", "speculativeConfig": draft}})
    dep = R.build_engine_deployment(svc, OWNER, 1)
    kubernetes_validate.validate(dep, K8S_VERSION, strict=True)
    args = _container(dep)["args"]
    at = args.index("--speculative-config")
    assert json.loads(args[at + 1]) == {"method": "draft_model", "num_speculative_tokens": 3,
                                        "model": "/models/draft"}
    # vLLM shards its draft itself: a two-GPU draft_model spec is fine with runtime vllm
    assert svc.engine.tensor_parallel_size == 2


@pytest.mark.parametrize(("speculative", "schema_error"), [
    ({"method": "eagle3", "numSpeculativeTokens": 2}, "'eagle3' is not one of ['ngram', 'draft_model']"),
    ({"method": "ngram", "numSpeculativeTokens": 0}, "0 is less than the minimum of 1"),
    ({"method": "ngram"}, "'numSpeculativeTokens' is a required property"),
    ({"method": "draft_model", "numSpeculativeTokens": 2, "model": "org/draft"},
     "'org/draft' does not match '^/'"),
    ({"method": "ngram", "numSpeculativeTokens": 2, "lookup": 3}, None),
])
def test_the_schema_and_the_operator_refuse_bad_fields(speculative: dict[str, Any], schema_error: str | None) -> None:
    spec = {"model": {}, "engine": {"speculativeConfig": speculative}}
    with pytest.raises(crd.SpecError) as err:
        _svc(spec)
    assert len(err.value.problems) == 1 and "spec.engine.speculativeConfig" in err.value.problems[0]
    if schema_error is not None:
        assert _schema_errors(_cr(spec)) == [schema_error]


def test_operator_messages_name_the_field() -> None:
    def problems(speculative: dict[str, Any], **engine: Any) -> list[str]:
        with pytest.raises(crd.SpecError) as err:
            _svc({"model": {}, "gpu": {"count": 2}, "engine": {"speculativeConfig": speculative, **engine}})
        return err.value.problems
    assert problems({"method": "ngram", "numSpeculativeTokens": 2, "promptLookupMin": 4, "promptLookupMax": 2},
                    tensorParallelSize=1) == [
        "spec.engine.speculativeConfig: prompt_lookup_min (4) must be <= prompt_lookup_max (2)"]
    assert problems({"method": "eagle3", "numSpeculativeTokens": 2}) == [
        "spec.engine.speculativeConfig.method must be one of ngram, draft_model, got 'eagle3'"]
    assert problems({"method": "draft_model", "numSpeculativeTokens": 2, "model": "/models/d"}) == [
        "spec.engine.speculativeConfig method draft_model needs tensorParallelSize 1 with runtime kvmesh (the "
        "engine runs the draft unsharded), got 2: set spec.engine.tensorParallelSize 1 or use method ngram"]
