"""vLLM's step breakdown from a torch profiler trace: self times by the nearest category."""
from __future__ import annotations

import gzip
import json
import re
import time

import pytest
import torch

from benchmarks import torch_trace_breakdown as ttb


def _x(name: str, ts: float, dur: float, tid: int = 7) -> dict:
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def synthetic_trace() -> dict:
    """Two steps (µs): the first a prefill with every scope, the second a bare decode."""
    step1 = [
        _x("execute_context_1(8)_generation_0(0)", 1000, 1000),
        _x("gpu_model_runner: preprocess", 1010, 40),
        _x("aten::copy_", 1020, 10),                           # runner_input (inherited)
        _x("gpu_model_runner: forward", 1060, 800),
        _x("## Call CompiledFxGraph None ##", 1070, 780),
        _x("_C::onednn_mm", 1080, 300),
        _x("vllm::unified_kv_cache_update", 1400, 50),
        _x("_C::cpu_attn_reshape_and_cache", 1405, 40),
        _x("vllm::unified_attention_with_output", 1460, 200),
        _x("_C::cpu_attention_with_kv_cache", 1470, 180),
        _x("gpu_model_runner: postprocess", 1870, 90),
        _x("_C::onednn_mm", 1875, 60),                          # the logits: lm_head
        # as vLLM's worker does, sampling in a call of its own after execute_model
        _x("gpu_model_runner: sample", 2050, 30),
        _x("_C::greedy_argmax", 2055, 20),                      # sampling (inherited)
        _x("aten::copy_", 2200, 10),                            # the worker's, between steps
    ]
    step2 = [
        _x("execute_context_0(0)_generation_1(1)", 2500, 100),
        _x("gpu_model_runner: forward", 2510, 80),
        _x("aten::mm", 2520, 50),
    ]
    other_thread = [_x("aten::empty", 1500, 5, tid=9)]        # not the worker's thread
    before = [_x("gpu_model_runner: forward", 100, 300), _x("_C::onednn_mm", 150, 200)]
    return {"traceEvents": step1 + step2 + other_thread + before + [{"ph": "M", "name": "process_name"}]}


def test_self_times_go_to_the_nearest_category(tmp_path):
    path = tmp_path / "w.pt.trace.json"
    path.write_text(json.dumps(synthetic_trace()))
    b = ttb.breakdown(ttb.load_events(str(path)))
    us = {k: round(v * 1e6, 6) for k, v in b.seconds.items()}
    assert us == {
        "gemm": 300 + 50, "lm_head": 60, "attention": 200, "kv_write": 50,
        "compiled_fused": 780 - 300 - 50 - 200,
        "forward_other": (800 - 780) + (80 - 50), "runner_input": 40, "sampling": 30,
        "output": 90 - 60, "step_other": (1000 - 40 - 800 - 90) + 10 + (100 - 80),
        "outside_step": 2600 - 1000 - (1000 + 30 + 10 + 100),   # what no worker event covers
    }
    assert b.steps == 2 and b.wall_s == pytest.approx(1600e-6)
    assert sum(b.seconds.values()) == pytest.approx(b.wall_s)
    assert b.step_names["execute_context_1(8)_generation_0(0)"] == 1


def test_a_real_torch_profiler_trace_in_vllm_scopes(tmp_path, capsys):
    """The torch profiler's own Chrome trace (gzipped, as vLLM writes it by default)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    x, w, head = torch.randn(16, 64), torch.randn(64, 64), torch.randn(64, 500)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for step in range(3):
            with record_function(f"execute_context_0(0)_generation_16({16 + step})"):
                with record_function("gpu_model_runner: preprocess"):
                    ids = torch.arange(16)
                with record_function("gpu_model_runner: forward"):
                    with record_function("## Call CompiledFxGraph None ##"):
                        h = torch.nn.functional.silu(torch.mm(x, w))
                with record_function("gpu_model_runner: postprocess"):
                    logits = torch.mm(h, head)
                with record_function("gpu_model_runner: sample"):
                    logits.argmax(dim=-1) + ids
            time.sleep(0.002)        # the engine core's turn: outside the worker's step
    trace = tmp_path / "rank0.1.pt.trace.json"
    prof.export_chrome_trace(str(trace))
    gz = tmp_path / "rank0.1.pt.trace.json.gz"
    gz.write_bytes(gzip.compress(trace.read_bytes()))

    assert ttb.main([str(gz)]) == 0
    out = capsys.readouterr().out
    assert "3 steps" in out
    rows = dict(re.findall(r"^\| (\w+) \| ([\d.]+) \|", out, re.MULTILINE))
    for part in ("gemm", "lm_head", "compiled_fused", "runner_input", "sampling", "outside_step"):
        assert float(rows[part]) > 0, part
    assert float(rows["attention"]) == 0 and float(rows["kv_write"]) == 0
    total = float(re.search(r"\*\*step total\*\* \| ([\d.]+)", out).group(1))
    assert sum(float(v) for v in rows.values()) == pytest.approx(total, abs=5e-5 * (len(rows) + 1))


def test_a_file_that_is_no_trace_is_a_clear_error(tmp_path, capsys):
    empty = tmp_path / "x.json"
    empty.write_text(json.dumps({"traceEvents": [{"ph": "M", "name": "process_name"}]}))
    assert ttb.main([str(empty)]) == 2
    assert "no complete ('X') events" in capsys.readouterr().err
    no_steps = tmp_path / "y.json"
    no_steps.write_text(json.dumps({"traceEvents": [_x("aten::mm", 0, 5)]}))
    assert ttb.main([str(no_steps)]) == 2
    assert "no engine steps" in capsys.readouterr().err
    assert ttb.main([str(tmp_path / "missing.json")]) == 2
