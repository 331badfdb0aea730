"""Multi-LoRA throughput: many adapters in one batch against the base model alone, kvmesh beside
vLLM's CPU build with `--enable-lora`, on the same adapters and requests, in one run.

    python benchmarks/lora_throughput.py --systems kvmesh,vllm --dtype bfloat16 --threads 2
    python benchmarks/lora_throughput.py --adapters 8 --ranks 16 --popularity uniform,skewed

Adapters: PEFT LoRA adapters made by `peft` itself (random A and B, `init_lora_weights=False`)
on the model's HF directory (the built-in GGUF exported once, `kvmesh.engine.hf_export`), every
projection of every layer adapted (q/k/v/o and gate/up/down: the most work an adapter can add),
written once under `--adapter-cache` and reused.

Requests: the offline benchmark's decode-heavy list (64 requests, prompts 32-256, outputs
64-256 tokens, real text, seeded), greedy, ignoring EOS, exactly that many tokens each, all
queued at once. Each case gives every request an adapter:

  uniform   adapter i of K for request i, in a seeded shuffled order (all K in the batch)
  skewed    drawn with Zipf weights 1/(i+1) (the first adapters take most requests, the tail
            a few: the popularity a platform with one big customer sees)

Cases: every combination of `--adapters` (K: adapters loaded and allowed in one batch,
`--max-loras K`), `--ranks` and `--popularity`; each K runs on an engine of its own started with
`--max-loras K --max-cpu-loras K --max-lora-rank max(--ranks)`. Before a case is timed one short
request per adapter runs (every adapter read and in a slot: the timed run measures batching, not
file reads). The base alone runs on an engine without `--enable-lora`: that is the throughput
the goal compares with (issue: >= 0.8x of it with 8 adapters in one batch).

vLLM runs in its own venv and process (benchmarks/peer.py, benchmarks/vllm_peer.py): one
process for the base and one per K, with the same `max_loras`, `max_lora_rank`, `max_cpu_loras`,
adapters (`LoRARequest(name, id, path)`), requests and warm-up.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

if __package__ in (None, ""):
    # NOTE: run as a script: make `benchmarks` importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.models import RANDOM_MODELS, resolve_model  # noqa: E402
from benchmarks.offline_throughput import BenchRequest, agreement, describe_machine  # noqa: E402
from benchmarks.workload import WORKLOADS, make_prompt_ids, uniform_requests  # noqa: E402

POPULARITY = ("uniform", "skewed")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SYSTEMS = ("kvmesh", "vllm")


@dataclass(frozen=True, slots=True)
class Case:
    adapters: int          # K: adapters loaded, all allowed in one batch
    rank: int
    popularity: str

    @property
    def name(self) -> str:
        return f"{self.adapters} adapters r{self.rank} {self.popularity}"


@dataclass(slots=True)
class Timing:
    wall_s: float
    cpu_s: float
    outputs: list[list[int]]


# ------------------------------------------------------------------------------- workload
def assign_adapters(n_requests: int, k: int, popularity: str, seed: int) -> list[int]:
    """The adapter index (0..k-1) of each request."""
    if k < 1 or n_requests < 1:
        raise ValueError(f"need k >= 1 adapters and >= 1 request, got k={k}, n={n_requests}")
    rng = np.random.default_rng(seed)
    if popularity == "uniform":
        order = rng.permutation(k)
        return [int(order[i % k]) for i in range(n_requests)]
    if popularity == "skewed":
        w = 1.0 / np.arange(1, k + 1)
        return [int(i) for i in rng.choice(k, size=n_requests, p=w / w.sum())]
    raise ValueError(f"popularity must be one of {', '.join(POPULARITY)}, got {popularity!r}")


def adapter_name(rank: int, i: int) -> str:
    return f"r{rank}-{i:02d}"


def make_adapters(base_hf_dir: Path, root: Path, rank: int, count: int, seed: int = 0) -> dict[str, Path]:
    """`count` rank-`rank` adapters on the base, made by peft (once; reused when present)."""
    paths = {adapter_name(rank, i): root / f"{Path(base_hf_dir).name}-{adapter_name(rank, i)}"
             for i in range(count)}
    missing = [(i, p) for i, p in enumerate(paths.values()) if not (p / "adapter_config.json").is_file()]
    if missing:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(str(base_hf_dir), dtype=torch.float32)
        for i, path in missing:
            torch.manual_seed(seed * 1000 + rank * 100 + i)
            cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS,
                             init_lora_weights=False, lora_dropout=0.0, bias="none",
                             task_type="CAUSAL_LM")
            peft_model = get_peft_model(base, cfg)
            tmp = path.with_name(path.name + f".tmp{os.getpid()}")
            peft_model.save_pretrained(str(tmp))
            os.replace(tmp, path)          # whole or absent: a killed run leaves only a .tmp
            base = peft_model.unload()
    return paths


def build_requests(tokenizer, workload: str, seed: int, num_requests: int) -> list[BenchRequest]:
    work = uniform_requests(workload, seed=seed)
    if num_requests:
        work = work[:num_requests]
    rng = np.random.default_rng(seed)
    return [BenchRequest(make_prompt_ids(tokenizer, w.prompt_len, rng), w.output_len) for w in work]


# ------------------------------------------------------------------------------- kvmesh
def _load(model_path, args):
    from kvmesh.engine.loader import load_model

    return load_model(model_path, dtype=args.dtype, device="cpu", tokenizer_path=args.tokenizer)


def _kvmesh_engine(loaded, args, k: int | None, max_rank: int):
    """An engine on `loaded` (with --enable-lora its sites are attached to that model: each K
    gets a model of its own)."""
    from kvmesh.common.config import EngineConfig
    from kvmesh.engine.engine import LLMEngine

    block = 16
    need = sum(-(-(len(r.prompt_ids) + r.output_len) // block) for r in args.requests) + len(args.requests)
    lora = {} if k is None else {"enable_lora": True, "max_loras": k, "max_cpu_loras": k,
                                 "max_lora_rank": max_rank}
    cfg = EngineConfig(num_kv_blocks=max(need, 64), max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, block_size=block,
                       swap_space=0.0, dtype=args.dtype, device="cpu", **lora)
    return LLMEngine(cfg, loaded=loaded)


def _kvmesh_run(engine, reqs: list[BenchRequest], loras: list | None, tag: str) -> Timing:
    from kvmesh.engine.sampling_params import SamplingParams

    t0, c0 = time.perf_counter(), time.process_time()
    for i, r in enumerate(reqs):
        sp = SamplingParams(temperature=0.0, max_tokens=r.output_len, min_tokens=r.output_len,
                            ignore_eos=True)
        engine.add_request(f"{tag}{i}", r.prompt_ids, sp,
                           lora_request=None if loras is None else loras[i])
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return Timing(wall, cpu, [done[f"{tag}{i}"] for i in range(len(reqs))])


def _warmup(reqs: list[BenchRequest], n: int) -> list[BenchRequest]:
    return [BenchRequest(reqs[i % len(reqs)].prompt_ids[:16], 2) for i in range(n)]


def run_kvmesh(model_path, base, args, cases: list[Case], adapters: dict[str, Path]) -> dict[str, Timing]:
    """`base`: the model loaded once (its tokenizer built the requests), served without LoRA."""
    from kvmesh.engine.lora import LoRARequest

    max_rank = max(c.rank for c in cases)
    results: dict[str, Timing] = {}
    engine = _kvmesh_engine(base, args, None, max_rank)
    try:
        _kvmesh_run(engine, _warmup(args.requests, 4), None, "warm")
        engine.reset_prefix_cache()
        results["base"] = _kvmesh_run(engine, args.requests, None, "base")
        _report("kvmesh", "base", results["base"])
    finally:
        engine.shutdown()
    for k, group in itertools.groupby(sorted(cases, key=lambda c: c.adapters), key=lambda c: c.adapters):
        engine = _kvmesh_engine(_load(model_path, args), args, k, max_rank)
        ids = {name: i + 1 for i, name in enumerate(adapters)}
        try:
            for case in group:
                names = [adapter_name(case.rank, i) for i in range(case.adapters)]
                loras = {n: LoRARequest(n, ids[n], str(adapters[n])) for n in names}
                _kvmesh_run(engine, _warmup(args.requests, len(names)), [loras[n] for n in names], "warm")
                engine.reset_prefix_cache()
                picks = assign_adapters(len(args.requests), case.adapters, case.popularity, args.seed)
                results[case.name] = _kvmesh_run(engine, args.requests, [loras[names[i]] for i in picks], "r")
                _report("kvmesh", case.name, results[case.name])
        finally:
            engine.shutdown()
    return results


# ------------------------------------------------------------------------------- vLLM
def run_vllm(hf_dir: Path, args, cases: list[Case], adapters: dict[str, Path]) -> dict[str, Timing]:
    from benchmarks import peer

    venv = Path(args.vllm_venv).expanduser()
    if not args.vllm_command:
        peer.ensure_venv(venv)
    env, warnings = peer.peer_env(None if args.vllm_command else venv, args.threads or os.cpu_count() or 1,
                                  args.vllm_kv_cache_gib)
    for w in warnings:
        print(f"# vllm: {w}", flush=True)
    command = peer.peer_command(venv, args.vllm_command)
    longest = max(len(r.prompt_ids) + r.output_len for r in args.requests)
    common = {"model": str(hf_dir), "dtype": args.dtype, "seed": args.seed,
              "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
              "max_model_len": max(2048, -(-longest // 256) * 256)}
    as_json = [{"prompt_ids": r.prompt_ids, "max_tokens": r.output_len} for r in args.requests]
    results: dict[str, Timing] = {}
    base = peer.run_peer(command, {**common, "warmup": [{"prompt_ids": r.prompt_ids, "max_tokens": r.output_len}
                                                        for r in _warmup(args.requests, 4)],
                                   "requests": as_json}, env, args.vllm_timeout)
    results["base"] = Timing(base.wall_s, base.cpu_s, base.outputs)
    _report("vllm", "base", results["base"])
    max_rank = max(c.rank for c in cases)
    ids = {name: i + 1 for i, name in enumerate(adapters)}
    for k, group in itertools.groupby(sorted(cases, key=lambda c: c.adapters), key=lambda c: c.adapters):
        group = list(group)
        spec = {**common, "requests": [],
                "lora": {"max_loras": k, "max_cpu_loras": k, "max_lora_rank": max_rank,
                         "adapters": {n: {"id": ids[n], "path": str(p)} for n, p in adapters.items()}},
                "cases": []}
        for case in group:
            names = [adapter_name(case.rank, i) for i in range(case.adapters)]
            picks = assign_adapters(len(args.requests), case.adapters, case.popularity, args.seed)
            spec["cases"].append({
                "name": case.name,
                "warmup": [{"prompt_ids": r.prompt_ids, "max_tokens": r.output_len, "lora": n}
                           for r, n in zip(_warmup(args.requests, len(names)), names)],
                "requests": [{**r, "lora": names[i]} for r, i in zip(as_json, picks)]})
        for name, res in run_lora_peer(command, spec, env, args.vllm_timeout).items():
            results[name] = res
            _report("vllm", name, res)
    return results


def run_lora_peer(command: list[str], spec: dict, env: dict[str, str], timeout_s: float) -> dict[str, Timing]:
    """The peer's LoRA mode: one process, one engine, every case of one K (vllm_peer.run_lora)."""
    import subprocess
    import tempfile

    from benchmarks import peer

    with tempfile.TemporaryDirectory(prefix="kvmesh-lora-peer-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(spec))
        log = Path(tmp) / "log"
        with open(log, "w") as f:
            try:
                done = subprocess.run([*command, str(req), str(res)], env=env, stdout=f,
                                      stderr=subprocess.STDOUT, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise peer.PeerError(f"the LoRA peer ran past {timeout_s:.0f} s") from None
        if done.returncode != 0 or not res.is_file():
            raise peer.PeerError(f"the LoRA peer failed ({done.returncode}):\n{log.read_text()[-3000:]}")
        raw = json.loads(res.read_text())
    out: dict[str, Timing] = {}
    by_name = {c["name"]: c for c in spec["cases"]}
    for case in raw.get("cases", []):
        checked = peer.parse_result(case, by_name[case["name"]]["requests"])
        out[case["name"]] = Timing(checked.wall_s, checked.cpu_s, checked.outputs)
    if set(out) != set(by_name):
        raise peer.PeerError(f"the LoRA peer answered cases {sorted(out)}, asked for {sorted(by_name)}")
    return out


# ------------------------------------------------------------------------------- report
def _report(system: str, case: str, t: Timing) -> None:
    print(f"# {system} {case}: {t.wall_s:.1f} s wall, {t.cpu_s:.1f} s CPU; load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)


def table(results: dict[str, dict[str, Timing]], cases: list[Case], n_out: int,
          distinct: dict[str, int]) -> list[str]:
    systems = list(results)
    head = "| case | adapters in the batch | " + " | ".join(
        f"{s} tok/s | {s} vs base" for s in systems)
    lines = [head, "|---|---:|" + "---:|---:|" * len(systems)]
    for name in ["base", *[c.name for c in cases]]:
        row = f"| {name} | {distinct.get(name, 0)} |"
        for s in systems:
            t = results[s].get(name)
            if t is None:
                row += " - | - |"
                continue
            base = results[s]["base"]
            row += f" {n_out / t.wall_s:.1f} | {base.wall_s / t.wall_s:.2f}x |"
        lines.append(row)
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--systems", default="kvmesh,vllm", help=f"any of {','.join(SYSTEMS)}")
    p.add_argument("--adapters", default="8,32", help="K values: adapters in one batch (comma list)")
    p.add_argument("--ranks", default="8,16", help="adapter ranks (comma list)")
    p.add_argument("--popularity", default="uniform,skewed", help=f"any of {','.join(POPULARITY)}")
    p.add_argument("--workload", default="decode-heavy", choices=tuple(WORKLOADS))
    p.add_argument("--num-requests", type=int, default=0, help="first N requests (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--model", default="builtin", help=f"builtin, {', '.join(RANDOM_MODELS)} or an HF directory")
    p.add_argument("--tokenizer", type=Path, default=None, metavar="DIR")
    p.add_argument("--model-cache", default=str(Path(__file__).resolve().parent / "results" / "models"))
    p.add_argument("--adapter-cache", default=str(Path(__file__).resolve().parent / "results" / "loras"),
                   help="where the adapters are written once")
    p.add_argument("--vllm-venv", default=None, help="vLLM's venv (default: $KVMESH_VLLM_VENV or "
                   "~/.cache/kvmesh/vllm-venv)")
    p.add_argument("--vllm-command", default=None, help="run this instead of vllm_peer.py (tests)")
    p.add_argument("--vllm-kv-cache-gib", type=int, default=2)
    p.add_argument("--vllm-timeout", type=float, default=3600.0)
    args = p.parse_args(argv)

    def csv(text: str) -> list[str]:
        return [x.strip() for x in text.split(",") if x.strip()]
    systems = csv(args.systems)
    if not systems or any(s not in SYSTEMS for s in systems):
        p.error(f"--systems: choose from {', '.join(SYSTEMS)}")
    pops = csv(args.popularity)
    if not pops or any(x not in POPULARITY for x in pops):
        p.error(f"--popularity: choose from {', '.join(POPULARITY)}")
    try:
        ks, ranks = [int(x) for x in csv(args.adapters)], [int(x) for x in csv(args.ranks)]
    except ValueError:
        p.error("--adapters and --ranks take comma lists of integers")
    if not ks or not ranks or min(ks) < 1 or min(ranks) < 1:
        p.error("--adapters and --ranks need integers >= 1")
    if args.vllm_venv is None:
        from benchmarks.peer import default_venv
        args.vllm_venv = str(default_venv())
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)

    from kvmesh.engine.hf_export import builtin_hf_dir
    model_path = resolve_model(args.model, Path(args.model_cache), args.tokenizer)
    hf_dir = builtin_hf_dir(args.dtype) if model_path is None else Path(model_path)
    peft_base = builtin_hf_dir("float32") if model_path is None else Path(model_path)
    base = _load(model_path, args)
    args.requests = build_requests(base.tokenizer, args.workload, args.seed, args.num_requests)

    cases = [Case(k, r, pop) for k in ks for r in ranks for pop in pops]
    adapters: dict[str, Path] = {}
    for r in ranks:
        adapters.update(make_adapters(peft_base, Path(args.adapter_cache), r, max(ks), args.seed))
    distinct = {c.name: len(set(assign_adapters(len(args.requests), c.adapters, c.popularity, args.seed)))
                for c in cases}
    n_out = sum(r.output_len for r in args.requests)
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  {describe_machine()}")
    print(f"# load average at start: {os.getloadavg()}")
    print(f"# model: {args.model} ({hf_dir}), {args.dtype}; {len(args.requests)} requests "
          f"({args.workload}, seed {args.seed}): {sum(len(r.prompt_ids) for r in args.requests)} prompt "
          f"and {n_out} output tokens; adapters on {', '.join(LORA_TARGETS)}", flush=True)

    results: dict[str, dict[str, Timing]] = {}
    for s in systems:
        results[s] = (run_kvmesh(model_path, base, args, cases, adapters) if s == "kvmesh"
                      else run_vllm(hf_dir, args, cases, adapters))
    print()
    print("\n".join(table(results, cases, n_out, distinct)))
    if "kvmesh" in results and "vllm" in results:
        print()
        for name in ["base", *[c.name for c in cases]]:
            a, b = results["kvmesh"][name], results["vllm"][name]
            print(f"{name}: kvmesh / vllm {b.wall_s / a.wall_s:.2f}x output tok/s; greedy outputs "
                  f"identical for {agreement(a.outputs, b.outputs)} requests")
    print(f"# load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
