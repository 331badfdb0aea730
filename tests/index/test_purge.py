"""The finalizer's purge: delete one service's keys by prefix, in batches (a fake client)."""
from __future__ import annotations

from typing import Any

from kvmesh.index import purge


class FakeRedis:
    def __init__(self, keys: list[str]) -> None:
        self.keys = set(keys)
        self.deletes: list[int] = []

    def scan_iter(self, match: str, count: int) -> Any:
        import fnmatch
        assert match == "kvmesh:team-a/smol:*"
        return iter(sorted(k for k in self.keys if fnmatch.fnmatchcase(k, match)))

    def delete(self, *keys: str) -> int:
        self.deletes.append(len(keys))
        self.keys -= set(keys)
        return len(keys)


def test_delete_keys_removes_only_the_services_prefix_in_batches() -> None:
    mine = [f"kvmesh:team-a/smol:block:{i}" for i in range(5)]
    others = ["kvmesh:team-a/smol2:block:0", "kvmesh:team-b/smol:block:0", "other"]
    fake = FakeRedis(mine + others)
    assert purge.delete_keys(fake, "team-a", "smol", batch=2) == 5
    assert fake.deletes == [2, 2, 1]
    assert fake.keys == set(others)
