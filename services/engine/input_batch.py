"""The persistent batch: one step's model inputs, filled in place in buffers the runner keeps.

Every field the forward pass reads lives at a fixed offset of one byte buffer:

    [ input_ids | positions | slot_mapping | sample_rows | query_start_loc | seq_lens | block_tables ]
      int64 [T]   int64 [T]   int64 [T]      int64 [T]     int32 [S + 1]     int32 [S]  int32 [S * W]

On CPU that buffer is what the model reads (numpy writes, torch views, no copy). On CUDA it is a
pinned host staging buffer mirrored by a device buffer of the same layout: a step is one
non-blocking copy of the bytes in use (the block tables come last, so the prefix up to the step's
table is everything). The torch views of each region are made once, so a step slices them
instead of building a tensor per field (CUDA graphs capture those very views).

Block tables persist per request: a request keeps its row while it runs, and each step writes only
what changed in its table (the blocks appended since, plus the block this step writes, which a
copy-on-write may have replaced); the step's [S, W] table is one gather of those rows. A row whose
request ran in none of the recent steps is reclaimed when rows run short.

A decode-only step can be padded to a larger batch (the next captured CUDA graph size): padding
rows read token 0 at position 0 with a context of one token through the all-zero row 0, write
slot -1 (the cache writes skip it) and are never sampled.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvmesh.engine.model_input import ModelInput
from kvmesh.kernels.metadata import AttentionMetadata

_PAD_ROW = 0            # the block-table row of padding sequences: all zeros, never assigned


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class BatchInput:
    """One step's forward inputs, as views of the batch's buffers (valid until the next step)."""
    input_ids: torch.Tensor         # [N] int64, N = num_tokens + padding
    positions: torch.Tensor         # [N] int64
    meta: AttentionMetadata         # num_seqs + padding sequences
    sample_rows: torch.Tensor       # [K] int64 rows whose logits are sampled ([N] when padded for a graph)
    sample_list: list[int]          # host copy of the K real sample rows
    num_tokens: int                 # T: real tokens (rows past T are padding)
    num_seqs: int                   # S: real sequences
    padded_size: int                # N: tokens (= sequences) after padding; == num_tokens unpadded
    logit_passes: list[tuple[int, int]]  # prompt-logprob LM-head row ranges (tensor parallelism)
    # host lists of the real sequences, for `to_model_input` (tensor parallelism)
    token_ids: list[int]
    starts: list[int]
    query_lens: list[int]
    tables: list[list[int]]
    # --enable-lora: per sequence its adapter slot (-1: base); None when no sequence has one
    lora_slots: list[int] | None = None

    def to_model_input(self) -> ModelInput:
        """The same step as plain lists (what a tensor-parallel driver sends its workers)."""
        positions = [p for s, q in zip(self.starts, self.query_lens) for p in range(s, s + q)]
        seq_lens = [s + q for s, q in zip(self.starts, self.query_lens)]
        return ModelInput(list(self.token_ids), positions, list(self.query_lens), seq_lens,
                          [list(t) for t in self.tables], list(self.sample_list),
                          list(self.logit_passes),
                          [] if self.lora_slots is None else list(self.lora_slots))


@dataclass(slots=True)
class _Layout:
    """Byte offsets of each region for capacities of T tokens, S sequences, W blocks a row."""
    tokens: int
    seqs: int
    width: int
    ids: int = 0
    pos: int = 0
    slots: int = 0
    samples: int = 0
    qsl: int = 0
    seq_lens: int = 0
    tables: int = 0
    nbytes: int = 0

    def __post_init__(self) -> None:
        t8 = self.tokens * 8
        self.ids, self.pos, self.slots, self.samples = 0, t8, 2 * t8, 3 * t8
        self.qsl = 4 * t8
        self.seq_lens = self.qsl + _round16((self.seqs + 1) * 4)
        self.tables = self.seq_lens + _round16(self.seqs * 4)
        self.nbytes = self.tables + self.seqs * self.width * 4


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


class InputBatch:
    """Persistent inputs of the model runner: begin() / add(...) per sequence / finish()."""

    def __init__(self, block_size: int, device: torch.device, max_num_seqs: int = 8,
                 max_num_tokens: int = 256, max_blocks_per_seq: int = 16) -> None:
        self.block_size = block_size
        self.device = device
        self.generation = 0           # bumped when buffers are reallocated (graphs hold views)
        self._copy_done: torch.cuda.Event | None = None
        self._alloc(_Layout(max(1, max_num_tokens), max(1, max_num_seqs), max(1, max_blocks_per_seq)))
        # persistent rows: request key -> row of `_rows_np`; row 0 is the padding row
        num_rows = 2 * max(1, max_num_seqs) + 1
        self._rows_np = np.zeros((num_rows, self._layout.width), dtype=np.int32)
        self._row_of: dict[str, int] = {}
        self._row_key: list[str | None] = [None] * num_rows
        self._row_table: list[list[int] | None] = [None] * num_rows   # the table object mirrored
        self._row_len: list[int] = [0] * num_rows                      # entries mirrored
        self._row_seen: list[int] = [-1] * num_rows                    # last step that used it
        self._free_rows: list[int] = list(range(num_rows - 1, 0, -1))
        self._step = 0
        self.begin()

    # ---- buffers -----------------------------------------------------------------------------
    def _alloc(self, layout: _Layout) -> None:
        self._layout = layout
        cuda = self.device.type == "cuda"
        host = torch.zeros(layout.nbytes, dtype=torch.uint8, pin_memory=cuda)
        self._host = host
        np_buf = host.numpy()
        (self._np_ids, self._np_pos, self._np_slots, self._np_samples, self._np_qsl,
         self._np_seq_lens, self._np_tables) = _field_views(np_buf, layout, np.int64, np.int32)
        dev = torch.zeros(layout.nbytes, dtype=torch.uint8, device=self.device) if cuda else host
        self._dev = dev
        (self.ids, self.pos, self.slots, self.samples, self.qsl, self.seq_lens,
         self.tables) = _field_views(dev, layout, torch.int64, torch.int32)
        self.generation += 1

    def _ensure(self, tokens: int, seqs: int, width: int) -> None:
        lay = self._layout
        if tokens <= lay.tokens and seqs <= lay.seqs and width <= lay.width:
            return
        # NOTE: only when a step outgrows the limits the runner was given (e.g. a tensor-parallel
        # worker, which is given none): CUDA graphs captured on the old buffers stop replaying.
        self._wait_copy()
        self._alloc(_Layout(max(tokens, lay.tokens), max(seqs, lay.seqs), max(width, lay.width)))

    def _ensure_width(self, width: int) -> None:
        if width > self._rows_np.shape[1]:
            grown = np.zeros((self._rows_np.shape[0], max(width, 2 * self._rows_np.shape[1])),
                             dtype=np.int32)
            grown[:, :self._rows_np.shape[1]] = self._rows_np
            self._rows_np = grown

    @property
    def max_blocks_per_seq(self) -> int:
        return self._layout.width

    def _wait_copy(self) -> None:
        # NOTE: the staging buffer is rewritten only once the previous step's copy out of it
        # has finished (a step without sampling has no later sync that would guarantee it).
        if self._copy_done is not None:
            self._copy_done.synchronize()
            self._copy_done = None

    # ---- persistent rows -----------------------------------------------------------------------
    def _claim_row(self, key: str) -> int:
        if not self._free_rows:
            self._reclaim()
        row = self._free_rows.pop()
        self._row_of[key] = row
        self._row_key[row] = key
        self._row_table[row] = None
        self._row_len[row] = 0
        return row

    def _reclaim(self) -> None:
        """Free every row not used by this step; grow the rows when that frees none."""
        for key, row in list(self._row_of.items()):
            if self._row_seen[row] != self._step:
                del self._row_of[key]
                self._row_key[row] = None
                self._row_table[row] = None
                self._free_rows.append(row)
        if not self._free_rows:
            old = self._rows_np.shape[0]
            self._rows_np = np.concatenate([self._rows_np, np.zeros_like(self._rows_np)])
            for lst, fill in ((self._row_key, None), (self._row_table, None), (self._row_len, 0),
                              (self._row_seen, -1)):
                lst.extend([fill] * old)
            self._free_rows.extend(range(2 * old - 1, old - 1, -1))

    def _mirror(self, key: str, table: list[int], start: int) -> int:
        """The row of `key`, updated to `table` (the request's live block table)."""
        row = self._row_of.get(key)
        if row is None:
            row = self._claim_row(key)
        n = len(table)
        done = self._row_len[row]
        if self._row_table[row] is table and done <= n:
            # NOTE: tables only grow, except that copy-on-write swaps the block being written
            # (from the one holding `start` on): rewrite from there, append the rest.
            lo = min(done, start // self.block_size)
        else:
            lo = 0                   # a new request, or a new table (after preemption or swap)
            self._row_table[row] = table
        if lo < n:
            if n - lo == 1:
                self._upd_rows.append(row)
                self._upd_cols.append(lo)
                self._upd_vals.append(table[lo])
            else:
                self._upd_rows.extend([row] * (n - lo))
                self._upd_cols.extend(range(lo, n))
                self._upd_vals.extend(table[lo:n])
            if n > self._upd_width:
                self._upd_width = n
        self._row_len[row] = n
        self._row_seen[row] = self._step
        return row

    # ---- one step ------------------------------------------------------------------------------
    def begin(self) -> None:
        self._step += 1
        self._token_ids: list[int] = []
        self._rows: list[int] = []
        self._starts: list[int] = []
        self._qlens: list[int] = []
        self._seq_lens: list[int] = []
        self._tables: list[list[int]] = []
        self._lora_slots: list[int] = []
        self._any_lora = False
        self._upd_rows: list[int] = []
        self._upd_cols: list[int] = []
        self._upd_vals: list[int] = []
        self._upd_width = 0

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_seqs(self) -> int:
        return len(self._rows)

    def add(self, key: str, all_token_ids: Sequence[int], start: int, num_tokens: int,
            table: list[int], lora_slot: int = -1, late: bool = False) -> int:
        """Add one sequence computing `all_token_ids[start:start + num_tokens]` (its KV blocks:
        `table`, the live list, mirrored incrementally by `key`; `lora_slot`: its adapter's
        slot, -1 for the base model); returns its first token's row. `late`: a decode whose
        token the host does not have yet (async scheduling): its id is written as 0 here and
        the runner fills it on the device after `finish`."""
        first = len(self._token_ids)
        if late:
            assert num_tokens == 1 and start == len(all_token_ids), \
                "only a decode's one token is in flight"
            self._token_ids.append(0)
        elif num_tokens == 1:
            self._token_ids.append(all_token_ids[start])
        else:
            self._token_ids.extend(all_token_ids[start:start + num_tokens])
        self._rows.append(self._mirror(key, table, start))
        self._starts.append(start)
        self._qlens.append(num_tokens)
        self._seq_lens.append(start + num_tokens)
        self._tables.append(table)
        self._lora_slots.append(lora_slot)
        if lora_slot >= 0:
            self._any_lora = True
        return first

    def finish(self, sample_rows: list[int], logit_passes: list[tuple[int, int]] = (),
               pad_to: int | None = None, full_width: bool = False) -> BatchInput:
        """The step's inputs. `pad_to` N (a decode-only step: one token per sequence) adds N - S
        padding sequences; `full_width` lays the block tables out at their capacity width (the
        layout a CUDA graph was captured with)."""
        T, S = len(self._token_ids), len(self._rows)
        if pad_to is not None:
            if T != S or pad_to < S:
                raise ValueError(f"only a decode-only step pads, to at least its {S} sequences "
                                 f"(got {T} tokens, pad_to={pad_to})")
            N = pad_to
        else:
            N = T
        seqs = S if pad_to is None else N
        bs = self.block_size
        self._wait_copy()
        if self._upd_width:
            self._ensure_width(self._upd_width)
            self._rows_np[self._upd_rows, self._upd_cols] = self._upd_vals
        seq_lens_np = np.asarray(self._seq_lens, dtype=np.int64)
        need_width = int((seq_lens_np.max() + bs - 1) // bs) if S else 0
        self._ensure(N, seqs, max(need_width, 1))
        width = self._layout.width if full_width else max(need_width, 1)
        rows_np = np.asarray(self._rows, dtype=np.int64)
        starts_np = np.asarray(self._starts, dtype=np.int64)

        self._np_ids[:T] = self._token_ids
        qsl = self._np_qsl
        qsl[0] = 0
        if T == S:
            pos = starts_np
            token_rows = rows_np
            qsl[1:S + 1] = np.arange(1, S + 1, dtype=np.int32)
        else:
            qlens_np = np.asarray(self._qlens, dtype=np.int64)
            np.cumsum(qlens_np, out=qsl[1:S + 1])
            seq_of = np.repeat(np.arange(S), qlens_np)
            pos = starts_np[seq_of] + (np.arange(T) - qsl[:S].astype(np.int64)[seq_of])
            token_rows = rows_np[seq_of]
        self._np_pos[:T] = pos
        blocks = self._rows_np[token_rows, pos // bs].astype(np.int64)
        np.add(blocks * bs, pos % bs, out=self._np_slots[:T])
        self._np_seq_lens[:S] = seq_lens_np
        table_rows = rows_np
        if N > T:                          # padding sequences
            self._np_ids[T:N] = 0
            self._np_pos[T:N] = 0
            self._np_slots[T:N] = -1
            self._np_seq_lens[S:N] = 1
            qsl[S + 1:N + 1] = np.arange(S + 1, N + 1, dtype=np.int32)
            table_rows = np.concatenate([rows_np, np.full(N - S, _PAD_ROW, dtype=np.int64)])
        step_tables = self._np_tables[:seqs * width].reshape(seqs, width)
        np.take(self._rows_np[:, :width], table_rows, axis=0, out=step_tables)
        K = len(sample_rows)
        self._np_samples[:K] = sample_rows
        num_samples = K
        if full_width and N > K:
            # NOTE: a graph gathers N rows; the extra ones read row 0 and are dropped after
            self._np_samples[K:N] = 0
            num_samples = N

        lay = self._layout
        if self._dev is not self._host:
            end = lay.tables + seqs * width * 4
            self._dev[:end].copy_(self._host[:end], non_blocking=True)
            self._copy_done = torch.cuda.Event()
            self._copy_done.record()

        qlens = self._qlens if N == T else self._qlens + [1] * (N - S)
        seq_lens = self._seq_lens if N == T else self._seq_lens + [1] * (N - S)
        meta = AttentionMetadata(
            slot_mapping=self.slots[:N],
            query_start_loc=self.qsl[:seqs + 1],
            seq_lens=self.seq_lens[:seqs],
            block_tables=self.tables[:seqs * width].view(seqs, width),
            max_query_len=max(qlens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_lens_cpu=qlens,
            seq_lens_cpu=seq_lens,
        )
        return BatchInput(self.ids[:N], self.pos[:N], meta, self.samples[:num_samples],
                          list(sample_rows), T, S, N, list(logit_passes), self._token_ids,
                          self._starts, self._qlens, self._tables,
                          self._lora_slots if self._any_lora else None)

    def from_model_input(self, step: ModelInput) -> BatchInput:
        """A step given as lists (a tensor-parallel worker): its rows are keyed by position."""
        self.begin()
        offset = 0
        slots = step.lora_slots or [-1] * len(step.query_lens)
        for i, (q, s, table) in enumerate(zip(step.query_lens, step.seq_lens, step.block_tables)):
            start = s - q
            # NOTE: the ids of the step's tokens sit at [offset, offset + q): add() reads
            # all_token_ids[start:start + q], so hand it a sequence whose `start` index is there.
            self.add(f"#{i}", _Shifted(step.input_ids, offset - start), start, q, table, slots[i])
            offset += q
        return self.finish(list(step.sample_rows), list(step.logit_passes))


class _Shifted:
    """A read-only view of `data` indexed from -shift (so x[i] is data[i + shift])."""
    __slots__ = ("data", "shift")

    def __init__(self, data: list[int], shift: int) -> None:
        self.data, self.shift = data, shift

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.data[i.start + self.shift:i.stop + self.shift]
        return self.data[i + self.shift]


def _field_views(buf, layout, i64, i32) -> tuple:
    """The seven fields of a staging buffer `buf` (bytes: a numpy array on the host or the
    device tensor), typed: ids, positions, slots, sample rows (int64); query starts, sequence
    lengths, block tables (int32). One home for the layout's offsets on both sides of the copy."""
    return (buf[layout.ids:layout.pos].view(i64), buf[layout.pos:layout.slots].view(i64),
            buf[layout.slots:layout.samples].view(i64), buf[layout.samples:layout.qsl].view(i64),
            buf[layout.qsl:layout.qsl + (layout.seqs + 1) * 4].view(i32),
            buf[layout.seq_lens:layout.seq_lens + layout.seqs * 4].view(i32),
            buf[layout.tables:].view(i32))
