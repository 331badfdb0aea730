"""`kvmesh fetch` as real processes against a real S3-protocol server (moto.server) behind a
slow, counting TCP proxy: killed midway then resumed, a corrupted partial file caught by its
checksum, two processes on one cache fetching once."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from throttle_proxy import ThrottleProxy  # tests/support
from upload import upload

from kvmesh.cli import main

CHUNK = 128 << 10


def _start(uri: str, cache, env: dict, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli", "fetch", uri, "--cache-dir", str(cache),
         "--chunk-size", str(CHUNK), *extra],
        env=dict(os.environ, **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(uri: str, cache, env: dict, *extra: str) -> subprocess.CompletedProcess:
    proc = _start(uri, cache, env, *extra)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _kill_midway(uri: str, cache, env: dict, chunks: int) -> list[int]:
    """Start a fetch, SIGKILL it once `chunks` chunks of the weights are written; the chunk
    indices its state file records."""
    proc = _start(uri, cache, env, "--workers", "2")
    deadline = time.monotonic() + 60
    done: list[int] = []
    while time.monotonic() < deadline and proc.poll() is None:
        states = list(cache.glob("*/*/model.safetensors.partial.state"))
        if states:
            done = [int(x) for x in states[0].read_text().splitlines()[1:]]
            if len(done) >= chunks:
                break
        time.sleep(0.02)
    assert proc.poll() is None, f"the fetch ended before it was killed:\n{proc.communicate()[1]}"
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    return [int(x) for x in next(cache.glob("*/*/model.safetensors.partial.state")).read_text().splitlines()[1:]]


@pytest.fixture
def model_in_bucket(moto_server, bucket, tiny_model):
    upload(moto_server.client(), bucket, "tiny-llama", tiny_model)
    return f"s3://{bucket}/tiny-llama"


def _model_bytes(tiny_model) -> int:
    return sum(p.stat().st_size for p in tiny_model.iterdir()
               if p.is_file() and p.name not in ("README.md", "pytorch_model.bin"))


def test_a_killed_fetch_resumes_and_no_partial_is_taken(moto_server, model_in_bucket, tiny_model, tmp_path):
    cache = tmp_path / "models"
    with ThrottleProxy(moto_server.port, bytes_per_s=250_000) as slow:
        done = _kill_midway(model_in_bucket, cache, moto_server.env(AWS_ENDPOINT_URL=slow.url), 3)
    entry = next(cache.glob("*/tiny-llama"))
    assert not (entry.parent / "entry.json").exists()          # not complete: never used as is
    assert not (entry / "model.safetensors").exists()
    assert (entry / "model.safetensors.partial").stat().st_size == (tiny_model / "model.safetensors").stat().st_size
    weights = (tiny_model / "model.safetensors").stat().st_size
    assert 3 <= len(done) < -(-weights // CHUNK)

    with ThrottleProxy(moto_server.port) as counting:
        run = _run(model_in_bucket, cache, moto_server.env(AWS_ENDPOINT_URL=counting.url))
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(entry)
    assert f"resuming {model_in_bucket}:" in run.stderr
    for p in tiny_model.iterdir():
        if p.is_file() and p.name not in ("README.md", "pytorch_model.bin"):
            assert (entry / p.name).read_bytes() == p.read_bytes()
    assert sorted(p.name for p in entry.iterdir() if "partial" in p.name) == []
    # the kept chunks were not read again (listing and headers: a few KiB)
    kept = sum(min(CHUNK, weights - i * CHUNK) for i in done)
    assert counting.down < _model_bytes(tiny_model) - kept + (32 << 10)


def test_a_corrupted_partial_file_fails_its_checksum(moto_server, model_in_bucket, tiny_model, tmp_path):
    cache = tmp_path / "models"
    with ThrottleProxy(moto_server.port, bytes_per_s=250_000) as slow:
        done = _kill_midway(model_in_bucket, cache, moto_server.env(AWS_ENDPOINT_URL=slow.url), 2)
    partial = next(cache.glob("*/tiny-llama/model.safetensors.partial"))
    # NOTE: the fault: bytes of a chunk the state file records as written change on the disk
    # (a bad sector, another writer): resuming keeps that chunk, the ETag (MD5) check catches it
    with open(partial, "r+b") as f:
        f.seek(done[0] * CHUNK + 100)
        byte = f.read(1)
        f.seek(done[0] * CHUNK + 100)
        f.write(bytes([byte[0] ^ 0xFF]))

    env = moto_server.env()
    bad = _run(model_in_bucket, cache, env)
    assert bad.returncode == 2
    last = bad.stderr.strip().splitlines()[-1]
    assert last.startswith(f"kvmesh fetch: error: {model_in_bucket}: model.safetensors: checksum "
                           "mismatch (the MD5 of the bytes fetched is not the ETag ")
    assert not partial.exists() and not list(cache.glob("*/entry.json"))
    good = _run(model_in_bucket, cache, env)
    assert good.returncode == 0, good.stderr
    assert (partial.parent / "model.safetensors").read_bytes() == (tiny_model / "model.safetensors").read_bytes()


def test_two_processes_on_one_cache_fetch_once(moto_server, model_in_bucket, tiny_model, tmp_path):
    cache = tmp_path / "models"
    with ThrottleProxy(moto_server.port, bytes_per_s=400_000) as proxy:
        env = moto_server.env(AWS_ENDPOINT_URL=proxy.url)
        first = _start(model_in_bucket, cache, env, "--workers", "1")
        time.sleep(0.3)
        second = _start(model_in_bucket, cache, env, "--workers", "1")
        outs = [p.communicate(timeout=120) for p in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0], outs
    assert outs[0][0] == outs[1][0] and outs[0][0].strip().endswith("/tiny-llama")
    waited = [err for _, err in outs if "waiting: another process on this node is fetching" in err]
    assert len(waited) == 1
    assert _model_bytes(tiny_model) <= proxy.down < 1.5 * _model_bytes(tiny_model)


def test_cli_prints_the_path_or_a_message(tmp_path, capsys, tiny_model):
    assert main(["fetch", str(tiny_model)]) == 0
    assert capsys.readouterr().out == f"{tiny_model}\n"
    assert main(["fetch", "gs://bucket/model", "--cache-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("kvmesh fetch: error: gs://bucket/model: gs:// is not supported")
    assert main(["fetch", str(tmp_path / "absent")]) == 2
    assert capsys.readouterr().err == (f"kvmesh fetch: error: {tmp_path / 'absent'}: no such file or "
                                       f"directory {tmp_path / 'absent'}\n")
    assert main(["fetch", str(tiny_model), "--workers", "0"]) == 2
    assert "--workers must be >= 1, got 0" in capsys.readouterr().err
