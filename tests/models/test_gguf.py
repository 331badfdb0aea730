"""GGUF reading: our lean parser vs gguf.GGUFReader, tiny GGUFs written like llama.cpp, the tokenizer cache."""
from __future__ import annotations

import math
import shutil
import time

import gguf
import numpy as np
import pytest
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig,
                          LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, Phi3Config,
                          Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

from kvmesh.engine.loader import load_model
from kvmesh.common.gguf_reader import GGUFReader
from kvmesh.engine.layers.quantized import QuantizedLinear
from kvmesh.engine.models.gguf import expert_names, hf_tensor_name, unpermute_rows
from kvmesh.kernels.quant import kernels_available
from kvmesh.prompt.sources import cache_key, gguf_tokenizer_dir

_GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
               "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "q_norm": "attn_q_norm", "k_norm": "attn_k_norm",
               "qkv_proj": "attn_qkv", "gate_up_proj": "ffn_up",      # Phi-3's fused projections
               "gate": "ffn_gate_inp"}                                 # a MoE layer's router
_GEMMA_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
_TOKENIZER_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")


def test_lean_reader_matches_gguf_package(builtin_path):
    ours, ref = GGUFReader(builtin_path), gguf.GGUFReader(str(builtin_path))
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        got = ours.get(key)
        got = got.tolist() if isinstance(got, np.ndarray) else got
        assert got == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.ggml_type == int(b.tensor_type) and a.shape == tuple(reversed(b.shape.tolist()))
        assert np.array_equal(a.data, b.data), a.name


