"""Rank 0's side of tensor parallelism: start the workers, send each step, watch, shut down.

    launch():  validate the size against the model's config -> spawn ranks 1..N-1 -> wait for
               each to start -> rendezvous (rank 0 serves the TCPStore on a free loopback port)
               -> load rank 0's shard while the workers load theirs -> wait until all are Ready
    DriverRunner.execute():  per step, rank 0 replays block operations on its shard and sends
               them with the model input as one Step; every rank runs the forward pass, whose
               all-reduces keep them in lockstep; rank 0 gathers the logits and samples alone

A worker that dies is seen on its process sentinel (checked before every step and, while the
server idles, by `check`) and, mid-step, by the collective it leaves (gloo fails at once with
"connection closed by peer"): the step raises WorkerDiedError naming the rank and its exit
status, and the engine's failure path takes over. `shutdown` leaves no process behind.
"""
from __future__ import annotations

import logging
import os
import signal
import time
import weakref
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvmesh.common.config import EngineConfig
from kvmesh.engine.loader import LoadedModel, load_model, read_model_config, resolve_device
from kvmesh.engine.input_batch import BatchInput
from kvmesh.engine.model_input import ModelInput
from kvmesh.engine.model_runner import ModelRunner
from kvmesh.engine.parallel.group import DEFAULT_TIMEOUT_S, TPGroup
from kvmesh.engine.parallel.messages import InitCache, Ready, Shutdown, Started, Step, decode, encode
from kvmesh.engine.parallel.plan import validate_tensor_parallel
from kvmesh.engine.parallel.worker import run_worker
from kvmesh.engine.sched_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("kvmesh.engine.tp")

STARTUP_TIMEOUT_S = 600.0       # spawning, importing and loading a shard (large checkpoints)


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process exited; the engine cannot go on."""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class TPExecutor:
    """The worker processes of one tensor-parallel engine and rank 0's group."""

    def __init__(self, size: int, group: TPGroup, procs: list, conns: list[Connection]) -> None:
        self.size = size
        self.group = group
        self.procs = procs          # rank r is procs[r - 1]
        self.conns = conns
        self.worker_free_memory: list[int] = []
        self.failure: str | None = None
        self._finalizer = weakref.finalize(self, _stop_workers, procs, conns)

    # ---- start ---------------------------------------------------------------------------
    @classmethod
    def launch(cls, config: EngineConfig) -> tuple["TPExecutor", LoadedModel]:
        size = config.tensor_parallel_size
        validate_tensor_parallel(read_model_config(config.model), size)   # before any process
        device = resolve_device(config.device)
        threads = config.cpu_threads or max(1, (os.cpu_count() or 1) // size)
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"--tensor-parallel-size {size} needs {size} GPUs, "
                             f"{torch.cuda.device_count()} visible")
        timeout = DEFAULT_TIMEOUT_S
        store = dist.TCPStore("127.0.0.1", 0, size, True, wait_for_workers=False,
                              timeout=_td(timeout))
        ctx = mp.get_context("spawn")
        procs, conns = [], []
        executor = cls(size, TPGroup(0, size), procs, conns)
        try:
            for rank in range(1, size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=run_worker, name=f"kvmesh-tp-rank{rank}", daemon=True,
                                   args=(rank, size, store.port, config, threads, timeout, child))
                proc.start()
                child.close()
                procs.append(proc)
                conns.append(parent)
            executor._expect(Started, STARTUP_TIMEOUT_S)
            executor.group.connect("127.0.0.1", store.port, device, timeout, store=store)
            loaded = load_model(config.model, config.dtype, device, config.attention_backend,
                                config.tokenizer, tp=executor.group,
                                quantization=config.quantization)
            executor.worker_free_memory = [m.free_memory for m in executor._expect(Ready, STARTUP_TIMEOUT_S)]
        except BaseException:
            executor.shutdown()
            raise
        logger.info("tensor parallel: %d ranks (pids %s), %s, %d threads per rank", size,
                    [p.pid for p in procs], "NCCL" if device.type == "cuda" else "gloo", threads)
        return executor, loaded

    def _expect(self, kind: type, timeout_s: float) -> list:
        """One message of `kind` from every worker, in rank order; a worker that dies first
        raises WorkerDiedError."""
        got: dict[int, object] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(self.conns):
            pending = [c for r, c in enumerate(self.conns) if r not in got]
            ready = wait(pending + [p.sentinel for p in self.procs], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"tensor-parallel workers sent no {kind.__name__} within {timeout_s:.0f} s")
            for r, conn in enumerate(self.conns):
                if r not in got and conn in ready and conn.poll():
                    try:
                        msg = decode(conn.recv_bytes())
                    except EOFError:
                        self.check(wait_s=5.0)
                        raise WorkerDiedError(f"tensor-parallel worker rank {r + 1} closed its pipe") from None
                    if not isinstance(msg, kind):
                        raise RuntimeError(f"worker rank {r + 1} sent {type(msg).__name__}, "
                                           f"expected {kind.__name__}")
                    got[r] = msg
            self.check()
        return [got[r] for r in range(len(self.conns))]

    # ---- the KV cache --------------------------------------------------------------------
    def kv_free_memory(self, rank0_free: int, device: torch.device) -> int:
        """Memory each rank may spend on its KV shard: the least free on any rank; on CPU the
        ranks share the host's memory, so a rank gets 1/N of it."""
        free = min([rank0_free, *self.worker_free_memory])
        return free if device.type == "cuda" else free // self.size

    def make_runner(self, loaded: LoadedModel, block_size: int, num_gpu_blocks: int,
                    num_cpu_blocks: int, seed: int, cache_dtype: torch.dtype,
                    lora=None) -> "DriverRunner":
        """Every rank allocates the same number of blocks (each of its KV heads); rank 0's runner
        (`lora`: rank 0's LoRAManager with --enable-lora)."""
        self._send(encode(InitCache(num_gpu_blocks, num_cpu_blocks)))
        mc = loaded.config
        return DriverRunner(self, loaded.model, mc.num_hidden_layers, loaded.plan.local_kv_heads,
                            mc.head_dim, block_size, num_gpu_blocks, num_cpu_blocks,
                            cache_dtype, loaded.device, seed=seed, lora=lora)

    # ---- steps ---------------------------------------------------------------------------
    def send_step(self, step: Step) -> None:
        self._send(encode(step))

    def _send(self, data: bytes) -> None:
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, ConnectionResetError, OSError) as e:
                self.check(wait_s=2.0)
                raise WorkerDiedError(f"tensor-parallel worker rank {rank} stopped reading: {e!r}") from e

    def check(self, wait_s: float = 0.0) -> None:
        """WorkerDiedError if a worker has exited (waiting up to `wait_s` for one to)."""
        if self.failure is None:
            dead = wait([p.sentinel for p in self.procs], wait_s) if self.procs else []
            for rank, proc in enumerate(self.procs, start=1):
                if proc.sentinel in dead:
                    proc.join(5.0)          # the sentinel fires as it exits: reap its status
                    self.failure = (f"tensor-parallel worker rank {rank} (pid {proc.pid}) "
                                    f"{_describe_exit(proc.exitcode)}")
                    logger.error("%s; the engine cannot go on", self.failure)
                    break
        if self.failure is not None:
            raise WorkerDiedError(self.failure)

    # ---- stop ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every worker (asked, then terminated, then killed); idempotent."""
        self.group.close()
        self._finalizer()


