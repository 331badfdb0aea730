"""The Sampler end to end on hand-built logits: greedy, seeded reproducibility whatever the batch,
n > 1, min_tokens, logprobs and ranks."""
from __future__ import annotations

import pytest
import torch

from kvmesh.engine.sampler import Sampler, SamplingRow
from kvmesh.engine.sampling_params import SamplingParams

V = 64
EOS = 3


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits(seed: int, rows: int = 1, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(rows, V, generator=_gen(seed)) * scale


def _row(params: SamplingParams, gens=None, n: int = 1, output=None, prompt=None, eos=(EOS,)) -> SamplingRow:
    return SamplingRow(params=params, prompt_token_ids=[1, 2] if prompt is None else prompt,
                       output_token_ids=[] if output is None else output,
                       generators=gens if gens is not None else [None] * n, num_samples=n, eos_token_ids=eos)


# greedy ----------------------------------------------------------------------------------

def test_greedy_is_argmax_with_lowest_index_on_ties():
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0], [9.0, 1.0, 2.0, 3.0]])
    out = Sampler()(logits, [_row(SamplingParams(temperature=0.0)), _row(SamplingParams(temperature=0.0))])
    assert out.token_ids == [[1], [0]]
    assert out.logprobs == [None, None]


def test_the_callers_logits_are_never_written():
    """Penalties and min_tokens masks work on a private copy; a batch with neither reads the
    logits as they are (no copy)."""
    logits = torch.tensor([[0.0, 5.0, 1.0, 6.0], [9.0, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]])
    before = logits.clone()
    rows = [_row(SamplingParams(temperature=0.0, repetition_penalty=2.0), output=[3], prompt=[0]),
            _row(SamplingParams(temperature=0.0, min_tokens=2), output=[1], eos=(0,)),
            _row(SamplingParams(temperature=0.0))]
    out = Sampler()(logits, rows)
    assert out.token_ids == [[1], [3], [3]]       # 6 / 2 < 5; EOS 0 masked; plain argmax
    assert torch.equal(logits, before)
    plain = Sampler()(logits, [_row(SamplingParams(temperature=0.0))] * 3)
    assert plain.token_ids == [[3], [0], [3]]
    assert torch.equal(logits, before)


def test_greedy_n_samples_are_identical_and_ignore_generators():
    logits = _logits(0)
    best = int(logits.argmax())
    out = Sampler()(logits, [_row(SamplingParams(temperature=0.0, n=3), gens=[_gen(1), None, _gen(2)], n=3)])
    assert out.token_ids == [[best] * 3]


def test_greedy_sees_penalties():
    logits = torch.tensor([[4.0, 3.0, 0.0]])
    plain = Sampler()(logits, [_row(SamplingParams(temperature=0.0), output=[0])])
    penalized = Sampler()(logits, [_row(SamplingParams(temperature=0.0, repetition_penalty=2.0), output=[0], prompt=[])])
    assert plain.token_ids == [[0]] and penalized.token_ids == [[1]]
    assert torch.equal(logits, torch.tensor([[4.0, 3.0, 0.0]]))   # the caller's logits are not touched


# min_tokens ------------------------------------------------------------------------------

def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, 8)
    logits[0, EOS] = 10.0
    logits[0, 5] = 9.0
    logits[0, 6] = 8.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5])
    assert Sampler()(logits, [_row(params, output=[6])]).token_ids == [[6]]
    assert Sampler()(logits, [_row(params, output=[6, 6])]).token_ids == [[EOS]]
    # ignore_eos leaves EOS alone but stop ids stay masked.
    ignore = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5], ignore_eos=True)
    assert Sampler()(logits, [_row(ignore, output=[6])]).token_ids == [[EOS]]
    logits[0, EOS] = 0.0
    assert Sampler()(logits, [_row(ignore, output=[6])]).token_ids == [[6]]


def test_min_tokens_masks_every_eos_id_for_sampled_rows():
    logits = torch.full((1, 4), -5.0)
    logits[0, 1] = logits[0, 2] = 5.0
    params = SamplingParams(temperature=1.0, min_tokens=1)
    out = Sampler()(logits, [_row(params, gens=[_gen(s) for s in range(20)], n=20, eos=(1, 2))])
    assert 1 not in out.token_ids[0] and 2 not in out.token_ids[0]


# seeded reproducibility ------------------------------------------------------------------

def _seeded_params(seed: int = 1234) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.01, seed=seed,
                          presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.1)


def _run_alone(steps: int, seed: int = 1234) -> list[int]:
    sampler, gen, out = Sampler(_gen(99)), _gen(seed), []
    for step in range(steps):
        rows = [_row(_seeded_params(seed), gens=[gen], output=list(out))]
        out += sampler(_logits(1000 + step), rows).token_ids[0]
    return out


