"""LLMEngine: add_request / step / abort. step() is schedule -> run -> output stage -> observers."""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Sequence

import torch

from kvmesh.common.config import EngineConfig
from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.input_processor import EngineRequest, InputProcessor, PromptInput
from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.fingerprint import model_fingerprint
from kvmesh.engine.kv_connector import KVConnector, KVConnectorContext, KVConnectorFactory
from kvmesh.engine.loader import LoadedModel, load_model
from kvmesh.engine.gpu_memory import kv_cache_bytes, log_kv_budget, profile_device_memory
from kvmesh.engine.memory import free_memory
from kvmesh.engine.model_runner import ModelRunner, kv_block_bytes
from kvmesh.engine.runner_options import runner_options
from kvmesh.engine.observers import EngineObserver, LoadSnapshot, StepReport
# NOTE: add_request builds the groups under their old name
from kvmesh.engine.output_processor import OutputProcessor, RequestGroup as _Group
from kvmesh.engine.outputs import CompletionOutput, RequestOutput
from kvmesh.engine.prompt_logprobs import record_prompt_logprobs
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.sched_output import SchedulerStats
from kvmesh.engine.scheduler import Scheduler
from kvmesh.engine.structured.manager import StructuredOutputManager
from kvmesh.common.kv_events import KVEventBatch
from kvmesh.kernels.linear import packed_copy_bytes

if TYPE_CHECKING:
    from kvmesh.engine.parallel.executor import TPExecutor

