"""benchmarks/models.py's builtin-w8a8: the built-in model as a compressed-tensors W8A8 checkpoint,
the int8 model kvmesh and vLLM's CPU build are compared on. Its codes are each projection's
per-channel int8 rounding of the float32 weights; kvmesh loads it as W8A8 and its logits stay within
the int8 rounding's reach of the float32 model's."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.models import W8A8_PROJ, ensure_builtin_w8a8, resolve_model
from kvmesh.engine.hf_export import builtin_hf_dir
from kvmesh.kernels.quant import hf_build
from tests.models.conftest import paged_generate


def test_the_checkpoint_is_the_per_channel_int8_rounding(tmp_path):
    out = ensure_builtin_w8a8(tmp_path)
    assert resolve_model("builtin-w8a8", tmp_path) == str(out)
    assert ensure_builtin_w8a8(tmp_path) == out                     # written once
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "int-quantized"
    group = qc["config_groups"]["group_0"]
    assert group["weights"]["num_bits"] == 8 and group["weights"]["strategy"] == "channel"
    assert group["input_activations"]["dynamic"] is True and group["input_activations"]["strategy"] == "token"
    got = load_file(str(out / "model.safetensors"))
    src = load_file(str(builtin_hf_dir("float32") / "model.safetensors"))
    for proj in W8A8_PROJ:
        name = f"model.layers.7.{proj}"
        w, q, s = src[f"{name}.weight"], got[f"{name}.weight"], got[f"{name}.weight_scale"]
        assert q.dtype == torch.int8 and q.shape == w.shape and s.shape == (w.shape[0], 1)
        torch.testing.assert_close(s, w.abs().amax(1, keepdim=True) / 127)
        assert torch.equal(q, torch.round(w / s).clamp(-128, 127).to(torch.int8))
    assert torch.equal(got["model.embed_tokens.weight"], src["model.embed_tokens.weight"])


@pytest.mark.skipif(hf_build.load() is None, reason="Hugging Face quantized kernels unavailable")
def test_kvmesh_serves_it_as_w8a8(tmp_path):
    from kvmesh.engine.loader import load_model
    loaded = load_model(str(ensure_builtin_w8a8(tmp_path)), "float32", device="cpu", load_tokenizer=False)
    assert loaded.quantization == "compressed-tensors"
    ref = load_model(str(builtin_hf_dir("float32")), "float32", device="cpu", load_tokenizer=False)
    prompt = [1, 504, 3458, 314, 260, 3575, 30, 1204, 282, 5248, 28, 284, 906, 17, 4093, 253]
    a = torch.log_softmax(paged_generate(loaded.model, [prompt], 1)[0]["prompt_logits"], -1)
    b = torch.log_softmax(paged_generate(ref.model, [prompt], 1)[0]["prompt_logits"], -1)
    # per-token int8 activations and per-channel int8 weights: near the float32 model, not equal.
    # NOTE: measured 0.256 here (SmolLM2's outlier activation channels widen a per-token int8
    # scale): the bound says the checkpoint is this model, not a broken one (several nats off)
    top = b.argmax(-1, keepdim=True)
    diff = (a.gather(-1, top) - b.gather(-1, top)).abs().mean().item()
    assert 0 < diff < 0.4
