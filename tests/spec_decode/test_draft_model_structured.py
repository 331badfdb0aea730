"""A draft model for structured-output requests: each draft is the draft model's best token among
those the grammar allows after the drafts before it, and that mask is the target's at the
position; greedy output token-identical to decoding without speculation, and valid."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from kvmesh.common.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.spec_decode.draft_model import DraftModel
from kvmesh.engine.spec_decode.grammar_drafts import GrammarDrafts
from kvmesh.engine.structured.spec import StructuredOutputSpec as Spec

from .conftest import json_ids, run_engine
from .test_spec_structured import EOS, REGEX, SCHEMA, _grammar, _mask


def _allowed(masks: torch.Tensor, row: int, vocab: int) -> list[int]:
    logits = torch.zeros(1, vocab)
    xgr.apply_token_bitmask_inplace(logits, masks[row:row + 1], vocab_size=vocab)
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


@pytest.fixture(scope="module")
def json_draft_dir(tiny_json, tmp_path_factory):
    """The tiny JSON Llama with its second layer dropped (same embeddings and tokenizer)."""
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast
    path, _ = tiny_json
    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    out = tmp_path_factory.mktemp("draft") / "json-draft-1-layer"
    model.save_pretrained(out)
    PreTrainedTokenizerFast.from_pretrained(path).save_pretrained(out)
    return str(out)


def _requests(max_tokens: int = 40) -> list[tuple]:
    def params(spec: Spec | None) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=spec)
    return [("json", json_ids('{"a":[3,4'), params(Spec.json_schema(SCHEMA))),
            ("json-free", json_ids("abab"), params(Spec.json_schema(SCHEMA))),
            ("regex", json_ids("cdcdgcdcd"), params(Spec.regex(REGEX))),
            ("plain", json_ids("abcabc"), params(None))]


def test_greedy_structured_output_is_identical_and_valid_with_a_draft_model(tiny_json,
                                                                             json_draft_dir):
    _, loaded = tiny_json
    base = run_engine(LLMEngine(EngineConfig(num_kv_blocks=64), loaded=loaded), _requests())
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, speculative_config={
        "method": "draft_model", "model": json_draft_dir, "num_speculative_tokens": 3}),
        loaded=loaded)
    spec = run_engine(engine, _requests())
    assert {k: v[0].token_ids for k, v in spec.outputs.items()} == \
        {k: v[0].token_ids for k, v in base.outputs.items()}
    assert spec.drafts > 0 and 0 < spec.accepted < spec.draft_tokens, spec
    for rid in ("json", "json-free"):
        out = spec.outputs[rid][0]
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert re.fullmatch(REGEX, spec.outputs["regex"][0].text)


def test_a_walk_fills_the_masks_after_each_draft_and_leaves_the_matcher(tiny_json):
    _, loaded = tiny_json
    vocab = loaded.config.vocab_size
    req = _grammar(Spec.regex("(cd)+e"), loaded)
    c, d, e = json_ids("cde")
    before = _mask(req, vocab)
    masks = xgr.allocate_token_bitmask(6, vocab)
    req.grammar.fill_bitmask(masks, 1)                  # the scheduler fills the first row
    walk = GrammarDrafts(req.grammar, masks, 1)
    logits = torch.zeros(1, vocab)
    walk.mask(logits, 0)                                # only c is allowed first
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [c]
    for token in (c, d, e, EOS):
        walk.take(token)
    assert walk.ended                                   # the stop token after e ends the grammar
    logits = torch.zeros(1, vocab)
    walk.mask(logits, 4)                                # nothing masked after the end
    assert bool(torch.isfinite(logits).all())
    walk.finish()
    assert torch.equal(_mask(req, vocab), before)       # the matcher did not move
    expected = xgr.allocate_token_bitmask(6, vocab)
    req.grammar.fill_draft_bitmasks(expected, 1, [c, d, e])
    assert torch.equal(masks[:5], expected[:5])
    assert _allowed(masks, 4, vocab) == [EOS]           # after e: only the stop token
    # after the draft that ends the grammar: all allowed, as decoding without drafts would be
    assert torch.equal(masks[5], torch.full_like(masks[5], -1))
    assert req.grammar.valid_prefix([c, d, e, EOS]) == 3       # from the start again


def test_a_failing_draft_forward_leaves_the_matcher_where_it_was(tiny_json, json_draft_dir,
                                                                 monkeypatch):
    """Fault injection: the draft's second forward raises; the grammar walk is rolled back."""
    _, loaded = tiny_json
    vocab = loaded.config.vocab_size
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, speculative_config={
        "method": "draft_model", "model": json_draft_dir, "num_speculative_tokens": 3}),
        loaded=loaded)
    engine.add_request("r", json_ids('{"a":[3,4'), SamplingParams(
        temperature=0.0, max_tokens=20, structured_outputs=Spec.json_schema(SCHEMA)))
    while not engine.scheduler.requests["r"].output_token_ids:
        engine.step()
    req = engine.scheduler.requests["r"]
    before = _mask(req, vocab)
    calls = []
    real = DraftModel._forward

    def failing(self, *args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected draft forward failure")
        return real(self, *args)
    monkeypatch.setattr(DraftModel, "_forward", failing)
    with pytest.raises(RuntimeError, match="injected draft forward failure"):
        engine.step()
    assert len(calls) == 2
    assert torch.equal(_mask(req, vocab), before)
