"""`kvmesh serve --enable-lora` with the official openai client: adapters from --lora-modules are
models with their `parent`; the load / unload endpoints (admin key) change the served set while
requests stream (none fails, none meets a half-loaded adapter); a bad adapter is a 400 that
changes nothing; an unknown one a 404 naming it; vllm:lora_requests_info reports them."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading

import httpx
import openai
import pytest
from lora_adapters import greedy, make_adapter, merged
from servers import start_server
from transformers import AutoTokenizer

ADMIN = {"Authorization": "Bearer adm"}
NEW = 8
PROMPT = [17, 42, 99, 5, 63, 120, 7, 201, 33]


@pytest.fixture(scope="module")
def moto():
    """A real S3-protocol server (moto's) the engine fetches s3:// adapters from."""
    from s3_server import MotoServer
    server = MotoServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server(llama_base, llama_adapters, tmp_path_factory, moto):
    tmp = tmp_path_factory.mktemp("server")
    # NOTE: the variables an engine pod gets from the operator: the node's model cache, the
    # store's endpoint and credentials, the model claim's mount (pvc://)
    env = {**moto.env(), "KVMESH_MODEL_CACHE_DIR": str(tmp / "cache"), "KVMESH_PVC_MOUNT": str(tmp / "pvc"),
           "HF_HUB_OFFLINE": "1"}
    srv = start_server(
        tmp, "--model", str(llama_base), "--served-model-name", "tiny", "--enable-lora",
        "--max-loras", "2", "--max-lora-rank", "16", "--admin-api-key", "adm", "--cpu-threads", "1",
        "--num-kv-blocks", "256", "--block-size", "4", "--max-model-len", "128",
        "--lora-modules", f"all={llama_adapters['all']}",
        json.dumps({"name": "od", "path": str(llama_adapters["o-down"]), "base_model_name": "tiny-v0"}),
        env=env)
    srv.pvc_root = tmp / "pvc"
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def refs(llama_base, llama_adapters):
    """The expected text of PROMPT per model name (peft merged, transformers, greedy)."""
    tok = AutoTokenizer.from_pretrained(str(llama_base))
    models = {"tiny": None, "all": "all", "od": "o-down", "qv": "qv-rslora"}
    prefix = tok.decode(PROMPT)
    out = {}
    for name, a in models.items():
        tokens = greedy(merged(llama_base, llama_adapters[a] if a else None), PROMPT, NEW)
        text = tok.decode(PROMPT + tokens)        # the completion: what follows the prompt's text
        assert text.startswith(prefix)
        out[name] = text[len(prefix):]
    assert len(set(out.values())) == len(out)   # every adapter answers differently
    return out


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _complete(client, model: str) -> str:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    assert r.model == model
    return r.choices[0].text


def _models(server) -> list[tuple[str, str | None]]:
    data = httpx.get(f"{server.url}/v1/models").json()["data"]
    return [(m["id"], m.get("parent")) for m in data]


def test_adapters_are_models_with_their_parent(server, refs):
    assert _models(server) == [("tiny", None), ("all", "tiny"), ("od", "tiny-v0")]
    client = _client(server)
    assert {name: _complete(client, name) for name in ("tiny", "all", "od")} == \
        {name: refs[name] for name in ("tiny", "all", "od")}
    r = httpx.post(f"{server.url}/tokenize", json={"model": "od", "prompt": "w5 w6"})
    assert r.status_code == 200 and r.json()["tokens"][-2:] == [5, 6]


def test_an_unknown_adapter_is_a_404_naming_it(server):
    with pytest.raises(openai.NotFoundError) as e:
        _complete(_client(server), "nope")
    assert e.value.body["message"] == "The model `nope` does not exist."


def test_load_and_unload_need_the_admin_key(server, llama_adapters):
    body = {"lora_name": "qv", "lora_path": str(llama_adapters["qv-rslora"])}
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", json=body).status_code == 401
    assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "all"}).status_code == 401
    assert [m for m, _ in _models(server)] == ["tiny", "all", "od"]


def test_a_bad_adapter_is_a_400_and_changes_nothing(server, llama_base, tmp_path):
    big = make_adapter(llama_base, tmp_path / "big", ["q_proj"], r=32, alpha=32)
    cases = [({"lora_name": "big", "lora_path": str(big)}, "rank 32 exceeds --max-lora-rank 16"),
             ({"lora_name": "gone", "lora_path": str(tmp_path / "none")}, "no adapter_config.json"),
             ({"lora_name": "all", "lora_path": str(big)}, "The lora adapter 'all' has already been loaded."),
             ({"lora_name": "x"}, "lora_path")]
    for body, message in cases:
        r = httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, headers=ADMIN)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "nope"}, headers=ADMIN)
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "The lora adapter 'nope' cannot be found."
    assert _models(server) == [("tiny", None), ("all", "tiny"), ("od", "tiny-v0")]


