"""vLLM's spec_decode metrics moved by a run whose acceptance is known by hand, and the
acceptance in the step span's attributes."""
from __future__ import annotations

import re

from kvmesh.api.metrics import EngineMetrics
from kvmesh.common.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.sched_output import SchedulerStats
from kvmesh.engine.tracing_hooks import step_attributes

from .conftest import run_engine

F, Q = 7, 9       # logit_bias +100 forces F whatever the tiny model says


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(vllm:spec_decode_\w+)\{([^}]*)\} (\S+)$', line)
        if m:
            pos = re.search(r'position="(\d+)"', m[2])
            out[m[1] + (f"[{pos[1]}]" if pos else "")] = float(m[3])
    return out


def test_metrics_count_drafts_and_acceptance_of_a_known_run(tiny_llama):
    _, loaded = tiny_llama
    k = 3
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, speculative_config={
        "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
        "prompt_lookup_max": 1}), loaded=loaded)
    metrics = EngineMetrics("m", engine)
    engine.add_observer(metrics)
    forced = dict(temperature=0.0, logit_bias={F: 100.0})
    # "all": every draft is F and accepted: after the prefill's token, two steps of k + 1
    # tokens reach max_tokens 1 + 2 (k + 1) = 9.
    # "none": the prompt F Q Q Q Q makes every lookup of F (1-grams only: its earliest
    # occurrence is the prompt's first token) propose Q Q Q, always rejected: one
    # token per step; drafts min(k, max_tokens - outputs - 1) at 1..4 outputs = 3 + 3 + 2 + 1.
    run = run_engine(engine, [("all", [F] * 8, SamplingParams(max_tokens=9, **forced)),
                              ("none", [F, Q, Q, Q, Q], SamplingParams(max_tokens=6, **forced))])
    assert run.outputs["all"][0].token_ids == [F] * 9
    assert run.outputs["none"][0].token_ids == [F] * 6
    assert run.deltas["all"] == [[1], [4], [4]]
    assert run.deltas["none"] == [[1]] * 6
    got = _samples(metrics.render().decode())
    assert got == {
        "vllm:spec_decode_num_drafts_total": 2 + 4,
        "vllm:spec_decode_num_draft_tokens_total": 2 * k + 9,
        "vllm:spec_decode_num_accepted_tokens_total": 2 * k,
        "vllm:spec_decode_num_accepted_tokens_per_pos_total[0]": 2,
        "vllm:spec_decode_num_accepted_tokens_per_pos_total[1]": 2,
        "vllm:spec_decode_num_accepted_tokens_per_pos_total[2]": 2,
    }


def test_no_spec_decode_metrics_without_speculation(tiny_llama):
    _, loaded = tiny_llama
    engine = LLMEngine(EngineConfig(num_kv_blocks=16), loaded=loaded)
    assert "spec_decode" not in EngineMetrics("m", engine).render().decode()


def test_step_span_carries_the_acceptance_rate():
    stats = SchedulerStats(spec_num_drafts=2, spec_num_draft_tokens=8,
                           spec_num_accepted_tokens=6, spec_num_accepted_per_pos=(2, 2, 1, 1))
    attrs = step_attributes(stats)
    assert attrs["kvmesh.spec_decode.acceptance_rate"] == 0.75
    assert attrs["kvmesh.sched.spec_num_accepted_per_pos"] == (2, 2, 1, 1)
    assert "kvmesh.spec_decode.acceptance_rate" not in step_attributes(SchedulerStats())
