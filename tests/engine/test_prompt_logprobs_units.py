"""The pieces without a model: logit_bias on a logits batch, the prompt-logprob spans of a chunk,
pooling across chunks (and a recompute), and the API's two prompt-logprob shapes."""
from __future__ import annotations

import torch
from kvmesh.api.prompt_logprobs import (
    echo_logprobs,
    join_logprobs,
    vllm_prompt_logprobs,
)
from kvmesh.engine.logit_bias import apply_logit_bias
from kvmesh.engine.pooling import PoolSpan, pool
from kvmesh.engine.pooling_params import PoolingParams
from kvmesh.engine.prompt_logprobs import logprob_entries, prompt_logprob_span
from kvmesh.engine.request import Logprob, Request
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.sched_output import ScheduledRequest


def test_logit_bias_adds_per_row_and_leaves_other_rows_alone():
    logits = torch.zeros(3, 5)
    params = [SamplingParams(logit_bias={1: 2.5, 4: -300}), SamplingParams(),
              SamplingParams(logit_bias={0: 100})]
    apply_logit_bias(logits, params)
    assert logits.tolist() == [[0, 2.5, 0, 0, -100], [0, 0, 0, 0, 0], [100, 0, 0, 0, 0]]


def _request(prompt: list[int], **sp) -> Request:
    return Request("r", prompt, SamplingParams(**sp), 0.0)


def test_a_chunk_scores_the_prompt_tokens_after_its_positions():
    req = _request([10, 11, 12, 13, 14], prompt_logprobs=2)
    assert req.prompt_logprobs == [None] * 5
    # positions 0..2 score tokens 1..3; the last chunk (3, 4) scores token 4 only: position 4's
    # logits are the first sample's
    span = prompt_logprob_span(ScheduledRequest(req, 0, 3, [0], False), row_start=7)
    assert (span.row_start, span.first_token, span.target_ids, span.num_top) == (7, 1, [11, 12, 13], 2)
    span = prompt_logprob_span(ScheduledRequest(req, 3, 2, [0], True), row_start=0)
    assert (span.first_token, span.target_ids) == (4, [14])
    assert prompt_logprob_span(ScheduledRequest(_request([1, 2]), 0, 2, [0], True), 0) is None


def test_a_recompute_scores_only_the_prompt_tokens_not_yet_scored():
    req = _request([10, 11, 12, 13, 14], prompt_logprobs=0)
    req.prompt_logprobs[1:3] = [{11: Logprob(11, -1.0, 1)}, {12: Logprob(12, -1.0, 1)}]
    # preempted by recompute after tokens 1..2 were scored: the chunk over positions 0..4 scores
    # tokens 3..4 only, from rows 2..3 of the chunk
    span = prompt_logprob_span(ScheduledRequest(req, 0, 5, [0], True), row_start=10)
    assert (span.row_start, span.first_token, span.target_ids) == (12, 3, [13, 14])
    req.prompt_logprobs[3:5] = [{13: Logprob(13, -1.0, 1)}, {14: Logprob(14, -1.0, 1)}]
    assert prompt_logprob_span(ScheduledRequest(req, 0, 6, [0], True), row_start=0) is None


def test_logprob_entries_rank_ties_and_top_k():
    lp = torch.log_softmax(torch.tensor([[0.0, 2.0, 2.0, 1.0]]), dim=-1)
    (entry,) = logprob_entries(lp, [3], 2)
    assert list(entry) == [3, 1, 2]
    assert [e.rank for e in entry.values()] == [3, 1, 1]
    assert entry[3].logprob == float(lp[0, 3])


def test_mean_pooling_sums_chunks_once_even_after_a_recompute():
    req = Request("e", [1, 2, 3, 4], SamplingParams(max_tokens=1), 0.0,
                  pooling=PoolingParams("mean", normalize=False))
    h = torch.arange(16, dtype=torch.float32).view(4, 4)          # one row per position
    assert pool(h[:2], [PoolSpan(ScheduledRequest(req, 0, 2, [0], False), 0)]) == {}
    # preempted by recompute: positions 0..2 again, then the last one
    assert pool(h[:3], [PoolSpan(ScheduledRequest(req, 0, 3, [0], False), 0)]) == {}
    out = pool(h[3:], [PoolSpan(ScheduledRequest(req, 3, 1, [0], True), 0)])
    assert out == {"e": h.mean(dim=0).tolist()}


def test_last_pooling_normalises_the_last_row():
    req = Request("e", [1, 2], SamplingParams(max_tokens=1), 0.0, pooling=PoolingParams("last"))
    h = torch.tensor([[9.0, 9.0], [3.0, 4.0]])
    out = pool(h, [PoolSpan(ScheduledRequest(req, 0, 2, [0], True), 0)])
    assert out == {"e": torch.tensor([0.6, 0.8]).tolist()}           # float32 0.6, 0.8


class _Tok:
    class hf:
        @staticmethod
        def decode(ids):
            return {5: "A", 6: "bc", 7: " d", 9: "Z"}[ids[0]]


PROMPT_LPS = [None, {6: Logprob(6, -1.0, 2), 9: Logprob(9, -0.5, 1)},
              {7: Logprob(7, -0.25, 1), 9: Logprob(9, -2.0, 2)}]


def test_echo_logprobs_in_openais_legacy_shape():
    got = echo_logprobs(_Tok, [5, 6, 7], PROMPT_LPS, k=1)
    assert got == {"tokens": ["A", "bc", " d"], "token_logprobs": [None, -1.0, -0.25],
                   "top_logprobs": [None, {"Z": -0.5, "bc": -1.0}, {" d": -0.25}],
                   "text_offset": [0, 1, 3]}
    gen = {"tokens": ["Z"], "token_logprobs": [-3.0], "top_logprobs": [{"Z": -3.0}],
           "text_offset": [5]}
    joined = join_logprobs(got, gen)
    assert joined["tokens"] == ["A", "bc", " d", "Z"] and joined["text_offset"] == [0, 1, 3, 5]


def test_vllm_prompt_logprobs_keep_the_prompt_token_and_top_k():
    assert vllm_prompt_logprobs(_Tok, [5, 6, 7], PROMPT_LPS, k=0) == [
        None, {"6": {"logprob": -1.0, "rank": 2, "decoded_token": "bc"}},
        {"7": {"logprob": -0.25, "rank": 1, "decoded_token": " d"}}]
    assert vllm_prompt_logprobs(_Tok, [5, 6, 7], PROMPT_LPS, k=2)[2] == {
        "7": {"logprob": -0.25, "rank": 1, "decoded_token": " d"},
        "9": {"logprob": -2.0, "rank": 2, "decoded_token": "Z"}}
