"""The Speculator's switches: per step above disable_by_batch_size, per request after a window
of low acceptance (a pause that doubles while it keeps failing, reset by a good window)."""
from __future__ import annotations

from kvmesh.common.speculative_config import SpeculativeConfig
from kvmesh.engine.request import Request
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.sched_output import SchedulerStats
from kvmesh.engine.spec_decode.speculator import (LOW_ACCEPTANCE, PAUSE_MIN, WINDOW,
                                                  Speculator)


def _req(rid="r", max_tokens=100):
    return Request(rid, [4, 5, 4, 5, 4], SamplingParams(max_tokens=max_tokens), 0.0,
                   max_model_len=256)


def _spec(**kw):
    return Speculator(SpeculativeConfig("ngram", 2, 1, 2, **kw))


def test_drafts_come_from_prompt_lookup_capped_by_budget():
    s = _spec()
    assert s.propose(_req(), budget=8) == [5, 4]
    assert s.propose(_req(), budget=1) == [5]
    assert s.propose(_req(), budget=0) == []


def test_a_step_with_more_running_requests_than_the_limit_does_not_speculate():
    s = _spec(disable_by_batch_size=4)
    s.begin_step(5)
    assert s.propose(_req(), 8) == []
    s.begin_step(4)
    assert s.propose(_req(), 8) == [5, 4]


def _window(s, req, accepted_per_round):
    stats = SchedulerStats()
    for a in accepted_per_round:
        assert s.propose(req, 8) == [5, 4]
        s.record(req.request_id, 2, a, stats)
    return stats


def test_low_acceptance_pauses_the_request_and_the_pause_doubles():
    assert LOW_ACCEPTANCE * 2 * WINDOW > 1       # one accepted draft per window stays "low"
    s = _spec()
    req, other = _req("r"), _req("o")
    stats = _window(s, req, [0] * (WINDOW - 1) + [1])
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens,
            stats.spec_num_accepted_per_pos) == (WINDOW, 2 * WINDOW, 1, (1, 0))
    assert [s.propose(req, 8) for _ in range(PAUSE_MIN)] == [[]] * PAUSE_MIN
    assert s.propose(other, 8) == [5, 4]          # other requests speculate on
    _window(s, req, [0] * WINDOW)                 # fails again: twice as long
    assert [s.propose(req, 8) for _ in range(2 * PAUSE_MIN)] == [[]] * (2 * PAUSE_MIN)
    _window(s, req, [2] * WINDOW)                 # a good window resets the pause
    _window(s, req, [0] * WINDOW)
    assert [s.propose(req, 8) for _ in range(PAUSE_MIN)] == [[]] * PAUSE_MIN
    assert s.propose(req, 8) == [5, 4]
    s.forget("r")
    assert s.propose(req, 8) == [5, 4]


def test_a_draft_model_gets_placeholders_sized_like_lookup_drafts():
    s = Speculator(SpeculativeConfig("draft_model", 3, model="/m"))
    assert s.propose(_req(), budget=8) == [0, 0, 0]         # the runner's draft fills them
    assert s.propose(_req(max_tokens=2), budget=8) == [0]    # room for 1 draft + 1 token
