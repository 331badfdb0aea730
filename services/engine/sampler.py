"""Turn a batch of logits rows into tokens: penalties, min_tokens, greedy or seeded sampling, logprobs.

Pipeline per row (vLLM's order and semantics):

    raw logits ──► log_softmax ─────────────────────────────────► logprobs (chosen + top-k, ranked)
        │
        ▼
    penalties (repetition over prompt+output, presence/frequency over output)
        ▼
    min_tokens mask (EOS unless ignore_eos, stop_token_ids)
        ▼
    greedy? ── yes ─► argmax
        │ no
        ▼
    / temperature ─► top_k ─► top_p ─► min_p ─► softmax ─► inverse CDF, one uniform per sample
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from kvmesh.engine.request import Logprob
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.kernels.cpu_ops import argmax
from kvmesh.kernels.precision import at_least_float32



@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]              # repetition penalty looks at prompt + output
    output_token_ids: list[int]              # penalties and min_tokens count these
    generators: list[torch.Generator | None] = field(default_factory=list)  # one per sample; None: shared default
    num_samples: int = 1                     # n > 1 at a request's first token: n draws from this row
    eos_token_ids: tuple[int, ...] = ()      # masked while len(output) < min_tokens, unless ignore_eos

    def __post_init__(self) -> None:
        if not self.generators:
            self.generators = [None] * self.num_samples
        if self.num_samples < 1 or len(self.generators) != self.num_samples:
            raise ValueError(
                f"SamplingRow needs one generator (or None) per sample: "
                f"num_samples={self.num_samples}, got {len(self.generators)} generators")


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[list[int]]                        # per row, num_samples tokens
    logprobs: list[list[dict[int, Logprob]] | None]   # per row, per sample; None without params.logprobs


def _per_row(logits: torch.Tensor, *columns: tuple) -> list[torch.Tensor]:
    """Each (values, dtype) as a [R] tensor on the logits' device, one value per row."""
    out = [torch.as_tensor(values, dtype=dtype, device=logits.device) for values, dtype in columns]
    assert all(t.shape == (logits.shape[0],) for t in out), [tuple(t.shape) for t in out]
    return out


def apply_penalties(
    logits: torch.Tensor,                   # [R, V] float32, modified in place
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    presence_penalties: Sequence[float] | torch.Tensor,    # [R]
    frequency_penalties: Sequence[float] | torch.Tensor,   # [R]
    repetition_penalties: Sequence[float] | torch.Tensor,  # [R]
) -> torch.Tensor:
    """Repetition penalty (HF/CTRL) over prompt + output tokens: positive logits are divided
    by it, negative ones multiplied. Then OpenAI's `logit -= frequency * count + presence * seen`
    over output tokens only. Neutral values (1, 0, 0) leave a row bit-for-bit unchanged."""
    vocab = logits.shape[1]
    device = logits.device
    presence, frequency, repetition = _per_row(
        logits, (presence_penalties, torch.float32), (frequency_penalties, torch.float32),
        (repetition_penalties, torch.float32))

    output_counts = _bin_counts(output_token_ids, vocab, device)   # [R, V]
    output_seen = output_counts > 0
    if bool((repetition != 1.0).any()):
        seen = output_seen | (_bin_counts(prompt_token_ids, vocab, device) > 0)
        scale = torch.where(seen, repetition[:, None], torch.ones_like(logits))
        logits.copy_(torch.where(logits > 0, logits / scale, logits * scale))
    logits -= frequency[:, None] * output_counts
    logits -= presence[:, None] * output_seen
    return logits


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,                    # [R, V] float32 (already divided by temperature), in place
    top_k: Sequence[int] | torch.Tensor,     # [R]; 0 (or >= V) disables
    top_p: Sequence[float] | torch.Tensor,   # [R]; 1 disables
    min_p: Sequence[float] | torch.Tensor,   # [R]; 0 disables
) -> torch.Tensor:
    """Set to -inf every token outside top-k, then outside the nucleus top-p, then below
    min_p * p(max), each computed on what the previous step kept. The best token always stays.
    Ties at the k-th value are all kept; top-p ties are ordered by token id (stable sort)."""
    vocab = logits.shape[1]
    k, p, mp = _per_row(logits, (top_k, torch.long), (top_p, torch.float32),
                        (min_p, torch.float32))

    k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
    if bool((k < vocab).any()):
        sorted_desc = logits.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(1, (k - 1)[:, None])               # [R, 1]
        logits.masked_fill_(logits < kth, float("-inf"))

    if bool((p < 1.0).any()):
        probs = torch.softmax(logits, dim=-1)
        sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True, stable=True)
        cum = sorted_probs.cumsum(dim=-1)
        mass_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
        # NOTE: a token is dropped when the better tokens already hold top_p of the mass; rows
        # with top_p == 1 are skipped outright so float error in cumsum never drops a tail token.
        drop_sorted = (mass_before >= p[:, None]) & (p[:, None] < 1.0)
        drop = torch.zeros_like(drop_sorted).scatter_(1, sorted_idx, drop_sorted)
        logits.masked_fill_(drop, float("-inf"))

    if bool((mp > 0.0).any()):
        probs = torch.softmax(logits, dim=-1)
        threshold = mp[:, None] * probs.max(dim=-1, keepdim=True).values
        logits.masked_fill_(probs < threshold, float("-inf"))
    return logits


