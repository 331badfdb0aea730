"""The suite's background builder of the kernel tests' narrower builds (tests/support/kernel_builds.py):
what it builds, when it starts, and that ending it ends its compilers."""
from __future__ import annotations

import subprocess
import sys
import time

import kernel_builds
from kvmesh.kernels import cpu_kernels


def test_it_builds_only_the_narrower_paths_this_cpu_runs(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "missing_flags",
                        lambda path: ("avx512f",) if path in ("avx512", "avx512_bf16") else ())
    builds = (("a", ("amx", "avx512_bf16", "avx512", "avx2", "portable")), ("b", ("avx2",)))
    # amx narrows nothing: on a CPU with it, the native build is that path
    assert kernel_builds.wanted(builds) == [("a", "avx2"), ("a", "portable"), ("b", "avx2")]


def test_it_starts_only_for_a_session_with_kernel_tests(monkeypatch):
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **kw: started.append((a[0], kw)) or "proc")
    assert kernel_builds.start(["tests/e2e/test_cli.py"]) is None
    monkeypatch.setenv(kernel_builds.DISABLE_ENV, "0")
    assert kernel_builds.start(["tests/kernels/test_cpu_paths.py"]) is None
    monkeypatch.delenv(kernel_builds.DISABLE_ENV)
    assert kernel_builds.start(["tests/e2e/test_cli.py", "tests/kernels/test_cpu_paths.py"]) == "proc"
    (argv, kw), = started
    assert argv == ["nice", "-n", "19", sys.executable, kernel_builds.__file__]
    # its own process group in the suite's session: a session of its own is scheduled beside
    # the tests' as an equal (Linux's autogroups), whatever its nice value
    assert kw["process_group"] == 0 and not kw.get("start_new_session")


def test_stopping_it_ends_the_processes_it_started():
    # a stand-in builder with a child of its own (as ninja and the compiler are)
    proc = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                             "c = subprocess.Popen(['sleep', '60']); print(c.pid, flush=True); c.wait()"],
                            stdout=subprocess.PIPE, text=True, process_group=0)
    child = int(proc.stdout.readline())
    kernel_builds.stop(proc)
    assert proc.returncode is not None
    deadline = time.monotonic() + 5
    while _running(child):
        assert time.monotonic() < deadline, f"the builder's child {child} outlived it"
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan waits for init to reap it, which a container may not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
