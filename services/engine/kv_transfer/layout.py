"""Where a block's bytes lie in an engine's KV cache, and the reads that copy blocks between two.

The runner's cache is one tensor [layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim],
so each (layer, K|V) is a region of num_blocks equal slots: a run of consecutive block ids is
one contiguous range in every region. One read per region per run moves it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class KVLayout:
    base_addr: int          # address of the cache tensor's first byte (registered with Mooncake)
    num_regions: int        # layers x 2: one region per layer's K and per layer's V
    num_blocks: int         # slots per region
    block_bytes: int        # bytes of one block in one region (block_size x kv_heads x head_dim x item)
    dtype: str              # e.g. "float32": both sides must agree, as on block_bytes

    @property
    def region_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "KVLayout":
        return cls(int(d["base_addr"]), int(d["num_regions"]), int(d["num_blocks"]),
                   int(d["block_bytes"]), str(d["dtype"]))

    def compatible(self, other: "KVLayout") -> str | None:
        """Why blocks cannot be copied between the two caches (None: they can)."""
        if (self.num_regions, self.block_bytes, self.dtype) != (
                other.num_regions, other.block_bytes, other.dtype):
            return (f"KV layouts differ: {self.num_regions} regions of {self.block_bytes}-byte "
                    f"{self.dtype} blocks here, {other.num_regions} of {other.block_bytes}-byte "
                    f"{other.dtype} there (same model, --dtype and --block-size needed)")
        return None


def runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(local id, remote id) pairs, in order -> (local start, remote start, length) runs where
    both ids go up by one together."""
    out: list[tuple[int, int, int]] = []
    for local, remote in pairs:
        if out:
            l0, r0, n = out[-1]
            if local == l0 + n and remote == r0 + n:
                out[-1] = (l0, r0, n + 1)
                continue
        out.append((local, remote, 1))
    return out


def plan_reads(local: KVLayout, remote: KVLayout, local_ids: list[int],
               remote_ids: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(local addresses, remote addresses, lengths): one read per contiguous run per region,
    copying block remote_ids[i] of `remote` into local_ids[i] of `local` in every layer."""
    assert len(local_ids) == len(remote_ids), "one remote block per local block"
    bb = local.block_bytes
    laddrs: list[int] = []
    raddrs: list[int] = []
    lengths: list[int] = []
    for l0, r0, n in runs(list(zip(local_ids, remote_ids))):
        for region in range(local.num_regions):
            laddrs.append(local.base_addr + region * local.region_bytes + l0 * bb)
            raddrs.append(remote.base_addr + region * remote.region_bytes + r0 * bb)
            lengths.append(n * bb)
    return laddrs, raddrs, lengths
