"""The block hash is a cross-process contract (engine <-> router): pin it with golden values."""
import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest

from kvmesh.common.block_hash import (extend_block_hashes, hash_block, hash_hex,
                                      hash_prompt_blocks, root_hash)

ROOT_DEFAULT = "3a440074356bf4d1d9de7b2403cfec4c633ec0f7afbc903e87cfbe24698beae6"
ROOT_42 = "2e0167ffebd71cbecafd07d0e72995c31c9b8b2b383b2d655105115c298a464b"
BLOCK_1234 = "cc4536d3273fc72d5feb67ec26baebc335204ad5550675c16590fa2b082ab2f5"
CHAIN_10_BS4 = ["cfba37a94481bbd20a7b89a525057f0e8b8b8a4345f662a7d45e928bf7a18f38",
                "5454712b52075d9cdd48204edf79328570f673d9dc8623e2be612ca9496fdf48"]
CHAIN_SALTED = ["76d26ba963b7a5edbb23847f1392381036a74255cd98661289c199aaa3b28fdd",
                "6867c157114ccf2f13d988ea0dc9694d3022ccf9ad7ce7ff1616c62ddd46866b"]
CHAIN_SEED7 = ["9ae684cadbcde3ad45b37e6b5036c26c97d7e5a0443608b70e8c15e3bf2c4b06",
               "36f636a5c4b7387e34b3047259a3ec0da62d3efaa0e4302c730bceed6099f9be"]
EXTRA_KEYS = "919d6fd796a64dc91d8930fd3c21419c8ed17cadd24c2f190ce28566ccd93fa2"


def test_golden_values():
    assert root_hash().hex() == ROOT_DEFAULT
    assert root_hash("kvmesh").hex() == ROOT_DEFAULT
    assert root_hash(42).hex() == ROOT_42
    assert hash_block(root_hash(), [1, 2, 3, 4]).hex() == BLOCK_1234
    assert [hash_hex(h) for h in hash_prompt_blocks(list(range(10)), 4)] == CHAIN_10_BS4
    salted = hash_prompt_blocks(list(range(10)), 4, cache_salt="tenant-a")
    assert [h.hex() for h in salted] == CHAIN_SALTED
    assert [h.hex() for h in hash_prompt_blocks(list(range(10)), 4, seed=7)] == CHAIN_SEED7
    extra = ({"b": 1, "a": [1, "x"]}, "lora")
    assert hash_block(root_hash(), [0, 2**32 - 1], extra).hex() == EXTRA_KEYS


def test_encoding_matches_the_documented_format():
    """A from-scratch re-implementation of the documented encoding (what a router in another
    language would write) gives the same digests."""
    root = hashlib.sha256(b"kvmesh-root-v1\x00" + b'"kvmesh"').digest()
    assert root.hex() == ROOT_DEFAULT
    salt = json.dumps([{"cache_salt": "tenant-a"}], separators=(",", ":")).encode()
    msg = (b"kvmesh-block-v1\x00" + root + struct.pack("<I", 4) + struct.pack("<4I", 0, 1, 2, 3)
           + struct.pack("<I", len(salt)) + salt)
    assert hashlib.sha256(msg).hexdigest() == CHAIN_SALTED[0]
    msg = (b"kvmesh-block-v1\x00" + root + struct.pack("<I", 4) + struct.pack("<4I", 1, 2, 3, 4)
           + struct.pack("<I", 2) + b"[]")
    assert hashlib.sha256(msg).hexdigest() == BLOCK_1234


def test_chain_links_parent_and_only_full_blocks():
    h = hash_prompt_blocks(list(range(10)), 4)
    assert len(h) == 2                                  # tokens 8, 9 form no full block
    assert h[0] == hash_block(root_hash(), [0, 1, 2, 3])
    assert h[1] == hash_block(h[0], [4, 5, 6, 7])
    assert hash_prompt_blocks([1, 2, 3], 4) == []
    # same block content, different parent -> different hash
    assert hash_block(h[0], [0, 1, 2, 3]) != h[0]


def test_salt_and_seed_isolate_and_the_chain_carries_the_salt():
    plain = hash_prompt_blocks(list(range(12)), 4)
    a = hash_prompt_blocks(list(range(12)), 4, cache_salt="a")
    b = hash_prompt_blocks(list(range(12)), 4, cache_salt="b")
    assert len({plain[i] for i in range(3)} & set(a) & set(b)) == 0
    assert all(x != y for x, y in zip(a, b))
    # the salt enters block 0 only: block 1 is hashed from block 0's (salted) hash
    assert a[1] == hash_block(a[0], [4, 5, 6, 7])
    assert hash_prompt_blocks(list(range(8)), 4, seed="other")[0] != plain[0]


