"""Tensor parallelism on CPU (gloo), float32, against transformers and against one rank.

Three levels:
* the plan alone: which sizes fit a model, each rank's heads and slices, the error's wording;
* every family's sharded model, two ranks as two threads of this process on a real gloo group
  (loopback): teacher-forced logits of every position, chunked through the paged cache, within
  1e-4 of transformers (cheap: no process start, so each family is covered);
* the whole engine with worker processes (torch.multiprocessing spawn): a Qwen2-style GQA model
  and a Qwen3-MoE model with one KV head (replicated on both ranks) at TP=2, the built-in
  SmolLM2-135M at TP=3: first-step logits against transformers and TP=1, greedy sequences under
  chunked prefill, prefix caching and swap / recompute preemption, n > 1, a worker SIGKILLed
  mid-run and one while the server idles, and no process left after shutdown.
"""
from __future__ import annotations

import asyncio
import datetime
import os
import random
import signal
import threading
import time

import logging

import numpy as np
import psutil
import pytest
from gguf.constants import GGMLQuantizationType as GT
import torch
import torch.distributed as dist
from model_families import FAMILIES
from tiny_models import randomize, save_tiny_model, tiny_tokenizer
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from kvmesh.common.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.loader import load_model, read_model_config
from kvmesh.engine.model_input import ModelInput
from kvmesh.engine.model_runner import kv_block_bytes
from kvmesh.index.kv_bytes import redis_kv_connector
from kvmesh.engine.parallel.executor import TPExecutor, WorkerDiedError
from kvmesh.engine.parallel.group import TPGroup
from kvmesh.engine.parallel.plan import make_plan, validate_tensor_parallel
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.kernels.metadata import AttentionMetadata
from kvmesh.kernels.quant import QuantizedWeight, kernels_available
from kvmesh.kernels.quant import build as quant_build
from kvmesh.kernels.quant import hf_build
from kvmesh.kernels.quant.ops import dequantize as quant_dequantize
from kvmesh.kernels.quant.weight import FORMATS
from kvmesh.engine.layers.quantized import QuantizedLinear
from kvmesh.engine.parallel.sharding import QuantizedVocabParallelEmbedding, ShardRule
from tests.models.test_gguf_quantized import write_tiny_gguf

BLOCK = 4
NEW_TOKENS = 10
TIE_GAP = 1e-4          # transformers' top-2 logits closer than this: either token is right


# ---- the plan ------------------------------------------------------------------------------
def test_smollm_refuses_two_ranks_with_the_numbers_and_accepts_three():
    config = read_model_config(None)                 # the built-in SmolLM2-135M GGUF
    with pytest.raises(ValueError) as e:
        validate_tensor_parallel(config, 2)
    assert str(e.value) == (
        "--tensor-parallel-size 2 does not fit LlamaForCausalLM: the number of query heads (9) is "
        "not divisible by 2; the number of KV heads (3) is not divisible by 2 (sizes that fit this "
        "model: 3)")
    validate_tensor_parallel(config, 3)
    plans = [make_plan(config, r, 3) for r in range(3)]
    assert [(p.local_heads, p.local_kv_heads, p.kv_head_start, p.vocab_start, p.local_vocab)
            for p in plans] == [(3, 1, 0, 0, 16384), (3, 1, 1, 16384, 16384), (3, 1, 2, 32768, 16384)]


def _qwen2_config(**kw) -> Qwen2Config:
    args = {"vocab_size": 301, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
            "bos_token_id": 1, "eos_token_id": 2}
    return Qwen2Config(**{**args, **kw})


@pytest.mark.parametrize("kw,size,message", [
    ({"num_attention_heads": 6, "num_key_value_heads": 3}, 4,
     ("the number of query heads (6) is not divisible by 4; 4 is not a multiple of the number of KV "
      "heads (3), so the KV heads cannot be replicated evenly (sizes that fit this model: 3, 6)")),
    ({"num_attention_heads": 8, "num_key_value_heads": 8}, 3,
     ("the number of query heads (8) is not divisible by 3; the number of KV heads (8) is not "
      "divisible by 3 (sizes that fit this model: 2, 4, 8)")),
    ({"intermediate_size": 90}, 4,
     "the MLP intermediate size (90) is not divisible by 4 (sizes that fit this model: 2)"),
    ({"num_attention_heads": 5, "num_key_value_heads": 5, "hidden_size": 60, "intermediate_size": 91}, 2,
     ("the number of query heads (5) is not divisible by 2; the number of KV heads (5) is not "
      "divisible by 2; the MLP intermediate size (91) is not divisible by 2 (this model cannot be "
      "split; use --tensor-parallel-size 1)")),
])
def test_sizes_that_do_not_split_are_named(kw, size, message):
    from kvmesh.engine.model_config import ModelConfig
    with pytest.raises(ValueError) as e:
        validate_tensor_parallel(ModelConfig.from_hf_config(_qwen2_config(**kw).to_dict()), size)
    assert str(e.value) == f"--tensor-parallel-size {size} does not fit Qwen2ForCausalLM: {message}"