def _stop_workers(procs: list, conns: list[Connection], grace_s: float = 5.0) -> None:
    for conn in conns:
        try:
            conn.send_bytes(encode(Shutdown()))
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)
    for conn in conns:
        conn.close()


def _td(seconds: float):
    import datetime  # noqa: PLC0415
    return datetime.timedelta(seconds=seconds)


class DriverRunner(ModelRunner):
    """Rank 0's runner: each step's block operations and model input go to every worker as
    one Step before rank 0 runs its own shard; sampling happens here only."""

    def __init__(self, executor: TPExecutor, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.executor = executor
        self._pending_ops: list[tuple[str, int, int]] = []   # applied here, not yet sent

    def apply_block_ops(self, ops, loads=()) -> None:
        if loads:
            raise RuntimeError("remote KV loads are not supported with tensor parallelism")
        self._pending_ops.extend(ops)
        super().apply_block_ops(ops)

    def run_model(self, step: BatchInput | ModelInput):
        ops, self._pending_ops = self._pending_ops, []
        sent = step.to_model_input() if isinstance(step, BatchInput) else step
        writes = []
        if self.lora is not None and self.lora.slot_writes:
            writes = [(slot, r.lora_name, r.lora_int_id, r.lora_path)
                      for slot, r in self.lora.slot_writes]
            self.lora.slot_writes = []
        self.executor.send_step(Step(ops, sent, writes))
        return super().run_model(step)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.executor.check()
        try:
            result = super().execute(out)
            if self._pending_ops:           # a step with block operations and nothing to run
                ops, self._pending_ops = self._pending_ops, []
                self.executor.send_step(Step(ops, None))
        except WorkerDiedError:
            raise
        except Exception:
            # NOTE: a collective that failed because a peer died: name the worker, not gloo.
            self.executor.check(wait_s=2.0)
            raise
        return result

    def block_data(self, block: int) -> bytes:
        raise RuntimeError("sharing KV bytes across pods is not supported with tensor parallelism")
