"""The offline benchmark's request list: `--num-requests` trims named workloads too."""
from __future__ import annotations

import argparse

import pytest

from benchmarks import offline_throughput
from benchmarks.workload import WORKLOADS, uniform_requests


class ByteTokenizer:
    """One id per byte of the text (only the lengths matter here)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())


def _args(workload: str, num_requests: int) -> argparse.Namespace:
    return argparse.Namespace(workload=workload, seed=0, num_requests=num_requests, scale=10.0,
                              max_total_len=1024, prompt_fraction=0.5)


@pytest.mark.parametrize("workload", ["decode-heavy", "prefill-heavy"])
def test_num_requests_trims_a_named_workload(workload):
    full = uniform_requests(workload, seed=0)
    reqs, _ = offline_throughput.build_requests(ByteTokenizer(), _args(workload, 3))
    assert [(len(r.prompt_ids), r.output_len) for r in reqs] == [(w.prompt_len, w.output_len)
                                                                 for w in full[:3]]
    every, _ = offline_throughput.build_requests(ByteTokenizer(), _args(workload, 0))
    assert len(every) == WORKLOADS[workload].num_requests
