"""Prometheus metrics with vLLM's names and semantics, exported twice: `kvmesh:*` and `vllm:*`.

NOTE: one collector owns each value and emits it under both prefixes, so existing vLLM
dashboards and autoscaler triggers (vllm:num_requests_waiting, ...) work unchanged.
"""
from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from kvmesh.api.lora_metrics import LoRACounters
from kvmesh.common.startup_times import StartupTimes
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.observers import EngineObserver, StepReport
from kvmesh.engine.outputs import RequestOutput

PREFIXES = ("kvmesh", "vllm")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# name -> help; the vLLM name is the same suffix under the vllm: prefix
GAUGES = {
    "num_requests_running": "Requests in the running queue (scheduled this step or holding KV).",
    "num_requests_waiting": "Requests waiting to be scheduled (never run, or preempted by recompute).",
    "num_requests_swapped": "Requests preempted by swap, their KV in CPU swap space.",
    "kv_cache_usage_perc": "Fraction of KV-cache blocks in use (1 = full).",
}
COUNTERS = {
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens served by the prefix cache.",
    "external_prefix_cache_hits": "Prompt tokens loaded from other pods' KV blocks (--kv-share).",
    "num_preemptions": "Preemptions (recompute or swap).",
    "prompt_tokens": "Prompt tokens of finished requests.",
    "generation_tokens": "Generated tokens.",
}
# speculative decoding (--speculative-config), exported only when it is on, as vLLM does
SPEC_COUNTERS = {
    "spec_decode_num_drafts": "Verifications of draft tokens (one per speculating request per step).",
    "spec_decode_num_draft_tokens": "Draft tokens proposed and verified.",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted by verification.",
}
SPEC_PER_POS = ("spec_decode_num_accepted_tokens_per_pos",
                "Accepted draft tokens by their position in the draft (0 = the first).")
# --kv-transfer-config (prefill/decode disaggregation), exported only when it is on
KV_TRANSFER_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                               5.0, 10.0, 30.0)
KV_TRANSFER_COUNTERS = {  # name -> (KVTransferStats field, help)
    "kv_transfer_bytes": ("bytes_read", "KV bytes read from prefill engines."),
    "kv_transfer_failures": ("failures", "KV reads that failed (the prompt was computed here)."),
    "kv_transfer_pin_timeouts": ("pin_timeouts", "Pinned prompts freed unread after their timeout."),
    "kv_transfer_pins_released": ("pins_released", "Pinned prompts freed once read."),
    "kv_transfer_read_seconds": ("read_seconds", "Seconds inside Mooncake's reads alone (successful "
                                 "reads; kv_transfer_seconds adds the side-channel round trips)."),
}
HISTOGRAMS = {
    "time_to_first_token_seconds": ("Arrival to first token.", TTFT_BUCKETS),
    "inter_token_latency_seconds": ("Time between consecutive tokens of a request.", ITL_BUCKETS),
    "e2e_request_latency_seconds": ("Arrival to finish.", LATENCY_BUCKETS),
    "request_queue_time_seconds": ("Arrival to first scheduled.", LATENCY_BUCKETS),
}


@dataclass(slots=True)
class _Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, count in zip(self.bounds, self.counts):
            running += count
            out.append((repr(float(bound)), running))
        out.append(("+Inf", running + self.counts[-1]))
        return out


