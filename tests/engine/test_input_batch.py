"""The persistent batch: exact inputs per step, block tables mirrored incrementally, padding."""
from __future__ import annotations

import pytest
import torch

from kvmesh.engine.input_batch import InputBatch
from kvmesh.engine.model_input import ModelInput
from kvmesh.kernels.metadata import AttentionMetadata

BS = 4


def _step(batch, seqs, sample_rows, **kw):
    """seqs: (key, all_token_ids, start, num_tokens, table)."""
    batch.begin()
    firsts = [batch.add(*s) for s in seqs]
    return firsts, batch.finish(sample_rows, **kw)


def _as_built(step, query_lens, seq_lens, tables):
    ref = AttentionMetadata.build(query_lens, seq_lens, tables, BS)
    m = step.meta
    assert m.slot_mapping.tolist() == ref.slot_mapping.tolist()
    assert m.query_start_loc.tolist() == ref.query_start_loc.tolist()
    assert m.seq_lens.tolist() == ref.seq_lens.tolist()
    width = ref.block_tables.shape[1]
    for s, t in enumerate(tables):
        need = -(-seq_lens[s] // BS)
        assert m.block_tables[s, :need].tolist() == t[:need]
    assert m.block_tables.shape[1] <= width
    assert (m.max_query_len, m.max_seq_len) == (ref.max_query_len, ref.max_seq_len)
    assert (m.query_lens_cpu, m.seq_lens_cpu) == (query_lens, seq_lens)


def test_a_mixed_step_matches_the_list_builder():
    batch = InputBatch(BS, torch.device("cpu"), max_num_seqs=4, max_num_tokens=32, max_blocks_per_seq=8)
    a, b = list(range(100, 110)), list(range(200, 203))
    ta, tb = [7, 3, 9], [5]
    firsts, step = _step(batch, [("a", a, 4, 6, ta), ("b", b, 2, 1, tb)], [5, 6])
    assert firsts == [0, 6]
    assert step.input_ids.tolist() == a[4:10] + [b[2]]
    assert step.positions.tolist() == [4, 5, 6, 7, 8, 9, 2]
    # a: positions 4..9 -> block 3 (offsets 0..3), block 9 (offsets 0..1); b: block 5 offset 2
    assert step.meta.slot_mapping.tolist() == [12, 13, 14, 15, 36, 37, 22]
    assert step.sample_rows.tolist() == [5, 6] and step.sample_list == [5, 6]
    assert (step.num_tokens, step.num_seqs, step.padded_size) == (7, 2, 7)
    _as_built(step, [6, 1], [10, 3], [ta, tb])


def test_block_tables_are_appended_and_the_written_block_rewritten():
    batch = InputBatch(BS, torch.device("cpu"), max_num_seqs=2, max_num_tokens=8, max_blocks_per_seq=8)
    table = [4, 6]
    toks = list(range(20))
    _step(batch, [("r", toks, 7, 1, table)], [0])
    table.append(11)                                     # the live table grows by one block
    _, step = _step(batch, [("r", toks, 8, 1, table)], [0])
    assert step.meta.block_tables.tolist() == [[4, 6, 11]]
    assert batch._upd_cols == [2]                        # only the new block was written
    assert step.meta.slot_mapping.tolist() == [44]
    table[2] = 13                                        # copy-on-write swapped the written block
    _, step = _step(batch, [("r", toks, 9, 1, table)], [0])
    assert step.meta.block_tables.tolist() == [[4, 6, 13]]
    assert step.meta.slot_mapping.tolist() == [53]
    assert batch._upd_cols == [2]
    _, step = _step(batch, [("r", toks, 9, 1, [2, 1, 0])], [0])   # a new table (after preemption)
    assert step.meta.block_tables.tolist() == [[2, 1, 0]]
    assert batch._upd_cols == [0, 1, 2]


def test_rows_are_reclaimed_from_requests_that_left():
    batch = InputBatch(BS, torch.device("cpu"), max_num_seqs=1, max_num_tokens=4, max_blocks_per_seq=2)
    for i in range(7):                                   # 3 rows (1 padding + 2): reclaimed as needed
        _, step = _step(batch, [(f"r{i}", [1, 2, 3], 2, 1, [i])], [0])
        assert step.meta.block_tables.tolist() == [[i]]
        assert step.meta.slot_mapping.tolist() == [i * BS + 2]
    assert len(batch._row_of) <= 2


def test_a_decode_pads_with_rows_that_write_nothing_and_are_not_sampled():
    batch = InputBatch(BS, torch.device("cpu"), max_num_seqs=8, max_num_tokens=8, max_blocks_per_seq=4)
    _, step = _step(batch, [("a", [5, 6, 7], 2, 1, [3]), ("b", [8, 9], 1, 1, [1])], [0, 1], pad_to=4)
    assert step.input_ids.tolist() == [7, 9, 0, 0]
    assert step.positions.tolist() == [2, 1, 0, 0]
    assert step.meta.slot_mapping.tolist() == [14, 5, -1, -1]
    assert step.meta.seq_lens.tolist() == [3, 2, 1, 1]
    assert step.meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert step.meta.block_tables.tolist() == [[3], [1], [0], [0]]
    assert step.sample_rows.tolist() == [0, 1]
    assert (step.num_tokens, step.padded_size) == (2, 4)
    _, full = _step(batch, [("a", [5, 6, 7, 1], 3, 1, [3])], [0], pad_to=2, full_width=True)
    assert full.meta.block_tables.tolist() == [[3, 0, 0, 0], [0, 0, 0, 0]]
    assert full.sample_rows.tolist() == [0, 0]           # a graph gathers N rows; one is real


def test_only_a_decode_only_step_pads():
    batch = InputBatch(BS, torch.device("cpu"))
    batch.begin()
    batch.add("a", [1, 2, 3], 0, 3, [0])
    with pytest.raises(ValueError, match="only a decode-only step pads"):
        batch.finish([2], pad_to=4)


def test_buffers_grow_past_their_limits():
    batch = InputBatch(BS, torch.device("cpu"), max_num_seqs=1, max_num_tokens=2, max_blocks_per_seq=1)
    gen = batch.generation
    toks = list(range(40))
    _, step = _step(batch, [("a", toks, 0, 10, [0, 1, 2]), ("b", toks, 30, 1, list(range(3, 11)))], [9, 10])
    assert batch.generation > gen
    _as_built(step, [10, 1], [10, 31], [[0, 1, 2], list(range(3, 11))])


def test_a_worker_step_given_as_lists():
    batch = InputBatch(BS, torch.device("cpu"))
    mi = ModelInput([11, 12, 13, 21], [0, 1, 2, 5], [3, 1], [3, 6], [[2], [0, 4]], [2, 3], [(0, 2)])
    step = batch.from_model_input(mi)
    assert step.input_ids.tolist() == [11, 12, 13, 21]
    assert step.positions.tolist() == [0, 1, 2, 5]
    assert step.meta.slot_mapping.tolist() == [8, 9, 10, 17]
    assert step.to_model_input() == mi