def test_name_mapping_and_unpermute():
    assert hf_tensor_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.0.ffn_gate_exps.weight") is None
    assert hf_tensor_name("blk.2.ffn_up.weight") == "model.layers.2.mlp.up_proj.weight"
    assert hf_tensor_name("blk.2.ffn_up.weight", "phi3") == "model.layers.2.mlp.gate_up_proj.weight"
    assert hf_tensor_name("blk.2.attn_qkv.weight", "phi3") == "model.layers.2.self_attn.qkv_proj.weight"
    assert hf_tensor_name("blk.2.attn_qkv.weight") is None
    assert expert_names("blk.1.ffn_up_exps.weight", "mixtral", 2) == [
        "model.layers.1.block_sparse_moe.experts.0.w3.weight", "model.layers.1.block_sparse_moe.experts.1.w3.weight"]
    assert expert_names("blk.1.ffn_down_exps.weight", "qwen3moe", 1) == ["model.layers.1.mlp.experts.0.down_proj.weight"]
    assert expert_names("blk.1.ffn_down_exps.weight", "llama", 1) is None
    assert hf_tensor_name("blk.1.ffn_gate_inp.weight", "mixtral") == "model.layers.1.block_sparse_moe.gate.weight"
    w = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)
    assert np.array_equal(unpermute_rows(_permute(w, 2), 2), w)
    assert np.array_equal(unpermute_rows(_permute(w[:, 0], 2), 2), w[:, 0])  # biases too


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_freqs(cfg) -> np.ndarray:
    """llama.cpp's converter (conversion/llama.py) on a llama3 rope_scaling: each frequency's divisor."""
    rope = cfg.rope_parameters
    dim = cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def _write_gguf(path, arch: str, hf_model, cfg, tokenizer_source: GGUFReader, rope_scaling: str | None = None,
                short_factors: bool = True, block_type: gguf.GGMLQuantizationType | None = None) -> None:
    """Write `hf_model` the way llama.cpp's converter does (2-D weights F16, Q/K permuted for llama,
    a llama3 rope_scaling as the rope_freqs tensor)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)     # Gemma 3: the global layers'
    w.add_rope_freq_base(rope["rope_theta"])
    if arch in ("gemma2", "gemma3"):     # conversion/gemma.py
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_sliding_window(cfg.sliding_window)
        if arch == "gemma2":
            w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        if rope.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokenizer_source.get("tokenizer.ggml.tokens"))
    w.add_token_merges(tokenizer_source.get("tokenizer.ggml.merges"))
    w.add_token_types(tokenizer_source.get("tokenizer.ggml.token_type").tolist())
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(tokenizer_source.get("tokenizer.chat_template"))
    if rope_scaling is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling))
        w.add_rope_scaling_factor(2.0)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _rope_freqs(cfg))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim != cfg.hidden_size // cfg.num_attention_heads and arch not in ("gemma2", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "phi3":      # conversion/phi.py: the window (0: none), the original context, longrope
        w.add_sliding_window(cfg.sliding_window or 0)
        orig = cfg.original_max_position_embeddings
        w.add_rope_scaling_orig_ctx_len(orig)
        if cfg.rope_parameters.get("long_factor"):
            scale = cfg.max_position_embeddings / orig
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)
            w.add_tensor("rope_factors_long.weight", np.array(cfg.rope_parameters["long_factor"], dtype=np.float32))
            if short_factors:
                w.add_tensor("rope_factors_short.weight", np.array(cfg.rope_parameters["short_factor"], dtype=np.float32))
    def add(gname, arr):
        if block_type is not None and arr.ndim >= 2 and gname != "token_embd.weight" and "gate_inp" not in gname:
            w.add_tensor(gname, gguf.quants.quantize(arr.astype(np.float32), block_type), raw_dtype=block_type)
        else:
            w.add_tensor(gname, arr.astype(np.float16) if arr.ndim >= 2 else arr.astype(np.float32))

    for name, p in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        arr = p.detach().numpy()
        if ".experts." in name:     # transformers' stacked experts: [E, 2I, H] gate|up, [E, H, I] down
            layer = name.split(".")[2]
            if name.endswith("gate_up_proj"):
                inter = arr.shape[1] // 2
                add(f"blk.{layer}.ffn_gate_exps.weight", arr[:, :inter])
                add(f"blk.{layer}.ffn_up_exps.weight", arr[:, inter:])
            else:
                add(f"blk.{layer}.ffn_down_exps.weight", arr)
            continue
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            parts = name.split(".")  # model.layers.N.<self_attn|mlp|norm>.<proj>.<weight|bias>
            names = {**_GGUF_NAMES, **_GEMMA_NAMES} if arch in ("gemma2", "gemma3") else _GGUF_NAMES
            gname = f"blk.{parts[2]}.{names[parts[-2]]}.{parts[-1]}"
            if arch == "llama" and ".q_proj." in name:
                arr = _permute(arr, cfg.num_attention_heads)
            elif arch == "llama" and ".k_proj." in name:
                arr = _permute(arr, cfg.num_key_value_heads)
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            arr = arr + 1           # Gemma's (1 + w) norms, stored as llama.cpp's converter does
        add(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


_GGUF_ARCH = {"llama3": "llama", "mixtral": "llama"}     # the architecture llama.cpp writes


def _tiny_hf(arch: str):
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rope_theta=20000.0, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        cfg, cls = LlamaConfig(tie_word_embeddings=False, **common), LlamaForCausalLM
    elif arch == "llama3":      # Llama 3.1's RoPE scaling, its original context inside the prompts
        scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=32)
        cfg, cls = LlamaConfig(tie_word_embeddings=True, rope_scaling=scaling, **common), LlamaForCausalLM
    elif arch == "qwen3":
        cfg, cls = Qwen3Config(tie_word_embeddings=True, head_dim=16, **common), Qwen3ForCausalLM
    elif arch == "mixtral":     # written as llama.cpp writes it: arch "llama" with experts
        cfg = MixtralConfig(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
                            **{**common, "intermediate_size": 128})     # whole blocks for two ranks
        cls = MixtralForCausalLM
    elif arch == "qwen3moe":    # every layer sparse, as llama.cpp's qwen3moe graph has them
        cfg = Qwen3MoeConfig(tie_word_embeddings=True, head_dim=32, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[], **common)
        cls = Qwen3MoeForCausalLM
    elif arch == "gemma2":      # the attention scale llama.cpp uses below 27B: head_dim's
        cfg = Gemma2Config(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, attn_logit_softcapping=3.0,
                           final_logit_softcapping=5.0, **{**common, "num_hidden_layers": 4})
        cls = Gemma2ForCausalLM
    elif arch == "gemma3":      # 5 sliding layers, then a global one with linear scaling
        rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
        cfg = Gemma3TextConfig(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, rope_parameters=rope,
                               **{**common, "num_hidden_layers": 6, "rope_theta": 1e6})
        cls = Gemma3ForCausalLM
    elif arch == "phi3":        # a 128k-style model: longrope, a window; prompts under the original context
        scaling = {"rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
                   "long_factor": [2.0 + i for i in range(8)]}
        cfg = Phi3Config(tie_word_embeddings=True, sliding_window=12, original_max_position_embeddings=64,
                         rope_scaling=scaling, **common)
        cls = Phi3ForCausalLM
    else:
        cfg, cls = Qwen2Config(tie_word_embeddings=True, **common), Qwen2ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            value = 1.0 + 0.1 * noise if "norm" in name else 0.15 * noise
            p.copy_(value.half().float() if p.ndim >= 2 else value)  # what F16 storage keeps
    return cfg, model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama3", "phi3", "mixtral", "qwen3moe", "gemma2",
                                  "gemma3"])
def test_tiny_gguf_matches_transformers(arch, tmp_path, monkeypatch, builtin_path, smollm_tokenizer_dir,
                                        paged_generate, hf_greedy_logits, assert_close_to_scale):
    cfg, hf_model = _tiny_hf(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(path, _GGUF_ARCH.get(arch, arch), hf_model, cfg, GGUFReader(builtin_path))
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(cache))
    if arch != "llama":  # NOTE: only one cold tokenizer conversion (~5 s) per run; these are pre-seeded
        shutil.copytree(smollm_tokenizer_dir, cache / cache_key(path))
    loaded = load_model(str(path), dtype="float32", device="cpu")
    assert loaded.name == f"tiny-{arch}"
    assert loaded.config.tie_word_embeddings == (arch not in ("llama", "mixtral"))
    assert loaded.config.attention_bias == (arch == "qwen2")
    if arch == "llama3":    # the divisors were read, and the prompts below pass the original context
        assert loaded.config.rope_scaling["rope_type"] == "rope_freqs"
        assert max(loaded.config.rope_scaling["freq_factors"]) == 8.0
    if arch == "phi3":      # the window (the second prompt is past it) and the factors were read
        assert loaded.config.sliding_window == 12
        assert loaded.config.rope_scaling["short_factor"] == cfg.rope_parameters["short_factor"]
    prompts = [[1, 9690, 198, 2683, 359], list(range(300, 330))]
    ours = paged_generate(loaded.model, prompts, 8, block_size=4, prefill_chunk=8, seed=1)
    for prompt, got in zip(prompts, ours):
        ref_prompt, ref_tokens, _ = hf_greedy_logits(hf_model, prompt, 8)
        assert got["tokens"] == ref_tokens
        assert_close_to_scale(got["prompt_logits"], ref_prompt)
    # the tokenizer cache: one complete directory, no temp directory left behind
    assert sorted(p.name for p in cache.iterdir()) == [cache_key(path)]
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])[0] == 1
    if arch == "llama":
        assert (cache / cache_key(path) / "tokenizer_config.json").read_text().count("im_start") >= 1
        start = time.perf_counter()
        gguf_tokenizer_dir(path, cache)
        assert time.perf_counter() - start < 1.0  # warm: no conversion


def test_rope_freqs_beside_a_rope_scaling_type_is_refused(tmp_path, builtin_path):
    cfg, hf_model = _tiny_hf("llama3")
    path = tmp_path / "both.gguf"
    _write_gguf(path, "llama", hf_model, cfg, GGUFReader(builtin_path), rope_scaling="linear")
    with pytest.raises(ValueError, match="has both RoPE scaling 'linear' and a rope_freqs tensor"):
        load_model(str(path), dtype="float32", device="cpu", load_tokenizer=False)


@pytest.mark.skipif(not kernels_available(), reason="quantized kernels unavailable")
@pytest.mark.parametrize("arch", ["phi3", "mixtral", "qwen3moe"])
def test_fused_projections_and_experts_served_as_blocks(arch, tmp_path, builtin_path, paged_generate):
    """Phi-3's fused qkv and gate|up tensors, and the stacked experts of Mixtral and Qwen3-MoE,
    in Q8_0 blocks: served as blocks (each expert its own rows of the stack), the dequantized
    model's logits to float32 rounding and its greedy tokens."""
    cfg, hf_model = _tiny_hf(arch)
    path = tmp_path / f"{arch}-q8_0.gguf"
    _write_gguf(path, _GGUF_ARCH.get(arch, arch), hf_model, cfg, GGUFReader(builtin_path),
                block_type=gguf.GGMLQuantizationType.Q8_0)
    quant = load_model(str(path), "float32", device="cpu", load_tokenizer=False, quantization="gguf",
                       quant_activations="float")
    dense = load_model(str(path), "float32", device="cpu", load_tokenizer=False, quantization="none")
    layer = quant.model.model.layers[0]
    if arch == "phi3":
        assert isinstance(layer.self_attn.qkv_proj, QuantizedLinear)
        assert isinstance(layer.mlp.gate_up_proj, QuantizedLinear)
    else:
        moe = layer.block_sparse_moe if arch == "mixtral" else layer.mlp
        assert len(moe.experts) == 4 and all(isinstance(m, QuantizedLinear) for e in moe.experts for m in e.linears())
        assert type(moe.gate) is torch.nn.Linear            # the router stays float, as llama.cpp keeps it
    prompts = [[1, 5, 9, 200, 17, 3, 3, 400], list(range(30, 60))]
    got = paged_generate(quant.model, prompts, 6, block_size=4, prefill_chunk=8, seed=1)
    ref = paged_generate(dense.model, prompts, 6, block_size=4, prefill_chunk=8, seed=1)
    for g, r in zip(got, ref):
        assert (g["prompt_logits"] - r["prompt_logits"]).abs().max() <= 1e-4 * r["prompt_logits"].abs().max()
        assert g["tokens"] == r["tokens"]


