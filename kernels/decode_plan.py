"""How a decode step is split (flash-decoding) and where the split partials live.

The decode kernel (`paged_attention.py`) cuts each sequence's context into at most NUM_SPLITS
slices of at least `min_split_tokens` tokens; with more than one slice per sequence, each slice
writes a float32 partial and its log-sum-exp and a second kernel merges them. This module holds
the host side of that choice:

  * `decode_splits`: the rule (SMs, KV heads, context) for NUM_SPLITS, a power of two;
  * `DecodeWorkspace`: the partials and LSEs, allocated once for the engine's largest decode
    and reused by every layer of every step and by the CUDA graphs captured over it;
  * `DecodePlanner`: what the model runner asks per step: `launch(num_seqs, max_seq_len,
    graph=...)` -> `DecodeLaunch`, carried to the kernel in `AttentionMetadata.decode_launch`.

NOTE: a CUDA graph bakes in NUM_SPLITS (a constexpr), so a graph's count is the rule at the
longest context (`max_model_len`) for its padded batch size, whatever the context it is
captured with or replayed at. The kernel makes that cheap at short context: a sequence uses only
cdiv(context, chunk) of its splits, the others return at once, and a sequence left with one
split writes its output directly (the merge kernel skips it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# NOTE: below ~512 tokens a split's K/V read (512 x 128 x 2 B x 2 = 256 KiB per KV head in
# bf16) is short enough that a second launch plus the partials' round trip cost more than the
# parallelism gains; benchmarks/paged_decode_kernel.py --min-split-tokens measures it.
DEFAULT_MIN_SPLIT_TOKENS = 512
MAX_SPLITS = 64
_WAVES = 2        # programs to fill about this many waves of SMs


def decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int, *,
                  min_split_tokens: int = DEFAULT_MIN_SPLIT_TOKENS,
                  max_splits: int = MAX_SPLITS) -> int:
    """NUM_SPLITS for a decode of `num_seqs` sequences up to `max_seq_len` tokens on a GPU of
    `num_sms` SMs: enough (seq, KV head, split) programs for ~2 waves, no split shorter than
    `min_split_tokens`, rounded up to a power of two (few compiled variants). 1 = one launch."""
    if min(num_seqs, num_kv_heads, num_sms, min_split_tokens, max_splits) < 1:
        raise ValueError("decode_splits needs num_seqs, num_kv_heads, num_sms, min_split_tokens "
                         f"and max_splits >= 1, got {num_seqs}, {num_kv_heads}, {num_sms}, "
                         f"{min_split_tokens}, {max_splits}")
    want = -(-_WAVES * num_sms // (num_seqs * num_kv_heads))
    cap = max(1, max_seq_len // min_split_tokens)        # each split gets >= min_split_tokens
    n = max(1, min(want, cap, max_splits))
    return 1 << (n - 1).bit_length()


def split_counts(max_num_seqs: int, num_kv_heads: int, max_model_len: int, num_sms: int, *,
                 min_split_tokens: int = DEFAULT_MIN_SPLIT_TOKENS) -> dict[int, int]:
    """NUM_SPLITS per decode batch size 1..max_num_seqs at the longest context: the most any
    step of that size uses (the count only falls as the context shrinks)."""
    return {b: decode_splits(b, num_kv_heads, max_model_len, num_sms,
                             min_split_tokens=min_split_tokens)
            for b in range(1, max_num_seqs + 1)}


@dataclass(slots=True)
class DecodeLaunch:
    """The decode kernel's split choice for one step (read by `triton_ops.paged_attention`)."""
    num_splits: int                 # NUM_SPLITS (constexpr); 1 = one launch, no partials
    min_split_tokens: int           # a sequence uses cdiv(context, >= this) of its splits
    workspace: "DecodeWorkspace | None" = None   # partials and LSEs; None: allocated per call


