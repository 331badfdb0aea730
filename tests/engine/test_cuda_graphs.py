"""CUDA graphs for decode: the capture sizes, the padding choice, and (where CUDA is present)
replay against eager, token for token."""
from __future__ import annotations

import pytest
import torch

from kvmesh.engine.cuda_graphs import (capture_sizes, default_capture_sizes, graph_sizes_reason,
                                       padded_size)


def test_default_sizes_follow_vllm_grid():
    assert default_capture_sizes(4) == [1, 2, 4]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = default_capture_sizes(512)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-3:] == [480, 496, 512]
    assert len(sizes) == 3 + 31 + 17


def test_sizes_are_bounded_by_max_num_seqs_and_the_flags():
    assert capture_sizes(128)[-1] == 128
    assert capture_sizes(1024)[-1] == 512
    assert capture_sizes(128, max_size=32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(16, requested=[8, 1, 64, 8, 3]) == [1, 3, 8]


def test_a_batch_pads_to_the_next_size():
    sizes = [1, 2, 4, 8, 16]
    assert [padded_size(sizes, n) for n in (1, 3, 4, 5, 16, 17)] == [1, 4, 4, 8, 16, None]
    assert padded_size([], 1) is None


def test_why_no_graphs():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert graph_sizes_reason(cpu, "cpu", False, 1) == "the device is cpu, not cuda"
    assert graph_sizes_reason(cuda, "triton", True, 1) == "--enforce-eager"
    assert "host" in graph_sizes_reason(cuda, "reference", False, 1)
    assert "tensor parallelism" in graph_sizes_reason(cuda, "triton", False, 2)
    assert graph_sizes_reason(cuda, "triton", False, 1) is None


def test_the_engine_on_cpu_captures_nothing(smollm, caplog):
    from kvmesh.common.config import EngineConfig
    from kvmesh.engine.engine import LLMEngine
    with caplog.at_level("DEBUG", logger="kvmesh.engine"):
        eng = LLMEngine(EngineConfig(max_model_len=64, num_kv_blocks=16), loaded=smollm)
    assert eng.runner.cuda_graphs is None and eng.runner.pad_sizes == []
    # NOTE: at DEBUG on a CPU (its start-up log stays its own phases), INFO on a CUDA device
    off = [r for r in caplog.records if r.getMessage() == "CUDA graphs: off (the device is cpu, not cuda)"]
    assert [r.levelname for r in off] == ["DEBUG"]


_NO_CUDA = "needs CUDA (a GPU) and Triton: graphs capture only there; CPU runs the padded eager path"


@pytest.mark.skipif(not torch.cuda.is_available(), reason=_NO_CUDA)
def test_graph_replay_matches_eager_token_for_token():
    from kvmesh.common.config import EngineConfig
    from kvmesh.engine.engine import LLMEngine
    from kvmesh.engine.sampling_params import SamplingParams

    prompts = ["Hello", "The capital of France is", "1, 2, 3,", "def f(x):", "Once upon a time"]

    def run(enforce_eager):
        eng = LLMEngine(EngineConfig(device="cuda", dtype="float32", max_model_len=256,
                                     max_num_seqs=8, enforce_eager=enforce_eager,
                                     cudagraph_capture_sizes=(1, 2, 4, 8)))
        assert (eng.runner.cuda_graphs is None) == enforce_eager
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, SamplingParams(max_tokens=8 + 4 * i, temperature=0,
                                                       ignore_eos=True))
        out = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    out[o.request_id] = o.outputs[0].token_ids
        return out

    assert run(False) == run(True)
