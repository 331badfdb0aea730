"""A checkpoint's calibrated KV-cache scales (compressed-tensors' kv_cache_scheme, k_scale /
v_scale per attention layer) with an 8-bit cache: the layers store K/V divided by them, so K/V
far past e4m3's range (448) keep their precision where unscaled codes saturate; with the
model's dtype in the cache they are not used; a scheme or a scale kvmesh cannot serve is refused
at load, naming it.

The model: a tiny random Llama whose k_proj and v_proj are multiplied by 2000 and q_proj and
o_proj divided by 2000, the same function with K/V in the thousands. Its W8A8 checkpoint is
written by benchmarks/quant_checkpoints.py (compressed-tensors' library), the scales calibrated
on prompts by transformers' own forward, as a calibration tool would."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.quant_checkpoints import make_checkpoint
from kvmesh.common.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.layers.attention import Attention
from kvmesh.engine.quantization import kv_scales
from kvmesh.engine.quantization.hf_config import parse_quantization_config
from kvmesh.engine.sampling_params import SamplingParams

GROW = 2000.0
LAYERS = 2


def _kv_scheme() -> dict:
    from compressed_tensors.quantization import QuantizationArgs
    return QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor",
                            dynamic=False).model_dump(mode="json")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from tiny_models import save_tiny_model
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    root = tmp_path_factory.mktemp("kv-scales")
    model = LlamaForCausalLM(cfg)
    save_tiny_model(model, root / "seed", seed=3)                # randomised and saved once
    model = LlamaForCausalLM.from_pretrained(root / "seed", dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn
            a.k_proj.weight.mul_(GROW)
            a.q_proj.weight.div_(GROW)
            a.v_proj.weight.mul_(GROW)
            a.o_proj.weight.div_(GROW)
    model.save_pretrained(root / "float")
    for f in (root / "seed").iterdir():
        if f.name.startswith("tokenizer"):
            (root / "float" / f.name).write_bytes(f.read_bytes())
    # calibration: the largest |K| (after RoPE: a rotated pair's norm bounds each element) and |V|
    peaks = {}
    hooks = [layer.self_attn.k_proj.register_forward_hook(
        lambda m, i, o, n=f"{j}.k": peaks.__setitem__(n, max(peaks.get(n, 0.0), float(o.abs().amax()) * 2 ** 0.5)))
        for j, layer in enumerate(model.model.layers)]
    hooks += [layer.self_attn.v_proj.register_forward_hook(
        lambda m, i, o, n=f"{j}.v": peaks.__setitem__(n, max(peaks.get(n, 0.0), float(o.abs().amax()))))
        for j, layer in enumerate(model.model.layers)]
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        model(torch.randint(3, 256, (4, 64), generator=g))
    for h in hooks:
        h.remove()
    plain, _ = make_checkpoint(root / "float", root / "w8a8", "compressed-tensors", kind="int",
                               keep_dequantized=False)
    scaled = root / "w8a8-kv"
    scaled.mkdir()
    for f in plain.iterdir():
        if f.name != "model.safetensors":
            (scaled / f.name).write_bytes(f.read_bytes())
    cfg_json = json.loads((plain / "config.json").read_text())
    cfg_json["quantization_config"]["kv_cache_scheme"] = _kv_scheme()
    (scaled / "config.json").write_text(json.dumps(cfg_json))
    tensors = load_file(str(plain / "model.safetensors"))
    for j in range(LAYERS):
        tensors[f"model.layers.{j}.self_attn.k_scale"] = torch.tensor([peaks[f"{j}.k"] / 448.0])
        tensors[f"model.layers.{j}.self_attn.v_scale"] = torch.tensor([peaks[f"{j}.v"] / 448.0])
    save_file(tensors, str(scaled / "model.safetensors"))
    # the same scales in the fp8 method's / older llm-compressor's layout, with the query and
    # softmax scales such checkpoints also carry
    older = root / "w8a8-kv-output-scale"
    older.mkdir()
    for f in scaled.iterdir():
        if f.name != "model.safetensors":
            (older / f.name).write_bytes(f.read_bytes())
    renamed = {}
    for name, t in tensors.items():
        for kv in "kv":
            name = name.replace(f".self_attn.{kv}_scale", f".self_attn.{kv}_proj.output_scale")
        renamed[name] = t
    for j in range(LAYERS):
        renamed[f"model.layers.{j}.self_attn.q_proj.output_scale"] = torch.tensor([0.25])
        renamed[f"model.layers.{j}.self_attn.prob_output_scale"] = torch.tensor([1 / 448])
    save_file(renamed, str(older / "model.safetensors"))
    assert min(peaks.values()) > 448 * 2             # far past e4m3's range unscaled
    return {"plain": plain, "scaled": scaled, "output_scale": older}


PROMPTS = [[3 + (i * 37 + j * 11) % 250 for i in range(n)] for j, n in enumerate((70, 55, 90))]


def _prompt_logprobs(path: Path, kv_cache_dtype: str, **kw) -> tuple[torch.Tensor, LLMEngine]:
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_cache_dtype=kv_cache_dtype,
                                    num_kv_blocks=64, max_model_len=256, swap_space=0, **kw))
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    for i, ids in enumerate(PROMPTS):
        engine.add_request(f"r{i}", ids, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    lps = [done[f"r{i}"].prompt_logprobs[k][tok].logprob
           for i, ids in enumerate(PROMPTS) for k, tok in enumerate(ids) if k > 0]
    return torch.tensor(lps, dtype=torch.float64), engine


def test_scaled_codes_keep_what_unscaled_codes_saturate(checkpoints):
    exact, e = _prompt_logprobs(checkpoints["scaled"], "auto")          # float32 cache: scales unused
    attn = [m for m in e.loaded.model.modules() if isinstance(m, Attention)]
    assert [(m.k_scale, m.v_scale) for m in attn] == [(1.0, 1.0)] * LAYERS
    scaled, e = _prompt_logprobs(checkpoints["scaled"], "fp8")
    attn = [m for m in e.loaded.model.modules() if isinstance(m, Attention)]
    want = load_file(str(checkpoints["scaled"] / "model.safetensors"))
    assert [(m.k_scale, m.v_scale) for m in attn] == [
        (float(want[f"model.layers.{j}.self_attn.k_scale"]), float(want[f"model.layers.{j}.self_attn.v_scale"]))
        for j in range(LAYERS)]
    unscaled, _ = _prompt_logprobs(checkpoints["plain"], "fp8")
    same_plain, _ = _prompt_logprobs(checkpoints["plain"], "auto")
    assert torch.equal(same_plain, exact)                               # the same weights
    err_scaled = float((scaled - exact).abs().mean())
    err_unscaled = float((unscaled - exact).abs().mean())
    print(f"mean |prompt log-prob diff| vs the float32 cache: scaled {err_scaled:.4f}, "
          f"unscaled (saturated) {err_unscaled:.4f}")
    # NOTE: measured 2026-11-27: scaled 0.166 (e4m3's own rounding of this random model's K/V;
    # the same at GROW 400 and 2000: the scales make the codes scale-free), unscaled 1.80 (K/V
    # saturated at 448 where they reach thousands; 1.42 at GROW 400)
    assert err_scaled < 0.3
    assert err_unscaled > 5 * err_scaled


def test_the_older_output_scale_layout_gives_the_same_model(checkpoints):
    """`k_proj.output_scale` / `v_proj.output_scale` (vLLM's fp8 method, older llm-compressor)
    set the same scales as `self_attn.k_scale` / `v_scale`; query and softmax scales are unused."""
    want, _ = _prompt_logprobs(checkpoints["scaled"], "fp8")
    got, e = _prompt_logprobs(checkpoints["output_scale"], "fp8")
    assert torch.equal(got, want)
    tensors = load_file(str(checkpoints["scaled"] / "model.safetensors"))
    attn = [m for m in e.loaded.model.modules() if isinstance(m, Attention)]
    assert [m.k_scale for m in attn] == [float(tensors[f"model.layers.{j}.self_attn.k_scale"])
                                         for j in range(LAYERS)]


def test_each_tensor_parallel_rank_scales_its_codes(checkpoints):
    """Two ranks, each holding one KV head: both store the checkpoint's scaled codes (a rank
    left unscaled would saturate its head's K/V, the error of the unscaled run above)."""
    exact, _ = _prompt_logprobs(checkpoints["scaled"], "auto")
    one, _ = _prompt_logprobs(checkpoints["scaled"], "fp8")
    two, engine = _prompt_logprobs(checkpoints["scaled"], "fp8", tensor_parallel_size=2, cpu_threads=1)
    try:
        err_one, err_two = float((one - exact).abs().mean()), float((two - exact).abs().mean())
        print(f"mean |prompt log-prob diff| vs the float32 cache: one rank {err_one:.4f}, two {err_two:.4f}")
        # NOTE: W8A8 quantizes each rank's slice of the activations per token: the two runs
        # differ by that (0.034 nats measured on another tiny model), not by the scales
        assert err_two < 0.3 and abs(err_two - err_one) < 0.1
    finally:
        engine.shutdown()


def test_the_scheme_kvmesh_serves_and_what_it_refuses():
    base = {"quant_method": "compressed-tensors", "format": "int-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                      "strategy": "channel", "dynamic": False},
                                          "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                                                "strategy": "token", "dynamic": True}}}}
    def parse(qc: dict):
        return parse_quantization_config({"quantization_config": qc})
    assert parse({**base, "kv_cache_scheme": _kv_scheme()}).scheme == "w8a8_int8"
    for key, value, want in (("strategy", "channel", "'tensor'"), ("num_bits", 4, "8"),
                             ("dynamic", True, "False"), ("type", "int", "'float'")):
        with pytest.raises(ValueError, match=rf"kv_cache_scheme\.{key}={value!r} \({want} is supported\)"):
            parse({**base, "kv_cache_scheme": {**_kv_scheme(), key: value}})
    with pytest.raises(ValueError, match="kv_cache_scheme='fp8' \\(null or a quantization args object"):
        parse({**base, "kv_cache_scheme": "fp8"})


def _layers(n: int) -> torch.nn.Module:
    from kvmesh.engine.layers.attention import AttentionSpec
    from kvmesh.kernels import reference
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(
        [torch.nn.Module() for _ in range(n)])
    for layer in model.layers:
        layer.self_attn = Attention(16, AttentionSpec(num_heads=2, num_kv_heads=1, head_dim=8, scale=0.3),
                                    reference)
    return model


def test_scales_are_recorded_checked_and_applied_per_layer():
    model = _layers(2)
    for j in range(2):
        kv_scales.record(model, f"layers.{j}.self_attn.k_scale", torch.tensor(2.0 + j), "ckpt")
        kv_scales.record(model, f"layers.{j}.self_attn.v_scale", torch.tensor([0.5]), "ckpt")
    assert kv_scales.apply(model, torch.bfloat16) == 0
    assert [(a.self_attn.k_scale, a.self_attn.v_scale) for a in model.layers] == [(1.0, 1.0)] * 2
    assert kv_scales.apply(model, torch.float8_e5m2) == 2
    assert [(a.self_attn.k_scale, a.self_attn.v_scale) for a in model.layers] == [(2.0, 0.5), (3.0, 0.5)]
    assert kv_scales.apply(_layers(1), torch.float8_e4m3fn) == 0              # no scales at all

    half = _layers(2)
    kv_scales.record(half, "layers.0.self_attn.k_scale", torch.tensor(2.0), "ckpt")
    kv_scales.record(half, "layers.0.self_attn.v_scale", torch.tensor(2.0), "ckpt")
    with pytest.raises(ValueError, match="k_scale and v_scale for 1 of its 2 attention layers"):
        kv_scales.apply(half, torch.float8_e4m3fn)
    for name, value, message in (
            ("layers.0.k_scale", torch.tensor(1.0), "names no attention layer"),
            ("layers.9.self_attn.k_scale", torch.tensor(1.0), "names no attention layer"),
            ("layers.0.self_attn.k_scale", torch.ones(2), r"must be one number .* shape \(2,\)"),
            ("layers.0.self_attn.v_scale", torch.tensor(0.0), "must be positive and finite, got 0.0"),
            ("layers.0.self_attn.v_scale", torch.tensor(float("inf")), "must be positive and finite")):
        with pytest.raises(ValueError, match=message):
            kv_scales.record(model, name, value, "ckpt")
    assert kv_scales.is_kv_scale("model.layers.3.self_attn.v_scale")
    assert not kv_scales.is_kv_scale("model.layers.3.self_attn.k_proj.weight_scale")


@pytest.mark.parametrize("names,want", [
    (("layers.0.self_attn.k_scale", "layers.0.self_attn.v_scale"), (2.0, 0.5)),
    (("layers.0.self_attn.k_proj.output_scale", "layers.0.self_attn.v_proj.output_scale"), (2.0, 0.5)),
    (("layers.0.self_attn.k_proj.k_scale", "layers.0.self_attn.v_proj.v_scale"), (2.0, 0.5)),    # ModelOpt
    (("layers.0.self_attn.qkv_proj.k_scale", "layers.0.self_attn.qkv_proj.v_scale"), (2.0, 0.5)),
    (("layers.0.self_attn.attn.k_scale", "layers.0.self_attn.attn.v_scale"), (2.0, 0.5)),
    (("layers.0.self_attn.kv_scale",), (2.0, 2.0)),               # deprecated: one scale for both
], ids=["compressed-tensors", "output_scale", "modelopt", "qkv_proj", "vllm", "kv_scale"])
def test_every_layout_vllm_reads_sets_the_layer_scales(names, want):
    model = _layers(1)
    for name, value in zip(names, (2.0, 0.5)):
        assert kv_scales.is_kv_scale(name)
        kv_scales.record(model, name, torch.tensor(value), "ckpt")
    for name in ("layers.0.self_attn.q_scale", "layers.0.self_attn.prob_scale",
                 "layers.0.self_attn.q_proj.output_scale", "layers.0.self_attn.prob_output_scale"):
        assert kv_scales.is_kv_scale(name)
        kv_scales.record(model, name, torch.tensor(9.0), "ckpt")       # recognised, not used
    assert kv_scales.apply(model, torch.float8_e4m3fn) == 1
    assert (model.layers[0].self_attn.k_scale, model.layers[0].self_attn.v_scale) == want
    for name in ("layers.0.self_attn.o_proj.output_scale", "layers.0.self_attn.k_proj.weight_scale",
                 "layers.0.self_attn.k_proj.input_scale"):
        assert not kv_scales.is_kv_scale(name)

