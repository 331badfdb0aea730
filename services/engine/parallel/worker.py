"""A tensor-parallel worker process (ranks 1..N-1): connect, load its shard, run every step.

It never schedules or samples: each Step from rank 0 is replayed on its shard (block operations,
then the forward pass, whose collectives pair with rank 0's). EOF on its pipe means rank 0's
process is gone: the worker exits quietly. Any other failure is printed and exits 1, which rank 0
sees on the process sentinel.
"""
from __future__ import annotations

import sys
import traceback
from multiprocessing.connection import Connection

import torch

from kvmesh.common.config import EngineConfig
from kvmesh.engine.lora.request import LoRARequest
from kvmesh.engine.memory import free_memory
from kvmesh.engine.parallel.messages import InitCache, Ready, Shutdown, Started, Step, decode, encode
from kvmesh.engine.quantization.kv_scales import apply as apply_kv_scales
from kvmesh.kernels.kv_cache_dtype import resolve_kv_cache_dtype


def device_for_rank(device: torch.device, rank: int) -> torch.device:
    """One device per rank: cuda:<rank> on CUDA (rank 0: the engine's device), the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def run_worker(rank: int, size: int, port: int, config: EngineConfig, threads: int,
               timeout_s: float, conn: Connection) -> None:
    """The worker process's entry point (torch.multiprocessing spawn)."""
    try:
        _serve(rank, size, port, config, threads, timeout_s, conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        sys.exit(0)                      # rank 0's process is gone: nothing left to serve
    except BaseException:                # noqa: BLE001 - reported by the exit status
        print(f"tensor-parallel worker rank {rank} failed:\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        sys.exit(1)


def _serve(rank: int, size: int, port: int, config: EngineConfig, threads: int,
           timeout_s: float, conn: Connection) -> None:
    from kvmesh.engine.loader import load_model, resolve_device  # noqa: PLC0415
    from kvmesh.engine.model_runner import ModelRunner  # noqa: PLC0415
    from kvmesh.engine.parallel.group import TPGroup  # noqa: PLC0415

    torch.set_num_threads(threads)
    device = device_for_rank(resolve_device(config.device), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    conn.send_bytes(encode(Started(rank)))
    group = TPGroup(rank, size)
    group.connect("127.0.0.1", port, device, timeout_s)
    loaded = load_model(config.model, config.dtype, device, config.attention_backend,
                        config.tokenizer, tp=group, load_tokenizer=False,
                        quantization=config.quantization)
    conn.send_bytes(encode(Ready(rank, free_memory(device))))
    init = decode(conn.recv_bytes())
    if isinstance(init, Shutdown):
        return                          # rank 0 gave up (e.g. the KV cache does not fit)
    if not isinstance(init, InitCache):
        raise RuntimeError(f"expected InitCache from rank 0, got {type(init).__name__}")
    mc = loaded.config
    lora = None
    if config.enable_lora:
        from kvmesh.engine.lora.manager import lora_manager  # noqa: PLC0415
        lora = lora_manager(loaded, config)
    cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, loaded.dtype, loaded.attention_backend)
    apply_kv_scales(loaded.model, cache_dtype)       # the checkpoint's k_scale / v_scale, as rank 0
    runner = ModelRunner(loaded.model, mc.num_hidden_layers, loaded.plan.local_kv_heads,
                         mc.head_dim, config.block_size, init.num_gpu_blocks, init.num_cpu_blocks,
                         cache_dtype, device, seed=config.seed, lora=lora)
    while True:
        msg = decode(conn.recv_bytes())
        if isinstance(msg, Shutdown):
            return
        if not isinstance(msg, Step):
            raise RuntimeError(f"unexpected message {type(msg).__name__} from rank 0")
        with torch.inference_mode():
            for slot, name, lora_int_id, path in msg.lora_writes:
                lora.write_slot(slot, LoRARequest(name, lora_int_id, path))
            runner.apply_block_ops(msg.block_ops)
            if msg.model_input is not None:
                hidden, _ = runner.run_model(msg.model_input)
                for a, b in msg.model_input.logit_passes:   # rank 0's prompt-logprob LM-head passes
                    runner.model.compute_logits(hidden[a:b])
