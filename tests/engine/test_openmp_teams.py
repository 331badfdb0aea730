"""kvmesh.common.openmp: when the server is asked to spin, and the event loop's team released so
that libgomp does not throttle the engine thread's (a fresh interpreter for the thread counts)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from kvmesh.common.openmp import loaded_libgomp, spin_requested


def test_spinning_is_asked_for_only_by_the_standard_variables():
    assert spin_requested({}) is False
    assert spin_requested({"GOMP_SPINCOUNT": "10000"}) is True
    assert spin_requested({"GOMP_SPINCOUNT": "10k"}) is True
    assert spin_requested({"GOMP_SPINCOUNT": "infinite"}) is True
    assert spin_requested({"GOMP_SPINCOUNT": "0"}) is False
    assert spin_requested({"GOMP_SPINCOUNT": "lots"}) is False
    assert spin_requested({"OMP_WAIT_POLICY": "ACTIVE"}) is True
    assert spin_requested({"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": "10000"}) is False


def test_loaded_libgomp_reads_the_path_from_the_maps():
    maps = ("7f04d3c00000-7f04d3c1a000 r--p 00000000 08:01 4242 /venv/torch/lib/libgomp.so.1\n"
            "7f04d3c1a000-7f04d3c1b000 rw-p 00000000 00:00 0\n")
    assert loaded_libgomp(maps) == "/venv/torch/lib/libgomp.so.1"
    assert loaded_libgomp("7f04d3c1a000-7f04d3c1b000 rw-p 00000000 00:00 0 [heap]\n") is None
    assert loaded_libgomp("") is None


_SCRIPT = textwrap.dedent("""
    import json, os, threading, torch
    from kvmesh.common.openmp import release_thread_team
    def threads(): return len(os.listdir("/proc/self/task"))
    x = torch.randn(256, 256)
    workers = torch.get_num_threads() - 1
    start = threads()
    x @ x                                   # the main thread's team: its workers park
    with_main = threads()
    seen = {}
    def engine():                           # a second team, on its own thread
        x @ x
        seen["engine_team"] = threads()
        done.wait()
        x @ x
        seen["engine_threads_after"] = torch.get_num_threads()
    done = threading.Event()
    t = threading.Thread(target=engine); t.start()
    while "engine_team" not in seen: pass
    released = release_thread_team()
    after = threads()
    x @ x                                   # the main thread runs alone now: no team again
    again = threads()
    done.set(); t.join()
    print(json.dumps({"start": start, "with_main": with_main, "released": released,
                      "after": after, "again": again, "workers": workers,
                      "main_threads": torch.get_num_threads(), **seen}))
""")


def test_releasing_the_loops_team_ends_its_parked_workers_and_keeps_the_engines():
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    w = r["workers"]                         # torch's threads minus the caller: 1 on 2 cores
    assert r["with_main"] == r["start"] + w
    assert r["engine_team"] == r["with_main"] + 1 + w     # the engine thread and its workers
    assert r["released"] is True
    assert r["after"] == r["engine_team"] - w             # only the main thread's workers left
    assert r["again"] == r["after"]                       # one thread on the main thread now
    assert r["engine_threads_after"] == w + 1             # the engine's team is untouched
