"""Start-up warm-up of the attention kernels, so that no Triton compile happens while serving.

Triton compiles a kernel on its first launch with each set of constexprs (and argument
specialisations). The variants a server can launch are known once the model and the KV cache
are: per distinct attention layer (heads, KV heads, head_dim, window, soft-cap) the decode kernel
at every split count the runner's `DecodePlanner` can choose (eager steps pick one by context,
CUDA graphs one per size) and the unified kernel of prefill chunks and mixed steps. The runner
launches each once on a one-block dummy batch right after the cache is allocated (the cache is
only read) and logs the time, counted as `kernel_build`.

NOTE: the launches reproduce the model's argument layout (the query a strided view of the fused
QKV output, the real cache tensors, int32 tables), because Triton also specialises on pointer
alignment and on integer arguments that are 1 or divisible by 16; the arguments that change
from step to step (table width, number of sequences) are marked `do_not_specialize` in the
kernels, so one compile per variant covers every step.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from kvmesh.engine.layers.attention import Attention, AttentionSpec

logger = logging.getLogger("kvmesh.engine")


@dataclass(frozen=True, slots=True)
class AttentionVariant:
    """One compiled specialisation of an attention kernel that serving can launch."""
    kernel: str             # "decode" (split-K decode) or "unified" (prefill / mixed)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int     # the layer's window (an int argument Triton specialises on)
    softcap: float          # > 0: the USE_SOFTCAP variant
    num_splits: int = 0     # decode: NUM_SPLITS; 0 for unified


def attention_specs(model: torch.nn.Module) -> list[AttentionSpec]:
    """The distinct specs of the model's attention layers, in layer order."""
    return list(dict.fromkeys(m.spec for m in model.modules() if isinstance(m, Attention)))


def uses_triton(model: torch.nn.Module) -> bool:
    """Whether the model's attention runs the Triton backend (`kernels/triton_ops.py`)."""
    return any(getattr(m.ops, "__name__", "") == "kvmesh.kernels.triton_ops"
               for m in model.modules() if isinstance(m, Attention))


def attention_variants(specs: list[AttentionSpec], split_counts: list[int]) -> list[AttentionVariant]:
    """Every attention kernel variant serving launches for these layer specs when the decode
    kernel may run with any of `split_counts` splits: decode per split count, unified once."""
    out: list[AttentionVariant] = []
    for s in specs:
        base = (s.num_heads, s.num_kv_heads, s.head_dim, s.sliding_window, s.softcap)
        out.extend(AttentionVariant("decode", *base, num_splits=n) for n in sorted(set(split_counts)))
        out.append(AttentionVariant("unified", *base))
    return list(dict.fromkeys(out))


def _query(v: AttentionVariant, tokens: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A query laid out as the model's: a strided view of a fused QKV projection's output."""
    nq, nkv = v.num_heads * v.head_dim, v.num_kv_heads * v.head_dim
    qkv = torch.zeros(tokens, nq + 2 * nkv, dtype=dtype, device=device)
    return qkv[:, :nq].view(tokens, v.num_heads, v.head_dim)


def query_dtype(model: torch.nn.Module, cache_dtype: torch.dtype) -> torch.dtype:
    """The dtype attention's queries have: the cache's, or with an 8-bit cache the model's (its
    norms' weights, which every family keeps in the dtype it computes in)."""
    from kvmesh.kernels.kv_cache_dtype import is_fp8  # noqa: PLC0415
    if not is_fp8(cache_dtype):
        return cache_dtype
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") and p.is_floating_point():
            return p.dtype
    raise ValueError("an 8-bit KV cache needs the model's dtype: no norm weight found")


def warm_attention(variants: list[AttentionVariant], kv_cache: tuple[torch.Tensor, torch.Tensor],
                   planner, dtype: torch.dtype | None = None) -> float:
    """Launch each variant once on a one-block batch over `kv_cache` (read only) with queries
    of `dtype` (default: the cache's); seconds taken. `planner`: the runner's `DecodePlanner`
    (its workspace and minimum split length)."""
    from kvmesh.kernels.paged_attention import paged_decode_attention  # noqa: PLC0415
    from kvmesh.kernels.prefill_attention import unified_attention  # noqa: PLC0415

    k_cache, v_cache = kv_cache
    device, dtype = k_cache.device, dtype or k_cache.dtype
    t0 = time.perf_counter()
    tables = torch.zeros(1, 1, dtype=torch.int32, device=device)
    for v in variants:
        if k_cache.shape[2:] != (v.num_kv_heads, v.head_dim):
            continue        # NOTE: a layer whose cache is shaped otherwise (none today)
        kw = dict(sliding_window=v.sliding_window, softcap=v.softcap)
        if v.kernel == "decode":
            # NOTE: one and two sequences: a one-token query view has another row stride
            # (the view of a size-1 dimension), which Triton may specialise differently
            for seqs in (1, 2):
                paged_decode_attention(_query(v, seqs, dtype, device), k_cache, v_cache,
                                       tables.expand(seqs, 1),
                                       torch.ones(seqs, dtype=torch.int32, device=device), 1,
                                       v.head_dim ** -0.5, num_splits=v.num_splits,
                                       min_split_tokens=planner.min_split_tokens,
                                       workspace=(planner.workspace if seqs * v.num_splits
                                                  <= planner.rows else None), **kw)
        else:
            # NOTE: the model's strided view, and a contiguous query: the rows of a mixed step
            # that the flash route leaves to this kernel are gathered (flash_prefill.py)
            for q in (_query(v, 2, dtype, device), _query(v, 2, dtype, device).contiguous()):
                unified_attention(q, k_cache, v_cache,
                                  torch.tensor([0, 2], dtype=torch.int32, device=device),
                                  torch.full((1,), 2, dtype=torch.int32, device=device), tables,
                                  v.head_dim ** -0.5, **kw)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def prepare_attention(model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      max_num_seqs: int, max_model_len: int, device: torch.device):
    """The runner's start-up step for the Triton attention kernels (CUDA only, else None): the
    `DecodePlanner` owning the decode workspace, every attention variant warmed."""
    if device.type != "cuda" or not kv_caches or not uses_triton(model):
        return None
    from kvmesh.common.startup import startup_phase  # noqa: PLC0415
    from kvmesh.kernels.decode_plan import DecodePlanner  # noqa: PLC0415
    from kvmesh.kernels.paged_attention import num_sms  # noqa: PLC0415

    specs = attention_specs(model)
    planner = DecodePlanner(max_num_seqs, max(s.num_heads for s in specs),
                            max(s.num_kv_heads for s in specs), max(s.head_dim for s in specs),
                            max_model_len, num_sms(device.index or 0), device)
    variants = attention_variants(specs, planner.variants())
    with startup_phase("warming attention kernels", f"{len(variants)} variants",
                       phase="kernel_build"):
        seconds = warm_attention(variants, kv_caches[0], planner,
                                 query_dtype(model, kv_caches[0][0].dtype))
    logger.info("attention kernels: %d variants warmed in %.1f s (decode splits %s; workspace "
                "%.1f MiB)", len(variants), seconds, planner.variants(),
                0 if planner.workspace is None else planner.workspace.part.numel() * 4 / 2**20)
    return planner