@dataclass(slots=True)
class DecodeWorkspace:
    """Float32 partials [rows, heads, head_dim] and LSEs [rows, heads], rows = seq x split,
    preallocated; `views` hands out [num_seqs, heads, splits(, head_dim)] views of the front."""
    part: torch.Tensor      # [capacity * head_dim] fp32, flat
    lse: torch.Tensor       # [capacity] fp32, flat; capacity = rows * heads

    @classmethod
    def allocate(cls, rows: int, num_heads: int, head_dim: int,
                 device: torch.device | str) -> "DecodeWorkspace":
        n = rows * num_heads
        return cls(torch.empty(n * head_dim, dtype=torch.float32, device=device),
                   torch.empty(n, dtype=torch.float32, device=device))

    def views(self, num_seqs: int, num_heads: int, num_splits: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = num_seqs * num_heads * num_splits
        if n * head_dim > self.part.numel() or n > self.lse.numel():
            raise ValueError(f"the decode workspace holds {self.lse.numel()} (seq, head, split) "
                             f"rows of head_dim <= {self.part.numel() // max(1, self.lse.numel())}; "
                             f"this decode needs {n} of head_dim {head_dim} ({num_seqs} seqs x "
                             f"{num_heads} heads x {num_splits} splits)")
        return (self.part[:n * head_dim].view(num_seqs, num_heads, num_splits, head_dim),
                self.lse[:n].view(num_seqs, num_heads, num_splits))


class DecodePlanner:
    """Owns the decode workspace of one engine and picks each step's split count.

    `graph=True`: the step replays (or is captured as) a CUDA graph of batch size `num_seqs`,
    so the count is that size's fixed one (the rule at `max_model_len`); otherwise the rule at
    the step's own longest context (often 1 split: one launch).
    """

    def __init__(self, max_num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 max_model_len: int, num_sms: int, device: torch.device | str, *,
                 min_split_tokens: int = DEFAULT_MIN_SPLIT_TOKENS) -> None:
        self.num_kv_heads = num_kv_heads
        self.max_model_len = max_model_len
        self.num_sms = num_sms
        self.min_split_tokens = min_split_tokens
        self.graph_splits = split_counts(max_num_seqs, num_kv_heads, max_model_len, num_sms,
                                         min_split_tokens=min_split_tokens)
        # NOTE: only multi-split decodes use the workspace; its rows are the most (seq, split)
        # pairs any batch size asks for (~2 waves of programs / KV heads, x2 for the rounding)
        self.rows = max([b * s for b, s in self.graph_splits.items() if s > 1], default=0)
        self.workspace = (DecodeWorkspace.allocate(self.rows, num_heads, head_dim, device)
                          if self.rows else None)

    def splits(self, num_seqs: int, max_seq_len: int, *, graph: bool = False) -> int:
        num_seqs = max(1, num_seqs)
        if graph and num_seqs in self.graph_splits:
            return self.graph_splits[num_seqs]
        n = decode_splits(num_seqs, self.num_kv_heads, max(1, max_seq_len), self.num_sms,
                          min_split_tokens=self.min_split_tokens)
        # NOTE: a step past the limits the planner was given (a tensor-parallel worker's runner
        # gets the defaults) could ask for a count that start-up did not warm, or for more rows
        # than the workspace holds: fewer splits, never a compile or an allocation per step
        n = min(n, self.variants()[-1])
        while n > 1 and num_seqs * n > self.rows:
            n //= 2
        return n

    def launch(self, num_seqs: int, max_seq_len: int, *, graph: bool = False) -> DecodeLaunch:
        return DecodeLaunch(self.splits(num_seqs, max_seq_len, graph=graph), self.min_split_tokens,
                            self.workspace)

    def variants(self) -> list[int]:
        """Every NUM_SPLITS a step can use, eager or graph (the powers of two up to the largest
        graph count: an eager step's count falls with its context): what start-up warms."""
        top = max(self.graph_splits.values(), default=1)
        return [1 << i for i in range(top.bit_length())]


__all__ = ["DEFAULT_MIN_SPLIT_TOKENS", "DecodeLaunch", "DecodePlanner", "DecodeWorkspace",
           "decode_splits", "split_counts"]
