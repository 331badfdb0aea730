"""Tiny GGUF files of every architecture the reader takes, run by llama.cpp's own llama-server and by
kvmesh: the same greedy tokens, and the first step's top-5 log-probabilities.

    python benchmarks/gguf_llama_cpp.py [--archs llama,llama3,qwen2,qwen3,phi3,mixtral,qwen3moe,gemma2,gemma3]
                                        [--ctx 256] [--tokens 8]

The files are the tests' (tests/models/test_gguf.py): seeded random models written the way
llama.cpp's converter writes them (F16 matrices, Q/K permuted for llama, experts stacked, Llama 3's
rope_freqs and Phi-3's longrope factors as tensors, Gemma's norms + 1), with the built-in model's
tokenizer. The tests hold kvmesh to transformers on them; this holds the files to llama.cpp, so a
convention the writer got wrong (and the reader with it) shows here. Where the two runtimes mean
different things by the same file (llama.cpp: Phi-3's longrope factors chosen by context size,
no sliding window for Phi-3), kvmesh follows transformers. llama-server: `--llama-server` or the
build benchmarks/llama_cpp_peer.py uses.
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.llama_cpp_peer import default_binary  # noqa: E402
from benchmarks.offline_throughput import describe_machine  # noqa: E402
from kvmesh.common.gguf_reader import GGUFReader  # noqa: E402
from kvmesh.common.model_files import builtin_model_path  # noqa: E402
from kvmesh.engine.llm import LLM  # noqa: E402
from kvmesh.engine.sampling_params import SamplingParams  # noqa: E402
from tests.models.test_gguf import _GGUF_ARCH, _tiny_hf, _write_gguf  # noqa: E402

ARCHS = ("llama", "llama3", "qwen2", "qwen3", "phi3", "mixtral", "qwen3moe", "gemma2", "gemma3")
PROMPT = [1, 9690, 198, 2683, 359, *range(300, 330)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_cpp(binary: Path, path: Path, ctx: int, n: int, log: Path) -> tuple[list[int], list[tuple[int, float]]]:
    """llama-server's greedy tokens and its first step's top-5 (token, log-prob)."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([str(binary), "-m", str(path), "--host", "127.0.0.1", "--port", str(port),
                                 "-np", "1", "-c", str(ctx), "-t", "1", "--no-webui"],
                                stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if urllib.request.urlopen(base + "/health", timeout=1).status == 200:
                    break
            except OSError:
                time.sleep(0.1)
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited on {path.name}: {log.read_text()[-400:]}")
        body = {"prompt": PROMPT, "n_predict": n, "temperature": 0.0, "ignore_eos": True,
                "cache_prompt": False, "return_tokens": True, "n_probs": 5, "post_sampling_probs": False}
        req = urllib.request.Request(base + "/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        out = json.load(urllib.request.urlopen(req, timeout=120))
    finally:
        proc.terminate()
        proc.wait()
    first = out["completion_probabilities"][0]["top_logprobs"]
    return out["tokens"], [(t["id"], t["logprob"]) for t in first]


def kvmesh(path: Path, n: int) -> tuple[list[int], dict[int, float]]:
    llm = LLM(str(path), dtype="float32", quantization="none", num_kv_blocks=64)
    try:
        o = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=5))[0]
    finally:
        llm.shutdown()
    return list(o.outputs[0].token_ids), {t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", default=",".join(ARCHS))
    p.add_argument("--ctx", type=int, default=256, help="llama-server's context (-c)")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--llama-server", type=Path, default=None)
    args = p.parse_args()
    binary = args.llama_server or default_binary()
    print(describe_machine())
    tmp = Path(tempfile.mkdtemp(prefix="gguf-llama-cpp-"))
    tokenizer = GGUFReader(builtin_model_path())
    print(f"{'arch':9s} {'greedy same':>11s} {'top-5 max |dlp|':>15s} {'top-2 gap':>9s}")
    for arch in args.archs.split(","):
        cfg, model = _tiny_hf(arch)
        path = tmp / f"tiny-{arch}.gguf"
        _write_gguf(path, _GGUF_ARCH.get(arch, arch), model, cfg, tokenizer)
        lc_tokens, lc_top = llama_cpp(binary, path, args.ctx, args.tokens, tmp / f"{arch}.log")
        km_tokens, km_top = kvmesh(path, args.tokens)
        same = sum(a == b for a, b in zip(lc_tokens, km_tokens))
        diffs = [abs(km_top[t] - lp) for t, lp in lc_top if t in km_top]
        top = f"{max(diffs):.2e}" if len(diffs) == len(lc_top) else f"{len(lc_top) - len(diffs)} ids differ"
        print(f"{arch:9s} {same:>5d} / {args.tokens:<3d} {top:>15s} {lc_top[0][1] - lc_top[1][1]:9.2e}", flush=True)


if __name__ == "__main__":
    main()
