"""vLLM as a benchmark peer: run in vLLM's own venv, speak JSON with `offline_throughput.py`.

    <vllm-venv>/bin/python benchmarks/vllm_peer.py REQUEST.json RESULT.json

REQUEST.json (written by `benchmarks/peer.py`):

    {"model": "/path/to/hf-dir", "dtype": "float32", "seed": 0,
     "max_num_seqs": 64, "max_num_batched_tokens": 512, "max_model_len": 2048,
     "warmup": [{"prompt_ids": [...], "max_tokens": 4}, ...],
     "requests": [{"prompt_ids": [...], "max_tokens": 37}, ...],
     "profile_dir": "/abs/dir"}          (optional)

With "profile_dir", the timed `generate` runs under vLLM's own torch profiler (its
`profiler_config`, `VLLM_CUSTOM_SCOPES_FOR_PROFILING=1` for the model runner's scopes): the worker
writes a Chrome trace there, which `benchmarks/torch_trace_breakdown.py` sorts into the categories
of `profile_engine.py`. The profiler slows the run: its wall time is not a throughput number.

With "lora" and "cases" (benchmarks/lora_throughput.py), one engine with `enable_lora` runs
several timed cases, each request naming an adapter (or null: the base model):

    {..., "lora": {"max_loras": 8, "max_cpu_loras": 8, "max_lora_rank": 16,
                   "adapters": {"r8-00": {"id": 1, "path": "/abs/dir"}, ...}},
     "cases": [{"name": "...", "warmup": [{..., "lora": "r8-00"}], "requests": [...]}, ...]}

and the result has "cases": [{"name", "outputs", "wall_s", "cpu_s"}, ...].

With "spec_decode" (benchmarks/spec_decode.py), one engine with that `speculative_config` (null:
none) runs each "latency" request alone, stepping the engine and timing its tokens as they come
(stopping at EOS), then each "batches" entry all queued at once (ignoring EOS, as above):

    {..., "spec_decode": {"speculative_config": {"method": "ngram", ...} | null,
                          "latency": [{"prompt_ids": [...], "max_tokens": 96}, ...],
                          "batches": [{"name": "8", "requests": [...]}, ...]}}

and the result has "latency": [{"tokens", "decode_s", "decode_steps", "drafts", "draft_tokens",
"accepted"}] and
"batches": [{"name", "outputs", "wall_s", "drafts", "draft_tokens", "accepted"}] (the counts from
vLLM's own spec_decode counters).

RESULT.json:

    {"system": "vllm 0.32.0", "outputs": [[token ids], ...], "wall_s": 12.3, "cpu_s": 24.1,
     "load_s": 95.0, "note": "..."}

Every request runs greedily (temperature 0), ignoring EOS, with its own max_tokens, prefix
caching off, all queued at once through `LLM.generate` on `TokensPrompt`s. `cpu_s` is the CPU
time of this process and its children (vLLM's engine core runs in a child process).

This file imports only vLLM and the standard library (plus psutil, a vLLM dependency): nothing of
kvmesh is installed in vLLM's venv. vLLM's engine spawns processes, hence the `__main__` guard.
"""
from __future__ import annotations

import json
import os
import sys
import time


def _tree_cpu_s() -> float:
    """CPU seconds (user + system) of this process and all its live descendants."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.Error:       # a child that exited meanwhile
            continue
        total += t.user + t.system
    return total


def _llm(spec: dict, **extra):
    """vLLM's engine as every mode starts it: the spec's model and sizes, prefix caching off."""
    from vllm import LLM

    return LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), seed=int(spec.get("seed", 0)),
               enable_prefix_caching=False, max_num_seqs=int(spec["max_num_seqs"]),
               max_num_batched_tokens=int(spec["max_num_batched_tokens"]),
               max_model_len=int(spec["max_model_len"]), **extra)


def _generate(llm, reqs: list[dict], adapters: dict | None = None) -> list[list[int]]:
    """Greedy, exactly max_tokens each, all queued at once; a request's "lora" names its adapter."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(r["prompt_ids"])) for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=int(r["max_tokens"]),
                             min_tokens=int(r["max_tokens"]), ignore_eos=True) for r in reqs]
    extra = {}
    if adapters is not None:
        extra["lora_request"] = [adapters[r["lora"]] if r.get("lora") else None for r in reqs]
    outs = llm.generate(prompts, params, use_tqdm=False, **extra)
    return [list(o.outputs[0].token_ids) for o in outs]


