"""Start-up warm-up of the attention kernels: which variants a model needs (a pure function of
its layers and the decode split counts), their launch (in the Triton interpreter here), and,
where CUDA is present, that serving then compiles nothing."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from kvmesh.engine.kernel_warmup import (AttentionVariant, attention_specs, attention_variants,
                                         prepare_attention, query_dtype, uses_triton, warm_attention)
from kvmesh.engine.layers.attention import Attention, AttentionSpec
from kvmesh.kernels import reference

GLOBAL = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25)
LOCAL = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25, sliding_window=32,
                      softcap=30.0, rope="local")


def _model(ops, specs) -> nn.Module:
    return nn.ModuleList([Attention(64, s, ops) for s in specs])


def test_variants_per_layer_spec_and_split_count():
    assert attention_variants([GLOBAL, LOCAL], [4, 1, 2, 2]) == [
        AttentionVariant("decode", 4, 2, 16, 0, 0.0, 1),
        AttentionVariant("decode", 4, 2, 16, 0, 0.0, 2),
        AttentionVariant("decode", 4, 2, 16, 0, 0.0, 4),
        AttentionVariant("unified", 4, 2, 16, 0, 0.0),
        AttentionVariant("decode", 4, 2, 16, 32, 30.0, 1),
        AttentionVariant("decode", 4, 2, 16, 32, 30.0, 2),
        AttentionVariant("decode", 4, 2, 16, 32, 30.0, 4),
        AttentionVariant("unified", 4, 2, 16, 32, 30.0),
    ]


def test_specs_are_the_distinct_layers_in_order():
    pytest.importorskip("triton")
    from kvmesh.kernels import triton_ops
    model = _model(triton_ops, [LOCAL, GLOBAL, LOCAL, GLOBAL])
    assert attention_specs(model) == [LOCAL, GLOBAL]
    assert uses_triton(model) and not uses_triton(_model(reference, [GLOBAL]))


def test_off_cuda_nothing_is_prepared():
    model = _model(reference, [GLOBAL])
    cache = torch.zeros(4, 8, 2, 16)
    assert prepare_attention(model, [(cache, cache)], 8, 2048, torch.device("cpu")) is None


def test_warm_launches_every_variant(monkeypatch):
    """Each variant is launched once, with the planner's split settings and workspace; the
    kernels run (interpreter) on a query laid out as the model's strided QKV view."""
    pytest.importorskip("triton")
    from kvmesh.kernels import paged_attention, prefill_attention
    from kvmesh.kernels.decode_plan import DecodePlanner

    calls = []

    def recording(name, real):
        def run(query, *args, **kw):
            calls.append((name, query.stride(0), kw.get("num_splits"), kw.get("sliding_window"),
                          kw.get("softcap"), kw.get("min_split_tokens")))
            return real(query, *args, **kw)
        return run

    monkeypatch.setattr(paged_attention, "paged_decode_attention",
                        recording("decode", paged_attention.paged_decode_attention))
    monkeypatch.setattr(prefill_attention, "unified_attention",
                        recording("unified", prefill_attention.unified_attention))
    planner = DecodePlanner(max_num_seqs=4, num_heads=4, num_kv_heads=2, head_dim=16,
                            max_model_len=2048, num_sms=2, device="cpu")
    assert planner.variants() == [1, 2]
    cache = torch.zeros(4, 8, 2, 16)
    seconds = warm_attention(attention_variants([GLOBAL, LOCAL], planner.variants()),
                             (cache, cache.clone()), planner)
    assert seconds > 0
    # the query's row stride: the fused QKV width (a one-token view reports the q part's)
    one, qkv = 4 * 16, 4 * 16 + 2 * 2 * 16
    assert calls == [(k, stride, n, w, cap, m) for w, cap in ((0, 0.0), (32, 30.0)) for k, stride, n, m in (
        ("decode", one, 1, 512), ("decode", qkv, 1, 512), ("decode", one, 2, 512),
        ("decode", qkv, 2, 512), ("unified", qkv, None, None), ("unified", one, None, None))]