def test_extra_keys_are_canonical():
    r = root_hash()
    assert hash_block(r, [1], ({"x": 1, "y": 2},)) == hash_block(r, [1], ({"y": 2, "x": 1},))
    assert hash_block(r, [1], ("a",)) != hash_block(r, [1])
    assert hash_block(r, [1], ((1, 2),)) == hash_block(r, [1], ([1, 2],))


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40])
def test_token_id_range(bad):
    with pytest.raises(ValueError, match="2\\*\\*32"):
        hash_block(root_hash(), [1, bad])
    hash_block(root_hash(), [0, 2**32 - 1])


def test_argument_validation():
    with pytest.raises(ValueError):
        hash_block(b"short", [1])
    with pytest.raises(ValueError):
        hash_prompt_blocks([1, 2, 3, 4], 0)
    with pytest.raises(ValueError):
        hash_prompt_blocks([1, 2, 3, 4], 4, start=2, parent=root_hash())
    with pytest.raises(ValueError):
        hash_prompt_blocks([1, 2, 3, 4], 4, start=4)
    with pytest.raises(TypeError):
        root_hash(True)


def test_start_parent_and_incremental_extension_equal_the_full_chain():
    tokens = list(range(100, 137))
    full = hash_prompt_blocks(tokens, 8, cache_salt="s", seed=3)
    assert hash_prompt_blocks(tokens, 8, seed=3, start=16, parent=full[1]) == full[2:]
    existing: list[bytes] = []
    for n in range(len(tokens) + 1):
        new = extend_block_hashes(existing, tokens[:n], 8, 3, "s")
        assert new == (full[n // 8 - 1:n // 8] if n and n % 8 == 0 else [])
    assert existing == full


def test_deterministic_across_processes():
    code = ("from kvmesh.common.block_hash import hash_prompt_blocks as h;"
            "print(','.join(x.hex() for x in h(list(range(10)), 4, cache_salt='tenant-a')))")
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout.strip()
        assert out.split(",") == CHAIN_SALTED


def test_block_hasher_keeps_a_requests_hashes_in_step_with_its_tokens():
    from kvmesh.common.block_hash import BlockHasher
    from kvmesh.engine.request import Request
    from kvmesh.engine.sampling_params import SamplingParams

    hasher = BlockHasher(4, seed=3)
    req = Request("r", list(range(10)), SamplingParams(), 0.0, cache_salt="s", block_hasher=hasher)
    assert req.block_hashes == hash_prompt_blocks(list(range(10)), 4, seed=3, cache_salt="s")
    first = list(req.block_hashes)
    for t in (50, 51, 52, 53, 54, 55):
        req.append_output_token(t)
        # the chain grows by one hash exactly when a block fills, and never rewrites old ones
        expected = hash_prompt_blocks(req.all_token_ids, 4, seed=3, cache_salt="s")
        assert req.block_hashes == expected and req.block_hashes[:2] == first
    assert len(req.block_hashes) == 4
    with pytest.raises(ValueError):
        BlockHasher(0)
    with pytest.raises(TypeError):
        BlockHasher(4, seed=1.5)


def test_a_lora_adapters_name_follows_the_salt_in_block_0():
    """Two adapters, or an adapter and the base model, never share a block hash."""
    tokens = list(range(8))
    keys = json.dumps([{"cache_salt": "t"}, {"lora_name": "sql"}], separators=(",", ":")).encode()
    msg = (b"kvmesh-block-v1\x00" + root_hash() + struct.pack("<I", 4)
           + struct.pack("<4I", 0, 1, 2, 3) + struct.pack("<I", len(keys)) + keys)
    chain = hash_prompt_blocks(tokens, 4, cache_salt="t", lora_name="sql")
    assert chain[0].hex() == hashlib.sha256(msg).hexdigest()
    assert chain[1] == hash_block(chain[0], [4, 5, 6, 7])       # carried by the chain
    a = hash_prompt_blocks(tokens, 4, lora_name="a")
    b = hash_prompt_blocks(tokens, 4, lora_name="b")
    base = hash_prompt_blocks(tokens, 4)
    assert len(set(a) | set(b) | set(base)) == 6
    grown: list[bytes] = []
    extend_block_hashes(grown, tokens, 4, lora_name="a")
    assert grown == a
