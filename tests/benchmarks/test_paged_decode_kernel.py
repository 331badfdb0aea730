"""The GPU benchmark is not run here; on a machine without CUDA it must refuse clearly."""
import pytest

pytest.importorskip("triton")

import torch  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the bench would run")
def test_bench_refuses_without_cuda(capsys):
    from benchmarks import paged_decode_kernel as bench
    assert bench.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
