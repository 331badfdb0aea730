"""The first minutes of `kvmesh serve` on CPU (issue 28): its start-up phases logged once each
with their durations, one access line per request (never a prompt or a key), and a Ctrl-C that
ends with the server's own few lines: no Triton leak report, no traceback. Also: a CPU engine,
the router and the operator never import Triton (nor, for the last two, torch)."""
from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import openai
from processes import free_port
from waiting import wait_until

from kvmesh.common import startup

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-do-not-log-me"
PROMPT = "The secret prompt text that must never reach a log"
PHASES = ["(building|loading) CPU kernels", "loading weights", "allocating the KV cache", "warm-up"]
# every line a clean start, a few requests and a Ctrl-C may write on stderr
STDERR_LINE = re.compile(
    r"kvmesh: restarting with \S+ preloaded \(--allocator none to keep glibc malloc\)"
    r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO kvmesh(\.[a-z_]+)+: .*"  # the server's own log
    r"|INFO: {5}(Started server process|Waiting for application (startup|shutdown)|"
    r"Application (startup|shutdown) complete|Uvicorn running on|Shutting down|"
    r"Finished server process).*")                                     # uvicorn's


def test_serve_logs_each_phase_once_logs_requests_without_secrets_and_exits_cleanly_on_sigint(
        tmp_path: Path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    out_path, err_path = tmp_path / "stdout.log", tmp_path / "stderr.log"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.cli", "serve", "--port", str(port), "--api-key", KEY,
             "--num-kv-blocks", "64", "--max-model-len", "256", "--device", "cpu"],
            stdout=out, stderr=err, env=env)
    try:
        assert wait_until(lambda: _ready(url), timeout=300, interval=0.2), err_path.read_text()
        phase_seconds = _startup_gauge(url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                         extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 2
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=2,
            stream=True))
        assert chunks
        # a key in the query string (some clients do that) and a refused key
        r = httpx.post(f"{url}/v1/completions?api_key={KEY}", json={"prompt": PROMPT},
                       headers={"Authorization": f"Bearer {KEY}-wrong"})
        assert r.status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
    stdout, stderr = out_path.read_text(), err_path.read_text()
    assert code == 0, stderr[-3000:]

    # the whole stderr: known lines only, no leak report, no traceback
    assert "nanobind" not in stderr and "leaked" not in stderr, stderr
    assert "Traceback" not in stderr, stderr
    unknown = [line for line in stderr.splitlines() if not STDERR_LINE.fullmatch(line)]
    assert unknown == [], stderr
    # each phase begins once and ends once, with its duration, in start-up order
    ends = []
    for phase in PHASES:
        begun = re.findall(rf"kvmesh\.startup: {phase}( \(.*\))? \.\.\.$", stderr, re.M)
        ended = list(re.finditer(rf"kvmesh\.startup: {phase}: done in \d+\.\d s$", stderr, re.M))
        assert (len(begun), len(ended)) == (1, 1), (phase, stderr)
        ends.append(ended[0].start())
    assert ends == sorted(ends) and ends[-1] < stderr.index("kvmesh.serve: ready"), stderr
    # the readiness line names each phase's seconds, as /metrics has them (a local model: no fetch)
    ready = re.search(r"kvmesh\.serve: ready: .*; start-up: (.*)$", stderr, re.M)
    assert ready, stderr
    logged = dict((p, float(s)) for p, s in re.findall(r"(\w+) (\d+\.\d) s", ready.group(1)))
    assert list(logged) == list(phase_seconds) == ["fetch", "kernel_build", "weight_load",
                                                   "kv_alloc", "warmup", "total"]
    assert {p: round(s, 1) for p, s in phase_seconds.items()} == logged
    assert phase_seconds["fetch"] == 0.0
    assert all(phase_seconds[p] > 0 for p in ("kernel_build", "weight_load", "kv_alloc", "warmup"))
    assert phase_seconds["total"] > sum(s for p, s in phase_seconds.items() if p != "total")
    assert stderr.rstrip().endswith("Finished server process [%d]" % proc.pid), stderr

    # one access line per request, uvicorn's format, without the query string or a secret
    access = [line for line in stdout.splitlines() if "HTTP/1.1" in line]
    assert all(re.fullmatch(r'INFO: +127\.0\.0\.1:\d+ - "[A-Z]+ /[a-z0-9/_]* HTTP/1\.1" \d{3} '
                            r"[A-Za-z ]+", line) for line in access), access
    api = [line.split(" - ", 1)[1] for line in access if "/ready" not in line]
    assert api == ['"GET /metrics HTTP/1.1" 200 OK',
                   '"POST /v1/completions HTTP/1.1" 200 OK',
                   '"POST /v1/chat/completions HTTP/1.1" 200 OK',
                   '"POST /v1/completions HTTP/1.1" 401 Unauthorized'], access
    for secret in (KEY, PROMPT, "api_key"):
        assert secret not in stdout and secret not in stderr, secret


