"""A decode step padded to a larger batch (the CUDA-graph sizes) gives the same tokens as the
unpadded step: padding rows write no KV and are never sampled. On CPU nothing captures, so the
runner's pad sizes are set directly, the stand-in for the sizes a GPU captures."""
from __future__ import annotations

from kvmesh.common.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling_params import SamplingParams

PROMPTS = ["Hello", "The capital of France is", "1, 2, 3, 4, 5,", "def add(a, b):",
           "Water boils at"]


def _run(smollm, pad_sizes):
    eng = LLMEngine(EngineConfig(max_model_len=256, num_kv_blocks=128, max_num_seqs=8), loaded=smollm)
    assert eng.runner.pad_sizes == [] and eng.runner.cuda_graphs is None   # CPU: no graphs
    eng.runner.pad_sizes = pad_sizes
    padded = []
    finish = eng.runner.input_batch.finish

    def spy(*args, **kw):
        step = finish(*args, **kw)
        padded.append(step.padded_size - step.num_tokens)
        return step

    eng.runner.input_batch.finish = spy
    for i, text in enumerate(PROMPTS):
        # NOTE: staggered lengths, so requests finish at different steps and batch sizes vary
        eng.add_request(f"r{i}", text, SamplingParams(max_tokens=6 + 3 * i, temperature=0,
                                                      ignore_eos=True, logprobs=2))
    out = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                c = o.outputs[0]
                out[o.request_id] = (c.token_ids, [sorted(lp) for lp in c.logprobs])
    return out, padded


def test_padding_changes_no_token(smollm):
    plain, none = _run(smollm, [])
    padded, pads = _run(smollm, [8])
    assert not any(none)
    assert sum(pads) > 0 and max(pads) == 7          # 1..5 sequences padded to 8
    assert padded == plain