def test_kv_heads_fewer_than_ranks_are_replicated():
    from kvmesh.engine.model_config import ModelConfig
    config = ModelConfig.from_hf_config(_qwen2_config(num_attention_heads=8, num_key_value_heads=2).to_dict())
    plans = [make_plan(config, r, 4) for r in range(4)]
    # ranks 0-1 hold KV head 0 (their query heads 0-3), ranks 2-3 hold KV head 1 (query heads 4-7)
    assert [(p.local_heads, p.local_kv_heads, p.kv_head_start) for p in plans] == \
        [(2, 1, 0), (2, 1, 0), (2, 1, 1), (2, 1, 1)]
    assert [(p.vocab_start, p.local_vocab) for p in plans] == [(0, 76), (76, 76), (152, 76), (228, 76)]


# ---- every family's sharded model, ranks as threads --------------------------------------------
def _chunked_logits(model, tokens: list[int], chunk: int = 7) -> torch.Tensor | None:
    """Logits of every position, the sequence fed in chunks through a paged cache whose block
    ids are shuffled (None on a rank that does not gather them)."""
    cfg = model.config                     # the rank's local config: its KV heads
    n = -(-len(tokens) // BLOCK)
    blocks = list(range(n + 2))
    random.Random(3).shuffle(blocks)
    blocks = blocks[:n]
    shape = (n + 2, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_hidden_layers)]
    out = []
    with torch.inference_mode():
        for s in range(0, len(tokens), chunk):
            e = min(s + chunk, len(tokens))
            meta = AttentionMetadata.build([e - s], [e], [blocks], BLOCK, torch.device("cpu"))
            hidden = model(torch.tensor(tokens[s:e]), torch.arange(s, e), caches, meta)
            out.append(model.compute_logits(hidden))
    return None if out[0] is None else torch.cat(out)