def _startup_gauge(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^kvmesh:startup_phase_seconds\{model_name="[^"]+",phase="(\w+)"\} (\S+)$', text, re.M)}


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# ---- what each process imports ----------------------------------------------------------------
def _modules_after(code: str) -> dict:
    """Run `code` in a fresh interpreter; the top-level packages it imported among torch, triton."""
    probe = textwrap.dedent(code) + textwrap.dedent("""
        import json, sys
        loaded = {m.split(".")[0] for m, module in sys.modules.items() if module is not None}
        print(json.dumps(sorted(loaded & {"torch", "triton"})))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_kvmesh_generate_on_cpu_loads_and_steps_a_model_without_importing_triton():
    """The `kvmesh generate` entry point, run in a fresh interpreter; torch imports Triton from
    torch._dynamo (which its meta-device ops load while the model is built) whenever it can."""
    assert _modules_after("""
        from kvmesh.cli import main
        assert main(["generate", "--device", "cpu", "--num-kv-blocks", "32", "--max-model-len",
                     "128", "--max-tokens", "2", "Hello"]) == 0
    """) == ["torch"]


def test_the_router_with_its_tokenizer_and_the_operator_never_import_torch_or_triton():
    assert _modules_after("""
        from kvmesh.prompt.sources import load_tokenizer
        from kvmesh.router.app import create_app
        from kvmesh.router.config import RouterConfig
        from kvmesh.router.main import build_parser
        create_app(RouterConfig(backends=("http://127.0.0.1:9",)), load_tokenizer(None, None))
        import kvmesh.operator.main
    """) == []


# ---- the phases module ------------------------------------------------------------------------
class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_phase_logs_its_start_and_duration_and_draws_no_live_line_off_a_terminal(caplog):
    caplog.set_level("INFO", logger="kvmesh.startup")
    stream = io.StringIO()
    with startup.startup_phase("loading weights", "m.gguf", stream=stream):
        pass
    assert [r.getMessage() for r in caplog.records][0] == "loading weights (m.gguf) ..."
    assert re.fullmatch(r"loading weights: done in 0\.\d s", caplog.records[1].getMessage())
    assert stream.getvalue() == ""


def test_a_failed_phase_says_so_and_the_error_passes_through(caplog):
    caplog.set_level("INFO", logger="kvmesh.startup")
    try:
        with startup.startup_phase("warm-up", stream=_Terminal()):
            raise RuntimeError("boom")
    except RuntimeError as e:
        assert str(e) == "boom"
    assert re.fullmatch(r"warm-up: failed after 0\.\d s", caplog.records[-1].getMessage())


def test_a_long_phase_on_a_terminal_shows_a_live_line_then_erases_it(monkeypatch):
    monkeypatch.setattr(startup, "PROGRESS_AFTER_S", 0.05)
    monkeypatch.setattr(startup, "_REDRAW_S", 0.02)
    term = _Terminal()
    with startup.startup_phase("building CPU kernels", estimate_s=60, stream=term):
        assert wait_until(lambda: "building CPU kernels [" in term.getvalue(), timeout=5,
                          interval=0.01)
    text = term.getvalue()
    assert text.startswith("\r\x1b[2Kbuilding CPU kernels [") and text.endswith("\r\x1b[2K")


def test_the_live_line_fills_its_bar_towards_the_estimate():
    assert startup.progress_line("warm-up", 4.2, None) == "warm-up ... 4 s"
    assert startup.progress_line("building CPU kernels", 30, 60) == \
        "building CPU kernels [##########..........] 30 s of ~60 s"
    assert startup.progress_line("building CPU kernels", 200, 60) == \
        "building CPU kernels [###################.] 200 s of ~60 s"
