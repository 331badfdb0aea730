"""A launched step whose sampled tokens the host has not read yet (vLLM's AsyncModelRunnerOutput).

`ModelRunner.launch` returns one as soon as the step's work is queued: on CUDA the forward, the
sampler and the copy of the draws to pinned host memory run behind it, so the engine schedules
and prepares the next step meanwhile; `result()` waits for that one copy only. On CPU every
kernel has run when `launch` returns, and `result()` only reads the tensors.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvmesh.engine.request import Logprob
from kvmesh.engine.sampler import DeviceSamples
from kvmesh.engine.sched_output import ModelRunnerOutput


@dataclass(slots=True)
class PendingOutput:
    row_ids: list[str]                   # request id of each sampled row, in row order
    samples: DeviceSamples | None        # the draws on the device (None: complete at launch)
    launch_s: float = 0.0                # host seconds the launch took (forward on CPU)
    sample_window: tuple[float, float] | None = None   # monotonic s: sampler start, end
    prompt_logprobs: dict[str, tuple[int, list[dict[int, Logprob]]]] = field(default_factory=dict)
    pooled: dict[str, list[float]] = field(default_factory=dict)
    done: ModelRunnerOutput | None = None   # a step complete at launch (nothing sampled, drafts)

    @property
    def draws(self) -> torch.Tensor | None:
        """[D] the step's draws on the device (None: it sampled nothing)."""
        return None if self.samples is None else self.samples.draws

    def draw_index(self) -> dict[str, int]:
        """Request id -> the index of its (first) draw in `draws`: the next step's input id of
        a request whose token is still in flight."""
        if self.samples is None:
            return {}
        return dict(zip(self.row_ids, self.samples.first))

    def result(self) -> ModelRunnerOutput:
        """The step's output, waiting for its sampled ids (one device-to-host copy)."""
        if self.done is not None:
            return self.done
        t0 = time.perf_counter()
        out = self.samples.to_output()
        waited = time.perf_counter() - t0
        # NOTE: the launch plus the wait: the forward's share of the step, not the host work
        # done while it ran (the prefill-rate estimate reads it)
        return ModelRunnerOutput(
            sampled=dict(zip(self.row_ids, out.token_ids)),
            logprobs=dict(zip(self.row_ids, out.logprobs)),
            model_time_s=self.launch_s + waited, sample_window=self.sample_window,
            prompt_logprobs=self.prompt_logprobs, pooled=self.pooled)
