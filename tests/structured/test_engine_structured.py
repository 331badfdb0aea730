"""Structured outputs on the real engine and the built-in SmolLM2 (issue 15): valid by
construction at temperature 1 for 20 JSON schemas in one batch, through preemption by recompute
and by swap; n > 1 samples each with a matcher; the mask reaches logprobs; a failed compile ends
only its request; unconstrained steps never touch xgrammar."""
from __future__ import annotations

import dataclasses
import itertools
import json

import jsonschema
import pytest
import torch
from kvmesh.common.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.structured.spec import StructuredOutputSpec as Spec

S = {"type": "string", "maxLength": 8}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0,
                                                         "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": S}, "required": ["ok"]},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
     "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": 0, "maximum": 1},
        "y": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["x", "y"]}},
     "required": ["point"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0,
                                                           "maximum": 9}, {"type": "null"}]}},
     "required": ["value"]},
    {"type": "object", "properties": {"id": {"type": "integer", "exclusiveMinimum": 0,
                                             "exclusiveMaximum": 1000},
                                      "kind": {"const": "user"}}, "required": ["id", "kind"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
        "type": "object", "properties": {"c": {"type": "integer", "minimum": 1, "maximum": 3}},
        "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": S, "qty": {"type": "integer", "minimum": 1,
                                                           "maximum": 9}},
        "required": ["sku", "qty"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"size": {"enum": ["S", "M", "L", 1, 2, None]}},
     "required": ["size"]},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0.5,
                                                "maximum": 99.5}}, "required": ["price"]},
    {"type": "object", "properties": {"uid": {"type": "string", "format": "uuid"}},
     "required": ["uid"]},
    {"type": "object", "properties": {"day": {"type": "string", "format": "date"}},
     "required": ["day"]},
    {"type": "object", "properties": {"pair": {"type": "array", "prefixItems": [
        {"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["x", "y"]}],
        "items": False}}, "required": ["pair"]},
    {"type": "object", "properties": {"shape": {"anyOf": [
        {"type": "object", "properties": {"r": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["r"]},
        {"type": "object", "properties": {"w": {"type": "integer", "minimum": 1, "maximum": 9},
                                          "h": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["w", "h"]}]}}, "required": ["shape"]},
    {"$defs": {"leaf": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                               "maximum": 5}}, "required": ["n"]}},
     "type": "object", "properties": {"left": {"$ref": "#/$defs/leaf"},
                                      "right": {"$ref": "#/$defs/leaf"}},
     "required": ["left", "right"]},
    {"type": "object", "properties": {"word": {"type": "string", "minLength": 2, "maxLength": 5},
                                      "count": {"type": "integer", "minimum": 0, "maximum": 50}},
     "required": ["word", "count"]},
    {"type": "object", "properties": {"flags": {"type": "array", "items": {"type": "boolean"},
                                                "minItems": 2, "maxItems": 2},
                                      "label": {"type": ["string", "null"], "maxLength": 6}},
     "required": ["flags", "label"]},
]


@pytest.fixture(scope="module")
def engine(smollm):
    torch.set_num_threads(1)
    # NOTE: 20 blocks of 16 tokens for 20 requests of ~40 prompt + up to 60 output tokens:
    # the batch cannot fit at once, so requests are preempted and their matchers must survive
    cfg = EngineConfig(dtype="float32", device="cpu", num_kv_blocks=20, max_num_seqs=24,
                       max_model_len=256, preemption_mode="recompute", swap_space=0.05)
    return LLMEngine(cfg, loaded=smollm)


def run(engine, requests: dict[str, tuple[str, SamplingParams]]):
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    final, preempted = {}, {"recompute": 0, "swap": 0}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        preempted["recompute"] += engine.last_stats.num_preempted_recompute
        preempted["swap"] += engine.last_stats.num_preempted_swap
    assert engine.kv_manager.usage == 0.0           # every block back
    return final, preempted


def chat(engine, text: str) -> str:
    return engine.tokenizer.render_chat([{"role": "user", "content": text}])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_twenty_schemas_at_temperature_one_are_valid_every_time(engine, mode):
    # NOTE: the scheduler reads the mode from its config at each preemption
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, preemption_mode=mode)
    schemas = SCHEMAS if mode == "recompute" else SCHEMAS[::2]
    # ~55-token prompts (4 blocks): 5 fit at once, and each needs a 5th block at 64 tokens
    ask = "Reply with one JSON value that matches the schema you are given, and nothing else."
    reqs = {f"s{i}": (chat(engine, ask),
                      SamplingParams(temperature=1.0, max_tokens=60, seed=100 + i,
                                     structured_outputs=Spec.json_schema(schema)))
            for i, schema in enumerate(schemas)}
    final, preempted = run(engine, reqs)
    for i, schema in enumerate(schemas):
        (c,) = final[f"s{i}"].outputs
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    assert preempted[mode] > 0, preempted             # the matchers survived preemption


