"""The router's prompt hashing: the engine's chained hashes of a prompt's full blocks."""
from __future__ import annotations

from kvmesh.index.hashing import prompt_block_hashes


def test_prompt_block_hashes_cover_full_blocks_and_ignore_an_empty_salt():
    assert prompt_block_hashes([1] * 33, 16, "kvmesh") == prompt_block_hashes([1] * 32, 16,
                                                                               "kvmesh")
    assert prompt_block_hashes(None, 16, "kvmesh") == []
    assert prompt_block_hashes([1] * 16, 16, "kvmesh", "") == prompt_block_hashes([1] * 16, 16,
                                                                                  "kvmesh")
