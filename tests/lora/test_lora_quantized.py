"""LoRA adapters over a quantized base: the built-in SmolLM2 Q4_1 GGUF served as blocks
(`quantization="gguf"`, kernels/quant) runs an adapter made by peft on the same weights exactly as
the dequantized model does: the adapter's sites add to the quantized projections' outputs."""
from __future__ import annotations

import random

import pytest
from lora_adapters import make_adapter

from kvmesh.engine.hf_export import builtin_hf_dir
from kvmesh.engine.llm import LLM
from kvmesh.engine.lora import LoRARequest
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.kernels.quant import build, kernels_available

pytestmark = pytest.mark.skipif(not kernels_available(),
                                reason=f"quantized kernels unavailable: {build.unavailable_reason()}")

NEW = 8


def test_an_adapter_over_gguf_blocks_matches_it_over_the_dequantized_weights(tmp_path):
    adapter = make_adapter(builtin_hf_dir("float32"), tmp_path / "adapter",
                           ["q_proj", "v_proj", "o_proj", "down_proj"], r=8, alpha=16, seed=4)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (24, 40)]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    lora = LoRARequest("a", 1, str(adapter))
    got = {}
    for q in ("gguf", "none"):
        llm = LLM(None, quantization=q, enable_lora=True, max_lora_rank=8, dtype="float32",
                  device="cpu", num_kv_blocks=32, block_size=16)
        assert (llm.engine.loaded.quantization is not None) == (q == "gguf")
        got[q] = ([o.outputs[0].token_ids for o in llm.generate(prompts, greedy, lora_request=lora)],
                  [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)])
        llm.shutdown()
    with_adapter, base = got["gguf"]
    assert with_adapter != base                       # the adapter changes the quantized model's answers
    assert got["gguf"] == got["none"]
