"""load_model: an HF directory or a GGUF file -> model on its device and dtype + tokenizer.

    path ─┬─ dir:   config.json -> ModelConfig;  *.safetensors -> weights;  tokenizer.json
          └─ .gguf: metadata -> ModelConfig;     block or float tensors;    tokenizer (cached conversion)
                         └────────── model built on the meta device, weights assigned ──────────┘

Quantization (`quantization`, vLLM's name; `--quantization`): "auto" (the default, as None)
serves a GGUF file's block-format tensors as they are (QuantizedLinear / QuantizedEmbedding over
kvmesh.kernels.quant: about a third of bf16's memory for the built-in Q4_1 file) and a Hugging
Face quantized checkpoint by its own method (engine/quantization/serving.py) where the kernels
can run, and otherwise dequantizes, saying why in the log. On a CUDA GPU a GGUF file's block
tensors are converted once for the Triton GEMMs (the block kernels are the CPU's): Q4_0 / Q4_1 /
Q4_K into int4 groups of 32, the other formats into 8-bit groups (kernels/quant/gguf_gpu.py).
"gguf" (or the checkpoint's method) insists, a ValueError where it cannot (GGUF on a device
other than CPU / CUDA, a GPU file without block tensors the GPU reads, a tensor-parallel split
that would cut a block or a group, kernels not built); "none" dequantizes every tensor to
`dtype` at load. `quant_activations`: "float" (default: float32
activations, log-probs within ~1e-5 of the dequantized model) or "int8" (per-32-block int8
activations, faster at one row, ~0.1 mean |log-prob| difference on the built-in model: see
docs/KERNELS.md).

Every user-facing failure is a FileNotFoundError / ValueError naming the file and the problem.

Tensor-parallel (`tp`, a rank's TPGroup): the rank builds its model at its local sizes and reads
only its shard of each tensor: memory-mapped `get_slice` reads from safetensors; GGUF tensors are
dequantized one at a time and cut to the rank's slice (see `kvmesh.engine.parallel.sharding`).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

import torch
from torch import nn

from kvmesh.common.model_files import (BUILTIN_MODEL_NAME, ModelFileNotFoundError, builtin_model_path,
                                       cache_dir)
from kvmesh.common.startup import startup_phase
from kvmesh.engine.model_config import ModelConfig
from kvmesh.engine.models import get_model_class
from kvmesh.engine.models.gguf import GGUFFile
from kvmesh.engine.parallel.plan import TPPlan, local_config, make_plan
from kvmesh.engine.layers.hf_quantized import HFQuantizedLinear, hf_quantized_bytes
from kvmesh.engine.layers.quantized import QuantizedEmbedding, QuantizedLinear, quantized_bytes
from kvmesh.engine.quantization.hf_config import METHODS, HFQuantConfig, parse_quantization_config
from kvmesh.engine.quantization.hf_load import hf_quantized_weights
from kvmesh.engine.quantization.kv_scales import is_kv_scale
from kvmesh.engine.quantization.kv_scales import record as record_kv_scale
from kvmesh.engine.quantization.serving import serve_quantized
from kvmesh.kernels.cpu_features import native_bf16_flags, onednn_allows_bf16
from kvmesh.kernels.ops import get_ops, resolve_backend
from kvmesh.kernels.quant import ACTIVATIONS, QuantizedWeight, kernels_available
from kvmesh.kernels.quant.build import unavailable_reason as quant_unavailable_reason
from kvmesh.kernels.quant.gguf_gpu import to_gpu_weight
from kvmesh.kernels.quant.hf_weight import HF_WEIGHTS, to_device

if TYPE_CHECKING:
    from kvmesh.prompt.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    model: nn.Module            # eval mode, on `device`, weights in `dtype` (RoPE cache stays float32)
    tokenizer: Tokenizer | None   # None when loaded without one (a tensor-parallel worker)
    name: str                   # served model name (API `model` field)
    path: Path                  # what was loaded: the directory or the .gguf file
    dtype: torch.dtype
    device: torch.device
    attention_backend: str = "reference"  # the resolved kernels backend ("reference" / "cpu" / "triton")
    plan: TPPlan | None = None  # tensor-parallel: this rank's share (config stays the full model's)
    quantization: str | None = None  # "gguf": block-format tensors served as blocks; an HF method
    # name (awq, gptq, compressed-tensors, fp8): that checkpoint served quantized; None: all float
    weight_bytes: int = 0       # the weights as held (loader.weight_bytes): /v1/models reports it


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use --device cpu")
    return dev


def device_computes_bf16(device: torch.device) -> bool:
    """Whether `device` has bfloat16 arithmetic in hardware: CUDA (Ampere on), or an x86 CPU with
    AVX512-BF16 or AMX (elsewhere a bf16 GEMM is float32 work plus conversions)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and bool(native_bf16_flags())