def _others(step: int) -> list[SamplingRow]:
    """Seven neighbours: other seeds, unseeded, greedy, n > 1, truncation and penalties."""
    return [
        _row(SamplingParams(temperature=1.3, seed=7), gens=[_gen(7 + step)]),
        _row(SamplingParams(temperature=1.0)),
        _row(SamplingParams(temperature=0.0, repetition_penalty=1.5), output=[4, 5]),
        _row(SamplingParams(temperature=0.5, top_k=3, n=3), n=3),
        _row(SamplingParams(temperature=1.0, top_p=0.5, min_p=0.2, seed=5), gens=[_gen(5)]),
        _row(SamplingParams(frequency_penalty=1.0, presence_penalty=-1.0), output=[1, 1, 2]),
        _row(SamplingParams(temperature=2.0, min_tokens=4), output=[1]),
    ]


@pytest.mark.parametrize("position", [0, 3, 7])
def test_seeded_tokens_do_not_depend_on_the_batch(position):
    steps = 12
    alone = _run_alone(steps)
    sampler, gen, out = Sampler(_gen(12345)), _gen(1234), []
    for step in range(steps):
        rows = _others(step)
        rows.insert(position, _row(_seeded_params(), gens=[gen], output=list(out)))
        logits = _logits(50 + step, rows=len(rows))
        logits[position] = _logits(1000 + step)[0]
        out += sampler(logits, rows).token_ids[position]
    assert out == alone


def test_seeded_tokens_do_not_depend_on_the_default_generator():
    assert _run_alone(8) == _run_alone(8)
    torch.manual_seed(0)
    first = _run_alone(8)
    torch.manual_seed(1)
    assert _run_alone(8) == first


def test_different_seeds_give_different_tokens():
    assert _run_alone(12, seed=1) != _run_alone(12, seed=2)


def test_n_samples_use_their_own_generators():
    logits = _logits(3, scale=0.5)         # flat-ish: independent samples rarely agree
    params = SamplingParams(temperature=1.0, n=4, seed=11)
    seeds = [11, 12, 13, 14]
    out = Sampler()(logits, [_row(params, gens=[_gen(s) for s in seeds], n=4)]).token_ids[0]
    assert len(out) == 4 and len(set(out)) > 1
    again = Sampler()(logits, [_row(params, gens=[_gen(s) for s in seeds], n=4)]).token_ids[0]
    assert again == out
    # Sample i equals a single draw with generator i: n > 1 is n independent samples.
    single = [Sampler()(logits, [_row(params, gens=[_gen(s)])]).token_ids[0][0] for s in seeds]
    assert single == out


def test_sampling_follows_the_distribution_and_truncation():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log()[None, :]
    n = 4000
    out = Sampler(_gen(0))(logits, [_row(SamplingParams(n=n), n=n)]).token_ids[0]
    freq = torch.bincount(torch.tensor(out), minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.03), freq
    top2 = Sampler(_gen(0))(logits, [_row(SamplingParams(n=n, top_k=2), n=n)]).token_ids[0]
    freq2 = torch.bincount(torch.tensor(top2), minlength=4).float() / n
    assert freq2[0] == 0 and freq2[1] == 0
    assert abs(freq2[3].item() - 4 / 7) < 0.03


def test_low_temperature_concentrates():
    logits = torch.tensor([[1.0, 1.5, 0.5]])
    out = Sampler(_gen(0))(logits, [_row(SamplingParams(temperature=0.01, n=50), n=50)]).token_ids[0]
    assert out == [1] * 50


# logprobs --------------------------------------------------------------------------------

def test_logprobs_chosen_and_top_k_from_raw_logits():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, -1.0, 0.5]])
    params = SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=4.0)
    out = Sampler()(logits, [_row(params, output=[1, 3], prompt=[])])
    raw = torch.log_softmax(logits[0], dim=-1).tolist()
    # The penalty makes token 2 the greedy pick; logprobs still come from the raw logits.
    assert out.token_ids == [[2]]
    entry = out.logprobs[0][0]
    assert list(entry) == [2, 1, 3]          # chosen first, then top-k not already present
    assert {t: (lp.logprob, lp.rank) for t, lp in entry.items()} == {
        2: (raw[2], 3), 1: (raw[1], 1), 3: (raw[3], 1)}   # ties share a rank
    assert all(lp.token_id == t for t, lp in entry.items())


