"""Speculative decoding (prompt lookup) at batch 1: inter-token latency with and without it.

    python benchmarks/spec_decode.py                        # built-in model, this CPU
    python benchmarks/spec_decode.py --num-speculative-tokens 4 --prompt-lookup-max 4 --max-tokens 96

Two workloads, each request alone in the engine (batch 1), greedy:
  copy   the answer copies from the prompt (repeat a code snippet / a paragraph with one edit):
         prompt lookup's territory
  free   open-ended questions: few drafts match, the adaptive back-off should keep the cost small
For each workload and mode (off, ngram) it reports the mean inter-token latency (decode time /
(tokens - 1): the first token's prefill excluded), decode tok/s, and with speculation the mean
acceptance length (1 + accepted / verifications: tokens per speculative step) and the draft
acceptance rate. Greedy output of both modes is compared token by token (it must be identical).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
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

WORKLOADS = {
    "copy": [
        f"Here is a Python function:\n\n{_CODE}\nRewrite it exactly, renaming `out` to `merged`:\n\n",
        f"{_TEXT}\n\nRepeat the paragraph above word for word, but say 'village' instead of "
        "'town':\n\n",
        f"{_CODE}\nCopy the function above unchanged:\n\n",
    ],
    "free": [
        "Write a short poem about the sea.",
        "Explain why the sky is blue in three sentences.",
        "Give me three ideas for a birthday party.",
    ],
}


def _run_one(engine, rid: str, prompt: str, max_tokens: int) -> dict:
    from kvmesh.engine.sampling_params import SamplingParams
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    t_first = t_end = None
    drafts = draft_tokens = accepted = 0
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        s = engine.last_stats
        drafts += s.spec_num_drafts
        draft_tokens += s.spec_num_draft_tokens
        accepted += s.spec_num_accepted_tokens
        for out in outs:
            if out.outputs[0].delta_token_ids and t_first is None:
                t_first = now
            if out.finished:
                tokens = out.outputs[0].token_ids
                t_end = now
    return {"tokens": tokens, "decode_s": t_end - t_first, "drafts": drafts,
            "draft_tokens": draft_tokens, "accepted": accepted}


def run_mode(args, spec: dict | None) -> dict[str, list[dict]]:
    from kvmesh.common.config import EngineConfig
    from kvmesh.engine.engine import LLMEngine
    model = resolve_model(args.model, Path(args.cache))
    engine = LLMEngine(EngineConfig(model=model, dtype=args.dtype, device="cpu",
                                    cpu_threads=args.threads, num_kv_blocks=args.num_kv_blocks,
                                    enable_prefix_caching=False, speculative_config=spec))
    tok = engine.tokenizer
    out: dict[str, list[dict]] = {}
    _run_one(engine, "warmup", "Hello", 8)
    for name, prompts in WORKLOADS.items():
        out[name] = []
        for i, p in enumerate(prompts):
            text = tok.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p
            out[name].append(_run_one(engine, f"{name}-{i}", text, args.max_tokens))
    return out


def summarise(runs: list[dict]) -> dict:
    tokens = sum(len(r["tokens"]) - 1 for r in runs)
    seconds = sum(r["decode_s"] for r in runs)
    drafts = sum(r["drafts"] for r in runs)
    out = {"itl_ms": 1000 * seconds / max(tokens, 1), "decode_tok_s": tokens / seconds,
           "tokens": tokens}
    if drafts:
        acc = sum(r["accepted"] for r in runs)
        out["acceptance_length"] = 1 + acc / drafts
        out["acceptance_rate"] = acc / sum(r["draft_tokens"] for r in runs)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin",
                   help=f"builtin, {', '.join(RANDOM_MODELS)} or an HF directory")
    p.add_argument("--cache", default=str(Path.home() / ".cache" / "kvmesh-bench"))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--no-chat", dest="chat", action="store_false",
                   help="send the prompts as raw text (default: in the chat template)")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": args.prompt_lookup_min,
            "prompt_lookup_max": args.prompt_lookup_max}
    base, fast = run_mode(args, None), run_mode(args, spec)
    report = {"config": spec, "max_tokens": args.max_tokens, "workloads": {}}
    print(f"{'workload':8} {'mode':6} {'ITL ms':>8} {'tok/s':>8} {'accept len':>10} "
          f"{'accept %':>9} {'speedup':>8} identical")
    for name in WORKLOADS:
        b, f = summarise(base[name]), summarise(fast[name])
        same = all(x["tokens"] == y["tokens"] for x, y in zip(base[name], fast[name]))
        report["workloads"][name] = {"off": b, "ngram": f, "greedy_identical": same}
        print(f"{name:8} {'off':6} {b['itl_ms']:8.2f} {b['decode_tok_s']:8.1f}")
        print(f"{name:8} {'ngram':6} {f['itl_ms']:8.2f} {f['decode_tok_s']:8.1f} "
              f"{f.get('acceptance_length', 1.0):10.2f} {100 * f.get('acceptance_rate', 0.0):8.1f}% "
              f"{b['itl_ms'] / f['itl_ms']:7.2f}x {same}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