def resolve_dtype(dtype: str | torch.dtype, device: torch.device,
                  checkpoint: torch.dtype | None = None, *, native_bf16: bool | None = None) -> torch.dtype:
    """The dtype to serve in. `auto` as vLLM resolves it: the checkpoint's dtype (`checkpoint`,
    from config.json; None: unknown, or a GGUF file's dequantized weights, taken as float32),
    with a float32 checkpoint served in bfloat16 where the device computes it natively
    (`native_bf16`, default: `device_computes_bf16`) and in float32 on a CPU that does not (on a
    GPU without bf16: float16). A float16 checkpoint on the CPU likewise becomes bfloat16 or
    float32: the CPU kernels compute neither in float16."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        native = device_computes_bf16(device) if native_bf16 is None else native_bf16
        ckpt = checkpoint or torch.float32
        if device.type == "cuda":
            if ckpt == torch.float32 or (ckpt == torch.bfloat16 and not native):
                return torch.bfloat16 if native else torch.float16
            return ckpt
        if ckpt in (torch.float32, torch.float16):
            return torch.bfloat16 if native else torch.float32
        return ckpt
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return _DTYPES[dtype]


def checkpoint_dtype(hf_config: dict) -> torch.dtype | None:
    """The dtype an HF config.json says its weights are stored in (`torch_dtype`, or `dtype` from
    transformers 4.56 on); None when it names none this loader knows."""
    name = hf_config.get("torch_dtype") or hf_config.get("dtype")
    return _DTYPES.get(str(name).removeprefix("torch.")) if name else None


def load_model(path: str | os.PathLike | None = None, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "auto", attention_backend: str = "auto",
               tokenizer_path: str | os.PathLike | None = None, tp=None,
               load_tokenizer: bool = True, quantization: str | None = None,
               quant_activations: str = "float") -> LoadedModel:
    """Load an HF directory or a .gguf file (None: the built-in SmolLM2 GGUF); with `tp` (a
    TPGroup, connected or not) only that rank's shard; `load_tokenizer=False` skips the
    tokenizer (and importing transformers: a worker process starts faster). `quantization`
    ("auto"/None, "gguf", "none", an HF method) and `quant_activations` ("int8", "float"): see the module doc."""
    p = _model_path(path)
    dev = resolve_device(device)
    backend = _resolve_backend(attention_backend, dev, _quant_kernels(p, quantization))
    with startup_phase("loading weights", BUILTIN_MODEL_NAME if path is None else str(p),
                       phase="weight_load"):
        return _load(p, path is None, dtype, dev, backend, tokenizer_path, tp, load_tokenizer,
                     quantization, quant_activations)


# NOTE: a first build of the built-in model's two extensions measured 34 s + 27 s on an idle 2-core
# Xeon (2026-11-27; the CPU kernels, then the GGUF GEMMs), minutes on a busy machine.
CPU_KERNELS_BUILD_ESTIMATE_S = 60.0


def _quant_kernels(p: Path, quantization: str | None) -> tuple:
    """The quantized-GEMM extensions (their build modules) that serving `p` quantized on the CPU
    would load: built in the CPU kernels' start-up phase rather than inside the weights'."""
    if str(quantization).lower() == "none":
        return ()
    from kvmesh.kernels.quant import build, hf_build  # noqa: PLC0415
    if not p.is_dir():
        # NOTE: a float GGUF file (F32 / F16 tensors only) has no blocks to serve
        gguf = p.suffix.lower() == ".gguf" or _has_gguf_magic(p)
        return (build,) if gguf and any(GGUFFile(p).block_tensors()) else ()
    return (hf_build,) if _hf_quantization(p) is not None else ()


def _resolve_backend(requested: str, dev: torch.device, extensions: tuple = ()) -> str:
    """resolve_backend, with the C++ CPU kernels it may use (and the quantized GEMMs' `extensions`)
    built (once per machine) or loaded first, as a start-up phase of their own."""
    from kvmesh.kernels import cpu_kernels  # noqa: PLC0415
    if dev.type != "cpu" or requested not in ("auto", "cpu") or not cpu_kernels.enabled():
        return resolve_backend(requested, dev)
    where = cache_dir() / "cpu-kernels"
    if cpu_kernels.cached() and all(ext.cached() for ext in extensions):
        phase = startup_phase("loading CPU kernels", f"cached in {where}", phase="kernel_build")
    else:
        phase = startup_phase("building CPU kernels", f"once per machine, usually about "
                              f"{CPU_KERNELS_BUILD_ESTIMATE_S:.0f} s; cached in {where}",
                              CPU_KERNELS_BUILD_ESTIMATE_S, phase="kernel_build")
    with phase:
        cpu_kernels.load()
        for ext in extensions:
            ext.load()
    return resolve_backend(requested, dev)


def _load(p: Path, builtin: bool, dtype: str | torch.dtype, dev: torch.device, backend: str,
          tokenizer_path: str | os.PathLike | None, tp, load_tokenizer: bool,
          quantization: str | None, quant_activations: str) -> LoadedModel:
    if p.is_dir():
        config, files, tok_dir, stored = _open_hf_dir(p)
        name = p.name
    elif p.suffix.lower() == ".gguf" or _has_gguf_magic(p):
        gguf = GGUFFile(p)
        config = ModelConfig.from_hf_config(gguf.hf_config())
        tok_dir = None
        name = BUILTIN_MODEL_NAME if builtin else p.stem
        stored = None       # dequantized to float32 whatever the file's quantization
    else:
        raise ValueError(f"unsupported model path {p}: expected an HF directory (config.json, "
                         "*.safetensors, tokenizer.json) or a .gguf file")
    dt = resolve_dtype(dtype, dev, stored)
    if dtype == "auto":
        log.info("dtype auto: %s checkpoint served in %s on %s%s", _dtype_name(stored or torch.float32),
                 _dtype_name(dt), dev.type, _bf16_reason(dev))
    if tokenizer_path is not None:
        # NOTE: an explicit tokenizer directory overrides the model's own (--tokenizer).
        tok_dir = Path(tokenizer_path).expanduser()
        if not tok_dir.is_dir():
            raise ModelFileNotFoundError(f"tokenizer directory does not exist: {tok_dir}")
    tokenizer = None
    if load_tokenizer:
        from kvmesh.prompt.sources import gguf_tokenizer_dir  # noqa: PLC0415
        from kvmesh.prompt.tokenizer import Tokenizer  # noqa: PLC0415
        tokenizer = Tokenizer.from_dir(tok_dir or gguf_tokenizer_dir(p), config.eos_token_ids)

    # NOTE: resolved (and its module imported) outside the meta-device context: module-level
    # code, e.g. the oneDNN probe in kernels/linear.py, must run on real tensors.
    model_cls, ops = get_model_class(config.architecture), get_ops(backend)
    plan = None if tp is None else make_plan(config, tp.rank, tp.size)
    with torch.device("meta"):
        model = model_cls(config if plan is None else local_config(config, plan), ops)
    rules = {}
    if plan is not None:
        from kvmesh.engine.parallel.sharding import shard_model, shard_rules  # noqa: PLC0415
        with torch.device("meta"):
            shard_model(model, plan, tp)
        rules = shard_rules(model, plan)
    hf_quant = _hf_quantization(p) if p.is_dir() else None
    for_gpu = _converts_blocks_for_gpu(dev)
    blocks = None if p.is_dir() else list(gguf.block_tensors())
    cut = None
    if rules and blocks:
        from kvmesh.engine.parallel.sharding import block_cut  # noqa: PLC0415
        cut = block_cut(rules, blocks, plan.size)
    elif rules and hf_quant is not None:
        from kvmesh.engine.parallel.sharding import hf_cut  # noqa: PLC0415
        cut = hf_cut(rules, hf_quant, plan.size)
    quant = resolve_quantization(quantization, quant_activations, p, dev, plan, dt, hf_quant, cut,
                                 has_blocks=bool(blocks))
    if hf_quant is not None:
        # NOTE: a module's quantized pieces are converted whole, then cut by the shard rules
        # (dequantized, or packed along whole groups: sharding.ShardRule.take).
        weights = hf_quantized_weights(_safetensors_weights(files), hf_quant, dev, dequantize=quant is None)
        if rules:
            weights = ((n, rules[n].take(t) if n in rules else t) for n, t in weights)
    elif p.is_dir():
        weights = _safetensors_weights(files, rules)
    else:
        weights = gguf.weights(config.num_attention_heads, config.num_key_value_heads,
                               keep_quantized=quant == "gguf", activations=quant_activations,
                               dtype=dt)
        if rules:
            weights = ((n, rules[n].take(t) if n in rules else t) for n, t in weights)
        if quant == "gguf" and for_gpu:
            weights = ((n, to_gpu_weight(t) if isinstance(t, QuantizedWeight) else t) for n, t in weights)
    assign_weights(model, weights, dt, dev, source=p)
    model.reset_rope_cache(dev)
    model.eval().requires_grad_(False)
    held = weight_bytes(model)
    if quant == "gguf" and for_gpu:
        log.info("%s: GGUF blocks served as int4 groups (Q4_0 / Q4_1 / Q4_K) and 8-bit groups (the "
                 "other formats) through the Triton GEMMs, float tensors in %s: %.1f MB of weights, "
                 "%.1f MB of them quantized", p.name, _dtype_name(dt), held / 1e6,
                 hf_quantized_bytes(model) / 1e6)
    elif quant == "gguf":
        log.info("%s: GGUF blocks served quantized (%s activations): %.1f MB of weights, %.1f MB "
                 "of them blocks", p.name, quant_activations, held / 1e6, quantized_bytes(model) / 1e6)
    elif quant is not None:
        log.info("%s: served quantized as %s: %.1f MB of weights, %.1f MB of them quantized", p.name,
                 hf_quant.describe, held / 1e6, hf_quantized_bytes(model) / 1e6)
    else:
        log.info("%s: weights held in %s: %.1f MB", p.name, _dtype_name(dt), held / 1e6)
    return LoadedModel(config=config, model=model, tokenizer=tokenizer, name=name, path=p,
                       dtype=dt, device=dev, attention_backend=backend, plan=plan,
                       quantization=quant, weight_bytes=held)


def _converts_blocks_for_gpu(dev: torch.device) -> bool:
    """Whether GGUF blocks are converted for the GPU's Triton GEMMs (gguf_gpu.py: every format
    the CPU's block kernels read has a GPU layout) rather than served by the CPU's kernels."""
    return dev.type == "cuda"


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as held: parameters and its quantized modules' packed
    buffers (persistent state), each storage once (a tied head shares the embedding's); not the
    RoPE tables."""
    seen: dict[int, int] = {}
    for t in model.state_dict(keep_vars=True).values():
        if t is not None and t.device.type != "meta":
            seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.nbytes)
    return sum(seen.values())


