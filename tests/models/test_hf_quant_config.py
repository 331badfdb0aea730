"""quantization_config parsing (engine/quantization/hf_config.py): what is served, what is refused
by name. The compressed-tensors configs are written by the compressed-tensors library itself."""
from __future__ import annotations

import pytest
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

from kvmesh.engine.quantization.hf_config import HFQuantConfig, check_requested, parse_quantization_config


def ct_config(preset: str, fmt: str, ignore=("lm_head",)) -> dict:
    """config.json's quantization_config as compressed-tensors writes it for `preset`."""
    cfg = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                             format=fmt, ignore=list(ignore), quantization_status="compressed")
    return {"quantization_config": cfg.model_dump(mode="json")}


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
       "modules_to_not_convert": ["visual"]}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": False,
        "checkpoint_format": "gptq"}


def test_supported_methods_parse_to_their_scheme():
    assert parse_quantization_config({}) is None
    assert parse_quantization_config(ct_config("W8A8", "int-quantized")) == HFQuantConfig(
        "compressed-tensors", "w8a8_int8", weight_strategy="channel", ignore=("lm_head",))
    fp8 = parse_quantization_config(ct_config("FP8_DYNAMIC", "float-quantized"))
    assert fp8 == HFQuantConfig("compressed-tensors", "fp8", weight_strategy="channel", activations="token",
                                ignore=("lm_head",))
    assert fp8.describe == "compressed-tensors fp8 e4m3 (channel scales, per-token fp8 activations)"
    weight_only = parse_quantization_config(_without_activations(ct_config("FP8_DYNAMIC", "float-quantized")))
    assert weight_only.activations == "none" and weight_only.describe.endswith("(channel scales, weight-only)")
    assert parse_quantization_config({"quantization_config": AWQ}) == HFQuantConfig(
        "awq", "w4a16", group_size=128, ignore=("visual",))
    assert parse_quantization_config({"quantization_config": GPTQ}) == HFQuantConfig(
        "gptq", "w4a16", group_size=128, desc_act=True, sym=False)
    per_row = parse_quantization_config({"quantization_config": {**GPTQ, "group_size": -1}})
    assert per_row.group_size == 0
    vllm_fp8 = parse_quantization_config({"quantization_config": {"quant_method": "fp8"}})
    assert (vllm_fp8.scheme, vllm_fp8.weight_strategy, vllm_fp8.activations) == ("fp8", "tensor", "tensor")


def _without_activations(cfg: dict) -> dict:
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = None
    return cfg


def test_fp8_activation_strategy_outside_tensor_and_token_is_refused():
    cfg = ct_config("FP8_DYNAMIC", "float-quantized")
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"].update(strategy="group", group_size=128)
    with pytest.raises(ValueError, match=r"group_0.input_activations.strategy='group'"):
        parse_quantization_config(cfg)


@pytest.mark.parametrize("qc, named", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({**AWQ, "bits": 8}, "awq checkpoint: bits=8"),
    ({**AWQ, "version": "gemv"}, "version='gemv'"),
    ({**AWQ, "zero_point": False}, "zero_point=False"),
    ({**GPTQ, "bits": 3}, "gptq checkpoint: bits=3"),
    ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    ({**GPTQ, "group_size": 48}, "group_size=48"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme='static'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "weight_block_size=[128, 128]"),
])
def test_unsupported_method_or_option_is_refused_by_name(qc, named):
    with pytest.raises(ValueError, match="unsupported") as e:
        parse_quantization_config({"quantization_config": qc})
    assert named in str(e.value)


@pytest.mark.parametrize("preset, fmt, named", [
    ("W4A16", "pack-quantized", "format='pack-quantized'"),
    ("W8A16", "int-quantized", "weights.strategy='group'"),   # int8 weight-only, groups
])
def test_compressed_tensors_schemes_outside_w8a8_and_fp8_are_refused(preset, fmt, named):
    with pytest.raises(ValueError) as e:
        parse_quantization_config(ct_config(preset, fmt))
    assert "compressed-tensors" in str(e.value) and named in str(e.value)


def test_static_activation_scales_are_refused():
    cfg = ct_config("W8A8", "int-quantized")
    acts = cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"]
    acts.update(strategy="tensor", dynamic=False)     # W8A8 with calibrated static input scales
    with pytest.raises(ValueError, match=r"group_0.input_activations.strategy='tensor'"):
        parse_quantization_config(cfg)


def test_ignore_lists_match_as_each_format_means_them():
    ct = parse_quantization_config(ct_config("W8A8", "int-quantized", ("lm_head", "re:.*mlp.down_proj")))
    assert ct.is_ignored("lm_head") and ct.is_ignored("model.layers.3.mlp.down_proj")
    assert not ct.is_ignored("model.layers.3.mlp.up_proj")
    awq = parse_quantization_config({"quantization_config": {**AWQ, "modules_to_not_convert": ["mlp.gate"]}})
    assert awq.is_ignored("model.layers.0.mlp.gate_proj") and not awq.is_ignored("model.layers.0.mlp.up_proj")


def test_requested_method_must_match_the_checkpoint():
    awq = parse_quantization_config({"quantization_config": AWQ})
    check_requested("awq", awq, "ckpt")
    with pytest.raises(ValueError, match="--quantization gptq does not match ckpt, a awq checkpoint"):
        check_requested("gptq", awq, "ckpt")
    with pytest.raises(ValueError, match="not a quantized checkpoint"):
        check_requested("awq", None, "ckpt")