def run(spec: dict) -> dict:
    profile_dir = spec.get("profile_dir")
    if profile_dir:
        os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
    import vllm

    extra = {}
    if profile_dir:
        extra["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": os.path.abspath(profile_dir),
                                    "torch_profiler_with_stack": False, "torch_profiler_record_shapes": True,
                                    "torch_profiler_use_gzip": False, "ignore_frontend": True}
    t_load = time.perf_counter()
    llm = _llm(spec, **extra)
    load_s = time.perf_counter() - t_load

    _generate(llm, spec.get("warmup") or [])
    if profile_dir:
        llm.start_profile()
    c0, t0 = _tree_cpu_s(), time.perf_counter()
    outputs = _generate(llm, spec["requests"])
    wall = time.perf_counter() - t0
    cpu = _tree_cpu_s() - c0
    if profile_dir:
        llm.stop_profile()      # the worker writes its trace now
    return {"system": f"vllm {vllm.__version__}", "outputs": outputs, "wall_s": wall, "cpu_s": cpu,
            "load_s": load_s,
            "note": (f"vllm {vllm.__version__}, max_num_seqs={spec['max_num_seqs']}, "
                     f"budget={spec['max_num_batched_tokens']} tok/step, prefix caching off"
                     + (f", torch profiler on (trace in {profile_dir})" if profile_dir else ""))}


def run_lora(spec: dict) -> dict:
    import vllm
    from vllm.lora.request import LoRARequest

    lora = spec["lora"]
    t_load = time.perf_counter()
    llm = _llm(spec, enable_lora=True, max_loras=int(lora["max_loras"]),
               max_cpu_loras=int(lora["max_cpu_loras"]), max_lora_rank=int(lora["max_lora_rank"]))
    load_s = time.perf_counter() - t_load
    adapters = {name: LoRARequest(name, int(a["id"]), a["path"]) for name, a in lora["adapters"].items()}

    cases = []
    for case in spec["cases"]:
        _generate(llm, case.get("warmup") or [], adapters)
        c0, t0 = _tree_cpu_s(), time.perf_counter()
        outputs = _generate(llm, case["requests"], adapters)
        cases.append({"name": case["name"], "outputs": outputs, "wall_s": time.perf_counter() - t0,
                      "cpu_s": _tree_cpu_s() - c0})
    return {"system": f"vllm {vllm.__version__}", "cases": cases, "load_s": load_s,
            "note": f"vllm {vllm.__version__}, enable_lora, max_loras={lora['max_loras']}"}


_SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts",
                  "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                  "vllm:spec_decode_num_accepted_tokens": "accepted"}


def _spec_counts(llm) -> dict[str, int]:
    """vLLM's speculative-decoding counters now (zeros without speculation)."""
    out = dict.fromkeys(_SPEC_COUNTERS.values(), 0)
    for m in llm.get_metrics():
        key = _SPEC_COUNTERS.get(m.name.removesuffix("_total"))
        if key is not None and hasattr(m, "value"):
            out[key] += int(m.value)
    return out


def _since(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in before}


def _latency_one(llm, rid: str, req: dict) -> dict:
    """One request alone, greedy, stopping at EOS: its tokens and the time from its first token
    to its last (the engine stepped here, as kvmesh's benchmark steps kvmesh)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    before = _spec_counts(llm)
    engine.add_request(rid, TokensPrompt(prompt_token_ids=list(req["prompt_ids"])),
                       SamplingParams(temperature=0.0, max_tokens=int(req["max_tokens"])))
    t_first = t_end = None
    tokens: list[int] = []
    decode_steps = 0        # steps after the first token's (the ITL's denominator in steps)
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        decode_steps += t_first is not None
        for out in outs:
            if out.outputs and out.outputs[0].token_ids and t_first is None:
                t_first = now
            if out.finished:
                tokens, t_end = list(out.outputs[0].token_ids), now
    return {"tokens": tokens, "decode_s": (t_end - t_first) if t_first is not None else 0.0,
            "decode_steps": decode_steps, **_since(before, _spec_counts(llm))}


def run_spec_decode(spec: dict) -> dict:
    import vllm

    sd = spec["spec_decode"]
    extra = {"disable_log_stats": False}
    if sd.get("speculative_config"):
        extra["speculative_config"] = sd["speculative_config"]
    t_load = time.perf_counter()
    llm = _llm(spec, **extra)
    load_s = time.perf_counter() - t_load
    _generate(llm, spec.get("warmup") or [])
    latency = [_latency_one(llm, f"lat-{i}", r) for i, r in enumerate(sd.get("latency", []))]
    batches = []
    for batch in sd.get("batches", []):
        before, t0 = _spec_counts(llm), time.perf_counter()
        outputs = _generate(llm, batch["requests"])
        wall = time.perf_counter() - t0
        batches.append({"name": batch["name"], "outputs": outputs, "wall_s": wall,
                        **_since(before, _spec_counts(llm))})
    return {"system": f"vllm {vllm.__version__}", "load_s": load_s, "latency": latency,
            "batches": batches,
            "note": f"vllm {vllm.__version__}, speculative_config={sd.get('speculative_config')}"}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: vllm_peer.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    if "spec_decode" in spec:
        result = run_spec_decode(spec)
    else:
        result = run_lora(spec) if "cases" in spec else run(spec)
    with open(argv[1], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
