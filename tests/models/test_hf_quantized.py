"""Hugging Face quantized checkpoints (AWQ, GPTQ, compressed-tensors W8A8 / FP8) served quantized
on CPU (the C++ GEMMs) and on a CUDA GPU (the Triton GEMMs; those tests run where CUDA is present
and TRITON_INTERPRET=0), against the same checkpoint dequantized at load (`--quantization none`).

The checkpoints are made from one tiny random Llama by benchmarks/quant_checkpoints.py
(compressed-tensors' own library for W8A8 / FP8; AWQ and GPTQ packed per the formats' documented
layouts, since AutoAWQ and AutoGPTQ do not install without CUDA). Each test also checks that the
loader's dequantized weight is exactly the one the writer quantized: the unpacking is tested
against the packing, not against itself.
"""
from __future__ import annotations

import json
import logging
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from benchmarks.quant_checkpoints import (awq_tensors, ct_tensors, make_checkpoint, quant_config,
                                         write_checkpoint)
from kvmesh.engine.layers.hf_quantized import HFQuantizedLinear, hf_quantized_bytes
from kvmesh.engine.loader import load_model
from kvmesh.engine.quantization.serving import serve_quantized
from kvmesh.engine.quantization.hf_config import parse_quantization_config
from kvmesh.kernels.quant import hf_build, hf_weight
from kvmesh.kernels.quant.hf_weight import Fp8Weight
from tests.models.conftest import prompt_logprob_diffs

cpu_kernels = pytest.mark.skipif(hf_build.load() is None,
                                 reason=f"quantized kernels unavailable: {hf_build.unavailable_reason()}")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "0",
                                reason="needs a CUDA GPU and TRITON_INTERPRET=0 (the Triton GEMMs)")



@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiny_models import save_tiny_model
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=512,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return save_tiny_model(LlamaForCausalLM(cfg), tmp_path_factory.mktemp("tiny-float"), seed=3)


def _against_dequantized(quant, dense, label: str, paged_generate, *, prompt_seed: int, seed: int,
                         new_tokens: int, chunk: int):
    """Greedy runs of both models over three random prompts (307 tokens): (quantized outputs,
    dequantized outputs, |log-prob difference| of every prompt token), the mean printed."""
    g = torch.Generator().manual_seed(prompt_seed)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (120, 100, 90)]
    got = paged_generate(quant.model, prompts, new_tokens, block_size=16, prefill_chunk=chunk, seed=seed)
    ref = paged_generate(dense.model, prompts, new_tokens, block_size=16, prefill_chunk=chunk, seed=seed)
    diff = prompt_logprob_diffs(got, ref, prompts)
    print(f"{label}: mean |log-prob difference| over {diff.numel()} prompt tokens = "
          f"{diff.mean().item():.2e} (max {diff.max().item():.2e})")
    return got, ref, diff


CASES = {   # id: (method, options, mean |log-prob difference| bound, fused q/k/v)
    "awq": ("awq", {}, 1e-3, True),
    "gptq-act-order": ("gptq", {"desc_act": True, "sym": False}, 1e-3, False),
    "gptq-sym": ("gptq", {"desc_act": False, "sym": True}, 1e-3, True),
    # NOTE: int8 activations, one scale per token: this random model's hidden states span a wide
    # range, so the rounding costs ~0.1 nats a token (measured 0.119; the same model with its
    # activations fake-quantized per token in float32 is within 8e-3 of the kernels)
    "w8a8": ("compressed-tensors", {"kind": "int"}, 0.25, True),
}


CUDA_CASES = {   # the same on the GPU, and FP8 (GPU only)
    **CASES,
    # NOTE: e4m3 keeps 3 mantissa bits: with each token's activations cast to it this random
    # model's log-probs move ~0.38 nats (the float64 reference GEMMs in place of the kernels on
    # CPU gave 0.379 per token, 0.404 per tensor); weight-only fp8 is exact to float32 rounding
    "fp8-per-token": ("compressed-tensors", {"kind": "float"}, 0.5, True),
    "fp8-weight-only": ("compressed-tensors", {"kind": "float", "weight_only": True}, 1e-3, True),
}


@cpu_kernels
@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_served_quantized_matches_dequantized(case, float_dir, tmp_path, paged_generate):
    _served_quantized_matches_dequantized(CASES[case], "cpu", float_dir, tmp_path / case, paged_generate)


