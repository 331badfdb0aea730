"""Prebuilt C++ extensions (kernels/prebuilt.py, issue 27): built for a named CPU target, found by
the widest target this CPU runs and by the very sources, loaded without compiling when no native
build is cached, and built natively when the prebuilt library does not load. A probe extension
of a few lines stands in for the kernels (it compiles in seconds; the kernels take minutes)."""
from __future__ import annotations

import logging

import pytest

from kvmesh.kernels import cpu_kernels, prebuilt

PROBE = """
#include <pybind11/pybind11.h>
#include <omp.h>

static int threads() {
    int n = 0;
#pragma omp parallel reduction(+ : n)
    n += 1;
    return n;
}

static const char* isa() {
#if defined(__AVX512BF16__)
    return "avx512_bf16";
#elif defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "portable";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("isa", &isa);
    m.def("threads", &threads);
}
"""
V3 = frozenset(prebuilt.TARGETS["avx2"][1])
V4_BF16 = frozenset(prebuilt.TARGETS["avx512_bf16"][1])


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    """The probe's source, and a prebuilt folder holding its avx2 build."""
    src_dir = tmp_path_factory.mktemp("probe-src")
    source = src_dir / "probe.cpp"
    source.write_text(PROBE)
    out = tmp_path_factory.mktemp("prebuilt")
    lib = prebuilt.build("kvmesh_probe_build", "probe", (source,), (), "avx2", out)
    return source, out, lib


def test_a_target_build_keeps_only_its_library_under_a_key_without_the_machine(probe):
    source, out, lib = probe
    key = prebuilt.target_key("avx2", (source,), ())
    assert lib == out / "probe" / key / "kvmesh_probe_build.so"
    assert sorted(p.name for p in lib.parent.iterdir()) == ["kvmesh_probe_build.so"]
    assert key.startswith("avx2-") and key != prebuilt.target_key("avx512", (source,), ())


def test_find_takes_the_widest_target_built_that_this_cpu_runs(probe):
    source, out, lib = probe
    def find(flags):
        return prebuilt.find("kvmesh_probe_build", "probe", (source,), (), where=out, flags=flags)
    assert prebuilt.runnable(V4_BF16) == ["avx512_bf16", "avx512_vnni", "avx512", "avx2"]
    assert prebuilt.runnable(V4_BF16 | {"amx_tile", "amx_bf16", "amx_int8"}) == [
        "amx", "avx512_bf16", "avx512_vnni", "avx512", "avx2"]
    assert prebuilt.runnable(V3 | {"avx_vnni"}) == ["avx2_vnni", "avx2"]
    assert prebuilt.runnable(V3) == ["avx2"]
    assert find(V4_BF16) == lib            # avx512 targets not built: the avx2 one
    assert find(V3) == lib
    assert find(V3 - {"avx2"}) is None     # a CPU without AVX2 runs none of them
    assert prebuilt.find("kvmesh_probe_build", "probe", (source,), (), flags=V3) is None  # no folder


def test_other_sources_never_find_a_library_built_from_these(probe, tmp_path):
    source, out, _ = probe
    changed = tmp_path / "probe.cpp"
    changed.write_text(PROBE + "\n// changed\n")
    assert prebuilt.find("kvmesh_probe_build", "probe", (changed,), (), where=out, flags=V3) is None


def test_with_no_native_build_cached_the_prebuilt_library_is_loaded_without_compiling(
        probe, tmp_path, monkeypatch, caplog):
    source, out, lib = probe
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(prebuilt.ENV, str(out))
    monkeypatch.setattr(prebuilt, "cpu_flags", lambda: V3)
    with caplog.at_level(logging.INFO, logger="kvmesh.kernels.cpu_kernels"):
        ext = cpu_kernels.build_extension("kvmesh_probe_build", "probe", (source,), ())
    assert (ext.isa(), ext.__file__) == ("avx2", str(lib))
    assert ext.threads() >= 1
    assert not (tmp_path / "cache").exists()           # nothing compiled, no build folder
    assert f"kvmesh_probe_build: prebuilt for avx2, from {lib.parent}" in caplog.text


def test_a_prebuilt_library_that_does_not_load_is_built_here_instead(probe, tmp_path, monkeypatch,
                                                                      caplog):
    source, _, _ = probe
    out = tmp_path / "prebuilt"
    broken = out / "probe" / prebuilt.target_key("avx2", (source,), ()) / "kvmesh_probe_broken.so"
    broken.parent.mkdir(parents=True)
    broken.write_bytes(b"\x7fELF truncated by a bad copy")       # the fault
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(prebuilt.ENV, str(out))
    monkeypatch.setattr(prebuilt, "cpu_flags", lambda: V3)
    with caplog.at_level(logging.WARNING, logger="kvmesh.kernels.cpu_kernels"):
        ext = cpu_kernels.build_extension("kvmesh_probe_broken", "probe", (source,), ())
    assert f"prebuilt kvmesh_probe_broken in {broken.parent} does not load" in caplog.text
    assert ext.__file__.startswith(str(tmp_path / "cache" / "probe"))   # the native build


def test_an_image_without_a_compiler_loads_the_prebuilt_library_and_says_why_when_none_fits(
        probe, tmp_path, monkeypatch):
    source, out, lib = probe
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(prebuilt.ENV, str(out))
    monkeypatch.setattr(prebuilt, "cpu_flags", lambda: V3)
    build = lambda: cpu_kernels.build_extension("kvmesh_probe_build", "probe", (source,), ())  # noqa: E731
    ext, why = cpu_kernels.build_or_reason(build)
    assert (ext.isa(), why) == ("avx2", None)
    monkeypatch.setattr(prebuilt, "cpu_flags", lambda: V3 - {"avx2"})       # none fits this CPU
    assert cpu_kernels.build_or_reason(build) == (None, "no C++ compiler (c++) on PATH")


def test_a_second_target_of_one_name_in_one_process_is_a_clear_error(probe, tmp_path):
    """The fault main() avoids with a process per target: torch renames the module it builds a
    second time (other flags) to NAME_v1, so the library the loader looks for is not there."""
    source, _, _ = probe
    with pytest.raises(RuntimeError, match=r"building kvmesh_probe_build for avx512 left no .*"
                       r"kvmesh_probe_build\.so \(one process builds one target"):
        prebuilt.build("kvmesh_probe_build", "probe", (source,), (), "avx512", tmp_path)


def test_the_command_line_refuses_an_unknown_target(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        prebuilt.main([str(tmp_path), "--targets", "avx2,sse2"])
    assert e.value.code == 2
    assert ("unknown target(s) sse2; use amx, avx512_bf16, avx512_vnni, avx512, avx2_vnni, avx2"
            in capsys.readouterr().err)