def _load(server, name: str, path: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                      headers=ADMIN, timeout=60)


def _unload(server, name: str) -> None:
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text


def test_an_adapter_from_a_storage_uri_is_fetched_then_served(server, moto, refs, llama_adapters):
    import shutil
    src = llama_adapters["qv-rslora"]
    s3 = moto.client()
    s3.create_bucket(Bucket="adapters")
    for f in src.iterdir():
        s3.upload_file(str(f), "adapters", f"team/qv/{f.name}")
    shutil.copytree(src, server.pvc_root / "loras" / "qv")
    for name, uri in (("qv-s3", "s3://adapters/team/qv"), ("qv-pvc", "pvc://models/loras/qv")):
        r = _load(server, name, uri)
        assert (r.status_code, r.text) == (200, f"Success: LoRA adapter '{name}' added successfully.")
        assert _complete(_client(server), name) == refs["qv"]
    # the URI as given is the adapter's root (what the operator compares with its spec)
    roots = {m["id"]: m.get("root") for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert (roots["qv-s3"], roots["qv-pvc"]) == ("s3://adapters/team/qv", "pvc://models/loras/qv")
    _unload(server, "qv-s3")
    _unload(server, "qv-pvc")


def test_an_adapter_that_cannot_be_fetched_is_a_400_naming_it(server, moto):
    s3 = moto.client()
    s3.create_bucket(Bucket="holes")
    s3.put_object(Bucket="holes", Key="notlora/config.json", Body=b"{}")
    cases = [("s3://holes/none", "cannot fetch the lora adapter 'bad': s3://holes/none: "),
             ("s3://holes/notlora", "cannot fetch the lora adapter 'bad': s3://holes/notlora: no "
                                    "adapter_config.json among the fetched files (config.json)"),
             ("hf://org/absent", "cannot fetch the lora adapter 'bad': hf://org/absent: "),
             ("pvc://models/absent", "cannot fetch the lora adapter 'bad': pvc://models/absent: no such file"),
             ("gs://bucket/x", "cannot fetch the lora adapter 'bad': gs://bucket/x: gs:// is not supported")]
    for uri, message in cases:
        r = _load(server, "bad", uri)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["message"].startswith(message), (uri, error)
        assert (error["code"], error["param"]) == ("invalid_lora_adapter", "lora_path")
    assert _models(server) == [("tiny", None), ("all", "tiny"), ("od", "tiny-v0")]


def test_load_and_unload_while_requests_stream(server, refs, llama_adapters):
    client = _client(server)
    results: dict[str, list[str]] = {}
    errors: list[BaseException] = []

    def stream(name: str, rounds: int) -> None:
        try:
            for _ in range(rounds):
                parts = client.completions.create(model=name, prompt=PROMPT, max_tokens=NEW,
                                                  temperature=0.0, stream=True,
                                                  extra_body={"ignore_eos": True})
                results.setdefault(name, []).append("".join(c.choices[0].text for c in parts))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(n, 3)) for n in ("tiny", "all", "od")]
    for t in threads:
        t.start()
    qv = {"lora_name": "qv", "lora_path": str(llama_adapters["qv-rslora"])}
    outcomes = []
    for _ in range(3):
        r = httpx.post(f"{server.url}/v1/load_lora_adapter", json=qv, headers=ADMIN, timeout=60)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'qv' added successfully."
        outcomes.append(_complete(client, "qv"))
        r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "qv"},
                       headers=ADMIN, timeout=60)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'qv' removed successfully."
        with pytest.raises(openai.NotFoundError):
            _complete(client, "qv")
    for t in threads:
        t.join(timeout=300)
    assert errors == []
    assert results == {n: [refs[n]] * 3 for n in ("tiny", "all", "od")}
    assert outcomes == [refs["qv"]] * 3
    assert [m for m, _ in _models(server)] == ["tiny", "all", "od"]


def test_lora_requests_info(server):
    text = httpx.get(f"{server.url}/metrics").text
    lines = [ln for ln in text.splitlines() if ln.startswith("vllm:lora_requests_info{")]
    assert len(lines) == 1
    labels = dict(re.findall(r'(\w+)="([^"]*)"', lines[0]))
    assert labels == {"max_lora": "2", "waiting_lora_adapters": "", "running_lora_adapters": ""}
    assert float(lines[0].rsplit(" ", 1)[1]) > 1.7e9                  # the time it was read


def test_lora_modules_without_enable_lora_is_a_cli_error():
    r = subprocess.run([sys.executable, "-m", "kvmesh.cli", "serve", "--lora-modules", "a=/x",
                        "--allocator", "none", "--log-level", "warning"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2
    assert r.stderr.strip().endswith("kvmesh serve: error: --lora-modules needs --enable-lora")