QUANTIZATIONS = ("auto", "gguf", "none", *METHODS)


def resolve_quantization(quantization: str | None, activations: str, path: Path,
                         device: torch.device, plan: TPPlan | None,
                         dtype: torch.dtype = torch.float32, hf: HFQuantConfig | None = None,
                         block_cut: str | None = None, has_blocks: bool = True) -> str | None:
    """"gguf" when `path`'s block tensors are to be served as blocks; for a Hugging Face
    directory whose quantization_config is `hf`, its method when served quantized
    (engine/quantization/serving.py); else None (dequantized, or a float checkpoint).
    `block_cut`: why the tensor-parallel `plan` would cut a GGUF block or an int4 group
    (sharding.block_cut / hf_cut). `has_blocks`: whether the GGUF file has any tensor the
    kernels read as blocks (a float file has none: `auto` then loads no kernels)."""
    choice = "auto" if quantization is None else str(quantization).lower()
    if choice not in QUANTIZATIONS:
        raise ValueError(f"unsupported quantization {quantization!r}; use {', '.join(QUANTIZATIONS)} "
                         "(auto, the default, serves a GGUF file or a quantized checkpoint quantized "
                         "where it can; none dequantizes it)")
    if activations not in ACTIVATIONS:
        raise ValueError(f"unsupported quantized activations {activations!r}; use "
                         f"{' or '.join(ACTIVATIONS)}")
    if path.is_dir() and choice != "gguf":
        return serve_quantized(choice, hf, path.name, device, block_cut, dtype)
    if choice in METHODS:
        raise ValueError(f"quantization {choice!r} needs a Hugging Face checkpoint directory, got {path.name}")
    if choice == "none":
        return None
    if path.is_dir():
        raise ValueError(f"quantization 'gguf' needs a .gguf file, got the directory {path}")
    if choice == "auto" and not has_blocks:
        return None
    why = None
    if device.type not in ("cpu", "cuda"):
        why = f"no quantized kernels for device {device}"
    elif device.type == "cuda" and not has_blocks:
        why = "this file has no tensor in a block format the GPU's kernels read"
    elif block_cut is not None:
        why = block_cut
    elif dtype == torch.float64:
        why = "the quantized kernels compute in float32, the model is float64"
    elif device.type == "cpu" and not kernels_available():
        why = f"the quantized kernels are unavailable here: {quant_unavailable_reason()}"
    if why is None:
        return "gguf"
    if choice == "gguf":
        raise ValueError(f"cannot serve {path.name} quantized: {why}; use quantization 'none'")
    log.warning("%s: serving GGUF tensors dequantized to float: %s", path.name, why)
    return None


