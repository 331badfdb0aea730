"""Speculative decoding: (a) batch-1 inter-token latency, (b) offline throughput at batch 1, 8, 64,
each with and without speculation, kvmesh and (optionally) vLLM's CPU build side by side.

    python benchmarks/spec_decode.py                        # built-in model, kvmesh, both parts
    python benchmarks/spec_decode.py --systems kvmesh,vllm --batch-sizes 1,8,64
    python benchmarks/spec_decode.py --systems kvmesh,vllm --parts latency --workloads verbatim
    python benchmarks/spec_decode.py --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'

(a) latency, two workloads, each request alone in the engine (batch 1), greedy, up to
--max-tokens (stopping at EOS):
  copy   the answer copies from the prompt (repeat a code snippet / a paragraph with one edit):
         prompt lookup's territory
  verbatim  copy a paragraph word for word: the model really copies (most drafts accepted)
  free   open-ended questions: few drafts match, the adaptive back-off should keep the cost small
For each workload and mode (off, spec) it reports the mean inter-token latency (decode time /
(tokens - 1): the first token's prefill excluded), decode tok/s, and with speculation the mean
acceptance length (1 + accepted / verifications: tokens per speculative step) and the draft
acceptance rate.

(b) throughput (--batch-sizes): B requests cycling through the copy prompts, all submitted
together (offline), greedy, exactly --throughput-max-tokens each (EOS ignored); tok/s = output
tokens / wall time of the whole batch.

Greedy output of both modes is compared token by token (it must be identical). With
`--systems kvmesh,vllm` the same prompt token ids and the same `--speculative-config` go to vLLM's
CPU build in its own venv (benchmarks/peer.py, benchmarks/vllm_peer.py: one engine start per
mode), and both run the built-in model's float32 HF directory (vLLM cannot read the GGUF);
kvmesh-only runs use --model as given. Each of kvmesh's modes also runs in a fresh process
(`--no-isolate`: both in this one), as vLLM's do: in one process the engine built second ran
~10 % dearer steps, whichever mode it was (docs/BENCHMARKS.md); `--mode-order spec,off` swaps them. `disable_by_batch_size` is kvmesh-only (vLLM 0.32 has no
such key): it is left out of vLLM's config.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.models import RANDOM_MODELS, resolve_model  # noqa: E402

_CODE = '''def merge(intervals):
    intervals.sort(key=lambda iv: iv[0])
    out = [intervals[0]]
    for start, end in intervals[1:]:
        if start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out
'''
_TEXT = ("The harbour town wakes before dawn. Fishing boats leave the quay one by one, their "
         "lamps swinging over the black water, and the bakery on the corner opens its shutters "
         "to the smell of bread. By seven the market is full: crates of mackerel, baskets of "
         "lemons, old men arguing about the weather.")

_TEXT2 = ("Our library opens at nine on weekdays and at ten on Saturdays. Members may borrow up to "
          "eight books for three weeks, and renew them twice online. Study rooms on the second "
          "floor can be booked at the front desk; please keep them quiet and leave them tidy.")

WORKLOADS = {
    "copy": [
        f"Here is a Python function:\n\n{_CODE}\nRewrite it exactly, renaming `out` to `merged`:\n\n",
        f"{_TEXT}\n\nRepeat the paragraph above word for word, but say 'village' instead of "
        "'town':\n\n",
        f"{_CODE}\nCopy the function above unchanged:\n\n",
    ],
    # NOTE: SmolLM2-135M rewrites rather than copies on most "copy" prompts (a quarter to two
    # fifths of the drafts accepted); these two it copies (nearly) word for word, the ceiling
    # prompt lookup reaches with this model
    "verbatim": [
        f"Copy this text exactly, word for word:\n\n{_TEXT}",
        f"Copy this text exactly, word for word:\n\n{_TEXT2}",
    ],
    "free": [
        "Write a short poem about the sea.",
        "Explain why the sky is blue in three sentences.",
        "Give me three ideas for a birthday party.",
    ],
}


# keys of --speculative-config that vLLM's CPU build (0.32) refuses: left out of its config
KVMESH_ONLY_KEYS = ("disable_by_batch_size",)


def _run_one(engine, rid: str, prompt_ids: list[int], max_tokens: int) -> dict:
    from kvmesh.engine.sampling_params import SamplingParams
    engine.add_request(rid, prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    t_first = t_end = None
    drafts = draft_tokens = accepted = 0
    tokens: list[int] = []
    # decode steps after the first token, by kind: [steps, seconds] with drafts / without
    steps = {"drafted": [0, 0.0], "plain": [0, 0.0]}
    decode_steps = 0
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        s = engine.last_stats
        drafts += s.spec_num_drafts
        draft_tokens += s.spec_num_draft_tokens
        accepted += s.spec_num_accepted_tokens
        decode_steps += t_first is not None
        if t_first is not None:
            kind = steps["drafted" if s.spec_num_drafts else "plain"]
            kind[0] += 1
            kind[1] += now - t0
        for out in outs:
            if out.outputs[0].delta_token_ids and t_first is None:
                t_first = now
            if out.finished:
                tokens = out.outputs[0].token_ids
                t_end = now
    return {"tokens": tokens, "decode_s": t_end - t_first, "drafts": drafts,
            "draft_tokens": draft_tokens, "accepted": accepted, "steps": steps,
            "decode_steps": decode_steps}


def _run_batch(engine, name: str, reqs: list[dict]) -> dict:
    """Every request queued at once, stepped to completion: outputs, wall time, spec counts."""
    from kvmesh.engine.sampling_params import SamplingParams
    for i, r in enumerate(reqs):
        engine.add_request(f"{name}-{i}", r["prompt_ids"], SamplingParams(
            temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True))
    outputs: dict[str, list[int]] = {}
    drafts = draft_tokens = accepted = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        s = engine.last_stats
        drafts += s.spec_num_drafts
        draft_tokens += s.spec_num_draft_tokens
        accepted += s.spec_num_accepted_tokens
    wall = time.perf_counter() - t0
    return {"name": name, "outputs": [outputs[f"{name}-{i}"] for i in range(len(reqs))],
            "wall_s": wall, "drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted}


@dataclass(slots=True)
class Workload:
    latency: dict[str, list[list[int]]]         # workload name -> prompt token ids
    batches: dict[str, list[dict]]              # batch size -> [{"prompt_ids", "max_tokens"}]
    warmup: list[int]                           # a short prompt each engine runs first


def build_workload(tokenizer, args) -> Workload:
    """The prompts as token ids (in the chat template unless --no-chat), shared by both systems."""
    def ids(text: str) -> list[int]:
        if args.chat:
            return list(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        return list(tokenizer.encode(text))
    latency = {name: [ids(p) for p in prompts] for name, prompts in WORKLOADS.items()
               if name in args.workloads}
    copy = [ids(p) for p in WORKLOADS["copy"]]
    batches = {str(b): [{"prompt_ids": copy[i % len(copy)], "max_tokens": args.throughput_max_tokens}
                        for i in range(b)] for b in args.batch_sizes}
    return Workload(latency, batches, ids(WORKLOADS["free"][0])[:8])


def run_kvmesh(args, model: str | None, work: Workload, spec: dict | None) -> dict:
    from kvmesh.common.config import EngineConfig
    from kvmesh.engine.engine import LLMEngine
    engine = LLMEngine(EngineConfig(model=model, dtype=args.dtype, device="cpu",
                                    cpu_threads=args.threads, num_kv_blocks=args.num_kv_blocks,
                                    max_num_seqs=max([*args.batch_sizes, 1]),
                                    enable_prefix_caching=False, speculative_config=spec))
    _run_one(engine, "warmup", work.warmup, 8)
    out: dict = {"latency": {}, "batches": []}
    if "latency" in args.parts:
        for name, prompts in work.latency.items():
            out["latency"][name] = [_run_one(engine, f"{name}-{i}", p, args.max_tokens)
                                    for i, p in enumerate(prompts)]
    if "throughput" in args.parts:
        out["batches"] = [_run_batch(engine, f"b{b}", reqs) for b, reqs in work.batches.items()]
    return out


def run_kvmesh_isolated(args, model: str | None, work: Workload, spec: dict | None) -> dict:
    """run_kvmesh in a fresh process, as each of vLLM's runs is (one engine start per mode):
    an engine built in a process where another had run measured ~10 % dearer steps here than
    the first (docs/BENCHMARKS.md, "Speculative decoding"), whichever mode it was."""
    import multiprocessing
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(run_kvmesh, (args, model, work, spec))


def run_vllm(args, hf_dir: str, work: Workload, spec: dict | None) -> dict:
    from benchmarks import peer
    venv = Path(args.vllm_venv).expanduser()
    if not args.vllm_command:
        peer.ensure_venv(venv)
    vllm_spec = None if spec is None else {k: v for k, v in spec.items()
                                           if k not in KVMESH_ONLY_KEYS}
    dropped = sorted(set(spec or ()) & set(KVMESH_ONLY_KEYS))
    if dropped:
        print(f"# vllm: {', '.join(dropped)} left out of vLLM's --speculative-config (vLLM 0.32's "
              "SpeculativeConfig has no such key): vLLM speculates at every batch size",
              flush=True)
    reqs = [r for rs in work.batches.values() for r in rs]
    longest = max([len(p) for ps in work.latency.values() for p in ps]
                  + [len(r["prompt_ids"]) for r in reqs]) + max(args.max_tokens,
                                                                args.throughput_max_tokens)
    request = {
        "model": hf_dir, "dtype": args.dtype, "seed": 0,
        "max_num_seqs": max([*args.batch_sizes, 1]), "max_num_batched_tokens": 2048,
        "max_model_len": max(2048, -(-longest // 256) * 256),
        "warmup": [{"prompt_ids": work.warmup, "max_tokens": 8}],
        "requests": [],
        "spec_decode": {
            "speculative_config": vllm_spec,
            "latency": ([{"prompt_ids": p, "max_tokens": args.max_tokens}
                         for ps in work.latency.values() for p in ps]
                        if "latency" in args.parts else []),
            "batches": ([{"name": f"b{b}", "requests": rs} for b, rs in work.batches.items()]
                        if "throughput" in args.parts else []),
        },
    }
    threads = args.threads or os.cpu_count() or 1
    env, warnings = peer.peer_env(None if args.vllm_command else venv, threads,
                                  args.vllm_kv_cache_gib)
    for w in warnings:
        print(f"# vllm: {w}", flush=True)
    raw = peer.run_peer_json(peer.peer_command(venv, args.vllm_command), request, env,
                             args.vllm_timeout, Path(args.vllm_log) if args.vllm_log else None)
    if not isinstance(raw, dict) or not isinstance(raw.get("latency"), list):
        raise peer.PeerError(f"the peer's spec_decode result is malformed: {str(raw)[:300]}")
    lat = iter(raw["latency"])
    note = " ".join(x for x in (raw.get("note", ""), dropped and
                                f"{', '.join(dropped)} left out (no such key in vLLM)") if x)
    out = {"latency": {}, "batches": raw.get("batches", []), "note": note}
    if "latency" in args.parts:
        out["latency"] = {name: [next(lat) for _ in ps] for name, ps in work.latency.items()}
    return out


def summarise(runs: list[dict]) -> dict:
    tokens = sum(len(r["tokens"]) - 1 for r in runs)
    seconds = sum(r["decode_s"] for r in runs)
    drafts = sum(r["drafts"] for r in runs)
    out = {"itl_ms": 1000 * seconds / max(tokens, 1), "decode_tok_s": tokens / max(seconds, 1e-9),
           "tokens": tokens}
    out.update(_acceptance(runs))
    if runs and all("decode_steps" in r for r in runs):    # both systems: per step, not token
        steps = sum(r["decode_steps"] for r in runs)
        out["decode_steps"] = steps
        out["tokens_per_step"] = tokens / max(steps, 1)
        out["step_ms"] = 1000 * seconds / max(steps, 1)
    if all("steps" in r for r in runs):       # kvmesh: the mean step with and without drafts
        for kind in ("drafted", "plain"):
            n = sum(r["steps"][kind][0] for r in runs)
            if n:
                out[f"{kind}_step_ms"] = 1000 * sum(r["steps"][kind][1] for r in runs) / n
                out[f"{kind}_steps"] = n
    return out if drafts else {k: v for k, v in out.items() if not k.startswith("accept")}


def _acceptance(runs: list[dict]) -> dict:
    drafts = sum(r["drafts"] for r in runs)
    if not drafts:
        return {}
    acc = sum(r["accepted"] for r in runs)
    return {"verifications": drafts, "accepted_tokens": acc,
            "acceptance_length": 1 + acc / drafts,
            "acceptance_rate": acc / max(sum(r["draft_tokens"] for r in runs), 1)}


def summarise_batch(b: dict) -> dict:
    tokens = sum(len(o) for o in b["outputs"])
    return {"tok_s": tokens / b["wall_s"], "wall_s": b["wall_s"], "tokens": tokens,
            **_acceptance([b])}


def report(args, results: dict[str, dict[str, dict]], spec: dict) -> dict:
    """Print the tables; the JSON report (per system, per mode)."""
    from kvmesh.kernels import gemm_rows
    rep: dict = {"config": spec, "max_tokens": args.max_tokens,
                 "throughput_max_tokens": args.throughput_max_tokens, "systems": {},
                 "gemm_min_rows": gemm_rows.MIN_ROWS}
    if "kvmesh" in results:
        # NOTE: the row floor moves kvmesh's plain (1-row) steps against its drafted ones: say
        # which one ran (KVMESH_GEMM_MIN_ROWS=1 for the unpadded GEMMs)
        print(f"# kvmesh: oneDNN GEMMs of fewer than {gemm_rows.MIN_ROWS} rows run as "
              f"{gemm_rows.MIN_ROWS} rows ({gemm_rows.ENV}={gemm_rows.MIN_ROWS}"
              f"{'' if gemm_rows.MIN_ROWS > 1 else ': no padding'})")
    for system, modes in results.items():
        off, on = modes["off"], modes["spec"]
        sysrep: dict = {"latency": {}, "throughput": {}, "note": on.get("note", "")}
        if on["latency"]:
            print(f"\n# {system}: batch-1 latency (max_tokens {args.max_tokens})")
            print(f"{'workload':8} {'mode':5} {'ITL ms':>8} {'tok/s':>8} {'accept len':>10} "
                  f"{'accept %':>9} {'speedup':>8} identical")
        for name in on["latency"]:
            b, f = summarise(off["latency"][name]), summarise(on["latency"][name])
            same = all(x["tokens"] == y["tokens"]
                       for x, y in zip(off["latency"][name], on["latency"][name]))
            sysrep["latency"][name] = {"off": b, "spec": f, "greedy_identical": same}
            print(f"{name:8} {'off':5} {b['itl_ms']:8.2f} {b['decode_tok_s']:8.1f}")
            print(f"{name:8} {'spec':5} {f['itl_ms']:8.2f} {f['decode_tok_s']:8.1f} "
                  f"{f.get('acceptance_length', 1.0):10.2f} "
                  f"{100 * f.get('acceptance_rate', 0.0):8.1f}% "
                  f"{b['itl_ms'] / f['itl_ms']:7.2f}x {same}")
            if "step_ms" in f and "step_ms" in b:
                # NOTE: the ITL gain is tokens per step x (step off / mean step with drafts)
                print(f"{'':8} {f['tokens_per_step']:.2f} tokens per step; mean step "
                      f"{f['step_ms']:.2f} ms with speculation, {b['step_ms']:.2f} ms without "
                      f"({b['step_ms'] / f['step_ms']:.2f}x)")
            if "drafted_step_ms" in f:
                # kvmesh: a verify step's cost against a plain one, in the same engine
                print(f"{'':8} steps: {f['drafted_steps']} drafted at {f['drafted_step_ms']:.2f} "
                      f"ms, {f.get('plain_steps', 0)} plain at {f.get('plain_step_ms', 0):.2f} "
                      f"ms")
        if on["batches"]:
            print(f"\n# {system}: offline throughput ({args.throughput_max_tokens} tokens each)")
            print(f"{'batch':>6} {'off tok/s':>10} {'spec tok/s':>10} {'ratio':>7} "
                  f"{'accept len':>10} identical")
        for bo, bs in zip(off["batches"], on["batches"]):
            so, ss = summarise_batch(bo), summarise_batch(bs)
            same = bo["outputs"] == bs["outputs"]
            sysrep["throughput"][bo["name"]] = {"off": so, "spec": ss, "greedy_identical": same}
            print(f"{bo['name'][1:]:>6} {so['tok_s']:10.1f} {ss['tok_s']:10.1f} "
                  f"{ss['tok_s'] / so['tok_s']:6.2f}x {ss.get('acceptance_length', 1.0):10.2f} "
                  f"{same}")
        rep["systems"][system] = sysrep
    if len(results) > 1 and all(m["spec"]["latency"] for m in results.values()):
        print("\n# side by side, speculation on: ITL ms per workload, tok/s at each batch")
        for system, modes in results.items():
            lat = " ".join(f"{n} {summarise(r)['itl_ms']:7.2f} "
                           for n, r in modes["spec"]["latency"].items())
            tput = " ".join(f"b{b['name'][1:]}={summarise_batch(b)['tok_s']:.1f}"
                            for b in modes["spec"]["batches"])
            print(f"{system:8} {lat} {tput}")
    return rep


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin",
                   help=f"builtin, {', '.join(RANDOM_MODELS)} or an HF directory")
    p.add_argument("--cache", default=str(Path.home() / ".cache" / "kvmesh-bench"))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=96, help="(a) latency: most tokens per request")
    p.add_argument("--parts", default="latency,throughput", help="latency, throughput or both")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"(a) latency: which of {', '.join(WORKLOADS)} (comma list)")
    p.add_argument("--batch-sizes", default="1,8,64", help="(b) throughput: comma list")
    p.add_argument("--throughput-max-tokens", type=int, default=64,
                   help="(b) throughput: tokens per request (EOS ignored)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="the config of the speculative mode (default: ngram from the flags below)")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--no-chat", dest="chat", action="store_false",
                   help="send the prompts as raw text (default: in the chat template)")
    p.add_argument("--systems", default="kvmesh", help="kvmesh, vllm or both (comma list)")
    p.add_argument("--vllm-venv", default=None,
                   help="vLLM's venv (default: $KVMESH_VLLM_VENV or ~/.cache/kvmesh/vllm-venv)")
    p.add_argument("--vllm-command", default=None,
                   help="run this instead of VENV/bin/python benchmarks/vllm_peer.py")
    p.add_argument("--vllm-kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--vllm-timeout", type=float, default=3600.0, help="seconds per vLLM run")
    p.add_argument("--vllm-log", default=None, help="write vLLM's output here")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--no-isolate", dest="isolate", action="store_false",
                   help="run kvmesh's two modes in this process, one after the other (default: "
                        "each in a fresh process, as vLLM's)")
    p.add_argument("--mode-order", default="off,spec", type=lambda v: v.split(","),
                   help="the order the modes run in (off,spec or spec,off)")
    args = p.parse_args(argv)
    args.parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    if not args.parts or args.parts - {"latency", "throughput"}:
        p.error("--parts: latency, throughput or both")
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        p.error("--batch-sizes: a comma list of integers")
    if any(b < 1 for b in args.batch_sizes):
        p.error("--batch-sizes: each at least 1")
    args.workloads = [x.strip() for x in args.workloads.split(",") if x.strip()]
    if not args.workloads or set(args.workloads) - set(WORKLOADS):
        p.error(f"--workloads: a comma list of {', '.join(WORKLOADS)}")
    systems = [x.strip() for x in args.systems.split(",") if x.strip()]
    if not systems or set(systems) - {"kvmesh", "vllm"}:
        p.error("--systems: kvmesh, vllm or both")
    if sorted(args.mode_order) != ["off", "spec"]:
        p.error("--mode-order: off,spec or spec,off")
    if args.speculative_config is not None:
        try:
            spec = json.loads(args.speculative_config)
        except ValueError as e:
            p.error(f"--speculative-config: not JSON ({e})")
    else:
        spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                "prompt_lookup_min": args.prompt_lookup_min,
                "prompt_lookup_max": args.prompt_lookup_max}
    if args.vllm_venv is None:
        from benchmarks.peer import default_venv
        args.vllm_venv = str(default_venv())

    from kvmesh.prompt.sources import load_tokenizer
    model = resolve_model(args.model, Path(args.cache))
    hf_dir = None
    if "vllm" in systems:
        from kvmesh.engine.hf_export import builtin_hf_dir
        hf_dir = model = str(builtin_hf_dir(args.dtype)) if model is None else model
    work = build_workload(load_tokenizer(model), args)
    results: dict[str, dict[str, dict]] = {}
    for system in systems:
        run = ((run_kvmesh_isolated if args.isolate else run_kvmesh) if system == "kvmesh"
               else run_vllm)
        where = model if system == "kvmesh" else hf_dir
        configs = {"off": None, "spec": spec}
        done = {mode: run(args, where, work, configs[mode]) for mode in args.mode_order}
        results[system] = {mode: done[mode] for mode in ("off", "spec")}
    rep = report(args, results, spec)
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
