"""llama.cpp's llama-server as the offline benchmark's peer (benchmarks/llama_cpp_peer.py).

NOTE: llama.cpp takes ~10 minutes to build here, so CI runs the peer against a stand-in
(`fake_llama_server.py`, written per test) that speaks llama-server's `/health` and `/completion`
JSON: each answer's tokens are a function of its prompt, so order and lengths are checked exactly.
With a real build (`KVMESH_LLAMA_SERVER=/path/to/llama-server`), `test_real_llama_server` serves the
built-in GGUF with it and checks greedy tokens against kvmesh's float32 engine.
"""
from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks import llama_cpp_peer

FAKE = textwrap.dedent('''
    #!{python}
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    mode = os.environ.get("FAKE_LLAMA_MODE", "ok")
    with open(os.environ["FAKE_LLAMA_SEEN"], "a") as f:
        f.write(json.dumps(args) + "\\n")
    if mode == "crash":
        print("error: failed to load model", flush=True)
        sys.exit(1)

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def _send(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        def do_GET(self):
            self._send(200, {{"status": "ok"}})
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with open(os.environ["FAKE_LLAMA_SEEN"], "a") as f:
                f.write(json.dumps({{k: v for k, v in body.items() if k != "prompt"}}) + "\\n")
            n = body["n_predict"] - (1 if mode == "short" else 0)
            last = body["prompt"][-1]
            self._send(200, {{"content": "x", "tokens": [last + i for i in range(n)],
                              "stop_type": "limit"}})

    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
''')


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    exe = tmp_path / "llama-server"
    exe.write_text(FAKE.format(python=sys.executable).lstrip())
    exe.chmod(0o755)
    seen = tmp_path / "seen.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_SEEN", str(seen))
    return exe, seen


def test_requests_posted_and_answers_kept_in_order(fake_server, tmp_path):
    exe, seen = fake_server
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    reqs = [([5, 6, 7], 4), ([100], 2), ([9, 40], 3)]
    res = llama_cpp_peer.run(gguf, reqs, warmup=[([1, 2], 1)], slots=2, threads=3, binary=exe,
                             log=tmp_path / "log")
    assert res.outputs == [[7, 8, 9, 10], [100, 101], [40, 41, 42]]
    lines = [__import__("json").loads(x) for x in seen.read_text().splitlines()]
    argv = lines[0]
    # two slots, each with the longest request (3 + 4 = 7 tokens) rounded up to 256
    assert argv[argv.index("-np") + 1] == "2" and argv[argv.index("-c") + 1] == "512"
    assert argv[argv.index("-t") + 1] == "3" and argv[argv.index("-m") + 1] == str(gguf)
    bodies = lines[1:]
    assert len(bodies) == 4            # one warm-up + three timed
    assert all(b["ignore_eos"] is True and b["temperature"] == 0.0 and b["cache_prompt"] is False
               and b["return_tokens"] is True for b in bodies)
    assert sorted(b["n_predict"] for b in bodies) == [1, 2, 3, 4]
    assert res.wall_s > 0 and res.cpu_s >= 0 and res.peak_rss_bytes > 0 and res.start_s > 0
    assert "-np 2" in res.note


def test_a_server_that_dies_at_start_is_reported(fake_server, tmp_path, monkeypatch):
    exe, _ = fake_server
    monkeypatch.setenv("FAKE_LLAMA_MODE", "crash")
    with pytest.raises(RuntimeError, match=r"llama-server exited with 1 while starting"):
        llama_cpp_peer.run(tmp_path / "m.gguf", [([1], 1)], [], slots=1, threads=1, binary=exe,
                           log=tmp_path / "log")
    assert "failed to load model" in (tmp_path / "log").read_text()


def test_a_short_answer_is_an_error(fake_server, tmp_path, monkeypatch):
    exe, _ = fake_server
    monkeypatch.setenv("FAKE_LLAMA_MODE", "short")
    with pytest.raises(RuntimeError, match=r"made 2 tokens, 3 were asked"):
        llama_cpp_peer.run(tmp_path / "m.gguf", [([1], 3)], [], slots=1, threads=1, binary=exe,
                           log=tmp_path / "log")


def test_missing_binary_says_how_to_build_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no llama-server at .*cmake --build"):
        llama_cpp_peer.run(tmp_path / "m.gguf", [([1], 1)], [], slots=1, threads=1,
                           binary=tmp_path / "absent")


def test_parse_completion_refuses_an_answer_without_ids():
    with pytest.raises(RuntimeError, match="without token ids"):
        llama_cpp_peer.parse_completion({"content": "hi"}, 1)
    assert llama_cpp_peer.parse_completion({"tokens": [3, 4]}, 2) == [3, 4]


@pytest.mark.skipif(not os.environ.get("KVMESH_LLAMA_SERVER"),
                    reason="opt-in: set KVMESH_LLAMA_SERVER to a llama-server build (~10 min to build)")
def test_real_llama_server():
    from kvmesh.common.model_files import builtin_model_path
    from kvmesh.engine.llm import LLM
    from kvmesh.engine.sampling_params import SamplingParams

    llm = LLM(dtype="float32")
    prompt = llm.get_tokenizer().encode("The capital of France is Paris. The capital of Germany is")
    res = llama_cpp_peer.run(builtin_model_path(), [(prompt, 8)], [], slots=1, threads=2,
                             binary=Path(os.environ["KVMESH_LLAMA_SERVER"]))
    ours = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    # a real prompt: no near-tie in the first tokens (Q4_1 blocks in llama.cpp, float32 here)
    assert res.outputs[0][:4] == list(ours[0].outputs[0].token_ids)[:4]


def test_extra_arguments_go_to_the_server_last(fake_server, tmp_path):
    exe, seen = fake_server
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    llama_cpp_peer.run(gguf, [([5], 1)], [], slots=1, threads=1, binary=exe, log=tmp_path / "log",
                       extra=("--no-repack",))
    argv = __import__("json").loads(seen.read_text().splitlines()[0])
    assert argv[-1] == "--no-repack" and argv.count("--no-repack") == 1
