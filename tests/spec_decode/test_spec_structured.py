"""Speculative decoding for structured-output requests: prompt-lookup drafts cut at the first
token the grammar refuses, a mask at every drafted position, the matcher advanced by the tokens
the request really gets; greedy output token-identical to decoding without speculation, and
always valid."""
from __future__ import annotations

import json
import re
import time

import jsonschema
import torch
import xgrammar as xgr

from kvmesh.common.config import EngineConfig
from kvmesh.common.speculative_config import SpeculativeConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.request import Request
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.spec_decode.speculator import Speculator
from kvmesh.engine.spec_decode.tokens import PendingDrafts
from kvmesh.engine.structured.manager import StructuredOutputManager
from kvmesh.engine.structured.spec import StructuredOutputSpec as Spec

from .conftest import json_ids, run_engine

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
SCHEMA = {"type": "object", "required": ["a"], "properties": {"a": {
    "type": "array", "maxItems": 8, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}
REGEX = "(cd|e)+f"
EOS = 2


def _requests() -> list[tuple]:
    def params(spec: Spec) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=spec)
    return [("json-copy", json_ids('{"a":[3,4,3,4,3,4]}{"a":[3,4'), params(Spec.json_schema(SCHEMA))),
            ("json-free", json_ids("abab"), params(Spec.json_schema(SCHEMA))),
            ("regex", json_ids("cdcdgcdcd"), params(Spec.regex(REGEX)))]


def test_greedy_structured_output_is_identical_and_valid_with_speculation(tiny_json):
    path, loaded = tiny_json
    base = run_engine(LLMEngine(EngineConfig(num_kv_blocks=64), loaded=loaded), _requests())
    spec = run_engine(LLMEngine(EngineConfig(num_kv_blocks=64, speculative_config=NGRAM),
                                loaded=loaded), _requests())
    assert {k: v[0].token_ids for k, v in spec.outputs.items()} == \
        {k: v[0].token_ids for k, v in base.outputs.items()}
    # the constrained requests speculated; drafts were both accepted and rejected
    assert spec.drafts > 0 and 0 < spec.accepted < spec.draft_tokens, spec
    for rid in ("json-copy", "json-free"):
        out = spec.outputs[rid][0]
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert re.fullmatch(REGEX, spec.outputs["regex"][0].text)


def _grammar(spec: Spec, loaded) -> Request:
    manager = StructuredOutputManager(loaded.tokenizer.hf, loaded.config.vocab_size, (EOS,))
    req = Request("r", json_ids("cdcd"), SamplingParams(max_tokens=100, structured_outputs=spec),
                  0.0, max_model_len=256)
    manager.attach("r", [req], spec)
    deadline = time.monotonic() + 30
    while not req.grammar.ready and time.monotonic() < deadline:
        time.sleep(0.01)
    assert req.grammar.ready and req.grammar.error is None
    return req


def _mask(req: Request, vocab: int) -> torch.Tensor:
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    req.grammar.fill_bitmask(bitmask, 0)
    return bitmask[0].clone()


def test_drafts_end_before_the_first_token_the_grammar_refuses(tiny_json):
    path, loaded = tiny_json
    vocab = loaded.config.vocab_size
    req = _grammar(Spec.regex("(cd)+e"), loaded)
    assert req.grammar.accept(json_ids("c")[0])
    before = _mask(req, vocab)
    c, d, e, g = json_ids("cdeg")
    assert req.grammar.valid_prefix([d, c, g, c]) == 2          # g is refused
    assert req.grammar.valid_prefix([c]) == 0                   # c after c is refused
    # e ends the grammar: the stop token after it is left for the target (no mask after an end)
    assert req.grammar.valid_prefix([d, e, EOS]) == 2
    assert torch.equal(_mask(req, vocab), before)               # the matcher did not move
    # the Speculator cuts prompt lookup's drafts the same way: [d, c] follow "cdc" in "cdcdc"
    req.all_token_ids.append(c)
    spec = Speculator(SpeculativeConfig("ngram", 3, 1, 3))
    assert spec.propose(req, budget=8) == [d, c]
    req.all_token_ids[:] = json_ids("cdgcdc")                   # lookup now proposes d, g, c
    assert spec.propose(req, budget=8) == [d]
    # a draft model proposes after scheduling: placeholders, chosen under the grammar later
    pending = Speculator(SpeculativeConfig("draft_model", 3, model="/d")).propose(req, 8)
    assert isinstance(pending, PendingDrafts) and pending == [0, 0, 0]


def test_each_drafted_position_gets_the_mask_after_the_drafts_before_it(tiny_json):
    path, loaded = tiny_json
    vocab = loaded.config.vocab_size
    req = _grammar(Spec.json_schema(SCHEMA), loaded)
    drafts = json_ids('{"a":')
    masks = xgr.allocate_token_bitmask(2 + len(drafts), vocab)
    req.grammar.fill_draft_bitmasks(masks, 1, drafts)
    expected = []
    for token in drafts:                 # the same masks, one accepted token at a time
        expected.append(_mask(req, vocab))
        assert req.grammar.accept(token)
    expected.append(_mask(req, vocab))
    assert torch.equal(masks[1:], torch.stack(expected))
    assert not torch.equal(expected[0], expected[-1])
    assert torch.equal(masks[0], torch.full_like(masks[0], -1))    # rows it was not given


def test_a_verified_run_with_a_refused_token_is_reported_after_its_valid_part(tiny_json):
    """Fault injection: a run the masks should have made impossible (d then g after "c")."""
    _, loaded = tiny_json
    vocab = loaded.config.vocab_size
    manager = StructuredOutputManager(loaded.tokenizer.hf, vocab, (EOS,))
    req = _grammar(Spec.regex("(cd)+e"), loaded)
    c, d, e, g = json_ids("cdeg")
    req.output_token_ids += [c, d, c]
    assert manager.accept([req], {"r": 3}) == []                # the whole run, in order
    req.output_token_ids += [d, g]
    assert manager.accept([req], {"r": 2}) == [req]
    # the matcher stands after "cdcd": d was accepted, g was not
    assert [req.grammar.valid_prefix([t]) for t in (c, d, e, g)] == [1, 0, 1, 0]
