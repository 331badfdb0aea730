"""`kvmesh serve` restarts itself once with tcmalloc / jemalloc preloaded (--allocator)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.common import preload


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", preload.REEXEC_MARK,
                                                               "KVMESH_ALLOCATOR")}
    return subprocess.run([sys.executable, "-m", "kvmesh.cli", "serve", "--model", "/no/such/model",
                           "--log-level", "info", *args], env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=300)


def test_reexec_env_decisions(tmp_path):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    got_lib, env = preload.reexec_env(str(lib), {"PATH": "/bin", "LD_PRELOAD": "/x/liba.so"})
    assert got_lib == lib
    assert env == {"PATH": "/bin", "LD_PRELOAD": f"{lib} /x/liba.so", preload.REEXEC_MARK: str(lib)}
    # already preloaded, or already re-executed once: go on as is
    assert preload.reexec_env(str(lib), {"LD_PRELOAD": str(lib)}) == (lib, None)
    assert preload.reexec_env(str(lib), {preload.REEXEC_MARK: str(lib)}) == (lib, None)
    assert preload.reexec_env("none", {}) == (None, None)
    with pytest.raises(ValueError, match="--allocator /no/lib.so: no such file"):
        preload.reexec_env("/no/lib.so", {})


def test_with_preload_keeps_other_libraries_once():
    env = preload.with_preload({"LD_PRELOAD": "/a.so:/b.so"}, [Path("/b.so"), Path("/c.so")])
    assert env["LD_PRELOAD"] == "/b.so /c.so /a.so"
    assert preload.with_preload({}, []) == {}


def test_serve_restarts_once_with_the_allocator_and_the_new_process_has_it():
    lib = preload.find_allocator()
    assert lib is not None, "install libtcmalloc-minimal4 (make install-test does)"
    done = _serve()
    assert done.returncode == 2
    assert done.stderr.count("preloaded (--allocator none to keep glibc malloc)") == 1
    assert f"restarting with {lib} preloaded" in done.stderr
    assert f"malloc: {lib.name}" in done.stderr
    assert "model path does not exist: /no/such/model" in done.stderr


def test_allocator_none_keeps_glibc_malloc():
    done = _serve("--allocator", "none")
    assert done.returncode == 2
    assert "restarting" not in done.stderr
    assert "malloc: the C library's (no tcmalloc / jemalloc loaded)" in done.stderr


def test_a_missing_allocator_library_is_a_clear_error(capsys):
    from kvmesh.api import server

    assert server.main(["--allocator", "/no/libfast.so"], reexec=True) == 2
    assert "kvmesh serve: error: --allocator /no/libfast.so: no such file" in capsys.readouterr().err


@pytest.mark.parametrize("argv, env, want", [
    ([], {}, "auto"),
    ([], {"KVMESH_ALLOCATOR": "none"}, "none"),
    (["--port", "8001", "--allocator", "none"], {"KVMESH_ALLOCATOR": "auto"}, "none"),
    (["--allocator=/opt/libjemalloc.so.2", "--host", "0.0.0.0"], {}, "/opt/libjemalloc.so.2"),
    # only the full parse can tell: a config file may name one, help prints and exits, argparse
    # takes abbreviations, a flag without its value is an error it reports
    (["--config", "serve.yaml"], {}, None),
    (["--config=serve.yaml"], {}, None),
    (["--conf", "serve.yaml"], {}, None),
    (["--help"], {}, None),
    (["-h"], {}, None),
    (["--alloc", "none"], {}, None),
    (["--allocator"], {}, None),
])
def test_the_allocator_choice_the_command_line_alone_tells(argv, env, want):
    assert preload.early_choice(argv, env) == want


def test_kvmesh_serve_restarts_before_it_imports_the_server_or_torch():
    """The restart costs an interpreter start, not the server's imports (seconds of torch)."""
    probe = (
        "import sys\n"
        "from kvmesh.common import preload\n"
        "def restart(choice, argv):\n"
        "    heavy = sorted(m for m in ('torch', 'kvmesh.api.server') if m in sys.modules)\n"
        "    print('restart', choice, argv, heavy)\n"
        "    sys.exit(0)\n"
        "preload.reexec_with_allocator = restart\n"
        "sys.argv = ['kvmesh', 'serve', '--allocator', 'none', '--port', '8001']\n"
        "from kvmesh.cli import main\n"
        "main()\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("restart none ['-m', 'kvmesh.cli', 'serve', '--allocator', 'none', "
                                   "'--port', '8001'] []")