class Sampler:
    """Stateless apart from the default generator shared by unseeded rows."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator   # None: torch's global RNG

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        return self.sample(logits, rows).to_output()

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> "DeviceSamples":
        """The draws (and the requested logprobs) on the device, their copy to the host
        started but not waited for: async scheduling reads the draws on the device for the
        next step before the host has them (`DeviceSamples.to_output` waits)."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
        raw = logits
        logits = logits.to(torch.float32)                           # [R, V]
        penalized = [i for i, r in enumerate(rows) if _has_penalty(r.params)]
        masked = _min_tokens_mask(rows, logits.shape[1])
        if (penalized or masked[0]) and logits is raw:
            # NOTE: a private copy only when something writes: the caller's logits stay raw
            # (logprobs, debugging); a plain greedy or sampled batch reads them as they are.
            logits = logits.clone()
        if penalized:
            self._penalize(logits, [rows[i] for i in penalized], penalized)
        if masked[0]:
            logits[masked] = float("-inf")

        if not rows:
            return DeviceSamples(None, [], [], rows, _LogprobTensors([], 0, []), None)
        # NOTE: every draw (one per sample, rows in order) as one device tensor; the tokens and
        # the requested logprobs then reach the host in one transfer (`to_host`).
        num = [r.num_samples for r in rows]
        first = [0] * len(rows)
        for i in range(1, len(rows)):
            first[i] = first[i - 1] + num[i - 1]
        total = first[-1] + num[-1] if rows else 0
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        randomized = [i for i, r in enumerate(rows) if not r.params.greedy]
        best = (argmax(logits if len(greedy) == len(rows) else logits[greedy])
                if greedy else None)
        if not randomized and total == len(rows):
            draws = best                                   # greedy, one sample a row: as is
        else:
            draws = torch.empty(total, dtype=torch.long, device=logits.device)
            if greedy:
                at = [first[i] + k for i in greedy for k in range(num[i])]
                reps = torch.tensor([num[i] for i in greedy], device=logits.device)
                draws[torch.tensor(at, device=logits.device)] = best.to(torch.long).repeat_interleave(reps)
            if randomized and not greedy:
                draws = self._sample(logits, rows)        # every row sampled: in row order
            elif randomized:
                at = [first[i] + k for i in randomized for k in range(num[i])]
                draws[torch.tensor(at, device=logits.device)] = self._sample(
                    logits[randomized], [rows[i] for i in randomized])
        lp = _logprob_tensors(raw, rows, draws, first)
        return DeviceSamples(draws, first, num, rows, lp, start_to_host([draws, *lp.tensors]))

    def greedy_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """The token __call__ picks for each row of greedy `rows` (penalties and min_tokens
        applied; logits left as they are): what target_probs puts its point mass on, without
        building [R, V] probabilities."""
        assert all(r.params.greedy for r in rows) and logits.shape[0] == len(rows)
        penalized = [i for i, r in enumerate(rows) if _has_penalty(r.params)]
        masked = _min_tokens_mask(rows, logits.shape[1])
        if penalized or masked[0]:
            logits = logits.to(torch.float32).clone()
            if penalized:
                self._penalize(logits, [rows[i] for i in penalized], penalized)
            if masked[0]:
                logits[masked] = float("-inf")
        return argmax(logits.float().contiguous()).tolist()

    def target_probs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """[R, V] float32: the distribution each row's token is drawn from, after the same
        steps as __call__ (penalties, min_tokens, temperature, top-k / top-p / min-p); a greedy
        row is a point mass on the token __call__ would pick. Speculative decoding verifies
        drafts against these (engine/spec_decode/rejection.py)."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
        logits = logits.to(torch.float32).clone()                  # [R, V]
        penalized = [i for i, r in enumerate(rows) if _has_penalty(r.params)]
        if penalized:
            self._penalize(logits, [rows[i] for i in penalized], penalized)
        masked = _min_tokens_mask(rows, logits.shape[1])
        if masked[0]:
            logits[masked] = float("-inf")
        probs = torch.zeros_like(logits)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        randomized = [i for i, r in enumerate(rows) if not r.params.greedy]
        if greedy:
            best = argmax(logits[greedy]).to(torch.long)
            idx = torch.tensor(greedy, device=logits.device)
            probs[idx, best] = 1.0
        if randomized:
            sub = [rows[i] for i in randomized]
            x = logits[randomized] / torch.tensor([r.params.temperature for r in sub],
                                                  dtype=torch.float32, device=logits.device)[:, None]
            if any(r.params.top_k or r.params.top_p < 1.0 or r.params.min_p > 0.0 for r in sub):
                apply_top_k_top_p_min_p(x, [r.params.top_k for r in sub],
                                        [r.params.top_p for r in sub], [r.params.min_p for r in sub])
            probs[torch.tensor(randomized, device=logits.device)] = torch.softmax(x, dim=-1)
        return probs

    def _penalize(self, logits: torch.Tensor, sub: list[SamplingRow], idx: list[int]) -> None:
        # NOTE: prompts are only binned for rows that use the repetition penalty (long prompts).
        prompts = [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else [] for r in sub]
        logits[idx] = apply_penalties(
            logits[idx], prompts, [r.output_token_ids for r in sub],
            [r.params.presence_penalty for r in sub],
            [r.params.frequency_penalty for r in sub],
            [r.params.repetition_penalty for r in sub])

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """logits: [Rr, V] of non-greedy rows. Returns [D] tokens: each row's num_samples draws,
        rows in order (on the logits' device)."""
        device = logits.device
        temperature = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32, device=device)
        logits = logits / temperature[:, None]
        if any(r.params.top_k or r.params.top_p < 1.0 or r.params.min_p > 0.0 for r in rows):
            apply_top_k_top_p_min_p(
                logits, [r.params.top_k for r in rows], [r.params.top_p for r in rows],
                [r.params.min_p for r in rows])
        probs = torch.softmax(logits, dim=-1)                      # [Rr, V]

        # One draw per sample by inverting the row's CDF at one uniform (an exact categorical
        # sample). NOTE: each draw consumes exactly one uniform from its own generator, so a
        # seeded sample depends only on its generator state and its own row, never the batch.
        # V exponentials a draw (argmax(probs / q), q ~ Exp(1)^V) cost ~1 ms of CPU per row at
        # V = 49k, 16 ms a step at 16 rows: more than the forward's share of a step.
        draw_rows = [i for i, r in enumerate(rows) for _ in range(r.num_samples)]
        draw_gens = [g for r in rows for g in r.generators]
        shared = [d for d, g in enumerate(draw_gens) if g is None]
        if len(shared) == len(draw_gens):
            u = _uniform(len(shared), self.generator, device)                    # [D]
        else:
            u = torch.empty(len(draw_gens), dtype=torch.float32, device=device)
            if shared:
                u[shared] = _uniform(len(shared), self.generator, device)
            for d, g in enumerate(draw_gens):
                if g is not None:
                    u[d] = _uniform(1, g, device)[0]
        # NOTE: cast first, then cumsum: cumsum(dtype=float64) of several rows took 10x longer
        # on CPU (torch 2.13); float64 so that float32 rounding over 49k terms biases no token
        cdf = probs.double().cumsum(dim=-1)                         # [Rr, V]
        if len(draw_rows) != len(rows):
            cdf = cdf[draw_rows]                                    # [D, V]: n > 1 samples
        return inverse_cdf(cdf, u)


