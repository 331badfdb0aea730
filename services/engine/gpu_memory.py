"""The KV cache's share of a GPU, sized as vLLM sizes it (`--gpu-memory-utilization`).

    KV cache = total device memory x utilization
               - what is in use before profiling (CUDA context, the weights, the LoRA slots,
                 other processes)
               - the activation peak of a profiling forward at max_num_batched_tokens
               - the CUDA-graph pool (the activation peak of a decode at the largest graph size)

The profiling forward runs the real model on dummy sequences over a small scratch KV cache that
is freed afterwards; the same run at the largest captured decode size stands in for the graph
pool, which can only be captured once the real cache exists. The CPU keeps its own rule
(`--kv-cache-memory-fraction` of the host's free memory, engine.py).
"""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch
from torch import nn

from kvmesh.kernels.metadata import AttentionMetadata

logger = logging.getLogger("kvmesh.engine")


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """What the KV-cache budget is computed from (bytes)."""
    total: int               # the device's memory
    in_use: int              # in use before profiling: context, weights, other processes
    weights: int             # of which the model's weights (for the log)
    activation_peak: int     # peak above the weights during the profiling forward
    graph_pool: int          # set aside for the CUDA graphs (0 without graphs)
    # of in_use: the LoRA slots (--max-loras x --max-lora-rank, every site's A and B), allocated
    # before the profile so the KV cache never takes their memory (for the log)
    lora_slots: int = 0


def kv_cache_bytes(mem: DeviceMemory, utilization: float) -> int:
    """Bytes the KV cache may take; ValueError (with the fix) when nothing is left."""
    budget = int(mem.total * utilization)
    left = budget - mem.in_use - mem.activation_peak - mem.graph_pool
    if left <= 0:
        gib = 1 << 30
        raise ValueError(
            f"no GPU memory left for the KV cache: {utilization:.2f} x {mem.total / gib:.2f} GiB "
            f"= {budget / gib:.2f} GiB, of which {mem.in_use / gib:.2f} GiB are in use (weights "
            f"{mem.weights / gib:.2f} GiB, LoRA slots {mem.lora_slots / gib:.2f} GiB), activations "
            f"peak at {mem.activation_peak / gib:.2f} GiB and CUDA graphs take "
            f"{mem.graph_pool / gib:.2f} GiB; raise "
            "--gpu-memory-utilization, lower --max-num-batched-tokens or --max-num-seqs, use "
            "--enforce-eager, lower --max-loras or --max-lora-rank, or set --num-kv-blocks")
    return left


def weight_bytes(model: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _dummy_step(num_tokens: int, num_seqs: int, block_size: int,
                device: torch.device) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, list[int]]:
    """`num_seqs` prefills sharing `num_tokens` tokens, each over its own scratch blocks."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    lens = [num_tokens // num_seqs + (1 if i < num_tokens % num_seqs else 0) for i in range(num_seqs)]
    tables, nxt = [], 0
    for n in lens:
        k = -(-n // block_size)
        tables.append(list(range(nxt, nxt + k)))
        nxt += k
    meta = AttentionMetadata.build(lens, lens, tables, block_size, device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    last = list(torch.tensor(lens).cumsum(0).sub(1).tolist())
    return meta, ids, positions, last


def _peak_of(model: nn.Module, num_layers: int, kv_shape: tuple[int, int, int], dtype: torch.dtype,
             device: torch.device, num_tokens: int, num_seqs: int, decode: bool) -> int:
    """Peak bytes allocated above the current level by one forward (+ LM head and a sampling
    sort over the sampled rows) of `num_tokens` tokens in `num_seqs` sequences."""
    block_size, kv_heads, head_dim = kv_shape
    meta, ids, positions, last = _dummy_step(num_tokens, num_tokens if decode else num_seqs,
                                             block_size, device)
    if decode:
        # a decode sees one token of context: same allocations as any decode of this batch
        meta = AttentionMetadata.build([1] * num_tokens, [1] * num_tokens,
                                       [[i] for i in range(num_tokens)], block_size, device)
        positions = torch.zeros(num_tokens, dtype=torch.long, device=device)
        last = list(range(num_tokens))
    num_blocks = int(meta.block_tables.max()) + 1 if meta.block_tables.numel() else 1
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    cache = torch.zeros((num_layers, 2, num_blocks, block_size, kv_heads, head_dim), dtype=dtype,
                        device=device)
    caches = [(cache[i, 0], cache[i, 1]) for i in range(num_layers)]
    cache_bytes = cache.numel() * cache.element_size()
    with torch.inference_mode():
        hidden = model(ids, positions, caches, meta)
        logits = model.compute_logits(hidden[torch.tensor(last, device=device)])
        if logits is not None:
            torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)   # top-p's working set
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base - cache_bytes
    del cache, caches, hidden, logits
    return max(0, peak)


def profile_device_memory(model: nn.Module, num_layers: int, block_size: int, num_kv_heads: int,
                          head_dim: int, dtype: torch.dtype, device: torch.device,
                          max_num_tokens: int, max_num_seqs: int, largest_graph: int) -> DeviceMemory:
    """Run the profiling forwards (vLLM's profile run) and read the device's memory."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    kv_shape = (block_size, num_kv_heads, head_dim)
    peak = _peak_of(model, num_layers, kv_shape, dtype, device, max_num_tokens, max_num_seqs, False)
    graphs = (_peak_of(model, num_layers, kv_shape, dtype, device, largest_graph, largest_graph, True)
              if largest_graph else 0)
    gc.collect()
    torch.cuda.empty_cache()
    return DeviceMemory(total, in_use, weight_bytes(model), peak, graphs)


def log_kv_budget(mem: DeviceMemory, utilization: float, num_blocks: int, block_size: int) -> None:
    mib = 1 << 20
    logger.info("GPU memory: %.0f MiB x %.2f; in use %.0f MiB (weights %.0f MiB, LoRA slots %.0f "
                "MiB), activation peak %.0f MiB, CUDA graphs %.0f MiB -> KV cache %d blocks (%d tokens)",
                mem.total / mib, utilization, mem.in_use / mib, mem.weights / mib,
                mem.lora_slots / mib,
                mem.activation_peak / mib, mem.graph_pool / mib, num_blocks, num_blocks * block_size)
