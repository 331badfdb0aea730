"""Finding a faster malloc (tcmalloc, else jemalloc) and preloading it into a process.

glibc's malloc returns the large, short-lived buffers of a CPU forward pass to the kernel and
faults them back in on the next step; tcmalloc and jemalloc keep them. They only take effect
when loaded before the process starts (`LD_PRELOAD`), so a process either re-executes itself
(`kvmesh serve`, see `kvmesh.api.server`) or starts its children with the variable set (the
vLLM peer of `benchmarks/offline_throughput.py`).

Debian / Ubuntu: `apt-get install libtcmalloc-minimal4` (or `libjemalloc2`).
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

# best first: tcmalloc's minimal build (no heap profiler), then jemalloc
ALLOCATORS = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libjemalloc.so.2")
_LIB_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu",
             "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/lib64", "/usr/local/lib", "/usr/lib")


def find_library(name: str, extra_dirs: tuple[str, ...] = ()) -> Path | None:
    """Absolute path of the shared library file `name` (e.g. libjemalloc.so.2), or None."""
    for d in (*extra_dirs, *_LIB_DIRS):
        p = Path(d) / name
        if p.is_file():
            return p
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        left, _, right = line.partition("=>")
        if left.strip().split(" ")[0] == name and Path(right.strip()).is_file():
            return Path(right.strip())
    return None


def find_allocator() -> Path | None:
    """The first of ALLOCATORS found on this machine, or None."""
    for name in ALLOCATORS:
        path = find_library(name)
        if path is not None:
            return path
    return None


def with_preload(env: dict[str, str], libs: list[Path]) -> dict[str, str]:
    """A copy of `env` whose LD_PRELOAD lists `libs` first (each once), then what it had."""
    have = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p]
    want = [str(p) for p in libs]
    out = dict(env)
    merged = want + [p for p in have if p not in want]
    if merged:
        out["LD_PRELOAD"] = " ".join(merged)
    return out


def is_preloaded(lib: Path, env: dict[str, str] | None = None) -> bool:
    """Whether `lib` is in LD_PRELOAD of `env` (default: this process's environment)."""
    env = os.environ if env is None else env
    names = env.get("LD_PRELOAD", "").replace(":", " ").split()
    return str(lib) in names or any(Path(n).name == lib.name for n in names)


# set in the environment of a process re-executed with an allocator: never re-execute twice
REEXEC_MARK = "KVMESH_ALLOCATOR_PRELOAD"


def resolve_allocator(choice: str) -> Path | None:
    """`--allocator`: auto (the best found, or None), none, or the path of a shared library."""
    if choice == "none":
        return None
    if choice == "auto":
        return find_allocator()
    path = Path(choice).expanduser()
    if not path.is_file():
        raise ValueError(f"--allocator {choice}: no such file (use auto, none or a library path)")
    return path.resolve()


def reexec_env(choice: str, env: dict[str, str]) -> tuple[Path | None, dict[str, str] | None]:
    """(allocator, environment to re-execute with, or None when this process should just go on).

    No re-exec when no allocator is wanted or found, when it is already preloaded, or when this
    process is itself the re-executed one (the mark is set: a library that failed to preload
    must not loop)."""
    lib = resolve_allocator(choice)
    if lib is None or is_preloaded(lib, env) or env.get(REEXEC_MARK):
        return lib, None
    out = with_preload(env, [lib])
    out[REEXEC_MARK] = str(lib)
    return lib, out


def loaded_allocator() -> str | None:
    """The file name of the ALLOCATORS library mapped into this process, or None (Linux only)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for name in ALLOCATORS:
        if name in maps:
            return name
    return None


def reexec_with_allocator(choice: str, argv: list[str]) -> None:
    """Replace this process by `python argv...` with the allocator preloaded, when one is wanted,
    found and not loaded yet; otherwise return. Call before threads start (exec keeps only the
    calling thread)."""
    lib, env = reexec_env(choice, dict(os.environ))
    if env is None:
        return
    import sys
    print(f"kvmesh: restarting with {lib} preloaded (--allocator none to keep glibc malloc)",
          file=sys.stderr, flush=True)
    os.execve(sys.executable, [sys.executable, *argv], env)


def early_choice(argv: list[str], env: dict[str, str]) -> str | None:
    """The `--allocator` choice of `kvmesh serve ARGV` read from the command line and the
    environment alone, so the restart can come before the server's imports (torch: seconds);
    None where only the full parse can tell: a `--config` file (it may name one), `--help`, an
    abbreviated `--alloc...`, a flag without its value."""
    choice = env.get("KVMESH_ALLOCATOR", "auto")
    for i, arg in enumerate(argv):
        flag, has_value, value = arg.partition("=")
        if flag in ("-h", "--help", "--config") or (flag.startswith("--con") and "--config".startswith(flag)):
            return None
        if flag == "--allocator":
            if has_value:
                choice = value
            elif i + 1 < len(argv):
                choice = argv[i + 1]
            else:
                return None
        elif len(flag) > 2 and "--allocator".startswith(flag):
            return None
    return choice
