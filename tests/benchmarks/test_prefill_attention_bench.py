"""benchmarks/prefill_attention.py: refuses --device cuda without a GPU; its --device cpu smoke
path (the interpreter, a tiny shape) runs every applicable path exactly against SDPA."""
import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from benchmarks import prefill_attention as bench  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the bench would run")
def test_refuses_cuda_without_a_gpu(capsys):
    assert bench.main(["--device", "cuda"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_cpu_smoke_rows_and_errors(capsys):
    assert bench.main(["--device", "cpu", "--shapes", "1x20"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("    1x20")]
    assert [r[1] for r in rows] == ["sdpa", "route-sdpa", "unified"]
    assert all(float(r[-1]) < 2e-3 for r in rows)        # max abs error vs SDPA, fp16
