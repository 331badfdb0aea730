"""The output stage's work per step is O(new tokens): step outputs carry deltas, and the
cumulative result (text, token ids, logprobs) is built once, on the final output."""
from __future__ import annotations

from kvmesh.common.config import EngineConfig
from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling_params import SamplingParams

NEW = 24


def test_step_outputs_stay_the_same_size_as_the_output_grows(smollm, monkeypatch):
    joins = []
    full_text = IncrementalDetokenizer.output_text
    monkeypatch.setattr(IncrementalDetokenizer, "output_text",
                        property(lambda self: joins.append(1) or full_text.fget(self)))
    engine = LLMEngine(EngineConfig(num_kv_blocks=32, max_model_len=256), loaded=smollm)
    engine.add_request("r", "Count from one to fifty: one, two,",
                       SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0, logprobs=2))
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    *steps, final = outs
    assert len(steps) == NEW - 1 and final.finished and not any(o.finished for o in steps)
    for out in steps:
        (c,) = out.outputs
        # what one step copies: one token, its logprobs, its text; nothing cumulative
        assert (len(c.delta_token_ids), len(c.delta_logprobs)) == (1, 1)
        assert (c.token_ids, c.logprobs, c.text) == ([], [], "")
        assert len(c.delta_text) <= 16
    assert joins == [1]                                  # the full text is joined once, at the end
    (c,) = final.outputs
    deltas = [o.outputs[0] for o in outs]
    assert c.token_ids == [t for d in deltas for t in d.delta_token_ids] and len(c.token_ids) == NEW
    assert c.logprobs == [lp for d in deltas for lp in d.delta_logprobs]
    assert c.text == "".join(d.delta_text for d in deltas) and c.text
    assert c.finish_reason == "length"