def test_n_samples_each_follow_the_grammar_and_logprobs_see_the_mask(engine):
    spec = Spec.choice(["yes", "no", "maybe"])
    final, _ = run(engine, {
        "n": (chat(engine, "Yes or no?"), SamplingParams(n=3, temperature=1.0, seed=7,
                                                         max_tokens=8, structured_outputs=spec)),
        "lp": (chat(engine, "Yes or no?"), SamplingParams(temperature=0, max_tokens=8, logprobs=5,
                                                          structured_outputs=spec))})
    assert [c.text in ("yes", "no", "maybe") for c in final["n"].outputs] == [True] * 3
    assert [c.finish_reason for c in final["n"].outputs] == ["stop"] * 3
    (c,) = final["lp"].outputs
    first = c.logprobs[0]
    allowed = {engine.tokenizer.decode([t]) for t, lp in first.items() if lp.logprob > -1e30}
    # only first tokens of the three words are possible; the rest of the top 5 is -inf
    assert allowed and all(any(w.startswith(a) for w in ("yes", "no", "maybe")) for a in allowed)
    assert c.text in ("yes", "no", "maybe")


def test_a_failed_compile_aborts_only_its_request(engine, monkeypatch):
    pool = engine.structured.pool

    def broken(spec):
        raise RuntimeError("injected compile failure")
    monkeypatch.setattr(pool, "_compile", broken)
    final, _ = run(engine, {
        "bad": (chat(engine, "x"), SamplingParams(max_tokens=4, n=2,
                                                  structured_outputs=Spec.regex("never-cached"))),
        "good": (chat(engine, "x"), SamplingParams(max_tokens=4, temperature=0))})
    assert [c.finish_reason for c in final["bad"].outputs] == ["abort", "abort"]
    assert "injected compile failure" in final["bad"].outputs[0].stop_reason
    assert final["good"].outputs[0].finish_reason in ("stop", "length")
    assert len(engine.scheduler.requests) == 0


def test_unconstrained_steps_never_touch_xgrammar(smollm, monkeypatch):
    import xgrammar as xgr

    def forbidden(*a, **k):
        raise AssertionError("an unconstrained step allocated a bitmask")
    monkeypatch.setattr(xgr, "allocate_token_bitmask", forbidden)
    engine = LLMEngine(EngineConfig(dtype="float32", device="cpu", num_kv_blocks=16,
                                    max_model_len=128), loaded=smollm)
    final, _ = run(engine, {"plain": ("Hello", SamplingParams(max_tokens=3, temperature=0))})
    assert len(final["plain"].outputs[0].token_ids) == 3
    assert engine.structured._pool is None            # no tokenizer tables, no threads


def test_offline_chat_with_tools_and_a_forced_call(smollm):
    from kvmesh.api.tool_parsers import HermesToolParser
    from kvmesh.engine.llm import LLM
    llm = LLM.__new__(LLM)               # NOTE: the shared loaded model, not a second load
    llm.engine = LLMEngine(EngineConfig(dtype="float32", device="cpu", num_kv_blocks=48,
                                        max_model_len=512), loaded=smollm)
    llm._ids = itertools.count()
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"word": {"type": "string", "maxLength": 8}},
        "required": ["word"]}}}]
    parser = HermesToolParser()
    (out,) = llm.chat([{"role": "user", "content": "Look up 'tea'."}],
                      SamplingParams(temperature=1.0, seed=3, max_tokens=40,
                                     structured_outputs=parser.constrained(tools, False)),
                      tools=tools)
    (call,) = parser.extract(out.outputs[0].text).calls
    assert call.name == "lookup" and isinstance(json.loads(call.arguments)["word"], str)
    assert out.outputs[0].finish_reason == "stop"


def test_a_constrained_request_batched_with_embeddings_keeps_its_mask_rows(engine):
    # NOTE: an embeddings request reaches its last prompt token in the same step as the
    # constrained request's sampling; the runner gives it no logits row, so neither may the mask
    from kvmesh.engine.pooling_params import PoolingParams
    proc = engine.input_processor
    spec = Spec.choice(["yes", "no"])
    engine.add_request(proc.process("c0", chat(engine, "Yes or no?"),
                                    SamplingParams(temperature=1.0, max_tokens=5, seed=1,
                                                   structured_outputs=spec)))
    for i in range(2):
        engine.add_request(proc.process(f"e{i}", f"embed this text number {i}",
                                        SamplingParams(max_tokens=1, temperature=0.0),
                                        pooling=PoolingParams("last")))
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert final["c0"].outputs[0].text in ("yes", "no")
    assert final["c0"].outputs[0].finish_reason == "stop"
    for i in range(2):
        emb = final[f"e{i}"].embedding
        assert emb is not None and len(emb) == engine.loaded.config.hidden_size
        assert abs(sum(x * x for x in emb) - 1.0) < 1e-4
    assert engine.kv_manager.usage == 0.0
