"""A Hugging Face checkpoint's `quantization_config`, parsed and checked once, at load.

    parse_quantization_config(cfg) -> HFQuantConfig | None     config.json's dict -> what to load

Supported (the methods and options vLLM loads the same checkpoints with):
    compressed-tensors  int-quantized W8A8: int8 symmetric weights, channel strategy; int8
                        dynamic symmetric activations, token strategy
                        float-quantized FP8: e4m3 weights, tensor or channel strategy; fp8
                        dynamic activations per tensor or per token, or none (weight-only);
                        served on GPU only
    awq                 bits 4, zero_point true, version gemm, any group size (-1: whole rows)
    gptq                bits 4, checkpoint_format gptq (v1: zeros stored minus one), sym or not,
                        desc_act (act-order, g_idx) or not
    fp8                 activation_scheme dynamic (per tensor), no weight_block_size (GPU only)
Anything else is a ValueError naming the method and the option (bitsandbytes, marlin formats,
3/8-bit GPTQ, static activations, ...).

`ignore` (compressed-tensors) and `modules_to_not_convert` (awq, gptq) name modules kept in float:
`is_ignored(module)` answers for one module name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

METHODS = ("compressed-tensors", "awq", "gptq", "fp8")
# What each method's modules hold once loaded (kvmesh.kernels.quant.hf_weight):
SCHEMES = ("w8a8_int8", "w4a16", "fp8")


@dataclass(frozen=True, slots=True)
class HFQuantConfig:
    """What a checkpoint's quantized modules are and how to read them."""

    method: str                     # quant_method, vLLM's name: compressed-tensors | awq | gptq | fp8
    scheme: str                     # one of SCHEMES: the canonical weight the loader builds
    group_size: int = 0             # w4a16: K elements per scale / zero (-1 in the config: whole rows, 0 here)
    desc_act: bool = False          # gptq: g_idx may permute K (act-order)
    sym: bool = True                # gptq: zeros are all 8 (still read from qzeros)
    weight_strategy: str = "channel"    # fp8 / int8: "tensor" or "channel" weight scales
    activations: str = "tensor"     # fp8: activations cast per "tensor" / per "token", or "none"
    ignore: tuple[str, ...] = ()    # module names / "re:" patterns kept in float

    def is_ignored(self, module: str) -> bool:
        """Whether `module` (e.g. "lm_head", "model.layers.0.mlp.down_proj") stays float."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module):
                    return True
            elif self.method == "compressed-tensors":
                # NOTE: compressed-tensors names whole modules (or the last part of a name)
                if module == pattern or module.endswith("." + pattern):
                    return True
            elif pattern in module:
                # NOTE: AutoAWQ / GPTQ match modules_to_not_convert as a substring of the name
                return True
        return False

    @property
    def describe(self) -> str:
        """How the weights are held, for the startup log and /v1/models."""
        if self.scheme == "w4a16":
            return f"{self.method} int4, group {self.group_size or 'row'}" + (
                ", act-order" if self.desc_act else "")
        if self.scheme == "w8a8_int8":
            return f"{self.method} int8 W8A8 (per-channel weights, per-token activations)"
        acts = {"tensor": "per-tensor fp8 activations", "token": "per-token fp8 activations",
                "none": "weight-only"}[self.activations]
        return f"{self.method} fp8 e4m3 ({self.weight_strategy} scales, {acts})"


def parse_quantization_config(hf_config: dict) -> HFQuantConfig | None:
    """The checkpoint's quantization (None: a float checkpoint); ValueError names what is not
    supported."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError("quantization_config must be a JSON object")
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "awq":
        return _awq(qc)
    if method == "gptq":
        return _gptq(qc)
    if method == "fp8":
        return _fp8(qc)
    raise ValueError(f"unsupported quantization method {qc.get('quant_method')!r} "
                     f"(quant_method in quantization_config); supported: {', '.join(METHODS)}")


def _refuse(method: str, option: str, value, want: str) -> ValueError:
    return ValueError(f"unsupported {method} checkpoint: {option}={value!r} ({want} is supported)")


def _group_size(method: str, qc: dict) -> int:
    g = qc.get("group_size", 128)
    if not isinstance(g, int) or (g != -1 and (g <= 0 or g % 32)):
        raise _refuse(method, "group_size", g, "a positive multiple of 32, or -1")
    return 0 if g == -1 else g


def _ignore_list(qc: dict, key: str) -> tuple[str, ...]:
    names = qc.get(key) or ()
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"quantization_config.{key} must be a list of module names")
    return tuple(names)


def _awq(qc: dict) -> HFQuantConfig:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _refuse("awq", "bits", bits, "4")
    if qc.get("zero_point", True) is not True:
        raise _refuse("awq", "zero_point", qc.get("zero_point"), "true")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("awq", "version", qc.get("version"), "gemm")
    return HFQuantConfig("awq", "w4a16", _group_size("awq", qc),
                         ignore=_ignore_list(qc, "modules_to_not_convert"))


