"""Turns one step's plan into tensors, runs the model once, and samples or verifies on the device.

Owns
  * building the step's flat inputs (`input_ids [T]`, `positions [T]`, `slot_mapping [T]`) and the
    `AttentionContext` (which requests attend densely, which draft tokens attend sparsely and to which slots);
  * the per-request device buffers: this cycle's draft tokens (and their draft distributions when sampling), the
    critical positions each request's drafts attend to, and a mirror of each request's block table (updated with
    only the entries that changed, so a step does not rebuild [B, blocks] tables from Python lists);
  * after the forward: sampling draft tokens, and verification (`verifier.verify`) for verifying requests and for a
    request's last prefill chunk (a verification with no drafts).
Everything `launch` returns stays on the device; `StepResult.fetch` is the one host synchronisation of a step, so the
engine can launch step t before it looks at step t-1 (delayed verification).

Must not decide who runs (the scheduler does) or re-implement attention or sampling.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import pillar_attn, verifier
from .config import SpecConfig
from .kv_cache import KVCache
from .model import CausalLM
from .pillar_attn import AttentionContext, DenseBatch, SparseBatch
from .cuda_graphs import StepGraphs
from .device import common_prefix, to_device
from .scheduler import Sequence, Work


@dataclass
class StepResult:
    """Device-side results of one step, plus the host-side plan they belong to."""
    works: list[Work]
    verify_works: list[Work]                 # verifications and last prefill chunks, in result order
    num_drafts: list[int]                    # drafts checked by each of them
    num_accepted: torch.Tensor               # [Bv]
    next_token: torch.Tensor                 # [Bv] the recovered / bonus (or, after prefill, first) token
    is_bonus: torch.Tensor                   # [Bv]
    draft_tokens: torch.Tensor               # [Bv, Mmax] drafts checked by each verification
    scores: torch.Tensor | None              # [L, Bv, n_kv, Lmax] PillarAttn scores of those requests, or None
    host: torch.Tensor | None = None         # [Bv, 3 + Mmax] the four above, copied to the host (`start_copy`)
    copied: torch.cuda.Event | None = None   # recorded on the stream right after that copy (CUDA only)

    def start_copy(self) -> None:
        """Queue the copy of what the host bookkeeping needs, right behind this step's own work.

        With delayed verification the host fetches step t-1 after it has queued step t; a copy queued only then would
        wait for step t as well, and the host would have nothing left to overlap."""
        packed = torch.cat([self.num_accepted[:, None], self.next_token[:, None], self.is_bonus.long()[:, None],
                            self.draft_tokens], dim=1)                                   # [Bv, 3 + Mmax]
        if packed.device.type == "cuda":
            self.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self.host.copy_(packed, non_blocking=True)              # pinned destination: an asynchronous copy
            self.copied = torch.cuda.Event()
            self.copied.record()
        else:
            self.host = packed

    def fetch(self) -> dict:
        """What the host bookkeeping needs (the step's one synchronisation: it waits for this step only)."""
        if self.copied is not None:
            self.copied.synchronize()
        rows = self.host.tolist()
        return {"num_accepted": [r[0] for r in rows], "next_token": [r[1] for r in rows],
                "is_bonus": [bool(r[2]) for r in rows], "draft_tokens": [r[3:] for r in rows]}


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache, spec: SpecConfig, cuda_graphs: bool = False):
        self.model, self.cache, self.spec = model, cache, spec
        self.graphs = StepGraphs(model, cache) if cuda_graphs else None     # padded static steps (CUDA: graphs)
        cfg = model.config
        self.device = cache.device
        self.num_layers, self.n_kv = cfg.num_layers, cfg.num_kv_heads
        rows, k = spec.max_batch, max(spec.stride, 1)
        self.draft_tokens = torch.zeros(rows, k, dtype=torch.long, device=self.device)   # [rows, k]
        self.draft_probs: torch.Tensor | None = None                                      # [rows, k, V] when sampling
        self.selection = torch.zeros(rows, self.num_layers, self.n_kv, 0, dtype=torch.long, device=self.device)
        self.selection_len = [0] * rows                                                   # valid width per row
        # pillar-lookup: each row's committed tokens mirrored on the device, so drafts can look tokens up in them
        self.context_tokens = torch.zeros(rows, 0, dtype=torch.long, device=self.device)  # [rows, capacity]
        self.tokens_sent = [(-1, 0)] * rows                                               # (seq_id, tokens sent)
        # each row's block table mirrored on the device, so a step sends only the entries that changed
        self.block_tables = torch.zeros(rows, 0, dtype=torch.long, device=self.device)    # [rows, capacity]
        self.tables_sent: list[tuple[int, list[int]]] = [(-1, [])] * rows                # (seq_id, table as sent)

    # --- critical positions ------------------------------------------------------------------------------------------
    def set_selection(self, seq: Sequence, positions: torch.Tensor) -> None:
        """Store the positions [L, n_kv, n] that `seq`'s next drafts attend to (besides the recent window)."""
        n = positions.shape[-1]
        if n > self.selection.shape[-1]:
            grown = torch.zeros(*self.selection.shape[:-1], max(n, 2 * self.selection.shape[-1]),
                                dtype=torch.long, device=self.device)
            grown[..., :self.selection.shape[-1]] = self.selection
            self.selection = grown
        self.selection[seq.row, :, :, :n] = positions
        self.selection_len[seq.row] = n

    def set_context_tokens(self, seq: Sequence) -> None:
        """Mirror `seq`'s committed tokens into its row of `context_tokens`, sending only the ones not sent yet."""
        owner, sent = self.tokens_sent[seq.row]
        sent = sent if owner == seq.seq_id else 0
        n = len(seq.tokens)
        if n > self.context_tokens.shape[1]:
            grown = torch.zeros(self.context_tokens.shape[0], max(n, 2 * self.context_tokens.shape[1]),
                                dtype=torch.long, device=self.device)
            grown[:, :self.context_tokens.shape[1]] = self.context_tokens
            self.context_tokens = grown
        if n > sent:
            self.context_tokens[seq.row, sent:n] = self._dev(seq.tokens[sent:n])
        self.tokens_sent[seq.row] = (seq.seq_id, n)

    # --- building the step -------------------------------------------------------------------------------------------
    def _dev(self, data, dtype=torch.long) -> torch.Tensor:
        return to_device(data, dtype, self.device)

    def _block_tables(self, seqs: list[Sequence], rows: torch.Tensor) -> torch.Tensor:
        """Block tables [B, max_blocks] (on the device) of these requests, whose rows are `rows` [B] (device).

        The device copy is brought up to date first, sending only what changed since a row's last step: a table only
        changes at its end (append adds blocks, rollback drops them), so usually nothing or one new block. Columns
        past a request's own table hold stale but valid block ids (masked by the context length, like padding)."""
        tables = [self.cache.pool.tables[s.seq_id] for s in seqs]
        width = max(len(t) for t in tables)
        if width > self.block_tables.shape[1]:
            grown = torch.zeros(self.block_tables.shape[0], max(width, 2 * self.block_tables.shape[1]),
                                dtype=torch.long, device=self.device)
            grown[:, :self.block_tables.shape[1]] = self.block_tables
            self.block_tables = grown
        changes = []                                                                    # (row, column, block)
        for seq, table in zip(seqs, tables):
            owner, sent = self.tables_sent[seq.row]
            if owner != seq.seq_id or sent != table:
                same = common_prefix(sent, table) if owner == seq.seq_id else 0
                changes += [(seq.row, j, table[j]) for j in range(same, len(table))]
                self.tables_sent[seq.row] = (seq.seq_id, list(table))
        if changes:
            row, column, block = self._dev(changes).unbind(1)
            self.block_tables[row, column] = block
        return self.block_tables[rows, :width]

    def _slots(self, tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pool slots of positions [B, ...] of the requests whose padded block tables are `tables` [B, max_blocks]."""
        bs = self.cache.block_size
        flat = positions.reshape(positions.shape[0], -1)
        block = torch.gather(tables, 1, (flat // bs).clamp(max=tables.shape[1] - 1))
        return (block * bs + flat % bs).view(positions.shape)

    def _dense_batch(self, dense: list[Work], row_of: list[int], with_scores: list[bool]) -> DenseBatch:
        q_max, ctx_max = max(w.num_tokens for w in dense), max(w.start + w.num_tokens for w in dense)
        starts = self._dev([w.start for w in dense])                                    # [Bd]
        q_lens = self._dev([w.num_tokens for w in dense])                               # [Bd]
        qi = torch.arange(q_max, device=self.device)
        q_valid = qi[None, :] < q_lens[:, None]                                         # [Bd, Qmax]
        q_index = (self._dev(row_of)[:, None] + qi).where(q_valid, 0)
        # Where the real (non-padding) query rows sit: flat index into [Bd * Qmax], and their rows in the step.
        valid_flat = self._dev([b * q_max + j for b, w in enumerate(dense) for j in range(w.num_tokens)])
        valid_rows = self._dev([r + j for r, w in zip(row_of, dense) for j in range(w.num_tokens)])
        num_blocks = -(-ctx_max // self.cache.block_size)
        kv_pos = torch.arange(num_blocks * self.cache.block_size, device=self.device).expand(len(dense), -1)  # [Bd, Lmax]
        q_pos = starts[:, None] + qi                                                    # [Bd, Qmax]
        mask = kv_pos[:, None, :] <= q_pos[:, :, None]                                  # causal, [Bd, Qmax, Lmax]
        mask &= q_valid[:, :, None] | (kv_pos[:, None, :] == 0)                         # padding rows see position 0
        seq_rows = self._dev([w.seq.row for w in dense])
        block_table = self._block_tables([w.seq for w in dense], seq_rows)[:, :num_blocks]   # [Bd, Lmax / block]
        batch = DenseBatch(q_index, q_valid, valid_flat, valid_rows, block_table, mask, starts)
        if any(with_scores):
            # Verification rows all count; after a last prefill chunk only its last row does.
            last = (q_lens - 1)[:, None]
            is_verify = self._dev([w.kind == "verify" for w in dense], torch.bool)[:, None]
            rows = q_valid & (is_verify | (qi[None, :] == last))
            rows &= self._dev(with_scores, torch.bool)[:, None]
            batch.score_weight = rows.float() / rows.sum(1, keepdim=True).clamp(min=1)
            batch.scores = torch.zeros(self.num_layers, len(dense), self.n_kv, kv_pos.shape[1], device=self.device)
        return batch

    def _sparse_batch(self, drafts: list[Work], row_of: list[int], input_ids: torch.Tensor) -> SparseBatch:
        seqs = [w.seq for w in drafts]
        windows = [w.start - w.seq.num_verified + 1 for w in drafts]   # positions written since the verification
        sel_max, win_max = max(self.selection_len[s.row] for s in seqs), max(windows)
        n_sel = self._dev([self.selection_len[s.row] for s in seqs])                    # [Bs]
        n_win = self._dev(windows)                                                      # [Bs]
        rows, verified = self._dev([s.row for s in seqs]), self._dev([s.num_verified for s in seqs])   # [Bs]
        tables = self._block_tables(seqs, rows)
        sel_pos = self.selection[rows, :, :, :sel_max]                                  # [Bs, L, n_kv, Nsel]
        sel_valid = torch.arange(sel_max, device=self.device)[None] < n_sel[:, None]   # [Bs, Nsel]
        if self.spec.method == "pillar-lookup":
            # Refreshed at every draft step: positions found from this draft's input token replace the lowest-ranked
            # critical positions of each (layer, KV head); the count stays the budget.
            # Same width and count as the selection (sel_valid holds): the step gathers B + window entries.
            lookup, lookup_valid = self._lookups(drafts, rows, verified, input_ids[self._dev(row_of)])  # [Bs, M]
            sel_pos = pillar_attn.merge_lookup(sel_pos, n_sel, lookup, lookup_valid)     # [Bs, L, n_kv, Nsel]
        win_pos = verified[:, None] + torch.arange(win_max, device=self.device)         # [Bs, W]
        sel_slots = self._slots(tables, sel_pos)                                        # [Bs, L, n_kv, Nsel]
        win_slots = self._slots(tables, win_pos)[:, None, None, :].expand(-1, self.num_layers, self.n_kv, -1)
        slots = torch.cat([sel_slots, win_slots], dim=-1)                               # [Bs, L, n_kv, S]
        heads = torch.arange(self.n_kv, device=self.device)[None, None, :, None]
        kv_index = (slots * self.n_kv + heads).permute(1, 0, 2, 3).contiguous()         # [L, Bs, n_kv, S]
        valid = torch.cat([sel_valid, torch.arange(win_max, device=self.device)[None] < n_win[:, None]], dim=1)
        return SparseBatch(self._dev(row_of), kv_index, valid)

    def _lookups(self, drafts: list[Work], rows: torch.Tensor, verified: torch.Tensor, tokens: torch.Tensor):
        """pillar-lookup: the positions each draft's input token `tokens` [Bs] finds in its verified context."""
        seqs = [w.seq for w in drafts]
        # The token before each input: committed (mirrored in context_tokens, the pending one included) or one of
        # this cycle's drafts (draft_tokens index j holds position num_verified + 1 + j).
        prev = [w.start - 1 for w in drafts]
        committed = self.context_tokens[rows, self._dev([min(p, s.num_verified) for p, s in zip(prev, seqs)])]
        drafted = self.draft_tokens[rows, self._dev([max(0, p - s.num_verified - 1) for p, s in zip(prev, seqs)])]
        in_context = self._dev([p <= s.num_verified for p, s in zip(prev, seqs)], torch.bool)
        context_tokens = self.context_tokens[rows, :max(s.num_verified for s in seqs)]              # [Bs, Lc]
        return pillar_attn.lookup_positions(context_tokens, tokens, verified, self.spec.num_lookups,
                                            torch.where(in_context, committed, drafted))

    # --- one step ----------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, works: list[Work]) -> StepResult:
        ids, positions, slots = [], [], []
        feed_at, feed_from = [], []                # flat rows whose input is a draft token still on the device
        first_row = []
        for w in works:
            seq = w.seq
            first_row.append(len(ids))
            pos = list(range(w.start, w.start + w.num_tokens))
            if w.kind == "prefill":
                inputs = seq.tokens[w.start:w.start + w.num_tokens]
            elif self.spec.method == "ngram":
                inputs = [seq.tokens[-1]] + seq.ngram_drafts[:w.num_tokens - 1]
            else:  # the pending token, then this cycle's model drafts (fed from the device buffer)
                inputs = [seq.tokens[-1]] + [0] * (w.num_tokens - 1)
                first_draft = seq.num_verified + 1
                for j, p in enumerate(pos):
                    if p >= first_draft:
                        feed_at.append(len(ids) + j)
                        feed_from.append((seq.row, p - first_draft))
            table = self.cache.pool.tables[seq.seq_id]
            bs = self.cache.block_size
            ids += inputs
            positions += pos
            slots += [table[p // bs] * bs + p % bs for p in pos]
        input_ids = self._dev(ids)
        if feed_at:
            src = self._dev(feed_from)
            input_ids[self._dev(feed_at)] = self.draft_tokens[src[:, 0], src[:, 1]]

        dense = [(w, r) for w, r in zip(works, first_row)
                 if w.kind != "draft" or self.spec.method == "full"]
        sparse = [(w, r) for w, r in zip(works, first_row) if w.kind == "draft" and self.spec.method != "full"]
        wants_scores = self.spec.method in ("pillar", "pillar-lookup")
        ctx = AttentionContext(self.cache.k, self.cache.v, self._dev(slots), self.cache.block_size)
        if dense:
            ctx.dense = self._dense_batch([w for w, _ in dense], [r for _, r in dense],
                                          [wants_scores and (w.kind == "verify" or w.final_prefill)
                                           for w, _ in dense])
        if sparse:
            ctx.sparse = self._sparse_batch([w for w, _ in sparse], [r for _, r in sparse], input_ids)
        static = self.graphs is not None and all(w.kind != "prefill" for w in works)
        forward = self.graphs.forward if static else self.model
        hidden = forward(input_ids, self._dev(positions), ctx)       # [T, hidden]

        drafts = [(w, r) for w, r in zip(works, first_row) if w.kind == "draft"]
        checks = [(w, r) for w, r in zip(works, first_row) if w.kind == "verify" or w.final_prefill]
        if drafts:
            self._sample_drafts(hidden, drafts)
        result = self._verify(hidden, checks)
        if wants_scores and checks:
            dense_index = {id(w): i for i, (w, _) in enumerate(dense)}
            # a device index: indexing with a Python list would copy it from pageable memory, waiting for the forward
            result.scores = ctx.dense.scores[:, self._dev([dense_index[id(w)] for w, _ in checks])]
        result.works = works
        result.start_copy()
        return result

    def _sample_drafts(self, hidden: torch.Tensor, drafts: list[tuple[Work, int]]) -> None:
        dev = self.device
        seqs = [w.seq for w, _ in drafts]
        logits = self.model.logits(hidden[self._dev([r for _, r in drafts])])      # [Bs, V]
        st = verifier.SamplingTensors.from_params([s.params for s in seqs], [s.seed for s in seqs], dev)
        probs = verifier.probs_from_logits(logits, st)
        decided = self._dev([w.start + 1 for w, _ in drafts])                  # position each draft will occupy
        tokens = verifier.sample(probs, st, decided, verifier.SALT_DRAFT)
        rows = self._dev([s.row for s in seqs])
        index = self._dev([w.start - w.seq.num_verified for w, _ in drafts])
        self.draft_tokens[rows, index] = tokens
        if not all(s.params.greedy for s in seqs):
            if self.draft_probs is None:
                self.draft_probs = torch.zeros(*self.draft_tokens.shape, probs.shape[-1], device=dev)
            self.draft_probs[rows, index] = probs

    def _verify(self, hidden: torch.Tensor, checks: list[tuple[Work, int]]) -> StepResult:
        dev = self.device
        num_drafts = [w.num_tokens - 1 if w.kind == "verify" else 0 for w, _ in checks]
        if not checks:
            empty = torch.zeros(0, dtype=torch.long, device=dev)
            return StepResult([], [], [], empty, empty, empty.bool(), empty[:, None], None)
        m_max = max(num_drafts)
        seqs = [w.seq for w, _ in checks]
        # Logit rows of each check: a verification's k+1 rows; a last prefill chunk's last row.
        rows = [[r + j for j in range(m + 1)] if w.kind == "verify" else [r + w.num_tokens - 1]
                for (w, r), m in zip(checks, num_drafts)]
        padded = self._dev([rs + [rs[-1]] * (m_max + 1 - len(rs)) for rs in rows])                 # [Bv, M+1]
        st = verifier.SamplingTensors.from_params([s.params for s in seqs], [s.seed for s in seqs], dev)
        logits = self.model.logits(hidden[padded.flatten()])                                       # [Bv*(M+1), V]
        st_rows = st.rows(torch.arange(len(checks), device=dev).repeat_interleave(m_max + 1))
        target = verifier.probs_from_logits(logits, st_rows).view(len(checks), m_max + 1, -1)     # [Bv, M+1, V]
        draft_probs = None
        if self.spec.method == "ngram":
            draft_tokens = self._dev([s.ngram_drafts[:m] + [0] * (m_max - m) for s, m in zip(seqs, num_drafts)])
        else:
            buf_rows = self._dev([s.row for s in seqs])
            draft_tokens = self.draft_tokens[buf_rows, :m_max].clone()                              # [Bv, M]
            if self.draft_probs is not None and not all(s.params.greedy for s in seqs):
                draft_probs = self.draft_probs[buf_rows, :m_max]
        first_position = self._dev([w.start + w.num_tokens if w.kind == "prefill" else w.start + 1
                                    for w, _ in checks])
        out = verifier.verify(target, draft_tokens, draft_probs, self._dev(num_drafts), st, first_position)
        return StepResult([], [w for w, _ in checks], num_drafts, out.num_accepted, out.next_token, out.is_bonus,
                          draft_tokens, None)