def test_logprobs_zero_gives_only_the_chosen_token_and_rank():
    logits = _logits(8)
    params = SamplingParams(temperature=1.0, logprobs=0, n=3)
    out = Sampler()(logits, [_row(params, gens=[_gen(1), _gen(2), _gen(3)], n=3)])
    lp = torch.log_softmax(logits[0], dim=-1)
    assert len(out.logprobs[0]) == 3
    for tok, entry in zip(out.token_ids[0], out.logprobs[0]):
        assert list(entry) == [tok]
        assert entry[tok].logprob == lp[tok].item()
        assert entry[tok].rank == 1 + int((lp > lp[tok]).sum())


def test_logprobs_only_for_rows_that_ask():
    logits = _logits(9, rows=3)
    rows = [_row(SamplingParams(temperature=0.0)), _row(SamplingParams(temperature=0.0, logprobs=5)),
            _row(SamplingParams(temperature=0.0, logprobs=1))]
    out = Sampler()(logits, rows)
    assert out.logprobs[0] is None
    lp1 = torch.log_softmax(logits[1], dim=-1)
    top5 = lp1.topk(5)
    entry = out.logprobs[1][0]
    assert list(entry) == top5.indices.tolist()         # greedy pick is the top-1 entry
    assert [e.rank for e in entry.values()] == [1, 2, 3, 4, 5]
    assert [e.logprob for e in entry.values()] == top5.values.tolist()
    assert list(out.logprobs[2][0]) == [int(logits[2].argmax())]


def test_to_host_reads_every_tensor_once():
    from kvmesh.engine.sampler import to_host
    ids = torch.tensor([3, 1, 2])
    lps = torch.tensor([[-0.5, -1.25]])
    assert to_host([ids, lps]) == [[3, 1, 2], [-0.5, -1.25]]


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs CUDA: the packed pinned-memory transfer runs only on a GPU")
def test_to_host_packs_one_transfer_exactly_on_cuda():
    from kvmesh.engine.sampler import to_host
    ids = torch.tensor([262143, 0, 7], device="cuda")
    lps = torch.tensor([-1e-7, -23.456789], device="cuda")
    out = to_host([ids, lps])
    assert out[0] == [262143, 0, 7] and all(type(v) is int for v in out[0])
    assert out[1] == lps.cpu().tolist()


# the draw: inverse CDF, one uniform per sample ------------------------------------------------

def test_inverse_cdf_picks_the_first_token_whose_running_sum_exceeds_the_target():
    from kvmesh.engine.sampler import inverse_cdf
    probs = torch.tensor([[0.1, 0.0, 0.2, 0.7], [0.0, 0.5, 0.0, 0.5]], dtype=torch.float64)
    cdf = probs.cumsum(dim=-1)                      # [.1, .1, .3, 1], [0, .5, .5, 1]
    rows = [0, 0, 0, 0, 1, 1, 1]
    u = torch.tensor([0.0, 0.05, 0.15, 0.9999, 0.0, 0.49, 0.51])
    got = inverse_cdf(cdf[rows], u).tolist()
    # a token of probability 0 (1 in row 0; 0 and 2 in row 1) is never drawn, even at u = 0
    assert got == [0, 0, 2, 3, 1, 1, 3]


def test_inverse_cdf_scales_by_the_rows_total():
    from kvmesh.engine.sampler import inverse_cdf
    cdf = torch.tensor([[2.0, 2.0, 6.0, 8.0]], dtype=torch.float64)   # unnormalised: total 8
    u = torch.tensor([0.2, 0.26, 0.74, 0.76])      # targets 1.6, 2.08, 5.92, 6.08
    assert inverse_cdf(cdf[[0, 0, 0, 0]], u).tolist() == [0, 2, 2, 3]


def test_each_seeded_sample_consumes_exactly_one_uniform_of_its_generator():
    logits = _logits(5)
    gens = [_gen(21), _gen(22)]
    Sampler()(logits, [_row(SamplingParams(temperature=1.0, n=2, seed=21), gens=gens, n=2)])
    for seed, g in zip((21, 22), gens):
        expected = _gen(seed)
        torch.rand(1, generator=expected)
        assert torch.equal(g.get_state(), expected.get_state())


def test_unseeded_samples_take_one_uniform_each_from_the_shared_generator():
    shared = _gen(31)
    rows = [_row(SamplingParams(temperature=1.0)), _row(SamplingParams(temperature=0.0)),
            _row(SamplingParams(temperature=0.7, n=3), n=3)]
    Sampler(shared)(_logits(6, rows=3), rows)
    expected = _gen(31)
    torch.rand(4, generator=expected)              # 1 + 3 sampled draws; the greedy row none
    assert torch.equal(shared.get_state(), expected.get_state())
