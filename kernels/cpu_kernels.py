"""The C++ CPU kernels (`kernels/csrc/`: attention, elementwise, sampling, LoRA, small-row GEMM), built once per machine and cached.

    from kvmesh.kernels.cpu_kernels import load
    ext = load()          # the extension module, or None when it cannot be built here
    ext.isa()             # the instruction-set path it was built for: "amx", "avx512_bf16", "avx512", "avx2", "portable"
    load("avx2")          # a narrower build of the same sources (tests: every path this CPU can run)

The sources are compiled by torch's own extension builder (g++, `-O3 -march=native -fopenmp`)
into `${KVMESH_CACHE_DIR:-~/.cache/kvmesh}/cpu-kernels/<key>/`, where the key hashes the source,
the headers, the flags, the torch version and this CPU's model and flags, so a cache copied to another
machine is rebuilt rather than run with instructions it may lack. A first build takes ~35 s on
two idle cores (the sources include only the ATen headers they use, `csrc/aten.h`); later
processes load the cached library in milliseconds. `KVMESH_CPU_KERNELS=0` turns them off (the
engine then runs the pure-torch reference kernels); `KVMESH_CPU_KERNELS=avx2` (any `PATHS` name)
makes the engine load that narrower build instead of the native one, so a benchmark can
stand in for a CPU that has less (with `ONEDNN_MAX_CPU_ISA` and `ATEN_CPU_CAPABILITY` for the GEMMs).

The code path is chosen at build time from the compiler's macros (`kernels/csrc/vec.h`): with
-march=native the widest this CPU has. A named `PATHS` entry adds -mno-... flags so the same CPU
also builds (and the tests check) the narrower paths; the engine always loads the native build.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import threading
from pathlib import Path
from typing import Callable

import torch

from kvmesh.common.model_files import cache_dir
from kvmesh.kernels import prebuilt
from kvmesh.kernels.cpu_features import cpu_flags

log = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
# the ATen headers every C++ extension's sources include (kernels/quant's too): in each build key
ATEN_HEADER = _CSRC / "aten.h"
SOURCES = tuple(_CSRC / name for name in ("attention.cpp", "attention_amx.cpp", "elementwise.cpp", "sampling.cpp", "lora.cpp", "small_gemm.cpp", "bindings.cpp"))
# NOTE: attention_amx.cpp takes the tile permission and the 16 x 16 transpose from the AMX home
HEADERS = (ATEN_HEADER, *(_CSRC / name for name in ("kernels.h", "vec.h", "attention_amx.h")),
           _CSRC.parent / "quant" / "csrc" / "amx_tiles.h")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno")
NAME = "kvmesh_cpu_kernels"

TORCH_LOCK = "lock"      # torch.utils.cpp_extension's FileBaton in the build directory
_lock = threading.Lock()
_state: dict[str | None, dict[str, object]] = {}
_default: tuple[dict, object] | None = None    # (the _state it came from, load()'s extension)

# path -> (flags added to CFLAGS, CPU flags the path needs). None: the native build, the widest.
PATHS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "amx": ((), ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")),
    "avx512_bf16": (("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"),
                    ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")),
    "avx512": (("-mno-avx512bf16",), ("avx512f", "avx512bw")),
    # NOTE: AVX-VNNI off too: an AVX2-only CPU's int8 dot products (maddubs + madd), not AVX-VNNI's
    "avx2": (("-mno-avx512f", "-mno-avxvnni"), ("avx2", "fma")),
    "portable": (("-mno-avx512f", "-mno-avx2", "-mno-fma"), ()),
}


def missing_flags(path: str) -> tuple[str, ...]:
    """The CPU flags `path` needs that this CPU lacks (empty: it can run it)."""
    have = cpu_flags()
    return tuple(f for f in PATHS[path][1] if f not in have)


def _flags(path: str | None) -> tuple[str, ...]:
    return CFLAGS if path is None else (*CFLAGS, *PATHS[path][0])


def _cpu_signature() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def build_key(path: str | None = None, sources: tuple[Path, ...] = SOURCES,
              headers: tuple[Path, ...] = HEADERS) -> str:
    h = hashlib.sha256()
    for src in (*sources, *headers):
        h.update(src.read_bytes())
    h.update(" ".join(_flags(path)).encode())
    h.update(torch.__version__.encode())
    h.update(_cpu_signature().encode())
    # NOTE: the sources' folder too: ninja's build file names sources by path, so two installs
    # with equal sources in one cache would rebuild each other's library on every load.
    h.update(str(sources[0].parent.resolve()).encode())
    return h.hexdigest()[:16]


_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def enabled() -> bool:
    return os.environ.get("KVMESH_CPU_KERNELS", "1").lower() not in _OFF


def requested_path() -> str | None:
    """The narrower path `KVMESH_CPU_KERNELS` names, or None (the native build)."""
    value = os.environ.get("KVMESH_CPU_KERNELS", "1").lower()
    if value in PATHS:
        return value
    if value not in (*_ON, *_OFF):
        raise ValueError(f"KVMESH_CPU_KERNELS={value!r}: expected 0, 1 or one of {', '.join(PATHS)}")
    return None


def build_or_reason(build: Callable[[], object]) -> tuple[object | None, str | None]:
    """(build(), None), or (None, why not): disabled, no compiler, the build failed. Every C++
    extension (these kernels, kernels/quant) goes through this one policy."""
    if not enabled():
        return None, "KVMESH_CPU_KERNELS=0"
    try:
        return build(), None
    except NoCompiler as e:
        return None, str(e)
    except Exception as e:   # noqa: BLE001 - any build failure means: run without them
        return None, f"build failed: {e}"


class NoCompiler(RuntimeError):
    """Nothing cached or prebuilt to load, and no compiler to build it."""


def load(path: str | None = None):
    """The built extension (`path`: one of PATHS, None: native or what KVMESH_CPU_KERNELS names),
    or None (disabled, no compiler, a CPU without the path's flags, build error: logged once)."""
    if path is None:
        # NOTE: every kernel call of a forward asks (~6 per layer): the engine's answer is
        # remembered, so KVMESH_CPU_KERNELS is read once per process (per `_state`: tests that
        # change the variable start a fresh one), not twice per call under the lock.
        fast = _default
        if fast is not None and fast[0] is _state:
            return fast[1]
        return _load_default()
    return _load(path)


def _load_default():
    global _default
    state = _state
    ext = _load(_resolve(None))
    _default = (state, ext)
    return ext


def _load(path: str | None):
    with _lock:
        state = _state.setdefault(path, {})
        if "ext" in state:
            return state["ext"]
        if enabled() and path is not None and missing_flags(path):
            ext, state["why"] = None, f"the {path} path needs {', '.join(missing_flags(path))}, which this CPU lacks"
        else:
            ext, state["why"] = build_or_reason(lambda: _build(path))
        if ext is None:
            log.warning("C++ CPU kernels unavailable (%s); using the torch reference kernels",
                        state["why"])
        else:
            where = prebuilt.root()
            how = ("prebuilt" if where is not None and str(ext.__file__).startswith(str(where))
                   else f"built with {' '.join(_flags(path))}")
            log.info("C++ CPU kernels: the %s path (%s)", ext.isa(), how)
        state["ext"] = ext
        return ext


def _resolve(path: str | None) -> str | None:
    return requested_path() if path is None and enabled() else path


def unavailable_reason(path: str | None = None) -> str | None:
    load(path)
    return _state[_resolve(path)].get("why")  # type: ignore[return-value]


def _build(path: str | None):
    # NOTE: one module name per path: two extensions of one name cannot share a process.
    name = NAME if path is None else f"{NAME}_{path}"
    return build_extension(name, "cpu-kernels", SOURCES, HEADERS, path)


def _prebuilt(name: str, subdir: str, sources: tuple[Path, ...], headers: tuple[Path, ...]):
    """The extension from KVMESH_PREBUILT_KERNELS (kernels/prebuilt.py), or None: none there for
    this CPU and these sources, or it does not load (then it is built here as usual)."""
    lib = prebuilt.find(name, subdir, sources, headers)
    if lib is None:
        return None
    try:
        ext = prebuilt.load(name, lib)
    except (ImportError, OSError) as e:
        log.warning("prebuilt %s in %s does not load (%s); building it here", name, lib.parent, e)
        return None
    log.info("%s: prebuilt for %s, from %s (no native build cached here)", name,
             lib.parent.name.rsplit("-", 1)[0], lib.parent)
    return ext


def cached() -> bool:
    """Whether loading the native CPU kernels compiles nothing: a build of them is cached here,
    or a prebuilt library fits this CPU."""
    return _cached(NAME, "cpu-kernels", SOURCES, HEADERS)


def _cached(name: str, subdir: str, sources: tuple[Path, ...], headers: tuple[Path, ...]) -> bool:
    try:
        if any((cache_dir() / subdir / build_key(None, sources, headers)).glob("*.so")):
            return True
    except OSError:
        return False
    return prebuilt.find(name, subdir, sources, headers) is not None


def build_extension(name: str, subdir: str, sources: tuple[Path, ...], headers: tuple[Path, ...],
                    path: str | None = None):
    """Compile (or load the cached build of) one extension: `sources` for `path` (None: native)
    into `<cache>/<subdir>/<key>/`, under the build lock below. Other kernel folders
    (kernels/quant) build through here, so every C++ extension shares the flags, the key and the
    lock."""
    from torch.utils import cpp_extension

    build_dir = cache_dir() / subdir / build_key(path, sources, headers)
    if path is None and not any(build_dir.glob("*.so")):
        ext = _prebuilt(name, subdir, sources, headers)
        if ext is not None:
            return ext
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise NoCompiler("no C++ compiler (c++) on PATH")
    build_dir.mkdir(parents=True, exist_ok=True)
    # NOTE: concurrent processes (a test run's workers, several servers) build once: the others
    # wait here and then load the result. torch's builder has a lock of its own, a plain file
    # that a build killed midway (OOM, SIGKILL, a restarted pod on a kept cache) leaves behind,
    # and every later load then waits on it forever. This flock is the kernel's: it goes with
    # its process, so whoever holds it knows a torch lock file still there is stale.
    with open(build_dir / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = build_dir / TORCH_LOCK
        if stale.exists():
            log.warning("removing %s, left by a C++ kernels build that did not finish", stale)
            stale.unlink()
        return cpp_extension.load(name=name, sources=[str(s) for s in sources],
                                  extra_cflags=list(_flags(path)), extra_ldflags=["-fopenmp"],
                                  build_directory=str(build_dir), verbose=False)


class PathExtensions:
    """Another C++ extension built per machine as these kernels are (`build_extension`), one
    build per `PATHS` name (None: native), each loaded once and remembered with the reason it is
    missing (logged once). The quantized GEMMs' extensions are two of these."""

    def __init__(self, name: str, subdir: str, sources: tuple[Path, ...],
                 headers: tuple[Path, ...], what: str) -> None:
        self.name, self.subdir, self.sources, self.headers, self.what = name, subdir, sources, headers, what
        self.state: dict[str | None, tuple[object | None, str | None]] = {}   # path -> (ext, why)
        self._lock = threading.Lock()

    def load(self, path: str | None = None):
        """The built extension (`path`: a `PATHS` name, None: native), or None (disabled, no
        compiler, a CPU without the path's flags, build error)."""
        # NOTE: every quantized GEMM of a forward asks (4 a layer): a path loaded (or refused)
        # before is answered without the lock (a dict read is atomic; entries are never removed)
        hit = self.state.get(path)
        if hit is not None:
            return hit[0]
        with self._lock:
            if path not in self.state:
                missing = missing_flags(path) if path is not None else ()
                if missing:
                    ext, why = None, f"the {path} path needs {', '.join(missing)}"
                else:
                    # NOTE: one module name per path: two extensions of one name cannot share a process
                    name = self.name if path is None else f"{self.name}_{path}"
                    ext, why = build_or_reason(
                        lambda: build_extension(name, self.subdir, self.sources, self.headers, path))
                if ext is None:
                    log.warning("%s unavailable (%s)", self.what, why)
                self.state[path] = (ext, why)
            return self.state[path][0]

    def cached(self) -> bool:
        """Whether loading the native build compiles nothing (built here before, or prebuilt)."""
        return None in self.state or _cached(self.name, self.subdir, self.sources, self.headers)

    def unavailable_reason(self, path: str | None = None) -> str | None:
        self.load(path)
        return self.state[path][1]