def _run_ranks(size: int, fn) -> list:
    """fn(group) on `size` threads, each one rank of a real gloo group; their results."""
    store = dist.TCPStore("127.0.0.1", 0, size, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    results, errors = [None] * size, []

    def run(rank: int) -> None:
        try:
            group = TPGroup(rank, size)
            group.connect("127.0.0.1", store.port, torch.device("cpu"), 60,
                          store=store if rank == 0 else None)
            results[rank] = fn(group)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def _teacher_forced_reference(hf, prompt, n, hf_greedy_logits):
    """transformers' greedy sequence and its logits at every position but the last."""
    prompt_logits, tokens, gen_logits = hf_greedy_logits(hf, prompt, n)
    return prompt + tokens, torch.cat([prompt_logits, gen_logits[1:]])


SWEEP_PROMPTS = [[5, 17, 200, 31, 9, 44, 3, 8, 90, 12, 11], [7, 299, 21]]


def _sweep(hf, path, size, hf_greedy_logits, assert_close_to_scale):
    refs = [_teacher_forced_reference(hf, p, 8, hf_greedy_logits) for p in SWEEP_PROMPTS]

    def rank(group):
        loaded = load_model(str(path), dtype="float32", device="cpu", tp=group)
        return loaded, [_chunked_logits(loaded.model, seq[:-1]) for seq, _ in refs]

    (loaded0, got), (loaded1, rest) = _run_ranks(size, rank)[:2]
    assert all(x is None for x in rest)            # logits are gathered on rank 0 only
    for (_, want), ours in zip(refs, got):
        assert_close_to_scale(ours, want)
    return loaded0, loaded1


@pytest.mark.parametrize("spec", FAMILIES, ids=lambda s: s.id)
def test_every_family_splits_over_two_ranks(spec, tmp_path, hf_greedy_logits, assert_close_to_scale):
    torch.manual_seed(0)
    hf = spec.build().eval()
    randomize(hf, seed=1)
    hf.save_pretrained(tmp_path)
    tiny_tokenizer(tmp_path, hf.config.vocab_size)
    loaded0, loaded1 = _sweep(hf, tmp_path, 2, hf_greedy_logits, assert_close_to_scale)
    attn0, attn1 = loaded0.model.model.layers[0].self_attn, loaded1.model.model.layers[0].self_attn
    hd = loaded0.config.head_dim
    assert attn0.spec.num_heads == 2 and attn0.spec.num_kv_heads == 1
    if spec.architecture == "Phi3ForCausalLM":
        # the fused checkpoint tensors: each part (q, k, v / gate, up) sliced, not the whole
        full = hf.model.layers[0].self_attn.qkv_proj.weight
        nq, nkv = 4 * hd, 2 * hd
        want = torch.cat([full[2 * hd:4 * hd], full[nq + hd:nq + 2 * hd], full[nq + nkv + hd:]])
        assert torch.equal(attn1.qkv_proj.weight, want)
        gate_up = hf.model.layers[0].mlp.gate_up_proj.weight
        assert torch.equal(loaded1.model.model.layers[0].mlp.gate_up_proj.weight,
                           torch.cat([gate_up[48:96], gate_up[144:192]]))


@pytest.mark.parametrize("kv_heads,size", [(1, 2), (2, 4)])
def test_qwen2_kv_heads_replicated_when_fewer_than_ranks(kv_heads, size, tmp_path, hf_greedy_logits,
                                                         assert_close_to_scale):
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(_qwen2_config(num_key_value_heads=kv_heads)).eval()
    path = save_tiny_model(hf, tmp_path / "qwen2", seed=2)
    loaded0, loaded1 = _sweep(hf, path, size, hf_greedy_logits, assert_close_to_scale)
    # vocab 301 padded to a multiple of the ranks: rank 0's shard is rows 0..ceil(301 / N)
    assert loaded0.model.lm_head.weight.shape == (-(-301 // size), 64)
    assert loaded1.model.model.layers[0].self_attn.k_proj.weight.shape == (16, 64)   # one KV head


def test_mixtral_experts_split_over_two_ranks(tmp_path, hf_greedy_logits, assert_close_to_scale):
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1, num_local_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=1,
                        eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = MixtralForCausalLM(cfg).eval()
    path = save_tiny_model(hf, tmp_path / "mixtral", seed=4)
    loaded0, _ = _sweep(hf, path, 2, hf_greedy_logits, assert_close_to_scale)
    moe = loaded0.model.model.layers[0].block_sparse_moe
    assert moe.experts[0].w1.weight.shape == (24, 64) and moe.experts[0].w2.weight.shape == (64, 24)
    assert moe.gate.weight.shape == (4, 64)                               # the router: replicated


# ---- GGUF blocks sharded without dequantizing ------------------------------------------------------
needs_hf_quant_kernels = pytest.mark.skipif(hf_build.load() is None,
                                            reason=f"quantized kernels unavailable: {hf_build.unavailable_reason()}")
needs_quant_kernels = pytest.mark.skipif(not kernels_available(),
                                         reason=f"quantized kernels unavailable: {quant_build.unavailable_reason()}")


@pytest.mark.parametrize("qtype", [GT.Q8_0, GT.Q4_1, GT.Q5_0, GT.Q3_K, GT.Q4_K, GT.Q6_K],
                         ids=lambda t: t.name)
def test_a_block_shard_decodes_to_the_float_shard(qtype):
    """Rows (column-parallel, the padded vocabulary) and whole blocks of columns (row-parallel)
    of a QuantizedWeight decode to exactly the same slice of the dequantized matrix."""
    from tests.kernels.test_quant_gemm import random_blocks
    n, k = 24, 1024
    name, qk, size = FORMATS[int(qtype)]
    w = QuantizedWeight(torch.from_numpy(random_blocks(qtype, n, k, np.random.default_rng(1))),
                        int(qtype), (n, k), "float")
    full = quant_dequantize(w)
    rows = ShardRule(0, ((4, 10), (16, 20)), pad_to=12)
    got = rows.take(w)
    assert got.shape == (12, k) and got.data.shape == (12, k // qk * size)
    assert torch.equal(quant_dequantize(got), torch.cat([full[4:10], full[16:20], torch.zeros(2, k)]))
    cols = ShardRule(1, ((qk, 3 * qk),))
    assert torch.equal(quant_dequantize(cols.take(w)), full[:, qk:3 * qk])
    assert rows.cut(qk) is None and cols.cut(qk) is None
    half = ShardRule(1, ((qk // 2, qk),))
    assert half.cut(qk) == (qk // 2, qk)
    with pytest.raises(ValueError, match=f"columns \\[{qk // 2}, {qk}\\) of a {name} weight cut its "
                                         f"{qk}-element blocks"):
        half.take(w)


def _gguf_ranks(path, size: int, quantization: str):
    def rank(group):
        loaded = load_model(str(path), dtype="float32", device="cpu", load_tokenizer=False, tp=group,
                            quantization=quantization)
        return loaded, _chunked_logits(loaded.model, SWEEP_PROMPTS[0])
    return _run_ranks(size, rank)


@needs_quant_kernels
@pytest.mark.parametrize("qtype,hidden,tied", [(GT.Q4_1, 64, True), (GT.Q8_0, 64, False),
                                               (GT.Q4_K, 512, True)], ids=lambda c: getattr(c, "name", None))
def test_gguf_blocks_split_over_two_ranks(qtype, hidden, tied, tmp_path, assert_close_to_scale):
    """Each rank holds its share of the blocks (the embedding and a tied head too) and the gathered
    logits equal one rank's over the same blocks to float32 rounding."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, qtype, hidden=hidden, tied=tied)
    one = load_model(str(path), "float32", device="cpu", load_tokenizer=False, quantization="gguf")
    want = _chunked_logits(one.model, SWEEP_PROMPTS[0])
    (r0, got), (r1, rest) = _gguf_ranks(path, 2, "gguf")
    assert rest is None and r0.quantization == r1.quantization == "gguf"
    assert_close_to_scale(got, want, rel=1e-5)
    for r in (r0, r1):
        layer = r.model.model.layers[0]
        assert isinstance(layer.self_attn.o_proj, QuantizedLinear)
        assert layer.self_attn.o_proj.weight.shape == (hidden, hidden // 2)        # row-parallel
        assert layer.mlp.up_proj.weight.shape == (hidden, hidden)                  # inter 2h / 2
        assert isinstance(r.model.model.embed_tokens, QuantizedVocabParallelEmbedding)
        assert r.model.lm_head.weight.shape == (256, hidden)
        if tied:   # the head multiplies the embedding shard's own bytes
            assert r.model.lm_head.qweight.data_ptr() == r.model.model.embed_tokens.qweight.data_ptr()
    # every weight byte is held once across the ranks (norms replicated)
    norms = sum(p.nbytes for p in one.model.parameters())
    assert r0.weight_bytes + r1.weight_bytes == one.weight_bytes + norms


@needs_quant_kernels
def test_a_shard_that_would_cut_a_block_is_refused_or_dequantized(tmp_path, caplog, assert_close_to_scale):
    """Q4_K blocks are 256 wide: o_proj's 128 columns a rank (hidden 256 over two) cut them.
    `gguf` refuses, naming the tensor; the default dequantizes, saying why."""
    path = tmp_path / "tiny-q4k.gguf"
    write_tiny_gguf(path, GT.Q4_K, hidden=256, tied=True)
    with pytest.raises(ValueError, match=r"cannot serve tiny-q4k.gguf quantized: --tensor-parallel-size 2 "
                                         r"gives each rank columns \[(0, 128|128, 256)\) of model.layers.0.self_attn."
                                         r"o_proj.weight, which cut its Q4_K blocks of 256"):
        _gguf_ranks(path, 2, "gguf")
    with caplog.at_level(logging.WARNING):
        (r0, got), _ = _gguf_ranks(path, 2, None)
    assert r0.quantization is None and "serving GGUF tensors dequantized to float: --tensor-parallel" in caplog.text
    dense = load_model(str(path), "float32", device="cpu", load_tokenizer=False, quantization="none")
    assert_close_to_scale(got, _chunked_logits(dense.model, SWEEP_PROMPTS[0]))


@pytest.fixture(scope="module")
def hf_float_dir(tmp_path_factory):
    """A tiny Llama (hidden 256, 4 heads of 64, intermediate 512) to quantize: at two ranks each
    row-parallel slice is whole groups of 128 (o_proj 128 columns, down_proj 256)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=512,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return save_tiny_model(LlamaForCausalLM(cfg), tmp_path_factory.mktemp("tiny-float"), seed=3)


def _next_token_logprob_gap(got: torch.Tensor, want: torch.Tensor, tokens: list[int]) -> float:
    nxt = torch.tensor(tokens[1:])[:, None]
    lg, lw = got[:-1].double().log_softmax(-1), want[:-1].double().log_softmax(-1)
    return (lg.gather(1, nxt) - lw.gather(1, nxt)).abs().mean().item()


@needs_hf_quant_kernels
@pytest.mark.parametrize("method,opts", [("awq", {}), ("gptq", {"desc_act": False, "sym": True}),
                                         ("compressed-tensors", {"kind": "int"})],
                         ids=["awq", "gptq-sym", "w8a8"])
def test_hf_quantized_checkpoint_split_over_two_ranks(method, opts, hf_float_dir, tmp_path,
                                                      assert_close_to_scale):
    """Packed int4 codes with their scales and zeros, or int8 codes with their row scales, cut per
    rank without dequantizing; the gathered logits equal one rank's (int4: float32 rounding;
    W8A8 quantizes each rank's slice of the activations per token, so within its rounding)."""
    from benchmarks.quant_checkpoints import make_checkpoint
    path, _ = make_checkpoint(hf_float_dir, tmp_path / "ckpt", method, **opts)
    tokens = SWEEP_PROMPTS[0]
    one = load_model(str(path), "float32", device="cpu", load_tokenizer=False, quantization=method)
    want = _chunked_logits(one.model, tokens)

    def rank(group):
        loaded = load_model(str(path), "float32", device="cpu", load_tokenizer=False, tp=group)
        return loaded, _chunked_logits(loaded.model, tokens)

    (r0, got), (r1, _) = _run_ranks(2, rank)
    assert r0.quantization == r1.quantization == method         # the default serves it quantized
    if method == "compressed-tensors":
        gap = _next_token_logprob_gap(got, want, tokens)
        print(f"W8A8 over two ranks against one: mean |log-prob difference| {gap:.3g}")
        assert gap <= 0.1         # NOTE: measured 0.034 (each rank's per-token scales differ)
    else:
        assert_close_to_scale(got, want, rel=1e-5)
    down = r1.model.model.layers[1].mlp.down_proj.weight
    assert down.shape == (256, 256)                                # row-parallel: K 512 / 2
    full = one.model.model.layers[1].mlp.down_proj.weight
    if method == "compressed-tensors":
        assert torch.equal(down.weight, full.weight[:, 256:])
        assert torch.equal(down.w_sum, full.weight[:, 256:].sum(1, dtype=torch.int32))
    else:
        assert torch.equal(down.qweight, full.qweight[:, 128:]) and torch.equal(down.scales, full.scales[:, 2:])
    assert r0.model.model.layers[0].self_attn.q_proj.weight.shape == (128, 256)   # column-parallel


@needs_hf_quant_kernels
def test_quantized_moe_experts_split_over_two_ranks(tmp_path, assert_close_to_scale):
    """AWQ experts: each rank holds its half of every expert's gate / up rows and down columns
    (whole groups of 128), runs them per expert, and the all-reduced logits equal one rank's."""
    from tests.models.test_hf_quantized import make_moe_checkpoint
    path, _ = make_moe_checkpoint(tmp_path / "moe", "awq")
    tokens = SWEEP_PROMPTS[0]
    one = load_model(str(path), "float32", device="cpu", load_tokenizer=False)
    want = _chunked_logits(one.model, tokens)

    def rank(group):
        loaded = load_model(str(path), "float32", device="cpu", load_tokenizer=False, tp=group)
        return loaded, _chunked_logits(loaded.model, tokens)

    (r0, got), (r1, _) = _run_ranks(2, rank)
    assert r0.quantization == r1.quantization == "awq"
    assert_close_to_scale(got, want, rel=1e-5)
    expert = r1.model.model.layers[0].mlp.experts[3]
    full = one.model.model.layers[0].mlp.experts[3]
    assert expert.up_proj.weight.shape == (128, 256) and expert.down_proj.weight.shape == (256, 128)
    assert torch.equal(expert.down_proj.weight.qweight, full.down_proj.weight.qweight[:, 64:])


@needs_hf_quant_kernels
def test_act_order_gptq_is_not_split_along_k(hf_float_dir, tmp_path, caplog, assert_close_to_scale):
    """GPTQ act-order permutes K: a row-parallel split would mix columns across ranks. Asked for
    by name it is refused; the default dequantizes, saying why."""
    from benchmarks.quant_checkpoints import make_checkpoint
    path, _ = make_checkpoint(hf_float_dir, tmp_path / "ckpt", "gptq", desc_act=True, sym=False)

    def rank(choice):
        def run(group):
            loaded = load_model(str(path), "float32", device="cpu", load_tokenizer=False, tp=group,
                                quantization=choice)
            return loaded, _chunked_logits(loaded.model, SWEEP_PROMPTS[0])
        return run

    with pytest.raises(ValueError, match=r"cannot serve ckpt quantized: --tensor-parallel-size 2 splits the "
                                         r"input columns of model.layers.0.mlp.down_proj.weight, and act-order "
                                         r"GPTQ weights \(desc_act\) permute them across ranks"):
        _run_ranks(2, rank("gptq"))
    with caplog.at_level(logging.WARNING):
        (r0, got), _ = _run_ranks(2, rank(None))
    assert r0.quantization is None and "act-order GPTQ weights (desc_act)" in caplog.text
    dense = load_model(str(path), "float32", device="cpu", load_tokenizer=False, quantization="none")
    assert_close_to_scale(got, _chunked_logits(dense.model, SWEEP_PROMPTS[0]))


# ---- the engine with worker processes ------------------------------------------------------------
def _prompts(vocab: int) -> list[list[int]]:
    """10 prompts of 1 to 45 tokens; 4 share a 13-token prefix (3 full blocks + 1)."""
    rng = random.Random(7)
    shared = [rng.randrange(3, vocab) for _ in range(13)]
    out = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 3, 8, 17, 30, 45)]
    return out + [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in (1, 4, 9, 20)]


def _engine(path, size: int, mode: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=None if path is None else str(path), dtype="float32", device="cpu",
        tensor_parallel_size=size, cpu_threads=1, block_size=BLOCK, max_num_batched_tokens=16,
        num_kv_blocks=20, max_model_len=64, preemption_mode=mode, swap_space=0.01,
        enable_prefix_caching=True, **kw))


def _first_step_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """One prefill of `prompt` straight through the runner (every rank), logits of every
    position; on a fresh engine, whose blocks 0.. are free."""
    blocks = list(range(-(-len(prompt) // BLOCK)))
    with torch.inference_mode():
        _, logits = engine.runner.run_model(ModelInput(prompt, list(range(len(prompt))),
                                                       [len(prompt)], [len(prompt)], [blocks],
                                                       list(range(len(prompt)))))
    return logits


def _generate(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[list[int]], dict]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, params)
    done, stats = {}, {"recompute": 0, "swap": 0, "chunked": 0, "prefix_hit_tokens": 0}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        s = engine.last_stats
        stats["recompute"] += s.num_preempted_recompute
        stats["swap"] += s.num_preempted_swap
        stats["chunked"] += s.num_chunked_prefills
        stats["prefix_hit_tokens"] += s.prefix_hit_tokens
    engine.kv_manager.check_invariants([])
    return [done[f"q{i}"] for i in range(len(prompts))], stats


def _assert_greedy_matches(got: list[list[int]], want: list[tuple[list[int], torch.Tensor]]) -> list[str]:
    """Sequences equal, but where transformers' top-2 logits are within TIE_GAP: there either
    token is right and the sequences may part. Returns the ties seen."""
    ties = []
    for i, (ours, (ref, logits)) in enumerate(zip(got, want)):
        for pos, (a, b) in enumerate(zip(ours, ref)):
            if a == b:
                continue
            top = logits[pos].topk(2)
            gap = float(top.values[0] - top.values[1])
            assert gap < TIE_GAP and a in top.indices.tolist(), \
                f"prompt {i} parts from transformers at token {pos}: {ours} vs {ref} (top-2 gap {gap:.3g})"
            ties.append(f"prompt {i}, token {pos}: {a} vs {b}, top-2 gap {gap:.2g}")
            break
    if ties:
        print("tensor-parallel greedy ties with transformers:", *ties, sep="\n  ")
    assert len(ties) <= 1, ties
    return ties


def _worker_pids(engine: LLMEngine) -> list[int]:
    return [p.pid for p in engine.executor.procs]


def _assert_gone(pids: list[int]) -> None:
    me = psutil.Process()
    left = [c.pid for c in me.children(recursive=True) if c.pid in pids and c.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"worker processes left behind: {left}"
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.fixture(scope="module")
def qwen2_gqa(tmp_path_factory):
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(_qwen2_config()).eval()
    return hf, save_tiny_model(hf, tmp_path_factory.mktemp("tp") / "qwen2-gqa", seed=3)


def test_engine_qwen2_gqa_two_ranks_swap(qwen2_gqa, hf_greedy_logits, assert_close_to_scale):
    hf, path = qwen2_gqa
    prompts = _prompts(301)
    want = [hf_greedy_logits(hf, p, NEW_TOKENS) for p in prompts]
    engine = _engine(path, 2, "swap")
    pids = _worker_pids(engine)
    try:
        # per-rank KV: one of the two KV heads, so a block is half the bytes of one rank's
        assert engine.runner.kv_cache.shape == (2, 2, 20, BLOCK, 1, 16)
        assert engine.block_bytes == kv_block_bytes(2, BLOCK, 1, 16, torch.float32)
        single = load_model(str(path), dtype="float32", device="cpu")
        for p in (prompts[5], prompts[-1]):
            ours = _first_step_logits(engine, p)
            assert_close_to_scale(ours, hf_greedy_logits(hf, p, 1)[0])
            one = _first_step_logits(LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu",
                                                            block_size=BLOCK, num_kv_blocks=20,
                                                            max_model_len=64), loaded=single), p)
            assert_close_to_scale(ours, one, rel=1e-5)
        got, stats = _generate(engine, prompts)
        assert stats["swap"] > 0 and stats["recompute"] == 0, stats
        assert stats["chunked"] > 0 and stats["prefix_hit_tokens"] > 0, stats
        _assert_greedy_matches(got, [(t, g) for _, t, g in want])
        # n > 1 with seeded sampling: the same samples as one rank (logits agree to ~1e-6)
        params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
        engine.add_request("n3", prompts[4], params)
        multi = []
        while engine.has_unfinished_requests():
            multi += [o for o in engine.step() if o.finished]
        ref = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", block_size=BLOCK,
                                     num_kv_blocks=64, max_model_len=64), loaded=single)
        ref.add_request("n3", prompts[4], params)
        ref_out = []
        while ref.has_unfinished_requests():
            ref_out += [o for o in ref.step() if o.finished]
        assert [c.token_ids for c in multi[0].outputs] == [c.token_ids for c in ref_out[0].outputs]
        assert len({tuple(c.token_ids) for c in multi[0].outputs}) > 1
    finally:
        engine.shutdown()
    _assert_gone(pids)


def test_engine_two_ranks_with_an_8_bit_kv_cache(qwen2_gqa, assert_close_to_scale):
    """--kv-cache-dtype fp8 under tensor parallelism: every rank holds its KV heads' e4m3 codes
    (a quarter of float32's bytes), sequences swap out and back in as bytes, and the logits and
    greedy tokens are one fp8 rank's."""
    _, path = qwen2_gqa
    prompts = _prompts(301)
    engine = _engine(path, 2, "swap", kv_cache_dtype="fp8")
    pids = _worker_pids(engine)
    try:
        assert engine.runner.kv_cache.dtype == torch.float8_e4m3fn
        assert engine.block_bytes == kv_block_bytes(2, BLOCK, 1, 16, torch.float8_e4m3fn)
        single = load_model(str(path), dtype="float32", device="cpu")
        one = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", block_size=BLOCK,
                                     num_kv_blocks=64, max_model_len=64, kv_cache_dtype="fp8"), loaded=single)
        assert_close_to_scale(_first_step_logits(engine, prompts[-1]), _first_step_logits(one, prompts[-1]),
                              rel=1e-5)
        got, stats = _generate(engine, prompts)
        assert stats["swap"] > 0, stats
        want, _ = _generate(one, prompts)
        # NOTE: a rank's K/V differ from one rank's by float rounding (~1e-6), which can move a
        # value across an e4m3 rounding boundary (a code 6% away): one sequence may part there
        assert sum(g == w for g, w in zip(got, want)) >= len(prompts) - 1, (got, want)
    finally:
        engine.shutdown()
    _assert_gone(pids)


def test_engine_qwen3_moe_replicated_kv_two_ranks_recompute(tmp_path, hf_greedy_logits,
                                                          assert_close_to_scale):
    """MoE experts split over the ranks, one KV head held by both, a dense layer between."""
    cfg = Qwen3MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=80, moe_intermediate_size=32,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(cfg).eval()
    path = save_tiny_model(hf, tmp_path / "qwen3-moe", seed=6)
    prompts = _prompts(300)
    want = [hf_greedy_logits(hf, p, NEW_TOKENS) for p in prompts]
    engine = _engine(path, 2, "recompute")
    pids = _worker_pids(engine)
    try:
        assert engine.runner.kv_cache.shape == (3, 2, 20, BLOCK, 1, 32)     # the KV head, replicated
        assert_close_to_scale(_first_step_logits(engine, prompts[4]), want[4][0])
        got, stats = _generate(engine, prompts)
        assert stats["recompute"] > 0 and stats["swap"] == 0, stats
        assert stats["chunked"] > 0 and stats["prefix_hit_tokens"] > 0, stats
        _assert_greedy_matches(got, [(t, g) for _, t, g in want])
    finally:
        engine.shutdown()
    _assert_gone(pids)


def test_engine_smollm_three_ranks(hf_smollm, hf_greedy_logits, assert_close_to_scale):
    """The built-in model (9 query heads, 3 KV heads, intermediate 1536, vocab 49152) over 3 ranks,
    its Q4_1 / Q8_0 blocks sharded as blocks (the default): every slice is whole 32-blocks."""
    rng = random.Random(5)
    shared = [rng.randrange(100, 40000) for _ in range(13)]
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (6, 21)]
    prompts += [shared + [rng.randrange(100, 40000) for _ in range(n)] for n in (3, 17)]
    want = [hf_greedy_logits(hf_smollm, p, 6) for p in prompts]
    engine = LLMEngine(EngineConfig(dtype="float32", device="cpu", tensor_parallel_size=3, cpu_threads=1,
                                    block_size=BLOCK, max_num_batched_tokens=16, num_kv_blocks=16,
                                    max_model_len=64, preemption_mode="swap", swap_space=0.01))
    pids = _worker_pids(engine)
    try:
        assert engine.runner.kv_cache.shape[4] == 1                      # one KV head per rank
        assert engine.loaded.quantization == "gguf"
        assert isinstance(engine.loaded.model.model.layers[0].mlp.down_proj, QuantizedLinear)
        assert_close_to_scale(_first_step_logits(engine, prompts[1]), want[1][0])
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"s{i}", p, params)
        done, swapped, hits = {}, 0, 0
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
            swapped += engine.last_stats.num_preempted_swap
            hits += engine.last_stats.prefix_hit_tokens
        assert swapped > 0 and hits > 0, (swapped, hits)
        _assert_greedy_matches([done[f"s{i}"] for i in range(len(prompts))], [(t, g) for _, t, g in want])
    finally:
        engine.shutdown()
    _assert_gone(pids)