def test_an_8_bit_cache_is_warmed_with_the_models_queries(monkeypatch):
    """The warm-up's queries take the model's dtype (its norms'), not the 8-bit cache's, and
    the kernels run on the codes (interpreter)."""
    pytest.importorskip("triton")
    from kvmesh.kernels import paged_attention
    from kvmesh.kernels.decode_plan import DecodePlanner

    model = torch.nn.Module()
    model.input_layernorm = torch.nn.Module()
    model.input_layernorm.weight = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    assert query_dtype(model, torch.float8_e4m3fn) == torch.bfloat16
    assert query_dtype(model, torch.float16) == torch.float16
    with pytest.raises(ValueError, match="no norm weight found"):
        query_dtype(torch.nn.Linear(2, 2), torch.float8_e5m2)
    seen = []
    real = paged_attention.paged_decode_attention
    monkeypatch.setattr(paged_attention, "paged_decode_attention",
                        lambda q, k, *a, **kw: seen.append((q.dtype, k.dtype)) or real(q, k, *a, **kw))
    planner = DecodePlanner(max_num_seqs=2, num_heads=4, num_kv_heads=2, head_dim=16,
                            max_model_len=64, num_sms=2, device="cpu")
    cache = torch.zeros(4, 8, 2, 16, dtype=torch.float8_e4m3fn)
    warm_attention(attention_variants([GLOBAL], [1]), (cache, cache.clone()), planner, torch.bfloat16)
    assert seen == [(torch.bfloat16, torch.float8_e4m3fn)] * 2


def _compiled(kernel) -> int:
    return sum(len(caches[0]) for caches in kernel.device_caches.values())


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs CUDA and TRITON_INTERPRET=0: Triton compiles for a GPU only there "
                           "(the interpreter compiles nothing)")
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_after_start_up_serving_compiles_nothing(enforce_eager, kv_cache_dtype, tmp_path):
    """A GQA model on the GPU (Triton): decodes at short and long context and batch sizes 1..5
    and prefills add no compiled attention variant after start-up (an 8-bit cache's variants
    included). A tiny model with its own word tokenizer, so the GPU machine needs no download."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvmesh.common.config import EngineConfig
    from kvmesh.engine.engine import LLMEngine
    from kvmesh.engine.sampling_params import SamplingParams
    from kvmesh.kernels import paged_attention, prefill_attention

    kernels = (paged_attention._decode_split_kernel, paged_attention._decode_reduce_kernel,
               prefill_attention._unified_attention_kernel)
    from tiny_models import save_tiny_model
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=2048)
    torch.manual_seed(0)
    path = save_tiny_model(LlamaForCausalLM(cfg), tmp_path / "gqa")
    eng = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="bfloat16", max_model_len=2048,
                                 max_num_seqs=8, enforce_eager=enforce_eager,
                                 cudagraph_capture_sizes=(1, 2, 4, 8), kv_cache_dtype=kv_cache_dtype))
    assert eng.runner.decode_planner is not None
    before = [_compiled(k) for k in kernels]
    for n, words in ((1, 2), (3, 400), (5, 30)):
        for i in range(n):
            eng.add_request(f"{n}-{i}", "w7 " * words + f"w{10 + i}",
                            SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()
    assert [_compiled(k) for k in kernels] == before


class _RecordingModel(nn.Module):
    """Stands in for a model (the runner's planner is CUDA-only, so it is set by hand here):
    records the decode launch each forward is given."""

    def __init__(self) -> None:
        super().__init__()
        self.launches = []

    def forward(self, input_ids, positions, kv_caches, meta):
        self.launches.append(meta.decode_launch)
        return torch.zeros(input_ids.shape[0], 8)

    def compute_logits(self, hidden):
        return torch.zeros(hidden.shape[0], 16)


def test_runner_gives_eager_steps_the_rule_and_graph_steps_the_fixed_count():
    from kvmesh.engine.model_runner import ModelRunner
    from kvmesh.engine.runner_options import RunnerOptions
    from kvmesh.kernels.decode_plan import DecodePlanner

    model = _RecordingModel()
    runner = ModelRunner(model, num_layers=1, num_kv_heads=2, head_dim=16, block_size=16,
                         num_gpu_blocks=64, num_cpu_blocks=0, dtype=torch.float32,
                         device=torch.device("cpu"),
                         options=RunnerOptions(max_num_seqs=4, max_model_len=1024))
    assert runner.decode_planner is None                # off CUDA: nothing prepared
    runner.decode_planner = DecodePlanner(4, 4, 2, 16, 1024, num_sms=64, device="cpu")
    assert runner.decode_planner.graph_splits == {1: 2, 2: 2, 3: 2, 4: 2}
    batch = runner.input_batch
    table = list(range(1, 9))

    def decode_step(context: int):
        batch.begin()
        batch.add("a", [5] * context, context - 1, 1, table)
        return batch.finish([0])

    runner.run_model(decode_step(100))       # eager, short context: one split, one launch
    runner._forward(decode_step(100))         # a graph step: the size's fixed count
    runner.run_model(decode_step(1024))      # eager at the longest context: the same as the graph
    batch.begin()
    batch.add("b", [5] * 40, 0, 40, table)   # a prefill: no decode launch
    runner.run_model(batch.finish([39]))
    assert [(x.num_splits, x.min_split_tokens) if x else None for x in model.launches] == [
        (1, 512), (2, 512), (2, 512), None]
    assert model.launches[1].workspace is runner.decode_planner.workspace