logger = logging.getLogger("kvmesh.engine")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 kv_connector: KVConnectorFactory | None = None) -> None:
        """`kv_connector` builds the store of other pods' KV blocks (`--kv-share`; e.g.
        `kvmesh.index.kv_bytes.redis_kv_connector(url)`); None: no cross-pod KV bytes."""
        self.executor: "TPExecutor | None" = None   # tensor parallelism: the worker processes
        try:
            self._init(config, loaded, kv_connector)
        except BaseException:
            self.shutdown()
            raise

    def _init(self, config: EngineConfig, loaded: LoadedModel | None,
              kv_connector: KVConnectorFactory | None) -> None:
        self.config = config
        tp = config.tensor_parallel_size
        threads = config.cpu_threads or (max(1, (os.cpu_count() or 1) // tp) if tp > 1 else None)
        if threads is not None:
            # NOTE: OpenMP threads of several processes on few cores spin-wait on each other;
            # one thread each was 10x faster than two on a shared 2-core machine.
            torch.set_num_threads(threads)
        if tp > 1:
            if loaded is not None:
                raise ValueError("a tensor-parallel engine loads its own shards: pass the model "
                                 "path in the config, not a loaded model")
            if kv_connector is not None:
                raise ValueError("--kv-share is not supported with --tensor-parallel-size > 1")
            from kvmesh.engine.parallel.executor import TPExecutor  # noqa: PLC0415
            self.executor, self.loaded = TPExecutor.launch(config)
        else:
            self.loaded = loaded or load_model(config.model, config.dtype, config.device,
                                               config.attention_backend, config.tokenizer)
        mc = self.loaded.config
        # NOTE: a rank holds only its KV heads: blocks are counted from per-rank bytes
        kv_heads = self.loaded.plan.local_kv_heads if self.loaded.plan else mc.num_key_value_heads
        self.tokenizer = self.loaded.tokenizer
        self.model_name = config.served_model_name or self.loaded.name
        self.block_size = config.block_size
        self.block_bytes = kv_block_bytes(mc.num_hidden_layers, config.block_size,
                                          kv_heads, mc.head_dim, self.loaded.dtype)
        num_gpu_blocks = self._num_gpu_blocks()
        capacity = num_gpu_blocks * config.block_size
        max_len = config.max_model_len or mc.max_position_embeddings
        if config.max_model_len is None:
            max_len = min(max_len, capacity)
        elif max_len > capacity:
            raise ValueError(
                f"max_model_len {max_len} does not fit in the KV cache ({num_gpu_blocks} blocks of "
                f"{config.block_size} tokens = {capacity} tokens); raise --num-kv-blocks or "
                "--kv-cache-memory-fraction, or lower --max-model-len")
        if max_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {max_len} exceeds the model's context length "
                             f"{mc.max_position_embeddings}")
        self.max_model_len = max_len
        num_cpu_blocks = int(config.swap_space * (1 << 30)) // self.block_bytes
        self.kv_manager = KVCacheManager(num_gpu_blocks, config.block_size, num_cpu_blocks,
                                         enable_caching=config.enable_prefix_caching,
                                         enable_events=config.enable_kv_events)
        if self.executor is not None:
            self.runner = self.executor.make_runner(self.loaded, config.block_size, num_gpu_blocks,
                                                    num_cpu_blocks, config.seed)
        else:
            self.runner = ModelRunner(self.loaded.model, mc.num_hidden_layers, kv_heads,
                                      mc.head_dim, config.block_size, num_gpu_blocks, num_cpu_blocks,
                                      self.loaded.dtype, self.loaded.device, seed=config.seed,
                                      options=runner_options(config, self.loaded.device,
                                                             self.loaded.attention_backend, max_len))
        # NOTE: the connector names bytes by the runner's block layout, so the runner comes first
        # NOTE: KV bytes are named by the loaded weights' fingerprint, not the served name
        self.kv_share: KVConnector | None = None if kv_connector is None else kv_connector(
            KVConnectorContext(model_fingerprint(self.loaded.model, repr(mc)),
                               str(self.loaded.dtype).removeprefix("torch."),
                               self.runner.block_layout))
        self.scheduler = Scheduler(config, self.kv_manager, max_len, self.block_bytes,
                                   kv_connector=self.kv_share)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids)
        self.vocab_size = mc.vocab_size
        self.input_processor = InputProcessor(self.tokenizer, mc.vocab_size, max_len)
        self.structured = StructuredOutputManager(self.tokenizer.hf, mc.vocab_size,
                                                  self.eos_token_ids)
        self._groups: dict[str, _Group] = {}
        self.output = OutputProcessor(self.scheduler, self._groups)
        self.last_stats = SchedulerStats()
        self.num_steps = 0
        # tracing, metrics, the prefix-index publisher: see observers.py
        self.observers: list[EngineObserver] = []
        logger.info("engine ready: model=%s dtype=%s device=%s tensor_parallel=%d kv_blocks=%d "
                    "(%d tokens) swap_blocks=%d max_model_len=%d", self.model_name, self.loaded.dtype,
                    self.loaded.device, tp, num_gpu_blocks, capacity, num_cpu_blocks, max_len)

    def check_health(self) -> None:
        """Raise if the engine can no longer step (a tensor-parallel worker died)."""
        if self.executor is not None:
            self.executor.check()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any; idempotent. A single-rank engine holds no
        process or thread of its own."""
        if self.executor is not None:
            self.executor.shutdown()

    def _num_gpu_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        device = self.loaded.device
        max_len = cfg.max_model_len or self.loaded.config.max_position_embeddings
        if device.type == "cuda" and self.executor is None:
            # vLLM's rule: a share of the device's memory, less weights, activations and graphs
            mc, opts = self.loaded.config, runner_options(cfg, device, self.loaded.attention_backend,
                                                          max_len)
            mem = profile_device_memory(
                self.loaded.model, mc.num_hidden_layers, cfg.block_size, mc.num_key_value_heads,
                mc.head_dim, self.loaded.dtype, device, opts.max_num_tokens, cfg.max_num_seqs,
                max(opts.decode_pad_sizes, default=0))
            free = kv_cache_bytes(mem, cfg.gpu_memory_utilization)
            blocks = free // self.block_bytes
            log_kv_budget(mem, cfg.gpu_memory_utilization, blocks, cfg.block_size)
        else:
            # NOTE: on CPU the projections' reordered weight copies (kernels.linear) are built on
            # the first forward, after this: their bytes are not the KV cache's to take.
            free = max(0, free_memory(device) - packed_copy_bytes(self.loaded.model))
            if self.executor is not None:
                free = self.executor.kv_free_memory(free, device)
            blocks = int(free * cfg.kv_cache_memory_fraction) // self.block_bytes
        # NOTE: no point holding more than every sequence at full length.
        wanted = cfg.max_num_seqs * _cdiv(max_len, cfg.block_size)
        blocks = min(blocks, wanted)
        if blocks < 1:
            raise ValueError("no memory left for the KV cache; set --num-kv-blocks or raise "
                             "--kv-cache-memory-fraction")
        return blocks

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request: EngineRequest | str, prompt: PromptInput | None = None,
                    params: SamplingParams | None = None, arrival_time: float | None = None,
                    priority: int = 0, cache_salt: str | None = None,
                    prompt_text: str | None = None, trace_context=None) -> None:
        """Queue a request. The front ends (AsyncLLMEngine, LLM) pass an `EngineRequest` from
        `self.input_processor`, trusted as is; a request id with a raw `prompt` (text or token
        ids; scripts and benchmarks) and the other arguments goes through that processor first.
        `trace_context` (an OpenTelemetry context, e.g. the HTTP server span's) parents the
        request's spans when tracing is on. ValueError: a bad request, or an id in use."""
        if not isinstance(request, EngineRequest):
            request = self.input_processor.process(
                request, prompt, params, prompt_text=prompt_text, priority=priority,
                cache_salt=cache_salt, arrival_time=arrival_time, trace_context=trace_context)
        request_id, params = request.request_id, request.params
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = list(request.prompt_token_ids)
        assert len(prompt_ids) < self.max_model_len or (
            request.pooling is not None and len(prompt_ids) == self.max_model_len), \
            "the input processor bounds prompts"
        samples: list[Request] = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                # NOTE: sample i draws from its own generator, so each sample is reproducible
                # whatever else shares the batch.
                gen = torch.Generator().manual_seed(params.seed + i)
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            samples.append(Request(rid, prompt_ids, params, request.arrival_time, request.priority,
                                   request.cache_salt,
                                   eos_token_ids=() if params.ignore_eos else self.eos_token_ids,
                                   max_model_len=self.max_model_len, sample_index=i,
                                   parent_id=request_id, generator=gen,
                                   pooling=request.pooling))
        if params.structured_outputs is not None:
            self.structured.attach(request_id, samples, params.structured_outputs)
        self.scheduler.add_request(samples[0])
        for child in samples[1:]:
            self.scheduler.add_fork(samples[0], child)
        detoks = [IncrementalDetokenizer(self.tokenizer.hf, prompt_ids, params) for _ in samples]
        self._groups[request_id] = _Group(request_id, request.prompt_text, samples, detoks,
                                          [0] * len(samples))
        for obs in self.observers:
            obs.on_request_added(request_id, samples, request.trace_context)

    def abort_request(self, request_ids: str | Sequence[str]) -> list[str]:
        """Abort unfinished requests; returns the ids that were still unfinished."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        aborted = []
        for rid in request_ids:
            group = self._groups.pop(rid, None)
            if group is not None:
                self.scheduler.abort_requests([r.request_id for r in group.samples])
                aborted.append(rid)
                for obs in self.observers:
                    obs.on_request_aborted(rid)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t_start = time.monotonic()
        failed = self._fail_broken_grammars()
        sched = self.scheduler.schedule()
        sched.grammar = self.structured.bitmask(sched)
        t_scheduled = time.monotonic()
        result = self.runner.execute(sched)
        t_executed = time.monotonic()
        if self.kv_share is not None:
            self._share_prompt_blocks(sched)
        for rid, (first, entries) in result.prompt_logprobs.items():
            req = self.scheduler.requests.get(rid)
            if req is not None:
                record_prompt_logprobs(req, first, entries)
        pooled = self._finish_pooled(result.pooled)
        touched = self.scheduler.update_from_output(sched, result)
        for req in self.structured.accept(touched):
            self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
        outputs = failed + pooled + self.output.process(touched)
        self.scheduler.end_step(sched)
        self.last_stats = sched.stats
        self.num_steps += 1
        self._learn_prefill_rate(sched.num_scheduled_tokens, result.model_time_s)
        if self.observers:           # NOTE: without observers this check is the whole cost
            report = StepReport(self.num_steps, t_start, t_scheduled, t_executed,
                                time.monotonic(), result.sample_window, sched, outputs,
                                self.kv_manager.take_event_batch(), self.load())
            for obs in self.observers:
                obs.on_step(report)
        return outputs

    def _fail_broken_grammars(self) -> list[RequestOutput]:
        """Finish (as aborted) the requests whose grammar failed to compile: their final output.

        NOTE: the input processor parsed every spec, so a compile failing after that is xgrammar's
        internal error; the request ends with finish_reason "abort" instead of waiting forever."""
        outputs = []
        for request_id, error in self.structured.take_failed():
            group = self._groups.pop(request_id, None)
            if group is None:
                continue
            logger.error("request %s: its grammar failed to compile: %s", request_id, error)
            self.scheduler.abort_requests([r.request_id for r in group.samples])
            for req in group.samples:
                req.stop_reason = f"grammar compile failed: {error}"
            outputs.append(self.output.final_output(group))
            for obs in self.observers:
                obs.on_request_aborted(request_id)
        return outputs

    def _finish_pooled(self, pooled: dict[str, list[float]]) -> list[RequestOutput]:
        """Finish the embeddings requests whose prefill completed this step (their blocks are
        freed now; nothing is sampled for them) and build their outputs."""
        outputs = []
        for rid, vector in pooled.items():
            group = self._groups.pop(rid, None)     # NOTE: pooled requests are n == 1
            if group is None:
                continue
            req = group.samples[0]
            self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED)
            metrics = {"arrival_time": req.arrival_time}
            if req.first_scheduled_time is not None:
                metrics["first_scheduled_time"] = req.first_scheduled_time
            outputs.append(RequestOutput(
                rid, group.prompt, req.prompt_token_ids,
                [CompletionOutput(0, "", [], None, req.finish_reason)], True,
                max(req.num_cached_tokens, 0), metrics, embedding=vector))
        return outputs

    # ---- observers -----------------------------------------------------------------------
    def add_observer(self, observer: EngineObserver) -> None:
        if observer not in self.observers:
            self.observers.append(observer)

    def remove_observer(self, observer: EngineObserver) -> None:
        if observer in self.observers:
            self.observers.remove(observer)

    def load(self) -> LoadSnapshot:
        s = self.scheduler
        return LoadSnapshot(len(s.running), len(s.waiting), len(s.swapped), self.kv_manager.usage)

    def _share_prompt_blocks(self, sched) -> None:
        """--kv-share: offer the full blocks of every prompt completed this step to other pods.

        NOTE: runs before update_from_output, while each ScheduledRequest still names its blocks
        (a request may finish, and free them, in this very step)."""
        bs = self.block_size
        for sr in sched.scheduled:
            req = sr.request
            if not sr.sample or req.num_output_tokens or req.sample_index:
                continue                  # only a prompt's first completion; forks share it
            # NOTE: the scheduler's hasher has hashed every full prompt block since add_request
            for i in range(req.num_prompt_tokens // bs):
                h = req.block_hashes[i]
                if self.kv_share.wants(h):
                    self.kv_share.save(h, self.runner.block_data(sr.block_ids[i]))

    def _learn_prefill_rate(self, tokens: int, seconds: float) -> None:
        if tokens >= 64 and seconds > 0:
            rate = tokens / seconds
            s = self.scheduler
            s.recompute_tokens_per_s = 0.8 * s.recompute_tokens_per_s + 0.2 * rate

    # ---- cache control -------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (False while running requests hold blocks); observers see
        the 'all cleared' event at once, since an idle engine may not step again soon."""
        ok = self.kv_manager.reset_prefix_cache()
        if ok and self.observers:
            events, load = self.kv_manager.take_event_batch(), self.load()
            for obs in self.observers:
                obs.on_cache_reset(events, load)
        return ok

    def cached_blocks(self) -> list[tuple[bytes, str]]:
        """(block hash, tier) of every block in the prefix cache; safe from another thread (the
        prefix-index publisher's resync snapshot)."""
        return self.kv_manager.cached_blocks()

    def take_kv_event_batch(self) -> KVEventBatch | None:
        """The KV events recorded since the last step or take, as one numbered batch (the
        prefix-index publisher drains them once when it attaches)."""
        return self.kv_manager.take_event_batch()
