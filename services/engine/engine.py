"""LLMEngine: add_request / step / abort. step() is vLLM V1's: schedule -> execute -> update from
the output (the scheduler's update_from_output, then the output stage), then the observers."""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, Sequence

import torch

from kvmesh.common.config import EngineConfig
from kvmesh.common.startup import startup_phase
from kvmesh.engine.async_output import PendingOutput
from kvmesh.engine.async_scheduling import sync_reason
from kvmesh.common.storage import resolve_engine_model
from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.input_processor import EngineRequest, InputProcessor, PromptInput
from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.fingerprint import model_fingerprint
from kvmesh.engine.kv_connector import KVConnector, KVConnectorContext, KVConnectorFactory
from kvmesh.engine.loader import LoadedModel, load_model
from kvmesh.engine.lora import LoRARequest
from kvmesh.engine.lora.adapter import LoRAModel
from kvmesh.engine.lora.manager import LoRAManager, lora_manager
from kvmesh.engine.lora.memory import slot_bytes
from kvmesh.engine.gpu_memory import kv_cache_bytes, log_kv_budget, profile_device_memory
from kvmesh.engine.memory import free_memory
from kvmesh.engine.model_runner import ModelRunner, kv_block_bytes, kv_block_layout
from kvmesh.engine.runner_options import runner_options
from kvmesh.engine.observers import EngineObserver, LoadSnapshot, StepReport
# NOTE: add_request builds the groups under their old name
from kvmesh.engine.output_processor import OutputProcessor, RequestGroup as _Group
from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.quantization.kv_scales import apply as apply_kv_scales
from kvmesh.engine.request import Request
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.sched_output import ModelRunnerOutput, SchedulerOutput, SchedulerStats
from kvmesh.engine.scheduler import Scheduler
from kvmesh.engine.spec_decode.draft_model import DraftModel, check_same_vocabulary
from kvmesh.engine.structured.manager import StructuredOutputManager
from kvmesh.common.kv_events import KVEventBatch
from kvmesh.kernels.kv_cache_dtype import resolve_kv_cache_dtype
from kvmesh.kernels.linear import packed_copy_bytes