@pytest.mark.parametrize("arch,layers,want", [("gemma2", 46, 144), ("gemma2", 42, 256), ("gemma3", 62, 168),
                                               ("gemma3", 34, 256)])
def test_gemma_attention_scale_as_llama_cpp_sets_it(arch, layers, want, tmp_path):
    """The metadata has no query_pre_attn_scalar: llama.cpp uses hidden / heads for the 27B models
    (46 / 62 layers) and head_dim for the others, and so does the reader (HF: 144 for
    gemma-2-27b, 168 for gemma-3-27b, 256 for the rest)."""
    from kvmesh.engine.models.gguf import GGUFFile
    hidden, heads = {46: 4608, 42: 3584, 62: 5376, 34: 2560}[layers], {46: 32, 42: 16, 62: 32, 34: 8}[layers]
    w = gguf.GGUFWriter(str(tmp_path / "meta.gguf"), arch)
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(4 * hidden)
    w.add_head_count(heads)
    w.add_key_length(256)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(256000)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cfg = GGUFFile(tmp_path / "meta.gguf").hf_config()
    assert cfg["query_pre_attn_scalar"] == want and cfg["head_dim"] == 256


def test_longrope_factors_without_their_pair_are_refused(tmp_path, builtin_path):
    cfg, hf_model = _tiny_hf("phi3")
    path = tmp_path / "half.gguf"
    _write_gguf(path, "phi3", hf_model, cfg, GGUFReader(builtin_path), short_factors=False)
    with pytest.raises(ValueError, match="has rope_factors_long.weight without its pair"):
        load_model(str(path), dtype="float32", device="cpu", load_tokenizer=False)


def test_cache_key_depends_on_name_size_and_head(tmp_path):
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    a.write_bytes(b"GGUF" + b"\0" * 100)
    b.write_bytes(b"GGUF" + b"\0" * 100)
    c.write_bytes(b"GGUF" + b"\1" * 100)
    assert cache_key(a) != cache_key(b)                # name
    assert cache_key(a).split("-")[1:] == cache_key(b).split("-")[1:]
    assert cache_key(b).rsplit("-", 1)[1] != cache_key(c).rsplit("-", 1)[1]  # content