class EngineMetrics(EngineObserver):
    """An engine observer updated on the engine thread after every step; read by /metrics."""

    def __init__(self, model_name: str, engine: LLMEngine | None = None,
                 startup: StartupTimes | None = None) -> None:
        self.model_name = model_name
        self.engine = engine       # gauges are read live from it at scrape time
        self.startup = startup     # the start-up phases' seconds (kvmesh: only; vLLM has none)
        self._lock = threading.Lock()
        self.gauges = dict.fromkeys(GAUGES, 0.0)
        self.counters = dict.fromkeys(COUNTERS, 0.0)
        self.success: dict[str, float] = {}
        self.hists = {name: _Histogram(buckets) for name, (_, buckets) in HISTOGRAMS.items()}
        self.extra = {"kvmesh:engine_steps": 0.0, "kvmesh:kv_blocks_evicted": 0.0,
                      "kvmesh:requests_swapped_out": 0.0, "kvmesh:requests_swapped_in": 0.0,
                      "kvmesh:requests_rejected": 0.0,
                      # --kv-share: requests that waited for their cross-pod KV prefetch, and
                      # those whose wait ran out (the store's own counters: kvmesh.index.metrics)
                      "kvmesh:kv_share_prefetch_waits": 0.0,
                      "kvmesh:kv_share_prefetch_timeouts": 0.0,
                      # prompt tokens run through the model (not cache hits, not transferred KV)
                      "kvmesh:prompt_tokens_computed": 0.0,
                      # the engine's own step timers, schedule to outputs built, and the
                      # forward (with the sampler) within it: a client's inter-token time
                      # minus the mean step is what the serving path adds (serve_gap.py)
                      "kvmesh:engine_step_seconds": 0.0,
                      "kvmesh:engine_forward_seconds": 0.0}
        # --kv-transfer-config: each read's duration (the connector calls on its thread)
        self.kv_transfer = getattr(engine, "kv_transfer", None)
        self.transfer_seconds = _Histogram(KV_TRANSFER_SECONDS_BUCKETS)
        if self.kv_transfer is not None:
            self.kv_transfer.transfer_listeners.append(self._on_transfer)
        self._last_token: dict[str, float] = {}
        self.spec_enabled = (engine is not None
                             and engine.config.speculative_config is not None)
        self.spec = dict.fromkeys(SPEC_COUNTERS, 0.0)
        # position -> accepted tokens; every position of k from the start (0 until accepted)
        self.spec_per_pos = ([0.0] * engine.config.speculative_config.num_speculative_tokens
                             if self.spec_enabled else [])
        # --enable-lora: per-adapter request counters
        self.lora = LoRACounters() if engine is not None and engine.lora is not None else None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # ---- updates -------------------------------------------------------------------------
    def on_step(self, report: StepReport) -> None:
        s, outputs = report.sched.stats, report.outputs
        now = time.monotonic()
        with self._lock:
            self.counters["prefix_cache_queries"] += s.prefix_query_tokens
            self.counters["prefix_cache_hits"] += s.prefix_hit_tokens
            self.counters["external_prefix_cache_hits"] += s.external_hit_tokens
            self.counters["num_preemptions"] += s.num_preempted
            self.extra["kvmesh:engine_steps"] += 1
            self.extra["kvmesh:kv_blocks_evicted"] += s.blocks_evicted
            self.extra["kvmesh:requests_swapped_out"] += s.num_swapped_out
            self.extra["kvmesh:requests_swapped_in"] += s.num_swapped_in
            self.extra["kvmesh:kv_share_prefetch_waits"] += s.remote_kv_waits
            self.extra["kvmesh:kv_share_prefetch_timeouts"] += s.remote_kv_timeouts
            self.extra["kvmesh:prompt_tokens_computed"] += s.num_prompt_tokens_computed
            self.extra["kvmesh:engine_step_seconds"] += report.t_end - report.t_start
            self.extra["kvmesh:engine_forward_seconds"] += report.t_executed - report.t_scheduled
            if s.spec_num_drafts:
                self._on_spec(s)
            for out in outputs:
                self._on_output(out, now)

    def on_request_added(self, request_id: str, samples, trace_context) -> None:
        if self.lora is not None:
            with self._lock:
                self.lora.added(request_id, samples)

    def _on_spec(self, s) -> None:
        self.spec["spec_decode_num_drafts"] += s.spec_num_drafts
        self.spec["spec_decode_num_draft_tokens"] += s.spec_num_draft_tokens
        self.spec["spec_decode_num_accepted_tokens"] += s.spec_num_accepted_tokens
        per_pos = self.spec_per_pos
        if len(per_pos) < len(s.spec_num_accepted_per_pos):
            per_pos.extend([0.0] * (len(s.spec_num_accepted_per_pos) - len(per_pos)))
        for i, n in enumerate(s.spec_num_accepted_per_pos):
            per_pos[i] += n

    def _on_output(self, out: RequestOutput, now: float) -> None:
        new_tokens = sum(len(c.delta_token_ids) for c in out.outputs)
        self.counters["generation_tokens"] += new_tokens
        if self.lora is not None:
            self.lora.output(out, new_tokens)
        rid = out.request_id
        arrival = out.metrics.get("arrival_time", now)
        if new_tokens:
            last = self._last_token.get(rid)
            if last is None:
                self.hists["time_to_first_token_seconds"].observe(now - arrival)
            else:
                self.hists["inter_token_latency_seconds"].observe(now - last)
            self._last_token[rid] = now
        if out.finished:
            self._last_token.pop(rid, None)
            self.counters["prompt_tokens"] += len(out.prompt_token_ids)
            self.hists["e2e_request_latency_seconds"].observe(now - arrival)
            scheduled = out.metrics.get("first_scheduled_time")
            if scheduled is not None:
                self.hists["request_queue_time_seconds"].observe(scheduled - arrival)
            for c in out.outputs:
                reason = c.finish_reason or "abort"
                self.success[reason] = self.success.get(reason, 0.0) + 1

    def _on_transfer(self, t) -> None:
        with self._lock:
            self.transfer_seconds.observe(t.seconds)

    def _kv_transfer_families(self, labels: list[str], values: list[str]):
        s = self.kv_transfer.transfer_stats()
        for name, (field_name, help_) in KV_TRANSFER_COUNTERS.items():
            c = CounterMetricFamily(f"kvmesh:{name}", help_, labels=labels)
            c.add_metric(values, float(getattr(s, field_name)))
            yield c
        g = GaugeMetricFamily("kvmesh:kv_transfer_pinned_blocks",
                              "KV blocks held for decode engines to read.", labels=labels)
        g.add_metric(values, float(s.pinned_blocks))
        yield g
        handoff = getattr(self.engine.scheduler, "handoff", None)
        c = CounterMetricFamily("kvmesh:kv_transfer_timeouts", "KV reads given up after "
                                "transfer_timeout_s (the prompt was computed here).", labels=labels)
        c.add_metric(values, float(handoff.num_timeouts if handoff is not None else 0))
        yield c
        h = HistogramMetricFamily("kvmesh:kv_transfer_seconds", "Duration of each KV read "
                                  "(side-channel round trips included).", labels=labels)
        h.add_metric(values, self.transfer_seconds.buckets(), self.transfer_seconds.total)
        yield h

    def on_request_aborted(self, request_id: str) -> None:
        """An unfinished request was aborted (client disconnect, shutdown): it produces no final
        output, so count it here under finished_reason="abort" (as vLLM does) and drop its
        per-request state."""
        with self._lock:
            self._last_token.pop(request_id, None)
            self.success["abort"] = self.success.get("abort", 0.0) + 1
            if self.lora is not None:
                self.lora.aborted(request_id)

    def count_rejected(self) -> None:
        with self._lock:
            self.extra["kvmesh:requests_rejected"] += 1

    def _read_gauges(self) -> None:
        # NOTE: live reads (list lengths, a float) are safe from another thread and never stale,
        # also after aborts that no step follows.
        e = self.engine
        if e is None:
            return
        sched = e.scheduler
        self.gauges["num_requests_running"] = len(sched.running)
        self.gauges["num_requests_waiting"] = (len(sched.waiting)
                                               + sum(len(c) for c in sched.pending_forks.values()))
        self.gauges["num_requests_swapped"] = len(sched.swapped)
        self.gauges["kv_cache_usage_perc"] = e.kv_manager.usage

    def _cache_config_info(self, prefix: str) -> GaugeMetricFamily | None:
        """vLLM's info gauge (value 1) whose labels describe the KV cache: endpoint pickers read
        block_size and num_gpu_blocks from it; model_name as on every other kvmesh series."""
        e = self.engine
        if e is None:
            return None
        kv = e.kv_manager
        labels = {"model_name": self.model_name, "block_size": str(e.block_size),
                  "num_gpu_blocks": str(kv.pool.num_blocks),
                  "num_cpu_blocks": str(kv.num_cpu_blocks),
                  "enable_prefix_caching": str(bool(kv.enable_caching)),
                  "cache_dtype": str(e.cache_dtype).removeprefix("torch.")}
        g = GaugeMetricFamily(f"{prefix}:cache_config_info", "Information of the KV cache "
                              "configuration (value 1).", labels=list(labels))
        g.add_metric(list(labels.values()), 1.0)
        return g

    def _lora_requests_info(self, prefix: str) -> GaugeMetricFamily | None:
        """vLLM's LoRA gauge (--enable-lora only): the adapters of running and of waiting
        requests, comma-separated, and --max-loras as labels; the value is the time it was read
        (a reader keeps the newest series). Endpoint pickers read it for adapter affinity."""
        e = self.engine
        if e is None or e.lora is None:
            return None
        sched = e.scheduler

        def names(requests) -> str:
            return ",".join(sorted({r.lora_request.lora_name for r in list(requests)
                                    if r.lora_request is not None}))

        waiting = [*sched.waiting, *sched.swapped]
        labels = {"max_lora": str(e.config.max_loras),
                  "waiting_lora_adapters": names(waiting),
                  "running_lora_adapters": names(sched.running)}
        g = GaugeMetricFamily(f"{prefix}:lora_requests_info", "Running stats on LoRA requests.",
                              labels=list(labels))
        g.add_metric(list(labels.values()), time.time())
        return g

    # ---- prometheus_client collector protocol ---------------------------------------------
    def collect(self):
        labels = ["model_name"]
        values = [self.model_name]
        with self._lock:
            self._read_gauges()
            for prefix in PREFIXES:
                for name, help_ in GAUGES.items():
                    g = GaugeMetricFamily(f"{prefix}:{name}", help_, labels=labels)
                    g.add_metric(values, self.gauges[name])
                    yield g
                for name, help_ in COUNTERS.items():
                    c = CounterMetricFamily(f"{prefix}:{name}", help_, labels=labels)
                    c.add_metric(values, self.counters[name])
                    yield c
                for info in (self._cache_config_info(prefix), self._lora_requests_info(prefix)):
                    if info is not None:
                        yield info
                c = CounterMetricFamily(f"{prefix}:request_success", "Finished requests by reason.",
                                        labels=labels + ["finished_reason"])
                for reason, count in sorted(self.success.items()):
                    c.add_metric(values + [reason], count)
                yield c
                for name, (help_, _) in HISTOGRAMS.items():
                    h = self.hists[name]
                    fam = HistogramMetricFamily(f"{prefix}:{name}", help_, labels=labels)
                    fam.add_metric(values, h.buckets(), h.total)
                    yield fam
                if self.spec_enabled:
                    yield from self._spec_families(prefix, labels, values)
            for name, value in self.extra.items():
                c = CounterMetricFamily(name, name.split(":", 1)[1].replace("_", " "), labels=labels)
                c.add_metric(values, value)
                yield c
            if self.lora is not None:
                yield from self.lora.families(self.model_name)
            if self.startup is not None:
                yield self._startup_phases(labels, values)
            if self.kv_transfer is not None:
                yield from self._kv_transfer_families(labels, values)

    def _startup_phases(self, labels: list[str], values: list[str]) -> GaugeMetricFamily:
        g = GaugeMetricFamily("kvmesh:startup_phase_seconds", "Seconds of each start-up phase "
                              "(fetch, kernel_build, weight_load, kv_alloc, warmup; 0: not run) "
                              "and total, process start to ready.", labels=labels + ["phase"])
        for phase, seconds in self.startup.series():
            g.add_metric(values + [phase], seconds)
        return g

    def _spec_families(self, prefix: str, labels: list[str], values: list[str]):
        for name, help_ in SPEC_COUNTERS.items():
            c = CounterMetricFamily(f"{prefix}:{name}", help_, labels=labels)
            c.add_metric(values, self.spec[name])
            yield c
        name, help_ = SPEC_PER_POS
        c = CounterMetricFamily(f"{prefix}:{name}", help_, labels=labels + ["position"])
        for pos, count in enumerate(self.spec_per_pos):
            c.add_metric(values + [str(pos)], count)
        yield c

    def render(self) -> bytes:
        return generate_latest(self.registry)