@needs_cuda
@pytest.mark.parametrize("case", list(CUDA_CASES))
def test_checkpoint_served_quantized_on_cuda_matches_dequantized(case, float_dir, tmp_path, paged_generate):
    quant = _served_quantized_matches_dequantized(CUDA_CASES[case], "cuda", float_dir, tmp_path / case,
                                                  paged_generate)
    w = quant.model.model.layers[0].mlp.down_proj.weight      # the packed tensors live on the GPU
    assert (w.qweight if hasattr(w, "qweight") else w.weight).is_cuda
    if case.startswith("fp8"):
        assert w.activations == ("none" if case == "fp8-weight-only" else "token")


def _served_quantized_matches_dequantized(spec, device, float_dir, out, paged_generate):
    method, opts, bound, fused = spec
    path, deq = make_checkpoint(float_dir, out, method, **opts)
    quant = load_model(str(path), "float32", device=device, load_tokenizer=False, quantization=method)
    dense = load_model(str(path), "float32", device=device, load_tokenizer=False, quantization="none")
    assert quant.quantization == method and dense.quantization is None
    for module, want in deq.items():     # the loader reads back exactly what was packed
        assert torch.equal(dense.model.get_submodule(module).weight.cpu(), want), module
    layer = quant.model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, HFQuantizedLinear) and isinstance(layer.mlp.down_proj, HFQuantizedLinear)
    assert type(quant.model.lm_head) is nn.Linear
    dense_bytes = sum(dense.model.get_submodule(m).weight.numel() * 4 for m in deq)
    assert hf_quantized_bytes(quant.model) < dense_bytes / 3
    got, ref, diff = _against_dequantized(quant, dense, f"{out.name} on {device}", paged_generate,
                                          prompt_seed=1, seed=1, new_tokens=8, chunk=32)
    assert diff.numel() >= 300 and diff.mean().item() <= bound
    same = 0
    for gt, rf in zip(got, ref):
        if gt["tokens"] == rf["tokens"]:
            same += 1
            continue
        first = next(i for i, (a, b) in enumerate(zip(gt["tokens"], rf["tokens"])) if a != b)
        top2 = torch.as_tensor(rf["gen_logits"][first]).double().log_softmax(-1).topk(2).values
        assert (top2[0] - top2[1]).item() <= diff.max().item()     # a near-tie
    if method != "compressed-tensors":     # NOTE: int8 activations may flip any near-tie
        assert same >= 2, f"greedy output identical on only {same} of 3 prompts"
    # q/k/v in one GEMM unless act-order gave each projection its own K permutation
    assert (layer.self_attn._qkv is not None) == fused
    return quant


def test_fp8_is_refused_on_cpu_and_dequantized_with_none(float_dir, tmp_path):
    path, deq = make_checkpoint(float_dir, tmp_path / "fp8", "compressed-tensors", kind="float")
    with pytest.raises(ValueError, match="cannot serve fp8 quantized: fp8 checkpoints are served on GPU only"):
        load_model(str(path), "float32", device="cpu", load_tokenizer=False, quantization="compressed-tensors")
    module = "model.layers.1.mlp.up_proj"
    for choice in (None, "none"):      # the default (auto) dequantizes where it cannot serve it
        dense = load_model(str(path), "float32", device="cpu", load_tokenizer=False, quantization=choice)
        assert dense.quantization is None
        assert torch.equal(dense.model.get_submodule(module).weight, deq[module])


@pytest.fixture(scope="module")
def awq_dir(float_dir, tmp_path_factory):
    return make_checkpoint(float_dir, tmp_path_factory.mktemp("awq") / "ckpt", "awq")[0]


