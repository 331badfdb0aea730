"""CUDA graphs for decode steps: which batch sizes, their capture at start-up, their replay.

A decode-only step (one token per sequence) is padded to the next captured size and replays that
size's graph: the forward pass plus the LM head over the sampled rows, reading its inputs from
the persistent batch's device buffers (`InputBatch`), which the step has just filled. Every
graph shares one memory pool; sizes are captured largest first so the smaller ones reuse its
memory. Mixed prefill/decode steps run eagerly.

NOTE: a graph bakes in every host-side decision made while it was captured. The Triton backend
reads the step from device tensors only, and its decode kernel's split count (a host choice)
is fixed per size: the runner's `DecodePlanner` gives a graph step its size's count at the
longest context (`max_model_len`); a shorter context uses fewer of the splits (one: written
directly), so any context replays the same graph, and the partials live in the planner's
preallocated workspace. The reference and CPU backends plan on host lists, so they never
capture.
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvmesh.engine.input_batch import BatchInput, InputBatch

logger = logging.getLogger("kvmesh.engine.cuda_graphs")

# vLLM's default grid: 1, 2, 4, then every 8 up to 256, then every 16; at most 512.
_DEFAULT_MAX = 512

Forward = Callable[[BatchInput], tuple[torch.Tensor, torch.Tensor]]   # -> hidden [N, H], logits [N, V]


def default_capture_sizes(max_size: int) -> list[int]:
    """vLLM's default capture list up to `max_size`, with `max_size` itself added if off-grid."""
    grid = [1, 2, 4, *range(8, 256, 8), *range(256, max_size + 1, 16)]
    sizes = [n for n in grid if n <= max_size]
    if max_size not in sizes:
        sizes.append(max_size)
    return sizes


def capture_sizes(max_num_seqs: int, requested: tuple[int, ...] | list[int] | None = None,
                  max_size: int | None = None) -> list[int]:
    """The decode batch sizes to capture, ascending. A decode batch never holds more than
    `max_num_seqs` sequences, so larger sizes are dropped."""
    limit = min(max_num_seqs, max_size if max_size is not None else _DEFAULT_MAX)
    if requested is None:
        return default_capture_sizes(limit)
    sizes = sorted({n for n in requested if n <= limit})
    dropped = sorted({n for n in requested if n > limit})
    if dropped:
        logger.warning("CUDA graph sizes %s exceed the largest decode batch (%d) and are not "
                       "captured", dropped, limit)
    return sizes


def padded_size(sizes: list[int], n: int) -> int | None:
    """The smallest of `sizes` (ascending) holding `n` sequences; None when none does."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def graph_sizes_reason(device: torch.device, backend: str, enforce_eager: bool,
                       tensor_parallel_size: int) -> str | None:
    """Why this engine captures no CUDA graph (None: it captures)."""
    if device.type != "cuda":
        return f"the device is {device.type}, not cuda"
    if enforce_eager:
        return "--enforce-eager"
    if backend != "triton":
        return f"the {backend!r} attention backend plans on the host (graphs need 'triton')"
    if tensor_parallel_size > 1:
        return "tensor parallelism (its collectives run outside graphs)"
    return None


@dataclass(slots=True)
class CaptureReport:
    captured: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)    # size -> reason
    seconds: float = 0.0
    memory_bytes: int = 0                                    # device memory the graphs took


@dataclass(slots=True)
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    hidden: torch.Tensor        # [N, hidden]: the static output the replay overwrites
    logits: torch.Tensor        # [N, vocab]


class CudaGraphs:
    """Decode graphs keyed by padded batch size, captured over one InputBatch's buffers."""

    def __init__(self, batch: InputBatch, forward: Forward, max_model_len: int,
                 num_warmups: int = 2) -> None:
        self.batch = batch
        self.forward = forward
        self.max_model_len = max_model_len
        self.num_warmups = num_warmups
        self._graphs: dict[int, _Graph] = {}
        self._generation = batch.generation
        self._pool = None
        self._warned_stale = False

    @property
    def sizes(self) -> list[int]:
        return sorted(self._graphs)

    def can_replay(self, size: int) -> bool:
        if size not in self._graphs:
            return False
        if self.batch.generation != self._generation:
            if not self._warned_stale:
                logger.warning("the persistent batch outgrew its limits and was reallocated; "
                               "CUDA graphs no longer replay (steps run eagerly)")
                self._warned_stale = True
            return False
        return True

    def _dummy(self, size: int) -> BatchInput:
        """A decode step of `size` padding sequences, laid out as every replay of it will be."""
        self.batch.begin()
        step = self.batch.finish([], pad_to=size, full_width=True)
        # NOTE: the longest context, as the split count the runner gives a graph step assumes
        step.meta.max_seq_len = self.max_model_len
        return step

    def capture(self, sizes: list[int]) -> CaptureReport:
        """Capture each size (largest first); a size that fails is logged and runs eagerly."""
        report = CaptureReport()
        if not sizes:
            return report
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        self._pool = torch.cuda.graph_pool_handle()
        self._generation = self.batch.generation
        for size in sorted(sizes, reverse=True):
            try:
                self._graphs[size] = self._capture_one(size)
                report.captured.append(size)
            except Exception as e:  # noqa: BLE001 - any failure: this size runs eagerly
                report.failed[size] = f"{type(e).__name__}: {e}"
                logger.warning("CUDA graph capture of decode batch size %d failed; that size "
                               "runs eagerly: %s", size, report.failed[size])
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        report.captured.sort()
        report.seconds = time.perf_counter() - t0
        report.memory_bytes = max(0, free_before - torch.cuda.mem_get_info()[0])
        return report

    def _capture_one(self, size: int) -> _Graph:
        step = self._dummy(size)
        with torch.inference_mode():
            for _ in range(self.num_warmups):       # compiles every kernel variant outside capture
                self.forward(step)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                hidden, logits = self.forward(step)
        return _Graph(graph, hidden, logits)

    def replay(self, step: BatchInput) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [T, H], logits of the K sampled rows [K, V]) of a step that `finish` padded
        to a captured size with `full_width`."""
        g = self._graphs[step.padded_size]
        g.graph.replay()
        return g.hidden[:step.num_tokens], g.logits[:len(step.sample_list)]
