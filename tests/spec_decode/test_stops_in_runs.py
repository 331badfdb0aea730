"""check_stops: several tokens appended in one step are checked one by one; the first that stops
the request ends its output there (the tokens after it are dropped)."""
from __future__ import annotations

from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.output_processor import check_stops
from kvmesh.engine.request import Logprob, Request, RequestStatus
from kvmesh.engine.sampling_params import SamplingParams

EOS = 2


def _req(prompt, outputs, **params) -> Request:
    req = Request("r", list(prompt), SamplingParams(**params), 0.0, eos_token_ids=(EOS,),
                  max_model_len=64)
    for t in outputs:
        req.append_output_token(t)
        req.output_logprobs.append({t: Logprob(t, -1.0, 1)})
    return req


def test_eos_inside_a_run_truncates_after_it():
    req = _req([5, 6], [7, 8, EOS, 9, 10])
    assert check_stops(req, None, 1) == (RequestStatus.FINISHED_STOPPED, None)
    assert req.output_token_ids == [7, 8, EOS]
    assert req.all_token_ids == [5, 6, 7, 8, EOS]
    assert [list(lp) for lp in req.output_logprobs] == [[7], [8], [EOS]]


def test_min_tokens_masks_an_early_stop_token_in_the_run():
    # stop id 8 at output 2 is before min_tokens = 3; at output 4 it stops
    req = _req([5], [7, 8, 9, 8, 11], stop_token_ids=[8], min_tokens=3)
    assert check_stops(req, None, 0) == (RequestStatus.FINISHED_STOPPED, 8)
    assert req.output_token_ids == [7, 8, 9, 8]


def test_max_tokens_inside_a_run_is_a_length_finish():
    req = _req([5], [7, 8, 9, 10], max_tokens=2)
    assert check_stops(req, None, 0) == (RequestStatus.FINISHED_LENGTH, None)
    assert req.output_token_ids == [7, 8]


def test_no_stop_keeps_every_token():
    req = _req([5], [7, 8, 9], max_tokens=10)
    assert check_stops(req, None, 1) is None
    assert req.output_token_ids == [7, 8, 9]


class _Words:
    """A tokenizer stand-in: token i is the word "t{i}" (enough for the detokenizer)."""
    all_special_ids: list[int] = []

    def convert_ids_to_tokens(self, ids):
        return [f"t{i}" for i in ids]

    def convert_tokens_to_string(self, tokens):
        return " ".join(tokens)


def test_a_stop_string_inside_a_run_cuts_text_and_tokens():
    params = dict(stop=["t8 t9"], max_tokens=10)
    req = _req([5], [7, 8, 9, 10, 11], **params)
    detok = IncrementalDetokenizer(_Words(), [5], SamplingParams(**params))
    assert check_stops(req, detok, 0) == (RequestStatus.FINISHED_STOPPED, "t8 t9")
    assert req.output_token_ids == [7, 8, 9]
    assert detok.output_token_ids == [7, 8, 9]      # tokens after the stop never decoded
    assert detok.output_text == " t7 "
