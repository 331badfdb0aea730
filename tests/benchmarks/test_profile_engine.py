"""The engine step profile: every part is timed and the parts add up to the run."""
from __future__ import annotations

import re

import pytest

from benchmarks import profile_engine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_profile_reports_each_part_of_the_step(capsys, dtype):
    profile_engine.main(["--workload", "prefill-heavy", "--num-requests", "1", "--threads", "2", "--dtype", dtype])
    out = capsys.readouterr().out
    # one request: 513 prompt tokens in two chunks (budget 512), then 38 more decode steps
    assert re.search(rf"# prefill-heavy \(cpu backend, {dtype}\): 1 requests, 513 prompt / 39 output tokens, "
                     r"40 steps", out)
    rows = dict(re.findall(r"^\| (\w[\w ]*?) \| ([\d.]+) \|", out, re.M))
    for part in ("gemm", "attention", "kv_write", "norm", "rope", "activation", "lm_head",
                 "sampling", "runner_input", "scheduler", "output"):
        assert float(rows[part]) > 0, part
    parts = sum(float(v) for k, v in rows.items() if k != "step_other")
    total = float(re.search(r"\*\*step total\*\* \| ([\d.]+)", out).group(1))
    # each row is printed rounded to 0.1 ms: the sum may exceed the total by half of that per row
    assert 0 < parts <= total + 0.00005 * (len(rows) + 1)
