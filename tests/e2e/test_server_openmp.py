"""`kvmesh serve` asked to spin (GOMP_SPINCOUNT): once ready, the event loop's parked OpenMP team
is gone, so libgomp no longer throttles the engine thread's workers (kvmesh.common.openmp). The
server logs how many parked workers the release ended: torch's threads - 1 where the event loop
had a team (the AVX-512 Xeon), none where it never ran a parallel region (an AVX2-only EPYC), and
the process has exactly that many fewer threads than the same server left as it is."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
from processes import free_port
from waiting import wait_until

RELEASED = "OpenMP: the event loop's team released"
ENDED = re.compile(r"team released \((\d+) parked workers ended\)")


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _serve(tmp_path: Path, name: str, extra_env: dict[str, str]) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(extra_env, PYTHONUNBUFFERED="1")
    log = tmp_path / f"{name}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.cli", "serve", "--port", str(port), "--log-level",
             "info", "--num-kv-blocks", "64", "--max-model-len", "256", "--device", "cpu"],
            stdout=f, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}", log


def test_a_server_asked_to_spin_releases_the_event_loops_team(tmp_path: Path):
    import torch
    servers = [_serve(tmp_path, "spin", {"GOMP_SPINCOUNT": "10000"}), _serve(tmp_path, "plain", {})]
    try:
        for proc, url, log in servers:
            assert wait_until(lambda: _ready(url), timeout=300, interval=0.2), log.read_text()
        threads = [len(os.listdir(f"/proc/{proc.pid}/task")) for proc, _, _ in servers]
        logs = [log.read_text() for _, _, log in servers]
    finally:
        for proc, _, _ in servers:
            proc.terminate()
            proc.wait(60)
    assert logs[0].count(RELEASED) == 1 and "GOMP_SPINCOUNT=10000" in logs[0]
    assert RELEASED not in logs[1]
    ended = [int(n) for n in ENDED.findall(logs[0])]
    assert len(ended) == 1 and ended[0] in (0, torch.get_num_threads() - 1), logs[0]
    assert threads[1] - threads[0] == ended[0]
