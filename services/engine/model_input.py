"""ModelInput: one packed forward pass as plain data, built from the scheduler's output.

The runner builds it, then runs the model on it; under tensor parallelism rank 0 sends the same
object to every worker (kvmesh.engine.parallel), which is why it is a msgspec struct of lists.
"""
from __future__ import annotations

import msgspec


class ModelInput(msgspec.Struct, array_like=True):
    input_ids: list[int]            # [T] the new tokens of every scheduled sequence, packed
    positions: list[int]            # [T] the absolute position of each
    query_lens: list[int]           # per sequence: its new tokens this step
    seq_lens: list[int]             # per sequence: its context including them
    block_tables: list[list[int]]   # per sequence: its KV blocks
    sample_rows: list[int]          # rows of the packed batch whose logits are sampled
    # row ranges whose logits rank 0 computes after the sampled rows' (prompt logprobs,
    # kvmesh.engine.prompt_logprobs.span_passes), in order: every rank runs the same LM-head passes
    logit_passes: list[tuple[int, int]] = []
    lora_slots: list[int] = []      # per sequence: its LoRA slot (-1: base); [] when none has one
