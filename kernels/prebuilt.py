"""C++ extensions built ahead of time for named CPU targets, shipped in the image, loaded without a
compiler when this machine has no native build cached.

    python -m kvmesh.kernels.prebuilt DIR [--targets avx512_bf16,avx2]           # at image build
    KVMESH_PREBUILT_KERNELS=DIR kvmesh serve ...                                  # at run time

A native build (`-march=native`, cpu_kernels) is keyed by this CPU's model and flags, so one
built on the image builder never matches a node. A target here is built for an ISA level instead
(`-march=x86-64-v3` or `x86-64-v4`, with AVX-VNNI, AVX512-VNNI, AVX512-BF16, AMX where named), into
`DIR/<subdir>/<target>-<key>/`,
the key hashing the sources, headers, flags and torch version but no machine. At load, the widest
target whose CPU flags this machine has is imported as it is (no ninja, no compiler). The image
puts the OpenMP runtime the libraries need (`libgomp.so.1`) in DIR itself, for images without
one: it is loaded first, so the libraries find it by name.

NOTE: a native build already cached wins (it is tuned for this CPU); a prebuilt library only
replaces the first, minutes-long build of a fresh pod.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch

from kvmesh.kernels.cpu_features import cpu_flags

log = logging.getLogger(__name__)

ENV = "KVMESH_PREBUILT_KERNELS"
_V3 = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe")
_V4 = (*_V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
# target -> (compiler flags in place of -march=native, CPU flags it needs); widest first. The
# macros the sources test (kernels/csrc/vec.h, kernels/quant/csrc) pick each one's code paths:
# AVX512-BF16 for the CPU kernels, the int8 dot product's VNNI (AVX512-VNNI, AVX-VNNI) for the
# quantized GEMM. NOTE: every CPU with AVX512-BF16 known (Cooper Lake, Sapphire Rapids, Zen 4)
# also has AVX512-VNNI.
TARGETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # Sapphire Rapids and later: AMX tiles (the quantized GEMM's AMX path) over avx512_bf16
    "amx": (("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mamx-int8"),
            (*_V4, "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")),
    "avx512_bf16": (("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"),
                    (*_V4, "avx512_vnni", "avx512_bf16")),
    "avx512_vnni": (("-march=x86-64-v4", "-mavx512vnni"), (*_V4, "avx512_vnni")),
    "avx512": (("-march=x86-64-v4",), _V4),
    "avx2_vnni": (("-march=x86-64-v3", "-mavxvnni"), (*_V3, "avx_vnni")),
    "avx2": (("-march=x86-64-v3",), _V3),
}
CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno")
LDFLAGS = ("-fopenmp",)
RUNTIME = "libgomp.so.1"


def root() -> Path | None:
    value = os.environ.get(ENV)
    return Path(value) if value else None


def target_key(target: str, sources: tuple[Path, ...], headers: tuple[Path, ...]) -> str:
    h = hashlib.sha256()
    for src in (*sources, *headers):
        h.update(src.read_bytes())
    h.update(" ".join((*CFLAGS, *TARGETS[target][0], *LDFLAGS)).encode())
    h.update(torch.__version__.encode())
    return f"{target}-{h.hexdigest()[:16]}"


def runnable(flags: frozenset[str] | None = None) -> list[str]:
    """The targets this CPU runs, widest first."""
    have = cpu_flags() if flags is None else flags
    return [t for t, (_, needs) in TARGETS.items() if all(f in have for f in needs)]


def find(name: str, subdir: str, sources: tuple[Path, ...], headers: tuple[Path, ...],
         where: Path | None = None, flags: frozenset[str] | None = None) -> Path | None:
    """The library of the widest runnable target built from these very sources, or None."""
    where = root() if where is None else where
    if where is None:
        return None
    for target in runnable(flags):
        lib = where / subdir / target_key(target, sources, headers) / f"{name}.so"
        if lib.is_file():
            return lib
    return None


def load(name: str, lib: Path, where: Path | None = None):
    """Import the extension module `name` from the library `lib` (of the prebuilt folder
    `where`, default KVMESH_PREBUILT_KERNELS), its OpenMP runtime first if the folder has one."""
    where = root() if where is None else where
    if where is not None and (where / RUNTIME).is_file():
        ctypes.CDLL(str(where / RUNTIME), mode=ctypes.RTLD_GLOBAL)
    loader = importlib.machinery.ExtensionFileLoader(name, str(lib))
    spec = importlib.util.spec_from_file_location(name, str(lib), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def build(name: str, subdir: str, sources: tuple[Path, ...], headers: tuple[Path, ...],
          target: str, out: Path) -> Path:
    """Compile one extension for `target` under `out`; the library's path."""
    from torch.utils import cpp_extension

    build_dir = out / subdir / target_key(target, sources, headers)
    build_dir.mkdir(parents=True, exist_ok=True)
    # NOTE: is_python_module=False: the library is only dlopened, not imported, so one process
    # builds every target of one module name (an import of a second would clash with the first)
    cpp_extension.load(name=name, sources=[str(s) for s in sources],
                       extra_cflags=[*CFLAGS, *TARGETS[target][0]], extra_ldflags=list(LDFLAGS),
                       build_directory=str(build_dir), verbose=False, is_python_module=False)
    lib = build_dir / f"{name}.so"
    if not lib.is_file():
        raise RuntimeError(f"building {name} for {target} left no {lib} (one process builds one "
                           "target: torch renames a module built twice)")
    for leftover in build_dir.iterdir():            # keep the library only: the image stays small
        if leftover != lib:
            leftover.unlink()
    return lib


def extensions() -> list[tuple[str, str, tuple[Path, ...], tuple[Path, ...]]]:
    """(name, cache subdir, sources, headers) of every C++ extension kvmesh builds."""
    from kvmesh.kernels import cpu_kernels
    from kvmesh.kernels.quant import build as quant
    from kvmesh.kernels.quant import hf_build

    return [(cpu_kernels.NAME, "cpu-kernels", cpu_kernels.SOURCES, cpu_kernels.HEADERS),
            (quant.NAME, quant.SUBDIR, quant.SOURCES, quant.HEADERS),
            (hf_build.NAME, hf_build.SUBDIR, hf_build.SOURCES, hf_build.HEADERS)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmesh.kernels.prebuilt",
                                description="Build kvmesh's C++ extensions for named CPU targets "
                                "into DIR (serve with KVMESH_PREBUILT_KERNELS=DIR).")
    p.add_argument("out", type=Path, metavar="DIR")
    p.add_argument("--targets", default=",".join(TARGETS),
                   help=f"comma-separated, of {', '.join(TARGETS)} (default: all)")
    args = p.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        p.error(f"unknown target(s) {', '.join(unknown) or '(none)'}; use {', '.join(TARGETS)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if len(targets) > 1:
        # NOTE: a process of its own per target: torch's builder gives a module name built a
        # second time in one process (other flags) a new name, `NAME_v1`, which no loader asks for
        for target in targets:
            done = subprocess.run([sys.executable, "-m", "kvmesh.kernels.prebuilt", str(args.out),
                                   "--targets", target])
            if done.returncode != 0:
                return done.returncode
        return 0
    for target in targets:
        for name, subdir, sources, headers in extensions():
            lib = build(name, subdir, sources, headers, target, args.out)
            log.info("built %s for %s: %s", name, target, lib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
