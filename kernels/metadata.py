"""The attention metadata the model runner builds each step and every kernel reads."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from kvmesh.kernels.decode_plan import DecodeLaunch


@dataclass(slots=True)
class AttentionMetadata:
    """Describes one packed batch of queries against the paged KV cache.

    Sequence s owns query tokens query_start_loc[s] : query_start_loc[s+1] (its new tokens) and a
    context of seq_lens[s] tokens (cached + new). Its new tokens sit at the *end* of its context,
    so query token i of s has absolute position seq_lens[s] - query_len(s) + i, and attention is
    causal over positions. A decode is the case query_len == 1.

    With `sliding_window` W > 0 a query at position p sees only positions p - W + 1 .. p (W
    tokens, itself included: HF's `kv_idx > q_idx - W`). The runner builds one metadata per step
    with W = 0; a sliding-window layer asks for its view with `with_window(W)`.
    """

    slot_mapping: torch.Tensor      # [num_tokens] int64: block_id * block_size + offset; -1 = skip
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32: cu_seqlens of the packed queries
    seq_lens: torch.Tensor          # [num_seqs] int32: context length incl. this step's tokens
    block_tables: torch.Tensor      # [num_seqs, max_blocks_per_seq] int32, padded with 0
    max_query_len: int              # host copy, so no device sync is needed to pick a path
    max_seq_len: int                # host copy
    query_lens_cpu: list[int]       # host copies per sequence (the CPU reference loops on them)
    seq_lens_cpu: list[int]
    sliding_window: int = 0         # W > 0: attend to the last W positions only; 0: full causal
    # the decode kernel's split count and workspace for this step (Triton backend; the runner's
    # DecodePlanner sets it); None: the kernel's own rule and per-call partials
    decode_launch: DecodeLaunch | None = None
    # NOTE: with_window's views of this step, one per window, so every layer of one window gets
    # the same object (the reference backend caches its plan per metadata object).
    _window_views: dict = field(default_factory=dict, repr=False, compare=False)

    def with_window(self, window: int) -> "AttentionMetadata":
        """This batch with sliding window `window` (0: full attention); memoised per window."""
        if window == self.sliding_window:
            return self
        if window < 0:
            raise ValueError(f"sliding window must be >= 0 (0 = full attention), got {window}")
        view = self._window_views.get(window)
        if view is None:
            view = replace(self, sliding_window=window, _window_views={})
            self._window_views[window] = view
        return view

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_all_decode(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Build tensors from per-sequence host lists (used by the runner and by tests)."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            if q_len > s_len:
                raise ValueError(f"query_len {q_len} exceeds seq_len {s_len}")
            if len(table) * block_size < s_len:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {s_len} tokens")
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        cu = [0]
        for q_len in query_lens:
            cu.append(cu[-1] + q_len)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(cu, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(padded), max_blocks),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
        )
