"""s3:// through the engine: `LLM(model="s3://...")` in this process, then a real `kvmesh serve
--model s3://...` answering the official openai client with the same tokens."""
from __future__ import annotations

from servers import start_server  # tests/support
from upload import upload

PROMPT = "w5 w9 w17 w33"


def test_llm_and_kvmesh_serve_load_an_s3_model(moto_server, s3_env, bucket, tiny_model, tmp_path):
    from openai import OpenAI

    from kvmesh import LLM, SamplingParams

    upload(moto_server.client(), bucket, "team/tiny-llama", tiny_model)
    uri = f"s3://{bucket}/team/tiny-llama"
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    # NOTE: the fetched files are the uploaded bytes (test_s3_fetch checks them), so the fetched
    # model's own greedy tokens are the reference the server must give
    with LLM(model=uri, dtype="float32", attention_backend="reference", num_kv_blocks=32) as remote:
        assert remote.engine.model_name == "tiny-llama"
        assert str(remote.engine.loaded.path).startswith(str(s3_env))
        want = remote.generate(PROMPT, greedy)[0].outputs[0]
    assert len(want.token_ids) == 6

    server = start_server(tmp_path, "--model", uri, "--attention-backend", "reference",
                          "--num-kv-blocks", "32", env=moto_server.env(KVMESH_MODEL_CACHE_DIR=str(s3_env)))
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny-llama"]
        answer = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=6,
                                           temperature=0.0, extra_body={"ignore_eos": True})
        assert answer.choices[0].text == want.text
        assert answer.usage.completion_tokens == 6
    finally:
        assert server.stop() == 0, server.log()[-3000:]
    log = server.log()
    assert f"fetching model ({uri}) ..." in log and "fetching model: done in" in log
    assert f"{uri}: cached at {next(s3_env.glob('*/tiny-llama'))}" in log   # LLM fetched it first


def test_kvmesh_serve_exits_2_naming_the_uri(moto_server, s3_env, bucket, capsys):
    from kvmesh.api.server import main

    assert main(["--model", f"s3://{bucket}/absent"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"kvmesh serve: error: s3://{bucket}/absent: no model files under this prefix (none of "
        "config.json, *.safetensors, *.gguf, tokenizer*: is the prefix right?)")