def test_startup_log_and_memory_accounting_count_the_quantized_bytes(awq_dir, caplog):
    from kvmesh.engine.gpu_memory import weight_bytes
    with caplog.at_level(logging.INFO):
        loaded = load_model(str(awq_dir), "float32", device="cpu", load_tokenizer=False, quantization="awq")
    held = hf_quantized_bytes(loaded.model)
    # per projection: K/2 bytes of codes a row, a float32 scale and a uint8 zero per group of 128
    sizes = [m.out_features * m.in_features for m in loaded.model.modules() if isinstance(m, HFQuantizedLinear)]
    assert len(sizes) == 14 and held == sum(s // 2 + s // 128 * 5 for s in sizes)
    floats = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    assert (f"ckpt: served quantized as awq int4, group 128: {(held + floats) / 1e6:.1f} MB of weights, "
            f"{held / 1e6:.1f} MB of them quantized") in caplog.text
    assert loaded.weight_bytes == held + floats        # /v1/models' weight_bytes
    # the KV-cache budget (gpu_memory.weight_bytes) takes the quantized buffers, not float copies
    rope = sum(b.numel() * b.element_size() for n, b in loaded.model.named_buffers()
               if n.startswith("cos_sin_cache"))
    assert rope > 0 and weight_bytes(loaded.model) == held + floats + rope


def test_requested_method_must_match_and_auto_follows_the_checkpoint(awq_dir):
    with pytest.raises(ValueError, match="--quantization gptq does not match ckpt, a awq checkpoint"):
        load_model(str(awq_dir), device="cpu", load_tokenizer=False, quantization="gptq")
    for default in (None, "auto"):
        assert load_model(str(awq_dir), device="cpu", load_tokenizer=False,
                          quantization=default).quantization == "awq"
    cfg = parse_quantization_config(json.loads((awq_dir / "config.json").read_text()))
    # a tensor-parallel split through an int4 group (parallel/sharding.py's hf_cut says why)
    cut = "--tensor-parallel-size 3 gives each rank columns [0, 85) of x, which cut its int4 groups of 128"
    with pytest.raises(ValueError, match=re.escape(f"cannot serve ckpt quantized: {cut}; use another "
                                                   "--tensor-parallel-size, or --quantization none")):
        serve_quantized("awq", cfg, "ckpt", torch.device("cpu"), cut, torch.float32)
    assert serve_quantized("auto", cfg, "ckpt", torch.device("cpu"), cut, torch.float32) is None
    assert serve_quantized("auto", cfg, "ckpt", torch.device("cpu"), None, torch.float32) == "awq"


def test_server_serves_the_checkpoint_quantized_to_the_openai_client(awq_dir, tmp_path):
    """A real `kvmesh serve --quantization awq` process (the flag through EngineConfig to the
    engine) and the official client: /v1/models says how the weights are held; a greedy
    completion runs on the quantized kernels."""
    from openai import OpenAI
    from servers import start_server

    # NOTE: start_server asks for float32 (servers.with_float32), as this load does
    held = load_model(str(awq_dir), "float32", device="cpu", load_tokenizer=False).weight_bytes
    srv = start_server(tmp_path, "--model", str(awq_dir), "--quantization", "awq", "--num-kv-blocks", "32",
                       "--max-model-len", "128")
    try:
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="none")
        card = client.models.list().data[0]
        assert card.id == "ckpt" and card.model_extra["quantization"] == "awq"
        assert card.model_extra["weight_bytes"] == held
        res = client.completions.create(model="ckpt", prompt="w5 w9 w17", max_tokens=5, temperature=0)
        assert res.usage.completion_tokens == 5
        assert "ckpt: served quantized as awq int4, group 128" in srv.log()
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


@needs_cuda
@pytest.mark.parametrize("case", ["awq", "fp8-per-token"])
def test_server_serves_the_checkpoint_quantized_on_cuda(case, float_dir, tmp_path):
    """`kvmesh serve --device cuda`: the Triton GEMMs behind the OpenAI API (CUDA graphs and all)."""
    from openai import OpenAI
    from servers import start_server

    method, opts, _, _ = CUDA_CASES[case]
    path, _ = make_checkpoint(float_dir, tmp_path / "ckpt", method, **opts)
    srv = start_server(tmp_path, "--model", str(path), "--device", "cuda", "--quantization", method,
                       "--max-model-len", "128")
    try:
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="none")
        assert client.models.list().data[0].model_extra["quantization"] == method
        res = client.completions.create(model="ckpt", prompt="w5 w9 w17", max_tokens=5, temperature=0)
        assert res.usage.completion_tokens == 5
        held = ("awq int4, group 128" if method == "awq"
                else "compressed-tensors fp8 e4m3 (channel scales, per-token fp8 activations)")
        assert f"ckpt: served quantized as {held}" in srv.log()
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


def test_the_layer_keeps_how_fp8_activations_are_cast():
    w = Fp8Weight(torch.zeros(8, 32, dtype=torch.float8_e4m3fn), torch.ones(8), "token")
    layer = HFQuantizedLinear(w, None)
    assert layer.weight.activations == "token" and hf_weight.rows(layer.weight, 0, 4).activations == "token"
    assert hf_weight.concat([layer.weight, Fp8Weight(w.weight, w.weight_scale, "none")]) is None


