"""Runs one scheduled step: block copies and swaps, the packed forward pass, sampling.

The KV cache is one preallocated tensor [num_layers, 2, num_blocks, block_size, kv_heads,
head_dim]; each layer's attention reads its K/V views through the step's block tables.
"""
from __future__ import annotations

import logging
import time

import torch

from kvmesh.common.startup import startup_phase
from kvmesh.engine.async_output import PendingOutput
from kvmesh.engine.kv_connector import KVConnector
from kvmesh.engine.cuda_graphs import CudaGraphs, padded_size
from kvmesh.engine.input_batch import BatchInput, InputBatch
from kvmesh.engine.kernel_warmup import prepare_attention
from kvmesh.engine.model_input import ModelInput
from kvmesh.engine.logit_bias import apply_logit_bias
from kvmesh.engine.lora.manager import LoRAManager
from kvmesh.engine.pooling import PoolSpan, pool
from kvmesh.engine.prompt_logprobs import (PromptLogprobSpan, compute_prompt_logprobs,
                                           prompt_logprob_span, span_passes)
from kvmesh.engine.runner_options import RunnerOptions
from kvmesh.engine.sampler import Sampler, SamplingRow
from kvmesh.engine.sched_output import ModelRunnerOutput, SchedulerOutput
from kvmesh.engine.spec_decode.draft_model import DraftModel
from kvmesh.engine.spec_decode.rejection import SpecGroup, spec_group, verify
from kvmesh.engine.spec_decode.tokens import WithDrafts

