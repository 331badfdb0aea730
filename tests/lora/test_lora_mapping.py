"""LoRAMapping: a step's adapter tokens grouped by slot, and the runs that let the CPU path use
views of the batch instead of gathering rows."""
import torch

from kvmesh.engine.lora.mapping import LoRAMapping

CPU = torch.device("cpu")


def test_sequences_grouped_by_adapter_are_runs_of_batch_rows():
    m = LoRAMapping()
    # sequence slots and query lengths: a prefill of 3 tokens on slot 1, two decodes on slot 0,
    # a base decode, then slot 2's prefill of 2
    m.update([1, 0, 0, -1, 2], [3, 1, 1, 1, 2], CPU)
    assert m.active
    assert m.rows.tolist() == [3, 4, 0, 1, 2, 6, 7]
    assert m.starts == [0, 2, 5, 7] and m.slots == [0, 1, 2]
    assert m.runs == [(3, 5), (0, 3), (6, 8)]
    assert m.max_seg_len == 3


def test_interleaved_adapters_are_gathered():
    m = LoRAMapping()
    m.update([0, 1, 0, -1], [1, 1, 1, 1], CPU)
    assert m.rows.tolist() == [0, 2, 1]
    assert m.starts == [0, 2, 3] and m.slots == [0, 1]
    assert m.runs is None


def test_a_base_only_step_is_inactive():
    m = LoRAMapping()
    m.update([0], [4], CPU)
    m.update([-1, -1], [2, 1], CPU)
    assert not m.active


def test_several_segments_of_similar_length_are_padded_for_two_bmm():
    m = LoRAMapping()
    # slot 0: rows 0, 3, 4 (3 tokens); slot 1: rows 1, 2 (2 tokens); 6 padded rows for 5 real
    m.update([0, 1, 1, 0], [1, 1, 1, 2], CPU)
    assert m.rows.tolist() == [0, 3, 4, 1, 2] and m.runs is None
    p = m.padded
    assert p.length == 3 and p.slots.tolist() == [0, 1]
    assert p.gather.tolist() == [0, 3, 4, 1, 2, 0]       # the padding repeats rows[0]
    assert p.keep.tolist() == [0, 1, 2, 3, 4]
    assert p.slot_range == (0, 2)                        # slots 0..1: the weights are views


def test_slots_with_a_gap_gather_their_weights():
    m = LoRAMapping()
    m.update([3, 1, 3, 1], [1, 1, 1, 1], CPU)
    assert m.padded.slots.tolist() == [1, 3] and m.padded.slot_range is None


def test_padding_beyond_four_times_the_rows_falls_back_to_the_loop():
    m = LoRAMapping()
    # slot 0 has 20 tokens, slots 1-4 one each: 5 x 20 = 100 padded rows for 24 real
    m.update([0, 1, 2, 3, 4], [20, 1, 1, 1, 1], CPU)
    assert m.padded is None and m.runs == [(0, 20), (20, 21), (21, 22), (22, 23), (23, 24)]
    m.update([0, 1, 2, 3], [13, 1, 1, 1], CPU)          # 4 x 13 = 52 for 16: padded
    assert m.padded.length == 13
    m.update([1, 0, 0, 1], [1, 1, 1, 1], CPU)           # equal segments: no padding at all
    assert m.padded.keep is None and m.padded.gather.tolist() == [1, 2, 0, 3]
