"""The draft-model proposer (vLLM's "draft_model"): a smaller model of the same vocabulary
proposes each speculating request's k drafts greedily, one batched forward per draft position,
before the target's forward verifies them.

Its KV cache is its own tensor, addressed by the target's block ids: the block pool hands out
blocks once for both models (a block costs the target's bytes plus the draft's, so the draft
shares the KV budget), and the draft writes its K/V into the slots the scheduler allocated for
the step. The draft catches up on the tokens it has not seen (the prompt at a request's first
speculating step, then the token verified after the accepted drafts) in the first forward.

NOTE: the draft's KV only shapes the proposals, never the output (verification keeps the
target's distribution whatever is proposed). So what is cheap to ignore is ignored: after a
swap-in, a recompute, a fork, or a step without speculation the request's draft context is
recomputed rather than tracked; KV loaded from another pod carries no draft KV.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvmesh.engine.input_batch import InputBatch
from kvmesh.engine.loader import LoadedModel
from kvmesh.engine.sched_output import ScheduledRequest
from kvmesh.engine.spec_decode.grammar_drafts import GrammarDrafts
from kvmesh.engine.spec_decode.tokens import WithDrafts
from kvmesh.kernels.cpu_ops import argmax

if TYPE_CHECKING:
    from kvmesh.engine.structured.bitmask import GrammarBitmask


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """ValueError naming the first difference between the two models' vocabularies."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise ValueError(f"--speculative-config: the draft model {draft.path} has vocab_size {dv}, "
                         f"the target {target.path} {tv}: a draft must share the target's "
                         "vocabulary")
    t_vocab, d_vocab = target.tokenizer.hf.get_vocab(), draft.tokenizer.hf.get_vocab()
    if t_vocab != d_vocab:
        for token in sorted(set(t_vocab) | set(d_vocab)):
            a, b = t_vocab.get(token), d_vocab.get(token)
            if a != b:
                raise ValueError(f"--speculative-config: the draft model's tokenizer differs "
                                 f"from the target's: token {token!r} is id {a} in the target, "
                                 f"{b} in the draft")


class DraftModel:
    def __init__(self, loaded: LoadedModel, block_size: int, num_blocks: int,
                 max_num_seqs: int, max_num_tokens: int, max_blocks_per_seq: int) -> None:
        mc = loaded.config
        self.model = loaded.model
        self.device = loaded.device
        shape = (mc.num_hidden_layers, 2, num_blocks, block_size, mc.num_key_value_heads,
                 mc.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=loaded.dtype, device=loaded.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1])
                          for i in range(mc.num_hidden_layers)]
        self.batch = InputBatch(block_size, loaded.device, max_num_seqs, max_num_tokens,
                                max_blocks_per_seq)
        # request id -> (its block table object, positions whose draft K/V is written)
        self._seen: dict[str, tuple[list[int], int]] = {}

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write copies of the target's blocks, replayed on the draft's cache."""
        if pairs:
            src = torch.tensor([s for s, _ in pairs], device=self.device)
            dst = torch.tensor([d for _, d in pairs], device=self.device)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    @torch.inference_mode()
    def propose(self, scheduled: list[ScheduledRequest],
                grammar: GrammarBitmask | None = None) -> None:
        """Fill each speculating request's drafts (`spec_token_ids`, placeholders the scheduler
        sized) in place, before the target's batch reads them; a structured-output request's
        drafts are chosen under its grammar, whose masks fill the step's `grammar` rows of its
        drafted positions (grammar_drafts.py)."""
        todo = [sr for sr in scheduled if sr.spec_token_ids]
        if not todo:
            self._seen.clear()
            return
        walks: dict[int, GrammarDrafts] = {}          # todo index -> its grammar walk
        if grammar is not None and grammar.pending:
            for j, sr in enumerate(todo):
                row = grammar.pending.get(sr.request.request_id)
                if row is not None:
                    walks[j] = GrammarDrafts(sr.request.grammar, grammar.bitmask, row)
        try:
            self._propose(todo, walks)
        finally:
            for walk in walks.values():
                walk.finish()
        self._seen = {sr.request.request_id: (sr.block_ids, len(sr.request.all_token_ids)
                                              + len(sr.spec_token_ids) - 1) for sr in todo}

    def _propose(self, todo: list[ScheduledRequest], walks: dict[int, GrammarDrafts]) -> None:
        batch = self.batch
        batch.begin()
        rows = []
        for sr in todo:
            req = sr.request
            table, done = self._seen.get(req.request_id, (None, 0))
            # NOTE: positions from sr.start on may hold rejected drafts' K/V
            done = min(done, sr.start) if table is sr.block_ids else 0
            n = len(req.all_token_ids) - done
            first = batch.add(req.request_id, req.all_token_ids, done, n, sr.block_ids)
            rows.append(first + n - 1)
        live = list(range(len(todo)))                   # todo indices still drafting
        for i in range(max(len(sr.spec_token_ids) for sr in todo)):
            if i:
                live = [j for j in live if len(todo[j].spec_token_ids) > i]
                batch.begin()
                rows = []
                for j in live:
                    sr = todo[j]
                    tokens = sr.request.all_token_ids
                    rows.append(batch.add(sr.request.request_id,
                                          WithDrafts(tokens, sr.spec_token_ids),
                                          len(tokens) + i - 1, 1, sr.block_ids))
            for j, token in zip(live, self._forward(rows, [walks.get(j) for j in live], i)):
                todo[j].spec_token_ids[i] = token
                if j in walks:
                    walks[j].take(token)

    def _forward(self, rows: list[int], walks: list[GrammarDrafts | None], i: int) -> list[int]:
        """The draft's greedy token after each row (under its grammar walk's mask, if any)."""
        step = self.batch.finish(rows)
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta)
        logits = self.model.compute_logits(hidden.index_select(0, step.sample_rows))
        logits = logits.float().contiguous()
        for j, walk in enumerate(walks):
            if walk is not None:
                walk.mask(logits[j:j + 1], i)
        return argmax(logits).tolist()
