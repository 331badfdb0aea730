"""What the model runner is told at start-up beyond the model: batch limits and decode padding."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvmesh.common.config import EngineConfig
from kvmesh.engine.cuda_graphs import capture_sizes, graph_sizes_reason

logger = logging.getLogger("kvmesh.engine")


@dataclass(frozen=True, slots=True)
class RunnerOptions:
    max_num_seqs: int = 8              # sizes the persistent batch (it grows past these if it must)
    max_num_tokens: int = 256          # per-step token budget
    max_model_len: int = 2048          # the widest block table; the context graphs are captured for
    # decode-only steps pad to the next of these (ascending); on CUDA they are captured as graphs
    decode_pad_sizes: tuple[int, ...] = ()
    cuda_graphs: bool = False          # capture decode_pad_sizes as CUDA graphs (CUDA + Triton)


def runner_options(config: EngineConfig, device: torch.device, attention_backend: str,
                   max_model_len: int) -> RunnerOptions:
    """The options of an engine's runner: graphs (and so padding) only where they can run."""
    reason = graph_sizes_reason(device, attention_backend, config.enforce_eager,
                                config.tensor_parallel_size)
    if reason is None and config.enable_lora:
        # NOTE: a step's adapter grouping is host data read by Python in every LoRA site
        reason = "--enable-lora (the adapter grouping changes every step)"
    sizes: tuple[int, ...] = ()
    if reason is None:
        sizes = tuple(capture_sizes(config.max_num_seqs, config.cudagraph_capture_sizes,
                                    config.max_cudagraph_capture_size))
    else:
        # NOTE: news only on a CUDA device; a CPU server's start-up log stays its own phases
        logger.log(logging.INFO if device.type == "cuda" else logging.DEBUG,
                   "CUDA graphs: off (%s)", reason)
    return RunnerOptions(config.max_num_seqs, config.token_budget(max_model_len), max_model_len,
                         sizes, bool(sizes))