def _rewrite(src, dst, edit_tensors=None, edit_config=None):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    if edit_tensors:
        tensors = load_file(str(src / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    if edit_config:
        cfg = json.loads((src / "config.json").read_text())
        edit_config(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_faults_are_named(awq_dir, tmp_path, monkeypatch, caplog):
    q = "model.layers.0.self_attn.q_proj"
    short = _rewrite(awq_dir, tmp_path / "short",
                     lambda t: t.__setitem__(f"{q}.qzeros", t[f"{q}.qzeros"][:, :-1].contiguous()))
    with pytest.raises(ValueError, match=rf"awq module {q}: qzeros must be int32 \(2, 32\), got torch.int32 \(2, 31\)"):
        load_model(str(short), device="cpu", load_tokenizer=False, quantization="awq")
    missing = _rewrite(awq_dir, tmp_path / "missing", lambda t: t.pop(f"{q}.scales"))
    with pytest.raises(ValueError, match=rf"awq module {q}: missing tensor\(s\) {q}.scales"):
        load_model(str(missing), device="cpu", load_tokenizer=False, quantization="awq")
    ignored = _rewrite(awq_dir, tmp_path / "ignored",
                       edit_config=lambda qc: qc.update(modules_to_not_convert=["layers.0.self_attn.q_proj"]))
    with pytest.raises(ValueError, match=f"{q}.qweight is quantized, but .* lists {q} as kept in float"):
        load_model(str(ignored), device="cpu", load_tokenizer=False, quantization="awq")
    truncated = _rewrite(awq_dir, tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="malformed safetensors file"):
        load_model(str(truncated), device="cpu", load_tokenizer=False, quantization="awq")
    # the kernels could not be built: an explicit method is refused, auto dequantizes and says so
    monkeypatch.setitem(hf_build._state, None, (None, "build failed: injected"))
    with pytest.raises(ValueError, match="cannot serve ckpt quantized: the quantized kernels are "
                                         "unavailable here: build failed: injected"):
        load_model(str(awq_dir), device="cpu", load_tokenizer=False, quantization="awq")
    with caplog.at_level(logging.WARNING):
        loaded = load_model(str(awq_dir), device="cpu", load_tokenizer=False, quantization="auto")
    assert loaded.quantization is None and "ckpt: serving the awq checkpoint dequantized" in caplog.text


# ---- mixture-of-experts: every expert's projections held quantized ------------------------------
def make_moe_checkpoint(out, method: str):
    """A tiny Qwen3-MoE (hidden 256, 4 experts of width 256, top 2) whose attention and expert
    projections are quantized by `method` (awq, or compressed-tensors W8A8); the router stays
    float, as quantizers leave it."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tiny_models import save_tiny_model
    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    src = save_tiny_model(Qwen3MoeForCausalLM(cfg), out.parent / f"{out.name}-float", seed=8)
    tensors = load_file(str(src / "model.safetensors"))
    quantized = [n for n in tensors if n.endswith(".weight") and tensors[n].dim() == 2
                 and (".experts." in n or ".self_attn." in n and n.endswith("_proj.weight"))]
    for name in quantized:
        w = tensors.pop(name)
        pieces, _ = awq_tensors(w, 128) if method == "awq" else ct_tensors(w, "int")
        tensors.update({f"{name.removesuffix('.weight')}.{leaf}": t for leaf, t in pieces.items()})
    qc = quant_config(method, kind="int", ignore=["lm_head", "re:.*mlp.gate$"])
    write_checkpoint(src, out, tensors, qc)
    return out, len(quantized)


@cpu_kernels
@pytest.mark.parametrize("method,bound", [("awq", 1e-3), ("compressed-tensors", 0.25)], ids=["awq", "w8a8"])
def test_moe_experts_served_quantized_match_dequantized(method, bound, tmp_path, paged_generate):
    """Every expert's gate / up / down stays packed (HFQuantizedLinear) and the block runs them per
    expert; log-probs against the same checkpoint dequantized at load (the stacked fused MoE)."""
    path, n_quantized = make_moe_checkpoint(tmp_path / "moe", method)
    quant = load_model(str(path), "float32", device="cpu", load_tokenizer=False)     # auto: quantized
    dense = load_model(str(path), "float32", device="cpu", load_tokenizer=False, quantization="none")
    assert quant.quantization == method and dense.quantization is None
    moe = quant.model.model.layers[0].mlp
    assert type(moe).__name__ == "SparseMoeBlock" and isinstance(moe.gate, torch.nn.Linear)
    held = [m for m in quant.model.modules() if isinstance(m, HFQuantizedLinear)]
    assert len(held) == n_quantized == 2 * (4 + 4 * 3)
    _, _, diff = _against_dequantized(quant, dense, f"MoE {method}", paged_generate, prompt_seed=3, seed=2,
                                      new_tokens=4, chunk=40)
    assert diff.numel() >= 300 and diff.mean().item() <= bound
