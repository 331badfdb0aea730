"""benchmarks/quant_gemm_gpu.py: refuses --device cuda without a GPU and unknown names; its
--device cpu smoke path (the interpreter, a tiny shape) runs every CPU-applicable path and
reports each within its bf16 output rounding of the reference."""
import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from benchmarks import quant_gemm_gpu as bench  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the bench would run")
def test_refuses_cuda_without_a_gpu(capsys):
    assert bench.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_refuses_unknown_shapes_and_paths(capsys):
    assert bench.main(["--device", "cpu", "--shapes", "huge", "--paths", "dense,w2a4"]) == 2
    assert "unknown shape or path: huge, w2a4" in capsys.readouterr().err


def test_cpu_smoke_rows_and_errors(capsys):
    assert bench.main(["--device", "cpu", "--rows", "3"]) == 0
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| tiny")]
    assert [(r[0], r[1], r[2]) for r in rows] == [("tiny 40x128", "3", p) for p in ("dense", "w4a16", "w4a16-dequant", "w4a16-gemv", "w8a8", "fp8",
                                                                               "fp8-token")]
    # bf16 results: one rounding (2^-8 of the largest value) plus float32 accumulation over K = 128
    assert all(float(r[-1]) <= 2.0 ** -8 + 130 * 2.0 ** -24 for r in rows), rows


def test_w4a16_split_paths_run_the_fused_kernel_split(capsys):
    assert bench.main(["--device", "cpu", "--rows", "3", "--paths", "w4a16-k2,w4a16-k4"]) == 0
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| tiny")]
    assert [r[2] for r in rows] == ["w4a16-k2", "w4a16-k4"]
    assert all(float(r[-1]) <= 2.0 ** -8 + 130 * 2.0 ** -24 for r in rows), rows


def test_gemv_sweep_times_every_tile_and_names_the_best(capsys, monkeypatch):
    monkeypatch.setattr(bench, "SWEEP", [(8, 128, 2), (2, 64, 2), (16, 32, 1)])
    assert bench.main(["--device", "cpu", "--rows", "3,20", "--gemv-sweep"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out if line.startswith("| tiny")]
    # M 20 is past the GEMV's 16 rows: swept at M 3 only, the three tiles, each within bf16 rounding
    assert sorted(r[1] for r in rows) == ["(16, 32, 1)", "(2, 64, 2)", "(8, 128, 2)"]
    assert {r[0] for r in rows} == {"tiny 40x128, M 3"}
    assert all(float(r[4]) <= 2.0 ** -8 + 130 * 2.0 ** -24 for r in rows), rows
    assert [line for line in out if line.startswith("# best tiny 40x128, M 3: (")]
    assert [r for r in rows if len(r) > 5 and r[5] == "default"] == [r for r in rows if r[1] == "(8, 128, 2)"]


def test_w8g_paths_run_each_route_of_the_8_bit_group_gemm(capsys):
    """Not in the default paths; the GEMV route only where M fits it (20 > 16 rows: left out)."""
    assert bench.main(["--device", "cpu", "--rows", "3,20", "--paths", "dense,w8g,w8g-gemv,w8g-dequant"]) == 0
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| tiny")]
    assert [(r[1], r[2]) for r in rows] == [("3", "dense"), ("3", "w8g"), ("3", "w8g-gemv"), ("3", "w8g-dequant"),
                                            ("20", "dense"), ("20", "w8g"), ("20", "w8g-dequant")]
    assert all(float(r[-1]) <= 2.0 ** -8 + 130 * 2.0 ** -24 for r in rows), rows