if TYPE_CHECKING:
    from kvmesh.engine.kv_transfer.connector import MooncakeConnector
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
        self.kv_share: KVConnector | None = None
        # --kv-transfer-config: the prefill/decode hand-off (kv_transfer/connector.py)
        self.kv_transfer: MooncakeConnector | None = None
        try:
            self._init(config, loaded, kv_connector)
        except BaseException:
            self.shutdown()
            if self.kv_share is not None:       # NOTE: built before the cache: nobody owns it yet
                self.kv_share.close()
            raise

    def _init(self, config: EngineConfig, loaded: LoadedModel | None,
              kv_connector: KVConnectorFactory | None) -> None:
        # NOTE: an s3:// / hf:// model is fetched into the node cache here (a no-op for a path)
        self.config = config = resolve_engine_model(config)
        self._load_model(loaded, kv_connector is not None)
        # NOTE: before the KV cache is sized: the slots' memory is not the cache's to take
        self.lora: LoRAManager | None = (lora_manager(self.loaded, config) if config.enable_lora
                                         else None)
        num_gpu_blocks, num_cpu_blocks = self._size_kv_cache()
        self.kv_share = self._build_connector(kv_connector)
        self._build_cache_and_runner(num_gpu_blocks, num_cpu_blocks)
        self.kv_transfer = self._build_kv_transfer()
        self._build_scheduler_and_processors()
        self.last_stats = SchedulerStats()
        self.num_steps = 0
        # --async-scheduling: the launched step whose tokens are not read yet, with its
        # schedule and its start times
        self._pending: tuple[SchedulerOutput, PendingOutput, float, float] | None = None
        # tracing, metrics, the prefix-index publisher: see observers.py
        self.observers: list[EngineObserver] = []
        logger.info("engine ready: model=%s dtype=%s device=%s tensor_parallel=%d kv_blocks=%d "
                    "(%d tokens, %s) swap_blocks=%d max_model_len=%d", self.model_name, self.loaded.dtype,
                    self.loaded.device, config.tensor_parallel_size, num_gpu_blocks,
                    num_gpu_blocks * config.block_size, str(self.cache_dtype).removeprefix("torch."),
                    num_cpu_blocks, self.max_model_len)
        if config.async_scheduling:
            logger.info("async scheduling: on (a step is scheduled while the one before runs%s)",
                        "" if self.loaded.device.type == "cuda"
                        else "; on a CPU the forward is synchronous: exact, but no overlap")

    def _load_model(self, loaded: LoadedModel | None, kv_share: bool) -> None:
        """The weights, in this process or (tensor parallelism) in the executor's workers."""
        config = self.config
        tp = config.tensor_parallel_size
        threads = config.cpu_threads or (max(1, (os.cpu_count() or 1) // tp) if tp > 1 else None)
        if threads is not None:
            # NOTE: OpenMP threads of several processes on few cores spin-wait on each other;
            # one thread each was 10x faster than two on a shared 2-core machine.
            torch.set_num_threads(threads)
        spec = config.speculative_config
        if tp > 1 and spec is not None and spec.method == "draft_model":
            # NOTE: refused before any worker process starts
            raise ValueError("--speculative-config: a draft model needs --tensor-parallel-size 1")
        if tp > 1:
            if loaded is not None:
                raise ValueError("a tensor-parallel engine loads its own shards: pass the model "
                                 "path in the config, not a loaded model")
            if kv_share:
                raise ValueError("--kv-share is not supported with --tensor-parallel-size > 1")
            from kvmesh.engine.parallel.executor import TPExecutor  # noqa: PLC0415
            self.executor, self.loaded = TPExecutor.launch(config)
        else:
            self.loaded = loaded or load_model(config.model, config.dtype, config.device,
                                               config.attention_backend, config.tokenizer,
                                               quantization=config.quantization)
        self.tokenizer = self.loaded.tokenizer
        self.model_name = config.served_model_name or self.loaded.name
        self.draft = self._load_draft()

    def _load_draft(self) -> LoadedModel | None:
        """--speculative-config method "draft_model": the draft, checked against the target."""
        spec = self.config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        c = self.config
        draft = load_model(spec.model, c.dtype, c.device, c.attention_backend)
        check_same_vocabulary(self.loaded, draft)
        return draft

    def _local_kv_heads(self) -> int:
        # NOTE: a rank holds only its KV heads: blocks are counted from per-rank bytes
        plan = self.loaded.plan
        return plan.local_kv_heads if plan else self.loaded.config.num_key_value_heads

    def _size_kv_cache(self) -> tuple[int, int]:
        """(GPU blocks, CPU swap blocks); sets block_bytes and max_model_len, which must fit."""
        config, mc = self.config, self.loaded.config
        self.block_size = config.block_size
        # --kv-cache-dtype: the cache's element type (refused here if the backend cannot read it)
        self.cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.loaded.dtype,
                                                  self.loaded.attention_backend)
        scaled = apply_kv_scales(self.loaded.model, self.cache_dtype)
        if scaled:
            logger.info("KV cache: %d layers store K/V divided by the checkpoint's k_scale / v_scale", scaled)
        self.block_bytes = kv_block_bytes(mc.num_hidden_layers, config.block_size,
                                          self._local_kv_heads(), mc.head_dim, self.cache_dtype)
        if self.draft is not None:
            # NOTE: one block holds both models' K/V of its tokens: the draft shares the budget
            dc = self.draft.config
            self.block_bytes += kv_block_bytes(dc.num_hidden_layers, config.block_size,
                                               dc.num_key_value_heads, dc.head_dim, self.draft.dtype)
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
        if self.draft is not None and max_len > self.draft.config.max_position_embeddings:
            raise ValueError(f"max_model_len {max_len} exceeds the draft model's context length "
                             f"{self.draft.config.max_position_embeddings}; lower --max-model-len")
        self.max_model_len = max_len
        return num_gpu_blocks, int(config.swap_space * (1 << 30)) // self.block_bytes

    def _build_cache_and_runner(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """The block bookkeeping (KVCacheManager) and the runner holding the cache tensors
        (it offers computed prompt blocks to the connector)."""
        config, mc = self.config, self.loaded.config
        self.kv_manager = KVCacheManager(num_gpu_blocks, config.block_size, num_cpu_blocks,
                                         enable_caching=config.enable_prefix_caching,
                                         enable_events=config.enable_kv_events)
        kv_gib = num_gpu_blocks * self.block_bytes / (1 << 30)
        with startup_phase("allocating the KV cache", f"{num_gpu_blocks} blocks, {kv_gib:.2f} "
                           f"GiB; swap space {config.swap_space:g} GiB", phase="kv_alloc"):
            if self.executor is not None:
                self.runner = self.executor.make_runner(self.loaded, config.block_size,
                                                        num_gpu_blocks, num_cpu_blocks, config.seed,
                                                        self.cache_dtype, lora=self.lora)
            else:
                opts = runner_options(config, self.loaded.device, self.loaded.attention_backend,
                                      self.max_model_len)
                drafter = None if self.draft is None else DraftModel(
                    self.draft, config.block_size, num_gpu_blocks, opts.max_num_seqs,
                    opts.max_num_tokens, _cdiv(self.max_model_len, config.block_size))
                self.runner = ModelRunner(self.loaded.model, mc.num_hidden_layers,
                                          self._local_kv_heads(), mc.head_dim, config.block_size,
                                          num_gpu_blocks, num_cpu_blocks, self.cache_dtype,
                                          self.loaded.device, seed=config.seed,
                                          kv_connector=self.kv_share, options=opts,
                                          lora=self.lora, drafter=drafter)

    def _build_connector(self, factory: KVConnectorFactory | None) -> KVConnector | None:
        """--kv-share: the store of other pods' KV blocks (None: no cross-pod KV bytes).

        NOTE: the connector names bytes by the block layout the runner will hold and by the
        loaded weights' fingerprint, not the served name."""
        if factory is None:
            return None
        mc = self.loaded.config
        layout = kv_block_layout(mc.num_hidden_layers, self.config.block_size,
                                 self._local_kv_heads(), mc.head_dim, self.cache_dtype)
        return factory(KVConnectorContext(model_fingerprint(self.loaded.model, repr(mc)),
                                          str(self.cache_dtype).removeprefix("torch."), layout))

    def _build_kv_transfer(self) -> "MooncakeConnector | None":
        """--kv-transfer-config: the connector that registers the runner's cache with Mooncake."""
        kt = self.config.kv_transfer_config
        if kt is None:
            return None
        from kvmesh.engine.kv_transfer.connector import MooncakeConnector  # noqa: PLC0415
        return MooncakeConnector(kt, self.runner.kv_cache, self.config.block_size)

    def poll_kv_transfers(self) -> None:
        """While idle: free the pinned blocks that were read or timed out (a step does it too)."""
        if self.kv_transfer is not None:
            self.scheduler.poll_handoff(SchedulerStats())

    def _build_scheduler_and_processors(self) -> None:
        """The scheduler with what it consults (structured outputs, the connector), the input
        processor before it and the output processor after it."""
        vocab_size = self.loaded.config.vocab_size
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids)
        self.vocab_size = vocab_size
        self.structured = StructuredOutputManager(self.tokenizer.hf, vocab_size,
                                                  self.eos_token_ids)
        self.scheduler = Scheduler(self.config, self.kv_manager, self.max_model_len,
                                   self.block_bytes, kv_connector=self.kv_share or self.kv_transfer,
                                   structured=self.structured)
        kt = self.config.kv_transfer_config
        self.input_processor = InputProcessor(self.tokenizer, vocab_size, self.max_model_len,
                                              kv_role=None if kt is None else kt.kv_role)
        if self.lora is not None:
            sched = self.scheduler
            self.lora.in_use = lambda: {r.lora_request.lora_int_id for r in sched.requests.values()
                                        if r.lora_request is not None}
        self._groups: dict[str, _Group] = {}
        self.output = OutputProcessor(self.scheduler, self._groups)

    def check_health(self) -> None:
        """Raise if the engine can no longer step (a tensor-parallel worker died)."""
        if self.executor is not None:
            self.executor.check()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and the KV-transfer threads, if any; idempotent.
        A single-rank engine without them holds no process or thread of its own."""
        if self.executor is not None:
            self.executor.shutdown()
        if self.kv_transfer is not None:
            self.kv_transfer.close()

    def _lora_slot_bytes(self) -> int:
        return 0 if self.lora is None else slot_bytes(self.lora.targets)

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
                mc.head_dim, self.cache_dtype, device, opts.max_num_tokens, cfg.max_num_seqs,
                max(opts.decode_pad_sizes, default=0))
            # the LoRA slots, allocated already, are part of the memory in use
            mem = dataclasses.replace(mem, lora_slots=self._lora_slot_bytes())
            free = kv_cache_bytes(mem, cfg.gpu_memory_utilization)
            blocks = free // self.block_bytes
            log_kv_budget(mem, cfg.gpu_memory_utilization, blocks, cfg.block_size)
        else:
            # NOTE: on CPU the projections' reordered weight copies (kernels.linear) are built on
            # the first forward, after this: their bytes are not the KV cache's to take.
            free = max(0, free_memory(device) - packed_copy_bytes(self.loaded.model))
            if self.executor is not None:
                free = self.executor.kv_free_memory(free, device)
            lora = self._lora_slot_bytes()
            blocks = max(0, int(free * cfg.kv_cache_memory_fraction) - lora) // self.block_bytes
            if lora:
                logger.info("LoRA slots: %.1f MiB (--max-loras %d x --max-lora-rank %d, every "
                            "site's A and B) taken from the KV cache's %.1f MiB -> %d blocks",
                            lora / (1 << 20), cfg.max_loras, cfg.max_lora_rank,
                            free * cfg.kv_cache_memory_fraction / (1 << 20), blocks)
        # NOTE: no point holding more than every sequence at full length.
        wanted = cfg.max_num_seqs * _cdiv(max_len, cfg.block_size)
        blocks = min(blocks, wanted)
        if blocks < 1:
            lora = self._lora_slot_bytes()
            raise ValueError("no memory left for the KV cache; set --num-kv-blocks or raise "
                             "--kv-cache-memory-fraction" + (
                                 f", or lower --max-loras or --max-lora-rank (the LoRA slots take "
                                 f"{lora / (1 << 20):.1f} MiB)" if lora else ""))
        return blocks

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request: EngineRequest | str, prompt: PromptInput | None = None,
                    params: SamplingParams | None = None, arrival_time: float | None = None,
                    priority: int = 0, cache_salt: str | None = None,
                    prompt_text: str | None = None, trace_context=None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request. The front ends (AsyncLLMEngine, LLM) pass an `EngineRequest` from
        `self.input_processor`, trusted as is; a request id with a raw `prompt` (text or token
        ids; scripts and benchmarks) and the other arguments goes through that processor first.
        `trace_context` (an OpenTelemetry context, e.g. the HTTP server span's) parents the
        request's spans when tracing is on. ValueError: a bad request, or an id in use."""
        if not isinstance(request, EngineRequest):
            request = self.input_processor.process(
                request, prompt, params, prompt_text=prompt_text, priority=priority,
                cache_salt=cache_salt, arrival_time=arrival_time, trace_context=trace_context,
                lora_request=lora_request)
        request_id, params = request.request_id, request.params
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        lora = request.lora_request
        if lora is not None:
            if self.lora is None:
                raise ValueError(f"LoRA adapter {lora.lora_name!r} requested, but this engine "
                                 "serves none; start it with --enable-lora")
            self.lora.ensure(lora)            # LoRAAdapterError (a ValueError): nothing changed
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
                                   pooling=request.pooling, lora_request=lora))
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

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) ----------------------------
    def _require_lora(self) -> LoRAManager:
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters; start it with --enable-lora")
        return self.lora

    def read_lora(self, lora_request: LoRARequest) -> LoRAModel:
        """Read and check an adapter against the model without changing anything (any thread:
        `add_lora` of the result is then the only step on the engine thread)."""
        return self._require_lora().read(lora_request)

    def add_lora(self, lora_request: LoRARequest | LoRAModel) -> bool:
        """Load an adapter into the host cache (LoRAAdapterError when it cannot be served);
        False when its id is loaded already."""
        manager = self._require_lora()
        lora = (lora_request if isinstance(lora_request, LoRAModel)
                else manager.read(lora_request))
        return manager.add(lora)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._require_lora().remove(lora_int_id)

    def list_loras(self) -> set[int]:
        return set() if self.lora is None else self.lora.list_loras()

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
        # NOTE: a launched step still pending counts: its results close the step's stats
        return bool(self._groups) or self._pending is not None

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step, as vLLM V1's: schedule, execute, update from the output; then the report.
        With --async-scheduling it returns the outputs of the step launched by the call
        before (see _step_async)."""
        if self.config.async_scheduling:
            return self._step_async()
        t_start = time.monotonic()
        sched = self.scheduler.schedule()
        t_scheduled = time.monotonic()
        result = self.runner.execute(sched)
        t_executed = time.monotonic()
        outputs = self._update(sched, result)
        if self.observers:           # NOTE: without observers this check is the whole cost
            self._report(sched, result, outputs, t_start, t_scheduled, t_executed)
        return outputs

    def _step_async(self) -> list[RequestOutput]:
        """Schedule and launch step n + 1, then wait for step n's sampled ids and update from
        them: the host's scheduling and input preparation overlap n's forward on the device.
        A step named by `sync_reason` is completed before the next is scheduled.

        NOTE: if launching n + 1 fails, n is still completed (its tokens are applied once)
        before the error propagates."""
        outputs: list[RequestOutput] = []
        pending, self._pending = self._pending, None
        if pending is not None and sync_reason(pending[0]) is not None:
            outputs, pending = self._complete(pending), None
        t_start = time.monotonic()
        sched = self.scheduler.schedule()
        t_scheduled = time.monotonic()
        try:
            launched = self.runner.launch(sched)
        finally:
            if pending is not None:
                outputs += self._complete(pending)
        current = (sched, launched, t_start, t_scheduled)
        if launched.done is not None:
            outputs += self._complete(current)     # nothing to wait for: no step left pending
        else:
            self._pending = current
        return outputs

    def _complete(self, pending: tuple[SchedulerOutput, PendingOutput, float, float]
                  ) -> list[RequestOutput]:
        """Wait for a launched step's tokens and update from them (then the observers)."""
        sched, launched, t_start, t_scheduled = pending
        result = launched.result()
        t_executed = time.monotonic()
        outputs = self._update(sched, result)
        if self.observers:
            self._report(sched, result, outputs, t_start, t_scheduled, t_executed)
        return outputs

    def _update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        """The step's results into the requests (the scheduler), then into the clients'
        outputs (the output stage), then the step's stats."""
        touched = self.scheduler.update_from_output(sched, result)
        outputs = self._fail_broken_grammars()
        outputs += self.output.process(touched, result.pooled)
        self.scheduler.end_step(sched)
        self.last_stats = sched.stats
        self.num_steps += 1
        return outputs

    def _fail_broken_grammars(self) -> list[RequestOutput]:
        """The final outputs (finish_reason "abort") of the requests whose grammar failed to
        compile.

        NOTE: the input processor parsed every spec, so a compile failing after that is xgrammar's
        internal error; the request ends instead of waiting forever (the scheduler skips it)."""
        outputs = []
        for request_id, error in self.structured.take_failed():
            out = self.output.fail(request_id, f"grammar compile failed: {error}")
            if out is None:
                continue
            logger.error("request %s: its grammar failed to compile: %s", request_id, error)
            outputs.append(out)
            for obs in self.observers:
                obs.on_request_aborted(request_id)
        return outputs

    def _report(self, sched: SchedulerOutput, result: ModelRunnerOutput,
                outputs: list[RequestOutput], t_start: float, t_scheduled: float,
                t_executed: float) -> None:
        report = StepReport(self.num_steps, t_start, t_scheduled, t_executed, time.monotonic(),
                            result.sample_window, sched, outputs,
                            self.kv_manager.take_event_batch(), self.load())
        for obs in self.observers:
            obs.on_step(report)

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
