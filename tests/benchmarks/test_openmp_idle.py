"""benchmarks/openmp_idle.py: its arguments and its /proc reading (the run itself starts servers)."""
from __future__ import annotations

import os
import time

import pytest

from benchmarks.openmp_idle import main, parse_env, process_cpu_s


def test_env_arguments():
    assert parse_env("") == {}
    assert parse_env("OMP_WAIT_POLICY=ACTIVE") == {"OMP_WAIT_POLICY": "ACTIVE"}
    assert parse_env("GOMP_SPINCOUNT=20000000, OMP_NUM_THREADS=2") == {"GOMP_SPINCOUNT": "20000000",
                                                                       "OMP_NUM_THREADS": "2"}
    with pytest.raises(ValueError, match="--env takes KEY=VALUE"):
        parse_env("ACTIVE")
    with pytest.raises(SystemExit):
        main(["--env", "=1"])


def test_process_cpu_time_counts_this_process_busy():
    before = process_cpu_s(os.getpid())
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    assert process_cpu_s(os.getpid()) - before >= 0.15