def read_model_config(path: str | os.PathLike | None = None) -> ModelConfig:
    """The model's config alone (config.json or the GGUF metadata), without its weights."""
    p = _model_path(path)
    if p.is_dir():
        config_file = p / "config.json"
        if not config_file.is_file():
            raise ModelFileNotFoundError(f"no config.json in model directory {p}")
        return ModelConfig.from_hf_config(_read_json(config_file))
    return ModelConfig.from_hf_config(GGUFFile(p).hf_config())


def _model_path(path: str | os.PathLike | None) -> Path:
    p = builtin_model_path() if path is None else Path(path).expanduser()
    if not p.exists():
        raise ModelFileNotFoundError(f"model path does not exist: {p}")
    return p


def assign_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
                   dtype: torch.dtype, device: torch.device, source: Path | str = "<weights>") -> None:
    """Put each (HF name, tensor) into the (meta-device) model; name what is missing or misshapen.
    A QuantizedWeight replaces its nn.Linear / nn.Embedding by the quantized module."""
    expected = dict(model.named_parameters())  # tied lm_head.weight is listed once, as embed_tokens
    tied = getattr(model.config, "tie_word_embeddings", False)
    seen: set[str] = set()
    for name, tensor in weights:
        if tied and name == "lm_head.weight":
            continue  # NOTE: some tied checkpoints store a copy; embed_tokens' is the one used
        if name not in expected:
            if is_kv_scale(name):
                record_kv_scale(model, name, tensor, source)
            elif not name.endswith("rotary_emb.inv_freq"):
                log.warning("ignoring unexpected tensor %s in %s", name, source)
            continue
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) != want:
            raise ValueError(f"shape mismatch for tensor {name} in {source}: checkpoint has "
                             f"{tuple(tensor.shape)}, the config implies {want}")
        module_name, _, leaf = name.rpartition(".")
        if isinstance(tensor, HF_WEIGHTS) and not (leaf == "weight" and isinstance(
                model.get_submodule(module_name), nn.Linear)):
            # NOTE: int4 groups made from GGUF blocks on a GPU reach embeddings too: those hold floats
            tensor = tensor.dequantize_original()
        if isinstance(tensor, (QuantizedWeight, *HF_WEIGHTS)):
            if not isinstance(tensor, QuantizedWeight):
                tensor = to_device(tensor, device)
            _assign_quantized(model, module_name, leaf, tensor, dtype, source)
            seen.add(name)
            continue
        param = nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)
        setattr(model.get_submodule(module_name), leaf, param)
        seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise ValueError(f"missing tensors in {source}: {shown}")
    model.tie_weights()


