"""Reading a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) and checking it
against the base model's sites, before anything in the engine changes.

    scaling = lora_alpha / r             (use_rslora: lora_alpha / sqrt(r))
    tensor "base_model.model.<module path>.lora_A.weight"  [r, in]
           "base_model.model.<module path>.lora_B.weight"  [out, r]

The scaling is folded into B once here. Every refusal is a `LoRAAdapterError` (a ValueError)
naming the adapter and what to change. Under tensor parallelism each rank keeps the slice of A
or B that matches its shard of the layer: B's rows of a column-parallel layer (q/k/v, gate/up,
each part of a fused one), A's columns of a row-parallel one (o, down), by the layer's own
`ShardRule`; the other factor is whole on every rank.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvmesh.engine.lora.request import LoRARequest
from kvmesh.engine.lora.targets import LoRATargets

if TYPE_CHECKING:
    from kvmesh.engine.parallel.sharding import ShardRule

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served by this engine (the message says why)."""


@dataclass(slots=True)
class LoRAModel:
    """An adapter read and checked: its tensors per site part, in the model's dtype, on the host."""
    lora_int_id: int
    lora_name: str
    rank: int
    scaling: float
    # HF module path -> (A [r, in], scaling * B [out, r])
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _config(req: LoRARequest) -> dict:
    path = os.path.join(req.lora_path, CONFIG_FILE)
    try:
        with open(path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise LoRAAdapterError(f"LoRA adapter {req.lora_name!r}: no {CONFIG_FILE} in "
                               f"{req.lora_path!r} (a PEFT adapter directory)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"LoRA adapter {req.lora_name!r}: cannot read {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"LoRA adapter {req.lora_name!r}: {CONFIG_FILE} is not an object")
    return cfg


def _check_config(req: LoRARequest, cfg: dict, max_rank: int) -> tuple[int, float]:
    """(rank, scaling), or the first unsupported setting."""
    name = req.lora_name

    def refuse(msg: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"LoRA adapter {name!r}: {msg}")

    if cfg.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type is {cfg.get('peft_type')!r}; only LORA adapters are served")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise refuse(f"r must be an integer >= 1, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise refuse(f"lora_alpha must be a number, got {alpha!r}")
    if r > max_rank:
        raise refuse(f"rank {r} exceeds --max-lora-rank {max_rank}; raise --max-lora-rank")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise refuse(f"{key} (per-module ranks) is not supported")
    if cfg.get("use_dora"):
        raise refuse("DoRA (use_dora) is not supported")
    if cfg.get("bias", "none") != "none":
        raise refuse(f"bias={cfg.get('bias')!r} is not supported (train with bias='none')")
    if cfg.get("modules_to_save"):
        raise refuse(f"modules_to_save {cfg['modules_to_save']} is not supported")
    if cfg.get("fan_in_fan_out"):
        raise refuse("fan_in_fan_out adapters are not supported")
    scaling = alpha / (math.sqrt(r) if cfg.get("use_rslora") else r)
    return r, float(scaling)


def _check_targets(req: LoRARequest, cfg: dict, targets: LoRATargets) -> None:
    wanted = cfg.get("target_modules")
    if isinstance(wanted, list):
        known = targets.module_names
        missing = sorted({m for m in wanted if m.rsplit(".", 1)[-1] not in known})
        if missing:
            raise LoRAAdapterError(
                f"LoRA adapter {req.lora_name!r}: target module(s) {', '.join(missing)} not in the "
                f"base model (its adaptable modules: {', '.join(sorted(known))})")


def read_adapter(req: LoRARequest, targets: LoRATargets, max_rank: int, dtype: torch.dtype,
                 shard: dict[str, ShardRule] | None = None) -> LoRAModel:
    """Read and check the adapter of `req`; nothing else is touched (LoRAAdapterError when it
    cannot be served). `shard`: this rank's rules (tensor parallelism), by HF parameter name."""
    from safetensors import safe_open  # noqa: PLC0415  (only where adapters are read)

    cfg = _config(req)
    rank, scaling = _check_config(req, cfg, max_rank)
    _check_targets(req, cfg, targets)
    path = os.path.join(req.lora_path, WEIGHTS_FILE)
    if not os.path.isfile(path):
        raise LoRAAdapterError(f"LoRA adapter {req.lora_name!r}: no {WEIGHTS_FILE} in "
                               f"{req.lora_path!r}")
    halves: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                m = _KEY.match(key)
                if m is None:
                    raise LoRAAdapterError(f"LoRA adapter {req.lora_name!r}: unsupported tensor "
                                           f"{key!r} (only lora_A / lora_B of linear layers)")
                halves.setdefault(m["module"], {})[m["ab"]] = f.get_tensor(key)
    except LoRAAdapterError:
        raise
    except Exception as e:  # noqa: BLE001  (a corrupt file is the adapter's error)
        raise LoRAAdapterError(f"LoRA adapter {req.lora_name!r}: cannot read {path}: {e}") from None
    if not halves:
        raise LoRAAdapterError(f"LoRA adapter {req.lora_name!r}: {WEIGHTS_FILE} holds no tensor")
    weights = {}
    for module, ab in sorted(halves.items()):
        if shard is not None and f"{module}.weight" in shard:
            rule = shard[f"{module}.weight"]
            key = "B" if rule.dim == 0 else "A"          # output rows / input columns
            if key in ab:
                ab[key] = rule.take(ab[key])
        weights[module] = _checked_pair(req, module, ab, rank, scaling, targets, dtype)
    return LoRAModel(req.lora_int_id, req.lora_name, rank, scaling, weights)


def _checked_pair(req: LoRARequest, module: str, ab: dict[str, torch.Tensor], rank: int,
                  scaling: float, targets: LoRATargets,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    where = targets.parts.get(module)
    if where is None:
        raise LoRAAdapterError(
            f"LoRA adapter {req.lora_name!r}: module {module!r} is not in the base model (its "
            f"adaptable modules: {', '.join(sorted(targets.module_names))})")
    if set(ab) != {"A", "B"}:
        raise LoRAAdapterError(f"LoRA adapter {req.lora_name!r}: {module} has lora_"
                               f"{''.join(ab)} without its pair")
    site, i = where
    a, b = ab["A"], ab["B"]
    want_a = (rank, site.in_features)
    want_b = (site.parts[i].out_features, rank)
    if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
        raise LoRAAdapterError(
            f"LoRA adapter {req.lora_name!r}: {module} has lora_A {list(a.shape)} and lora_B "
            f"{list(b.shape)}, the base model needs {list(want_a)} and {list(want_b)} (an "
            "adapter for another base model?)")
    return a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous()
