import json

import pytest

from kvmesh.common.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
                                     KVEventSequencer, event_from_dict)

H0, H1 = bytes(range(32)), bytes(range(1, 33))


def test_round_trip_through_json():
    events = [BlockStored([H0, H1], None, [1, 2, 3, 4], 2),
              BlockStored([H1], H0, [3, 4], 2, medium="cpu", lora_id=7, lora_name="sql"),
              BlockRemoved([H0]), AllBlocksCleared()]
    batch = KVEventBatch(3, 12.5, events)
    wire = json.loads(json.dumps(batch.to_dict()))
    assert wire["events"][0] == {"type": "BlockStored", "block_hashes": [H0.hex(), H1.hex()],
                                 "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
                                 "block_size": 2, "medium": "gpu", "lora_id": None,
                                 "lora_name": None}
    assert wire["events"][1]["lora_id"] == 7 and wire["events"][1]["lora_name"] == "sql"
    assert wire["events"][2] == {"type": "BlockRemoved", "block_hashes": [H0.hex()],
                                 "medium": "gpu"}
    assert KVEventBatch.from_dict(wire) == batch
    assert BlockRemoved.from_dict(wire["events"][2]) == BlockRemoved([H0])


def test_unknown_type():
    with pytest.raises(ValueError, match="unknown"):
        event_from_dict({"type": "Nope"})


def test_sequencer_numbers_non_empty_batches():
    seq = KVEventSequencer()
    assert seq.batch([]) is None
    b0 = seq.batch([AllBlocksCleared()], ts=1.0)
    b1 = seq.batch([BlockRemoved([H0])], ts=2.0)
    assert (b0.seq, b0.ts, b1.seq) == (0, 1.0, 1)
    assert b1.events == [BlockRemoved([H0])]