def _assign_quantized(model: nn.Module, module_name: str, leaf: str, weight: QuantizedWeight,
                      dtype: torch.dtype, source: Path | str) -> None:
    """Swap the module holding `weight` for its quantized twin (the bias, if any, moves along)."""
    module = model.get_submodule(module_name)
    parent_name, _, child = module_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if leaf == "weight" and isinstance(module, nn.Linear) and not isinstance(weight, QuantizedWeight):
        replacement: nn.Module = HFQuantizedLinear(weight, module.bias)
    elif leaf == "weight" and isinstance(module, nn.Linear):
        replacement = QuantizedLinear(weight, module.bias)
    elif leaf == "weight" and isinstance(module, nn.Embedding):
        replacement = QuantizedEmbedding(weight, dtype)
    elif leaf == "weight" and (twin := _sharded_twin(module, weight, dtype)) is not None:
        replacement = twin
    else:
        raise ValueError(f"tensor {module_name}.{leaf} in {source} is {weight.format} blocks, "
                         f"but {type(module).__name__} cannot hold a quantized weight")
    setattr(parent, child, replacement)


def _sharded_twin(module: nn.Module, weight: QuantizedWeight, dtype: torch.dtype) -> nn.Module | None:
    """A tensor-parallel module's quantized twin (the vocab-parallel embedding), or None."""
    if not isinstance(weight, QuantizedWeight):
        return None
    from kvmesh.engine.parallel.sharding import quantized_twin  # noqa: PLC0415
    return quantized_twin(module, weight, dtype)