def test_two_ranks_for_smollm_is_refused_before_any_process_starts():
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match=r"query heads \(9\) is not divisible by 2"):
        LLMEngine(EngineConfig(dtype="float32", device="cpu", tensor_parallel_size=2))
    assert {c.pid for c in psutil.Process().children(recursive=True)} <= before


def test_what_a_tensor_parallel_engine_refuses_before_starting_anything(qwen2_gqa):
    _, path = qwen2_gqa
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    cfg = EngineConfig(model=str(path), dtype="float32", device="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="a tensor-parallel engine loads its own shards"):
        LLMEngine(cfg, loaded=load_model(str(path), dtype="float32", device="cpu"))
    with pytest.raises(ValueError, match=r"--kv-share is not supported with --tensor-parallel-size > 1"):
        LLMEngine(cfg, kv_connector=redis_kv_connector("redis://127.0.0.1:1/0"))
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        EngineConfig(tensor_parallel_size=0)
    assert {c.pid for c in psutil.Process().children(recursive=True)} <= before


def test_kv_memory_per_rank_is_the_least_free_on_cuda_and_a_share_of_the_host_on_cpu():
    executor = TPExecutor(4, TPGroup(0, 4), [], [])
    executor.worker_free_memory = [900, 700, 800]
    assert executor.kv_free_memory(1000, torch.device("cuda")) == 700
    assert executor.kv_free_memory(1000, torch.device("cpu")) == 175     # 700 / 4 ranks


def test_a_killed_worker_fails_the_step_within_seconds_and_leaves_no_process(qwen2_gqa):
    _, path = qwen2_gqa
    engine = _engine(path, 2, "recompute")
    pids = _worker_pids(engine)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        engine.add_request("long", list(range(3, 20)), params)
        for _ in range(3):
            engine.step()
        os.kill(pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"worker rank 1 \(pid \d+\) was killed by SIGKILL"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - t0 < 30          # a hang guard: gloo fails at once here
        with pytest.raises(WorkerDiedError):
            engine.check_health()
    finally:
        engine.shutdown()
    _assert_gone(pids)


def test_a_worker_that_dies_while_the_server_idles_kills_the_async_engine(qwen2_gqa):
    """No step runs, yet the engine thread notices (its idle wait checks the workers) and fails,
    so the server's probes turn 503 and it exits instead of failing the next request."""
    from kvmesh.engine.async_engine import AsyncLLMEngine, EngineDeadError

    _, path = qwen2_gqa
    engine = _engine(path, 2, "recompute")
    pids = _worker_pids(engine)
    died = threading.Event()
    async_engine = AsyncLLMEngine(engine, on_dead=lambda e: died.set())
    async_engine.start()
    try:
        os.kill(pids[0], signal.SIGKILL)
        assert died.wait(30), "the idle engine did not notice its dead worker"
        assert isinstance(async_engine.dead, WorkerDiedError)
        assert "was killed by SIGKILL" in str(async_engine.dead)
        with pytest.raises(EngineDeadError, match="killed by SIGKILL"):
            asyncio.run(async_engine.add_request("late", [5, 6], SamplingParams(max_tokens=1)))
    finally:
        async_engine.shutdown()
    _assert_gone(pids)


@needs_quant_kernels
@pytest.mark.parametrize("arch", ["mixtral", "qwen3moe"])
def test_gguf_experts_split_over_two_ranks(arch, tmp_path, assert_close_to_scale):
    """A MoE GGUF's stacked experts in Q8_0 blocks: each rank holds its rows of every expert
    (gate / up) and its columns (down), and the gathered logits equal one rank's."""
    from kvmesh.common.gguf_reader import GGUFReader
    from kvmesh.common.model_files import builtin_model_path
    from tests.models.test_gguf import _GGUF_ARCH, _tiny_hf, _write_gguf
    cfg, hf_model = _tiny_hf(arch)
    path = tmp_path / f"{arch}.gguf"
    _write_gguf(path, _GGUF_ARCH.get(arch, arch), hf_model, cfg,
                GGUFReader(builtin_model_path()), block_type=GT.Q8_0)
    one = load_model(str(path), "float32", device="cpu", load_tokenizer=False, quantization="gguf")
    want = _chunked_logits(one.model, SWEEP_PROMPTS[0])
    (r0, got), (r1, rest) = _gguf_ranks(path, 2, "gguf")
    assert rest is None and r0.quantization == r1.quantization == "gguf"
    assert_close_to_scale(got, want, rel=1e-5)
    inter = cfg.intermediate_size if arch == "mixtral" else cfg.moe_intermediate_size
    for r in (r0, r1):
        layer = r.model.model.layers[0]
        gate, up, down = (layer.block_sparse_moe if arch == "mixtral" else layer.mlp).experts[0].linears()
        assert all(isinstance(m, QuantizedLinear) for m in (gate, up, down))
        assert gate.weight.shape == (inter // 2, cfg.hidden_size) and down.weight.shape == (cfg.hidden_size, inter // 2)