def token_logprobs(raw: torch.Tensor, rows: list[SamplingRow],
                   tokens: list[int]) -> list[dict[int, Logprob] | None]:
    """Per row, the logprobs entry of `tokens[i]` (the chosen token plus the row's top
    `logprobs`, from the raw logits as __call__ reports them); None for rows that asked for none."""
    draws = torch.tensor(tokens, dtype=torch.long, device=raw.device)
    lp = _logprob_tensors(raw, rows, draws, list(range(len(rows))))
    host = to_host(lp.tensors) if lp.want else []
    per_row = lp.assemble(rows, [[t] for t in tokens], host)
    return [entries[0] if entries else None for entries in per_row]


def inverse_cdf(cdf: torch.Tensor,      # [D, V] float64 running sums of each draw's row
                u: torch.Tensor,        # [D] float32 uniforms in [0, 1)
                ) -> torch.Tensor:
    """[D] tokens: the first token whose running sum exceeds u times the row's total, so token
    t is drawn with probability p(t) / total, and a token of probability 0 never (its sum equals
    the one before). NOTE: u < 1 - 2**-24, so u * total stays below total in float64."""
    target = u.to(cdf.dtype)[:, None] * cdf[:, -1:]                 # [D, 1]
    return torch.searchsorted(cdf, target, right=True)[:, 0]