def _hf_quantization(path: Path) -> HFQuantConfig | None:
    """The directory's quantization_config, parsed (None: a float checkpoint)."""
    config_file = path / "config.json"
    return parse_quantization_config(_read_json(config_file)) if config_file.is_file() else None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _bf16_reason(device: torch.device) -> str:
    if device.type != "cpu":
        return ""
    flags = native_bf16_flags()
    if flags:
        return f" (bf16 native: {', '.join(flags)})"
    if not onednn_allows_bf16():
        return " (ONEDNN_MAX_CPU_ISA keeps oneDNN below AVX512-BF16: bf16 not native)"
    return " (no AVX512-BF16 or AMX: bf16 not native)"


def _open_hf_dir(path: Path) -> tuple[ModelConfig, list[Path], Path, torch.dtype | None]:
    """(config, weight files, tokenizer directory, stored dtype) of an HF model directory."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelFileNotFoundError(f"no config.json in model directory {path}")
    cfg = _read_json(config_file)
    gen_file = path / "generation_config.json"
    gen_eos = _as_ids(_read_json(gen_file).get("eos_token_id")) if gen_file.is_file() else ()
    config = ModelConfig.from_hf_config(cfg, extra_eos_token_ids=gen_eos)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFileNotFoundError(f"no *.safetensors weights in model directory {path} "
                                "(.bin / .pth checkpoints are not supported; re-save with safe_serialization)")
    if not (path / "tokenizer.json").is_file():
        raise ModelFileNotFoundError(f"missing tokenizer.json in model directory {path}")
    return config, files, path, checkpoint_dtype(cfg)


def _safetensors_weights(files: list[Path], rules: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor; a name with a shard rule yields only that shard (a memory-mapped slice read)."""
    from safetensors import SafetensorError, safe_open  # noqa: PLC0415

    rules = rules or {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    rule = rules.get(name)
                    yield name, f.get_tensor(name) if rule is None else rule.take(f.get_slice(name))
        except SafetensorError as e:
            raise ValueError(f"malformed safetensors file {file}: {e}") from None


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed JSON in {file}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"malformed {file}: expected a JSON object")
    return data


def _as_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