logger = logging.getLogger("kvmesh.engine")


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype) -> int:
    """Bytes of one block across all layers, K and V."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


def kv_block_layout(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> tuple[int, ...]:
    """Shape of one block across layers, K and V, plus the item size: names shared KV bytes
    (ModelRunner.block_data's layout)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return (num_layers, 2, block_size, num_kv_heads, head_dim, itemsize)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_layers: int, num_kv_heads: int,
                 head_dim: int, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 dtype: torch.dtype, device: torch.device, seed: int = 0,
                 kv_connector: KVConnector | None = None,
                 options: RunnerOptions | None = None,
                 lora: LoRAManager | None = None,
                 drafter: DraftModel | None = None) -> None:
        self.model = model
        # --enable-lora: the adapters' slots and the step's mapping (its sites are in the model)
        self.lora = lora
        self.drafter = drafter     # speculative decoding with a draft model: proposes drafts
        # --kv-share: offered each completed prompt's blocks after the forward pass
        self.kv_connector = kv_connector
        self.block_size = block_size
        self.device = device
        shape = (num_layers, 2, num_gpu_blocks, block_size, num_kv_heads, head_dim)
        # NOTE: zeros, not empty: attention may read (and multiply by zero probability) slots
        # past a sequence's end, and NaN garbage would survive 0 * NaN.
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(num_layers)]
        cpu_shape = (num_layers, 2, num_cpu_blocks, block_size, num_kv_heads, head_dim)
        self.swap_cache = torch.zeros(cpu_shape, dtype=dtype, device="cpu",
                                      pin_memory=device.type == "cuda" and num_cpu_blocks > 0)
        self.sampler = Sampler(generator=torch.Generator().manual_seed(seed))
        # the last launch (async scheduling reads its draws) and its draws' index by request
        self._prev: PendingOutput | None = None
        self._prev_index: dict[str, int] = {}
        self._prev_index_of: PendingOutput | None = None
        opts = options or RunnerOptions()
        self.options = opts
        self.input_batch = InputBatch(block_size, device, opts.max_num_seqs,
                                      max(opts.max_num_tokens, max(opts.decode_pad_sizes, default=0)),
                                      -(-opts.max_model_len // block_size))
        self.pad_sizes = list(opts.decode_pad_sizes)
        # Triton on CUDA: the decode split counts and workspace, every attention variant compiled
        self.decode_planner = prepare_attention(model, self.kv_caches, opts.max_num_seqs,
                                                opts.max_model_len, device)
        self.cuda_graphs: CudaGraphs | None = None
        if opts.cuda_graphs and device.type == "cuda" and self.pad_sizes:
            self.cuda_graphs = CudaGraphs(self.input_batch, self._forward, opts.max_model_len)
            # NOTE: counted as kernel_build (vLLM's "graph capturing"), not as the KV allocation
            # whose phase it runs inside
            with startup_phase("capturing CUDA graphs", f"{len(self.pad_sizes)} decode batch sizes",
                               phase="kernel_build"):
                report = self.cuda_graphs.capture(self.pad_sizes)
            # NOTE: a size that failed to capture runs eagerly, unpadded
            self.pad_sizes = report.captured
            logger.info("CUDA graphs: captured %d decode batch sizes %s in %.1f s, %.1f MiB%s",
                        len(report.captured), report.captured, report.seconds,
                        report.memory_bytes / 2**20,
                        f"; failed: {sorted(report.failed)}" if report.failed else "")

    # ---- block movement ------------------------------------------------------------------
    @property
    def block_layout(self) -> tuple[int, ...]:
        """Shape of one block across layers, K and V, plus the item size: names shared KV bytes."""
        layers, _, _, block_size, kv_heads, head_dim = self.kv_cache.shape
        return kv_block_layout(layers, block_size, kv_heads, head_dim, self.kv_cache.dtype)

    def block_data(self, block: int) -> bytes:
        """One block's K/V of every layer as bytes ([layers, 2, block_size, kv_heads, head_dim])."""
        return self.kv_cache[:, :, block].contiguous().view(torch.uint8).cpu().numpy().tobytes()

    def _blocks_from_bytes(self, chunks: list[bytes]) -> torch.Tensor:
        layers, two, _, block_size, kv_heads, head_dim = self.kv_cache.shape
        raw = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
        t = raw.view(self.kv_cache.dtype).view(len(chunks), layers, two, block_size, kv_heads, head_dim)
        return t.permute(1, 2, 0, 3, 4, 5).to(self.device)      # [layers, 2, n, bs, kvh, d]

    def apply_block_ops(self, ops: list[tuple[str, int, int]], loads: list[bytes] = ()) -> None:
        """Replay copy / swap_out / swap_in / load in decision order, batching runs of one kind."""
        start = 0
        while start < len(ops):
            kind = ops[start][0]
            end = start
            while end < len(ops) and ops[end][0] == kind:
                end += 1
            a = torch.tensor([op[1] for op in ops[start:end]])
            b = torch.tensor([op[2] for op in ops[start:end]])
            if kind == "copy":
                if self.drafter is not None:
                    self.drafter.copy_blocks([op[1:] for op in ops[start:end]])
                a, b = a.to(self.device), b.to(self.device)
                self.kv_cache[:, :, b] = self.kv_cache[:, :, a]
            elif kind == "swap_out":
                self.swap_cache[:, :, b] = self.kv_cache[:, :, a.to(self.device)].to("cpu")
            elif kind == "swap_in":
                self.kv_cache[:, :, b.to(self.device)] = self.swap_cache[:, :, a].to(self.device)
            elif kind == "load":
                data = self._blocks_from_bytes([loads[i] for i in a.tolist()])
                self.kv_cache[:, :, b.to(self.device)] = data
            else:
                raise ValueError(f"unknown block op {kind!r}")
            start = end

    # ---- one step ------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step and wait for its sampled tokens."""
        return self.launch(out).result()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> PendingOutput:
        """Queue the step (block moves, forward, sampling, the copy of the draws to the host)
        and return before the host has its tokens (`PendingOutput.result` waits).

        NOTE: async scheduling: a decode whose input token is the previous launch's draw, not
        yet on the host (its position is past the request's known tokens), reads it from
        that launch's draws on the device: a gather into the input-ids buffer."""
        pending = self._launch(out)
        self._prev = pending
        return pending

    def _launch(self, out: SchedulerOutput) -> PendingOutput:
        self.apply_block_ops(out.block_ops, out.kv_loads)
        if not out.scheduled:
            return PendingOutput([], None, done=ModelRunnerOutput(sampled={}, logprobs={}))
        t0 = time.perf_counter()
        if self.drafter is not None:
            self.drafter.propose(out.scheduled, out.grammar)    # fills the drafts in place
        batch = self.input_batch
        batch.begin()
        sample_rows: list[int] = []
        rows: list[SamplingRow] = []
        row_ids: list[str] = []
        lp_spans: list[PromptLogprobSpan] = []
        pool_spans: list[PoolSpan] = []
        spec: list[SpecGroup] = []      # speculating requests: k + 1 sampled rows each
        primary: list[int] = []         # per sampling request, its (last) logits row
        late_rows: list[int] = []       # rows whose input id is the previous launch's draw
        late_draws: list[int] = []      # ... and the index of that draw
        lora_slots = (self.lora.slots_for([sr.request.lora_request for sr in out.scheduled])
                      if self.lora is not None else None)
        for i, sr in enumerate(out.scheduled):
            req = sr.request
            drafts = sr.spec_token_ids
            late = sr.start == len(req.all_token_ids)
            first = batch.add(req.request_id,
                              WithDrafts(req.all_token_ids, drafts) if drafts else req.all_token_ids,
                              sr.start, sr.num_tokens, sr.block_ids,
                              -1 if lora_slots is None else lora_slots[i], late=late)
            if late:
                late_rows.append(first)
                late_draws.append(self._prev_draw_index[req.request_id])
            if req.sampling_params.prompt_logprobs is not None:
                span = prompt_logprob_span(sr, first)
                if span is not None:
                    lp_spans.append(span)
            if req.pooling is not None:
                pool_spans.append(PoolSpan(sr, first))
            if sr.sample and req.pooling is None and drafts:
                spec.append(spec_group(req, drafts, len(sample_rows)))
                sample_rows.extend(range(first, first + sr.num_tokens))
                primary.append(len(sample_rows) - 1)
            elif sr.sample and req.pooling is None:
                primary.append(len(sample_rows))
                sample_rows.append(first + sr.num_tokens - 1)
                samples = [req, *sr.fork_children]
                rows.append(SamplingRow(
                    params=req.sampling_params,
                    prompt_token_ids=req.prompt_token_ids,
                    output_token_ids=req.output_token_ids,
                    generators=[r.generator for r in samples],
                    num_samples=len(samples),
                    eos_token_ids=req.eos_token_ids,
                ))
                row_ids.append(req.request_id)
        passes = [rng for span in lp_spans for rng in span_passes(span)]
        pad = None
        if self.pad_sizes and batch.num_tokens == batch.num_seqs:
            pad = padded_size(self.pad_sizes, batch.num_seqs)
        graphs = self.cuda_graphs
        replay = pad is not None and graphs is not None and graphs.can_replay(pad)
        step = batch.finish(sample_rows, passes, pad_to=pad, full_width=replay)
        if late_rows:
            self._gather_late(step.input_ids, late_rows, late_draws)
        if replay:
            hidden, logits = graphs.replay(step)
        else:
            hidden, logits = self.run_model(step)
        prompt_lps = (compute_prompt_logprobs(self.model.compute_logits, hidden, lp_spans)
                      if lp_spans else {})
        pooled = pool(hidden, pool_spans) if pool_spans else {}
        if spec:
            done = self._verify(out, logits, rows, row_ids, spec, primary, t0, prompt_lps, pooled)
            return PendingOutput([], None, done=done)
        if not rows:
            model_time_s = time.perf_counter() - t0
            self._save_computed_prompts(out)
            return PendingOutput([], None, done=ModelRunnerOutput(
                sampled={}, logprobs={}, model_time_s=model_time_s, prompt_logprobs=prompt_lps,
                pooled=pooled))
        apply_logit_bias(logits, [r.params for r in rows])
        if out.grammar is not None:
            out.grammar.apply(logits)            # structured outputs: only grammar tokens
        s0 = time.monotonic()
        samples = self.sampler.sample(logits, rows)
        s1 = time.monotonic()
        self._save_computed_prompts(out)
        return PendingOutput(row_ids, samples, launch_s=time.perf_counter() - t0,
                             sample_window=(s0, s1), prompt_logprobs=prompt_lps, pooled=pooled)

    @property
    def _prev_draw_index(self) -> dict[str, int]:
        prev = self._prev
        if prev is None or prev.draws is None:
            raise RuntimeError("a decode reads a token in flight, but the previous step "
                               "sampled none")
        if self._prev_index_of is not prev:
            self._prev_index, self._prev_index_of = prev.draw_index(), prev
        return self._prev_index

    def _gather_late(self, input_ids: torch.Tensor, rows: list[int], draws: list[int]) -> None:
        """input_ids[rows] = the previous launch's draws[draws], on the device (queued behind
        the staging copy that wrote the placeholders, so it lands last)."""
        idx = torch.tensor([rows, draws], dtype=torch.long)
        if input_ids.device.type == "cuda":
            # NOTE: from pinned memory without blocking: a pageable copy would wait for the
            # device to finish the previous step, the very wait async scheduling avoids
            idx = idx.pin_memory().to(input_ids.device, non_blocking=True)
        input_ids[idx[0]] = self._prev.draws[idx[1]].to(input_ids.dtype)

    def _verify(self, out: SchedulerOutput, logits: torch.Tensor, rows: list[SamplingRow],
                row_ids: list[str], spec: list[SpecGroup], primary: list[int], t0: float,
                prompt_lps: dict, pooled: dict) -> ModelRunnerOutput:
        """A step with speculating requests: logit_bias and the grammar bitmask on every row
        (a constrained speculating request has a mask per drafted position), the plain rows
        sampled, the drafts verified (engine/spec_decode/rejection.py)."""
        spec_last = {g.offset + len(g.drafts) for g in spec}
        plain = [p for p in primary if p not in spec_last]      # aligned with `rows`
        row_params: list = [None] * logits.shape[0]
        for p, r in zip(plain, rows):
            row_params[p] = r.params
        for g in spec:
            row_params[g.offset:g.offset + len(g.rows)] = [g.rows[0].params] * len(g.rows)
        apply_logit_bias(logits, row_params)
        if out.grammar is not None:
            out.grammar.apply(logits)
        s0 = time.monotonic()
        result = self.sampler(logits[torch.tensor(plain, device=logits.device)], rows) if rows else None
        verified = verify(self.sampler, logits, spec)
        s1 = time.monotonic()
        model_time_s = time.perf_counter() - t0
        self._save_computed_prompts(out)
        return ModelRunnerOutput(
            sampled=dict(zip(row_ids, result.token_ids)) if result else {},
            logprobs=dict(zip(row_ids, result.logprobs)) if result else {},
            model_time_s=model_time_s, sample_window=(s0, s1), prompt_logprobs=prompt_lps,
            pooled=pooled, spec_tokens=verified.tokens, spec_logprobs=verified.logprobs)

    def _save_computed_prompts(self, out: SchedulerOutput) -> None:
        """--kv-share: the forward pass wrote the step's KV; offer the completed prompts' blocks
        (their copies are not part of model_time_s, the measured prefill rate)."""
        if self.kv_connector is not None:
            self.kv_connector.save_computed_prompts(out.scheduled, self.block_size,
                                                    self.block_data)

    def run_model(self, step: BatchInput | ModelInput) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The eager forward pass: the hidden states [T, hidden] and the float32 logits of the
        step's sample rows (None when there are none, and on a tensor-parallel rank other than
        0). A `ModelInput` (a tensor-parallel worker's step) is laid into the batch first."""
        if isinstance(step, ModelInput):
            step = self.input_batch.from_model_input(step)
        if self.lora is not None:
            self.lora.set_step(step.lora_slots, step.query_lens, self.device)
        if self.decode_planner is not None and step.meta.is_all_decode:
            step.meta.decode_launch = self.decode_planner.launch(step.meta.num_seqs,
                                                                 step.meta.max_seq_len)
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta)
        if not step.sample_list:
            return hidden[:step.num_tokens], None
        return hidden[:step.num_tokens], self.model.compute_logits(hidden.index_select(0, step.sample_rows))

    def _forward(self, step: BatchInput) -> tuple[torch.Tensor, torch.Tensor]:
        """What a CUDA graph captures: the forward and the LM head over `step.sample_rows`."""
        if self.decode_planner is not None:
            # NOTE: the size's fixed split count, whatever context the graph is replayed at
            step.meta.decode_launch = self.decode_planner.launch(step.meta.num_seqs,
                                                                 step.meta.max_seq_len, graph=True)
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta)
        return hidden, self.model.compute_logits(hidden.index_select(0, step.sample_rows))