def _uniform(num: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """[num] U[0, 1) float32 draws. NOTE: drawn on the generator's own device (the engine's seeded
    generators live on the CPU) and then moved, so a CPU generator works with GPU logits."""
    where = generator.device if generator is not None else device
    u = torch.rand(num, dtype=torch.float32, device=where, generator=generator)
    return u.to(device, non_blocking=True)


def _has_penalty(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


def _bin_counts(token_ids: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[R, V] float32 occurrence counts; ids outside [0, V) are ignored."""
    width = max((len(ids) for ids in token_ids), default=0)
    counts = torch.zeros(len(token_ids), vocab + 1, dtype=torch.float32, device=device)
    if width:
        padded = torch.tensor([list(ids) + [vocab] * (width - len(ids)) for ids in token_ids],
                              dtype=torch.long, device=device)
        padded = torch.where((padded < 0) | (padded > vocab), vocab, padded)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]


def _min_tokens_mask(rows: list[SamplingRow], vocab: int) -> tuple[list[int], list[int]]:
    """(rows, tokens) to set to -inf: EOS (unless ignore_eos) and stop_token_ids of each row
    that has not yet produced min_tokens tokens."""
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, r in enumerate(rows):
        if len(r.output_token_ids) >= r.params.min_tokens:
            continue
        banned = set(r.params.stop_token_ids)
        if not r.params.ignore_eos:
            banned.update(r.eos_token_ids)
        for t in banned:
            if 0 <= t < vocab:
                row_idx.append(i)
                tok_idx.append(t)
    return row_idx, tok_idx


def to_host(tensors: list[torch.Tensor]) -> list[list]:
    """Each tensor's values as a (flat) list, in ONE device-to-host transfer: on CUDA they are
    packed into one float64 buffer (exact for token ids, ranks and float32 log-probs), copied
    without blocking into pinned memory, and waited for once; on CPU they are read as they are."""
    return start_to_host(tensors).wait()


@dataclass(slots=True)
class HostTransfer:
    """A device-to-host copy in flight (`start_to_host`); `wait` gives the values."""
    tensors: list[torch.Tensor]                  # the sources (on CPU: read at wait)
    host: torch.Tensor | None = None             # CUDA: the pinned float64 destination
    done: "torch.cuda.Event | None" = None       # CUDA: recorded after the copy

    def wait(self) -> list[list]:
        if self.host is None:
            return [t.reshape(-1).tolist() for t in self.tensors]
        self.done.synchronize()
        values = self.host.tolist()
        out, at = [], 0
        for t in self.tensors:
            n = t.numel()
            part = values[at:at + n]
            out.append([int(v) for v in part] if not t.is_floating_point() else part)
            at += n
        return out


def start_to_host(tensors: list[torch.Tensor]) -> HostTransfer:
    """Enqueue `to_host`'s one transfer and return at once. NOTE: on CUDA the copy is queued
    right behind the kernels that made the tensors, so waiting for it never waits for work
    queued later (the next step's forward, with async scheduling)."""
    if not tensors or tensors[0].device.type != "cuda":
        return HostTransfer(tensors)
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
    host = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return HostTransfer(tensors, host, done)


@dataclass(slots=True)
class DeviceSamples:
    """One step's draws before the host has them (`Sampler.sample`)."""
    draws: torch.Tensor | None     # [D] every draw, rows in order, num_samples each (None: no row)
    first: list[int]               # per row, the index of its first draw in `draws`
    num: list[int]                 # per row, its draws (num_samples)
    rows: list[SamplingRow]
    lp: "_LogprobTensors"          # the requested logprobs, on the device
    transfer: HostTransfer | None  # draws then the logprob tensors, on their way to the host

    def to_output(self) -> SamplerOutput:
        """Wait for the transfer: the tokens and logprobs as host lists."""
        if self.transfer is None:
            return SamplerOutput(token_ids=[], logprobs=[])
        host = self.transfer.wait()
        flat, first, num = host[0], self.first, self.num
        token_ids = [flat[first[i]:first[i] + num[i]] for i in range(len(self.rows))]
        return SamplerOutput(token_ids=token_ids,
                             logprobs=self.lp.assemble(self.rows, token_ids, host[1:]))


@dataclass(slots=True)
class _LogprobTensors:
    """The requested logprobs of one step, on the device until `to_host`."""
    want: list[int]                          # rows that asked for logprobs
    k: int                                   # top-k width computed (the largest asked)
    tensors: list[torch.Tensor]              # chosen lp [D'], chosen rank [D'], top lp / id / rank [W, k]
    vocab: int = 0

    def assemble(self, rows: list[SamplingRow], token_ids: list[list[int]],
                 host: list[list]) -> list[list[dict[int, Logprob]] | None]:
        out: list[list[dict[int, Logprob]] | None] = [None] * len(rows)
        if not self.want:
            return out
        chosen_lp_l, chosen_rank_l, top_lp, top_id, top_rank = host
        k = self.k
        d = 0
        for w, i in enumerate(self.want):
            num_top = min(rows[i].params.logprobs, self.vocab)
            base = w * k
            per_sample: list[dict[int, Logprob]] = []
            for tok in token_ids[i]:
                entry = {tok: Logprob(tok, chosen_lp_l[d], chosen_rank_l[d])}
                for j in range(num_top):
                    t = top_id[base + j]
                    if t not in entry:
                        entry[t] = Logprob(t, top_lp[base + j], top_rank[base + j])
                per_sample.append(entry)
                d += 1
            out[i] = per_sample
        return out


def _logprob_tensors(raw: torch.Tensor, rows: list[SamplingRow], draws: torch.Tensor,
                     first: list[int]) -> _LogprobTensors:
    """Logprobs of the RAW logits (before penalties and temperature, vLLM's default) of the drawn
    tokens and the top-k, as device tensors. rank = 1 + the number of tokens with a strictly
    higher logprob, so ties share a rank."""
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not want:
        return _LogprobTensors(want, 0, [])
    lp = torch.log_softmax(at_least_float32(raw[want]), dim=-1)   # [W, V]
    vocab = lp.shape[1]
    device = lp.device
    draw_w = [w for w, i in enumerate(want) for _ in range(rows[i].num_samples)]
    draw_at = [first[i] + s for i in want for s in range(rows[i].num_samples)]
    w_t = torch.tensor(draw_w, dtype=torch.long, device=device)
    tok_t = draws[torch.tensor(draw_at, dtype=torch.long, device=device)].to(torch.long)
    chosen_lp = lp[w_t, tok_t]                                        # [D']
    chosen_rank = (lp[w_t] > chosen_lp[:, None]).sum(dim=-1) + 1      # [D']
    k = min(max(rows[i].params.logprobs for i in want), vocab)
    if k > 0:
        top_lp, top_id = lp.topk(k, dim=-1)                           # [W, k], sorted
        # Every token strictly above a top-k value is itself in the top-k.
        top_rank = (top_lp[:, None, :] > top_lp[:, :, None]).sum(dim=-1) + 1
    else:
        top_lp = torch.empty(0, device=device)
        top_id = top_rank = torch.empty(0, dtype=torch.long, device=device)
    return _LogprobTensors(want, k, [chosen_lp, chosen_rank, top_lp, top_id, top_rank], vocab)
