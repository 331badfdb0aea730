"""The per-token cost tools of issue 28: stream_cost.py's CPU split by thread, step_cpu.py's
one-row step."""
from __future__ import annotations

import os
import re
import threading

from benchmarks import step_cpu, stream_cost


def test_split_names_the_main_thread_loop_the_busiest_other_engine_and_sums_the_rest():
    before = {100: 1.0, 101: 2.0, 102: 0.5}
    after = {100: 1.25, 101: 3.0, 102: 0.75, 103: 0.5}           # 103 started meanwhile
    assert stream_cost.split(100, before, after) == {"loop": 0.25, "engine": 1.0, "other": 0.75}
    assert stream_cost.split(100, {100: 1.0}, {100: 1.5}) == {"loop": 0.5, "engine": 0.0,
                                                               "other": 0.0}


def test_thread_cpu_s_reads_every_thread_of_a_process():
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        cpu = stream_cost.thread_cpu_s(os.getpid())
        assert os.getpid() in cpu and t.native_id in cpu
        assert all(v >= 0 for v in cpu.values())
    finally:
        stop.set()
        t.join()


def test_step_cpu_times_every_measured_step(tmp_path, capsys):
    assert step_cpu.main(["--model", "random-tiny", "--cache", str(tmp_path), "--steps", "3",
                          "--warmup", "1", "--prompt-tokens", "8"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"random-tiny bfloat16: step CPU ms median ([\d.]+) mean [\d.]+; forward median "
                  r"([\d.]+); rest median [\d.]+ \(3 steps", out)
    assert m and 0 < float(m.group(2)) <= float(m.group(1)), out