def _gptq(qc: dict) -> HFQuantConfig:
    if qc.get("bits") != 4:
        raise _refuse("gptq", "bits", qc.get("bits"), "4")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt != "gptq":
        raise _refuse("gptq", "checkpoint_format", fmt, "gptq (v1)")
    if qc.get("is_marlin_format"):
        raise _refuse("gptq", "is_marlin_format", True, "false")
    for key in ("desc_act", "sym"):
        if not isinstance(qc.get(key, key == "sym"), bool):
            raise _refuse("gptq", key, qc.get(key), "true or false")
    return HFQuantConfig("gptq", "w4a16", _group_size("gptq", qc), desc_act=qc.get("desc_act", False),
                         sym=qc.get("sym", True), ignore=_ignore_list(qc, "modules_to_not_convert"))


def _fp8(qc: dict) -> HFQuantConfig:
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse("fp8", "activation_scheme", qc.get("activation_scheme"), "dynamic")
    if qc.get("weight_block_size") is not None:
        raise _refuse("fp8", "weight_block_size", qc.get("weight_block_size"), "none (per-tensor scales)")
    return HFQuantConfig("fp8", "fp8", weight_strategy="tensor",
                         ignore=_ignore_list(qc, "modules_to_not_convert"))


def _compressed_tensors(qc: dict) -> HFQuantConfig:
    m = "compressed-tensors"
    fmt = qc.get("format")
    if fmt not in ("int-quantized", "float-quantized", "naive-quantized"):
        raise _refuse(m, "format", fmt, "int-quantized or float-quantized")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or len(groups) != 1:
        raise _refuse(m, "config_groups", f"{len(groups)} groups" if isinstance(groups, dict) else groups,
                      "exactly one group")
    name, group = next(iter(groups.items()))
    w, a = group.get("weights") or {}, group.get("input_activations")
    if group.get("output_activations") is not None:
        raise _refuse(m, f"{name}.output_activations", group["output_activations"], "null")
    kv = qc.get("kv_cache_scheme")
    if kv is not None:
        # NOTE: 8-bit float KV codes with one static scale per tensor (k_scale / v_scale, read
        # by the loader: kvmesh.engine.quantization.kv_scales), as vLLM serves them
        if not isinstance(kv, dict):
            raise _refuse(m, "kv_cache_scheme", kv, "null or a quantization args object")
        _want(kv, "kv_cache_scheme", type="float", num_bits=8, strategy="tensor", dynamic=False,
              symmetric=True)
    wtype = w.get("type")
    if wtype == "int":
        _want(w, f"{name}.weights", num_bits=8, symmetric=True, strategy="channel", dynamic=False)
        if a is None:
            raise _refuse(m, f"{name}.input_activations", None, "int8 dynamic per-token (W8A8)")
        _want(a, f"{name}.input_activations", type="int", num_bits=8, symmetric=True,
              strategy="token", dynamic=True)
        scheme, strategy, activations = "w8a8_int8", "channel", "tensor"   # activations: fp8 only (the default)
    elif wtype == "float":
        _want(w, f"{name}.weights", num_bits=8, dynamic=False)
        if w.get("strategy") not in ("tensor", "channel"):
            raise _refuse(m, f"{name}.weights.strategy", w.get("strategy"), "tensor or channel")
        activations = "none"
        if a is not None:
            _want(a, f"{name}.input_activations", type="float", num_bits=8, dynamic=True)
            if a.get("strategy") not in ("tensor", "token"):
                raise _refuse(m, f"{name}.input_activations.strategy", a.get("strategy"), "tensor or token")
            activations = a["strategy"]
        scheme, strategy = "fp8", w["strategy"]
    else:
        raise _refuse(m, f"{name}.weights.type", wtype, "int (W8A8) or float (FP8)")
    return HFQuantConfig(m, scheme, weight_strategy=strategy, activations=activations,
                         ignore=_ignore_list(qc, "ignore"))


def _want(args: dict, where: str, **expected) -> None:
    for key, want in expected.items():
        if args.get(key) != want:
            raise _refuse("compressed-tensors", f"{where}.{key}", args.get(key), repr(want))


def check_requested(requested: str, found: HFQuantConfig | None, where: str) -> None:
    """A `--quantization` method name must match the checkpoint's own quant_method."""
    if found is None:
        raise ValueError(f"--quantization {requested}: {where} is not a quantized checkpoint "
                         "(config.json has no quantization_config)")
    if requested != found.method:
        raise ValueError(f"--quantization {requested} does not match {where}, a {found.method} "
                         f"checkpoint; use --quantization {found.method} or auto")
