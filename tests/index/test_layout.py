"""The Redis key layout: every key name of the prefix index, spelled in one module."""
from __future__ import annotations

from kvmesh.index.layout import (KeySpace, parse_block_member, parse_pod_block_member,
                                 pod_block_member)


def test_key_layout(monkeypatch):
    monkeypatch.setenv("POD_NAMESPACE", "prod")
    monkeypatch.setenv("KVMESH_SERVICE", "llama")
    k = KeySpace.from_env()
    assert k.prefix == "kvmesh:prod/llama:"
    assert k.block("m", "ab") == "kvmesh:prod/llama:blk:m:ab"
    assert k.pod("p-1") == "kvmesh:prod/llama:pod:p-1"
    assert k.pod_blocks("p-1") == "kvmesh:prod/llama:podblk:p-1"
    assert k.pods == "kvmesh:prod/llama:pods"
    assert KeySpace.from_env("ns", None).prefix == "kvmesh:ns/llama:"
    monkeypatch.delenv("POD_NAMESPACE")
    monkeypatch.delenv("KVMESH_SERVICE")
    assert KeySpace.from_env().prefix == "kvmesh:default/kvmesh:"
    assert KeySpace("a", "b").block_pattern("m*[x]") == r"kvmesh:a/b:blk:m\*\[x\]:*"
    assert parse_block_member("pod|with|bars|gpu") == ("pod|with|bars", "gpu")
    member = pod_block_member("cpu", "org|model", "ff")
    assert parse_pod_block_member(member) == ("cpu", "org|model", "ff")


def test_kv_bytes_and_purge_keys_share_the_service_prefix():
    k = KeySpace("team-a", "smol")
    assert k.kv_bytes_prefix("m", "float32", (2, 30, 16, 64)) == \
        "kvmesh:team-a/smol:kv:m:float32:2x30x16x64:"
    assert k.all_keys_pattern == "kvmesh:team-a/smol:*"
    assert KeySpace("a[1]", "b*").all_keys_pattern == r"kvmesh:a\[1\]/b\*:*"
