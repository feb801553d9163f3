"""Turns one step's plan into tensors, runs the model once, and samples or verifies on the device.

Owns
  * building the step's flat inputs (`input_ids [T]`, `positions [T]`, `slot_mapping [T]`) and the
    `AttentionContext` (which requests attend densely, which draft tokens attend sparsely and to which slots). The
    host first writes every index list the step needs (`_*_lists`), sends them in one copy, then builds the
    tensors from those on the device;
  * the per-request device buffers: this cycle's draft tokens (and their draft distributions when sampling; for plain
    decoding that runs ahead, column 0 holds the token of the step in flight), the critical positions each
    request's drafts attend to, each request's sampling parameters (sent once per request), and a mirror of each
    request's block table (updated with only the entries that changed, so a step does not rebuild [B, blocks] tables
    from Python lists);
  * after the forward, as its `Readout` says: sampling draft tokens (`verifier.sample_drafts`), and verification
    (`verifier.verify_logits`) for verifying requests and for a request's last prefill chunk (a verification with no
    drafts). `_compute` (forward + readout) is the whole device step: a padded static step records it as one CUDA
    graph (cuda_graphs.py), so neither the layers nor the sampling are launched from Python kernel by kernel.
Everything `launch` returns stays on the device; `StepResult.fetch` is the one host synchronisation of a step, so the
engine can launch step t before it looks at step t-1 (delayed verification).

Must not decide who runs (the scheduler does) or re-implement attention or sampling.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import pillar_attn, verifier
from .config import SamplingParams, SpecConfig
from .kv_cache import KVCache
from .model import CausalLM
from .pillar_attn import AttentionContext, DenseBatch, SparseBatch
from .cuda_graphs import StepGraphs
from .device import common_prefix, to_device, to_device_packed
from .scheduler import Sequence, Work

# the named device lists of a step (`launch`) that make up its Readout
READOUT_LISTS = ("draft_logit_row", "draft_row", "draft_index", "draft_position", "check_logit_rows", "check_row",
                 "check_num_drafts", "check_first_position", "ngram_drafts")


@dataclass
class Readout:
    """What a step reads out of its hidden states after the forward: which token rows are sampled as drafts and which
    verify, for which request rows (index tensors on the device), with the sampling flags of those requests (host).
    Draft fields are None in a step without drafts, check fields None in a step without verifications."""
    draft_logit_row: torch.Tensor | None = None        # [Nd] the flat token row whose output samples the draft
    draft_row: torch.Tensor | None = None              # [Nd] its request's row (draft buffers, sampling table)
    draft_index: torch.Tensor | None = None            # [Nd] the draft buffer column it fills
    draft_position: torch.Tensor | None = None         # [Nd] the position it will occupy (its uniform's counter)
    check_logit_rows: torch.Tensor | None = None       # [Bv, M+1] a verification's k+1 rows, or a last prefill
                                                       #   chunk's last row (repeated as padding)
    check_row: torch.Tensor | None = None              # [Bv] its request's row
    check_num_drafts: torch.Tensor | None = None       # [Bv] drafts it checks (0..M)
    check_first_position: torch.Tensor | None = None   # [Bv] position its first logit row decides
    ngram_drafts: torch.Tensor | None = None           # [Bv, M] n-gram drafts (method ngram; model drafts are on
                                                       #   the device already, in the runner's draft buffer)
    draft_flags: dict | None = None                    # SamplingTensors.host_flags of the drafts' requests
    check_flags: dict | None = None                    # ... and of the checks' requests


@dataclass
class StepResult:
    """Device-side results of one step, plus the host-side plan they belong to."""
    works: list[Work]
    verify_works: list[Work]                 # verifications and last prefill chunks, in result order
    num_drafts: list[int]                    # drafts checked by each of them
    packed: torch.Tensor                     # [Bv, 3 + Mmax] per check: accepted count, the recovered / bonus (or,
                                             # after prefill, first) token, 1 if bonus, the drafts it checked
    scores: torch.Tensor | None = None       # [L, Bv, n_kv, Lmax] PillarAttn scores of those requests, or None
    host: torch.Tensor | None = None         # `packed` copied to the host (`start_copy`)
    copied: torch.cuda.Event | None = None   # recorded on the stream right after that copy (CUDA only)

    def start_copy(self) -> None:
        """Queue the copy of what the host bookkeeping needs, right behind this step's own work.

        With delayed verification the host fetches step t-1 after it has queued step t; a copy queued only then would
        wait for step t as well, and the host would have nothing left to overlap. (Queued before the next step, it
        also reads `packed` before a CUDA graph replay can reuse that memory.)"""
        if self.packed.device.type == "cuda":
            self.host = torch.empty(self.packed.shape, dtype=self.packed.dtype, pin_memory=True)
            self.host.copy_(self.packed, non_blocking=True)          # pinned destination: an asynchronous copy
            self.copied = torch.cuda.Event()
            self.copied.record()
        else:
            self.host = self.packed

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
        cfg = model.config
        self.device = cache.device
        self.num_layers, self.n_kv = cfg.num_layers, cfg.num_kv_heads
        rows, k = spec.max_batch, max(spec.stride, 1)
        # Buffers indexed by request row have one row more, the scratch row: a padded static step's padding drafts
        # and checks read and write there, never in a request's row.
        self.scratch_row = rows
        self.graphs = StepGraphs(model, cache, self._compute, self.scratch_row) if cuda_graphs else None
        self.draft_tokens = torch.zeros(rows + 1, k, dtype=torch.long, device=self.device)   # [rows + 1, k]
        self.draft_probs: torch.Tensor | None = None                                          # [rows + 1, k, V]
        self.selection = torch.zeros(rows, self.num_layers, self.n_kv, 0, dtype=torch.long, device=self.device)
        self.selection_len = [0] * rows                                                   # valid width per row
        # pillar-lookup: each row's committed tokens mirrored on the device, so drafts can look tokens up in them
        self.context_tokens = torch.zeros(rows, 0, dtype=torch.long, device=self.device)  # [rows, capacity]
        self.tokens_sent = [(-1, 0)] * rows                                               # (seq_id, tokens sent)
        # each row's block table mirrored on the device, so a step sends only the entries that changed
        self.block_tables = torch.zeros(rows, 0, dtype=torch.long, device=self.device)    # [rows, capacity]
        self.tables_sent: list[tuple[int, list[int]]] = [(-1, [])] * rows                # (seq_id, table as sent)
        # each row's sampling parameters, sent once when a request takes the row
        self.sampling = verifier.SamplingTensors.from_params([SamplingParams()] * (rows + 1), [0] * (rows + 1),
                                                             self.device)
        self.params_sent = [-1] * rows                                                    # seq_id holding a row

    # --- critical positions ------------------------------------------------------------------------------------------
    def set_selections(self, seqs: list[Sequence], positions: list[torch.Tensor]) -> None:
        """Store, for each request, the positions [L, n_kv, n] its next drafts attend to (besides the recent window).

        One write for all of them: the shorter selections are padded to the longest, and the padding columns lie
        beyond their row's `selection_len`, where drafts do not read."""
        widths = [p.shape[-1] for p in positions]
        n = max(widths)
        if n > self.selection.shape[-1]:
            grown = torch.zeros(*self.selection.shape[:-1], max(n, 2 * self.selection.shape[-1]),
                                dtype=torch.long, device=self.device)
            grown[..., :self.selection.shape[-1]] = self.selection
            self.selection = grown
        padded = torch.stack([F.pad(p, (0, n - p.shape[-1])) if p.shape[-1] < n else p for p in positions])
        self.selection[self._dev([s.row for s in seqs]), :, :, :n] = padded        # [B, L, n_kv, n]
        for seq, width in zip(seqs, widths):
            self.selection_len[seq.row] = width

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

    # --- building the step: host lists first, one copy, then device tensors --------------------------------------
    def _table_changes(self, seqs: list[Sequence]) -> list[list[int]]:
        """(row, column, block) entries of the device block tables that differ from the host tables of `seqs`.

        A table only changes at its end (append adds blocks, rollback drops them), so usually nothing or one new
        block per request; `_apply_table_changes` writes them. Columns past a request's own table keep stale but
        valid block ids (masked by the context length, like padding)."""
        changes = []
        for seq in seqs:
            table = self.cache.pool.tables[seq.seq_id]
            owner, sent = self.tables_sent[seq.row]
            if owner != seq.seq_id or sent != table:
                same = common_prefix(sent, table) if owner == seq.seq_id else 0
                changes += [[seq.row, j, table[j]] for j in range(same, len(table))]
                self.tables_sent[seq.row] = (seq.seq_id, list(table))
        return changes

    def _apply_table_changes(self, changes: torch.Tensor | None, width: int) -> None:
        """Grow the device tables to `width` columns if needed and write `changes` [C, 3] (row, column, block)."""
        if width > self.block_tables.shape[1]:
            grown = torch.zeros(self.block_tables.shape[0], max(width, 2 * self.block_tables.shape[1]),
                                dtype=torch.long, device=self.device)
            grown[:, :self.block_tables.shape[1]] = self.block_tables
            self.block_tables = grown
        if changes is not None:
            row, column, block = changes.unbind(1)
            self.block_tables[row, column] = block

    def _send_sampling_params(self, seqs: list[Sequence]) -> None:
        """Bring the per-row sampling table up to date for requests new in their rows (once per request)."""
        new = [s for s in seqs if self.params_sent[s.row] != s.seq_id]
        if not new:
            return
        fresh = verifier.SamplingTensors.from_params([s.params for s in new], [s.seed for s in new], self.device)
        rows = self._dev([s.row for s in new])
        for name in ("temperature", "top_k", "top_p", "seed", "greedy"):
            getattr(self.sampling, name)[rows] = getattr(fresh, name)
        for s in new:
            self.params_sent[s.row] = s.seq_id

    def _dev(self, data, dtype=torch.long) -> torch.Tensor:
        return to_device(data, dtype, self.device)

    def _slots(self, tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pool slots of positions [B, ...] of the requests whose padded block tables are `tables` [B, max_blocks]."""
        bs = self.cache.block_size
        flat = positions.reshape(positions.shape[0], -1)
        block = torch.gather(tables, 1, (flat // bs).clamp(max=tables.shape[1] - 1))
        return (block * bs + flat % bs).view(positions.shape)

    @staticmethod
    def _dense_lists(dense: list[tuple[Work, int]], with_scores: bool) -> dict[str, list]:
        q_max = max(w.num_tokens for w, _ in dense)
        lists = {"dense_first_row": [r for _, r in dense], "dense_start": [w.start for w, _ in dense],
                 "dense_q_len": [w.num_tokens for w, _ in dense], "dense_row": [w.seq.row for w, _ in dense],
                 # where the real (non-padding) query rows sit: flat index into [Bd * Qmax], and their rows in the step
                 "valid_flat": [b * q_max + j for b, (w, _) in enumerate(dense) for j in range(w.num_tokens)],
                 "valid_rows": [r + j for w, r in dense for j in range(w.num_tokens)]}
        if with_scores:
            # which query rows count in the PillarAttn scores: 1 all real rows (a verification), 2 the last row only
            # (a last prefill chunk), 0 none (an earlier prefill chunk)
            lists["score_rows"] = [1 if w.kind == "verify" else 2 if w.final_prefill else 0 for w, _ in dense]
        return lists

    def _dense_batch(self, dense: list[Work], dev: dict[str, torch.Tensor]) -> DenseBatch:
        q_max, ctx_max = max(w.num_tokens for w in dense), max(w.start + w.num_tokens for w in dense)
        starts, q_lens = dev["dense_start"], dev["dense_q_len"]                        # [Bd]
        qi = torch.arange(q_max, device=self.device)
        q_valid = qi[None, :] < q_lens[:, None]                                         # [Bd, Qmax]
        q_index = (dev["dense_first_row"][:, None] + qi).where(q_valid, 0)
        num_blocks = -(-ctx_max // self.cache.block_size)
        kv_pos = torch.arange(num_blocks * self.cache.block_size, device=self.device).expand(len(dense), -1)  # [Bd, Lmax]
        q_pos = starts[:, None] + qi                                                    # [Bd, Qmax]
        mask = kv_pos[:, None, :] <= q_pos[:, :, None]                                  # causal, [Bd, Qmax, Lmax]
        mask &= q_valid[:, :, None] | (kv_pos[:, None, :] == 0)                         # padding rows see position 0
        block_table = self.block_tables[dev["dense_row"], :num_blocks]                  # [Bd, Lmax / block]
        batch = DenseBatch(q_index, q_valid, dev["valid_flat"], dev["valid_rows"], block_table, mask, starts)
        if "score_rows" in dev:
            rule = dev["score_rows"][:, None]                                           # [Bd, 1]
            rows = q_valid & ((rule == 1) | ((rule == 2) & (qi[None, :] == (q_lens - 1)[:, None])))
            batch.score_weight = rows.float() / rows.sum(1, keepdim=True).clamp(min=1)
            batch.scores = torch.zeros(self.num_layers, len(dense), self.n_kv, kv_pos.shape[1], device=self.device)
        return batch

    def _sparse_lists(self, sparse: list[tuple[Work, int]]) -> dict[str, list]:
        seqs = [w.seq for w, _ in sparse]
        lists = {"sparse_first_row": [r for _, r in sparse], "sparse_row": [s.row for s in seqs],
                 "sparse_verified": [s.num_verified for s in seqs],
                 "sparse_n_sel": [self.selection_len[s.row] for s in seqs],
                 "sparse_window": [w.start - w.seq.num_verified + 1 for w, _ in sparse]}  # written since verification
        if self.spec.method == "pillar-lookup":
            # The token before each draft's input: committed (mirrored in context_tokens, the pending one included)
            # or one of this cycle's drafts (draft_tokens index j holds position num_verified + 1 + j).
            prev = [w.start - 1 for w, _ in sparse]
            lists["prev_committed"] = [min(p, s.num_verified) for p, s in zip(prev, seqs)]
            lists["prev_drafted"] = [max(0, p - s.num_verified - 1) for p, s in zip(prev, seqs)]
            lists["prev_in_context"] = [int(p <= s.num_verified) for p, s in zip(prev, seqs)]
        return lists

    def _sparse_batch(self, drafts: list[Work], dev: dict[str, torch.Tensor], input_ids: torch.Tensor) -> SparseBatch:
        seqs = [w.seq for w in drafts]
        sel_max = max(self.selection_len[s.row] for s in seqs)
        win_max = max(w.start - w.seq.num_verified + 1 for w in drafts)
        width = max(len(self.cache.pool.tables[s.seq_id]) for s in seqs)
        rows, verified, n_sel = dev["sparse_row"], dev["sparse_verified"], dev["sparse_n_sel"]   # [Bs]
        tables = self.block_tables[rows, :width]                                        # [Bs, blocks]
        sel_pos = self.selection[rows, :, :, :sel_max]                                  # [Bs, L, n_kv, Nsel]
        sel_valid = torch.arange(sel_max, device=self.device)[None] < n_sel[:, None]   # [Bs, Nsel]
        if self.spec.method == "pillar-lookup":
            # Refreshed at every draft step: positions found from this draft's input token replace the lowest-ranked
            # critical positions of each (layer, KV head); the count stays the budget.
            # Same width and count as the selection (sel_valid holds): the step gathers B + window entries.
            lookup, lookup_valid = self._lookups(seqs, dev, input_ids[dev["sparse_first_row"]])   # [Bs, M]
            sel_pos = pillar_attn.merge_lookup(sel_pos, n_sel, lookup, lookup_valid)     # [Bs, L, n_kv, Nsel]
        win_pos = verified[:, None] + torch.arange(win_max, device=self.device)         # [Bs, W]
        sel_slots = self._slots(tables, sel_pos)                                        # [Bs, L, n_kv, Nsel]
        win_slots = self._slots(tables, win_pos)[:, None, None, :].expand(-1, self.num_layers, self.n_kv, -1)
        slots = torch.cat([sel_slots, win_slots], dim=-1)                               # [Bs, L, n_kv, S]
        heads = torch.arange(self.n_kv, device=self.device)[None, None, :, None]
        kv_index = (slots * self.n_kv + heads).permute(1, 0, 2, 3).contiguous()         # [L, Bs, n_kv, S]
        win_valid = torch.arange(win_max, device=self.device)[None] < dev["sparse_window"][:, None]
        valid = torch.cat([sel_valid, win_valid], dim=1)                                # [Bs, S]
        return SparseBatch(dev["sparse_first_row"], kv_index, valid)

    def _lookups(self, seqs: list[Sequence], dev: dict[str, torch.Tensor], tokens: torch.Tensor):
        """pillar-lookup: the positions each draft's input token `tokens` [Bs] finds in its verified context."""
        rows, verified = dev["sparse_row"], dev["sparse_verified"]
        committed = self.context_tokens[rows, dev["prev_committed"]]
        drafted = self.draft_tokens[rows, dev["prev_drafted"]]
        context_tokens = self.context_tokens[rows, :max(s.num_verified for s in seqs)]              # [Bs, Lc]
        return pillar_attn.lookup_positions(context_tokens, tokens, verified, self.spec.num_lookups,
                                            torch.where(dev["prev_in_context"] != 0, committed, drafted))

    # --- one step ---------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, works: list[Work]) -> StepResult:
        method = self.spec.method
        first_row, num_rows = [], 0                 # each work's first row in the step's flat token list
        for w in works:
            first_row.append(num_rows)
            num_rows += w.num_tokens
        placed = list(zip(works, first_row))
        dense = [(w, r) for w, r in placed if w.kind != "draft" or method == "full"]
        sparse = [(w, r) for w, r in placed if w.kind == "draft" and method != "full"]
        drafts = [(w, r) for w, r in placed if w.kind == "draft"]
        checks = [(w, r) for w, r in placed if w.kind == "verify" or w.final_prefill]
        num_drafts = [w.num_tokens - 1 if w.kind == "verify" else 0 for w, _ in checks]   # drafts each check checks
        wants_scores = method in ("pillar", "pillar-lookup")

        # Everything the host knows about the step, as named integer lists; then one copy to the device.
        seqs = [w.seq for w in works]
        lists = self._token_lists(works)
        changes = self._table_changes(seqs)
        if changes:
            lists["table_changes"] = changes
        if dense:
            lists |= self._dense_lists(dense, wants_scores and any(w.kind == "verify" or w.final_prefill
                                                                   for w, _ in dense))
        if sparse:
            lists |= self._sparse_lists(sparse)
        if drafts:
            lists |= self._draft_lists(drafts)
        if checks:
            lists |= self._check_lists(checks, num_drafts, dense if wants_scores else None)
        self._send_sampling_params(seqs)
        dev = to_device_packed(lists, self.device)

        self._apply_table_changes(dev.get("table_changes"), max(len(self.cache.pool.tables[s.seq_id]) for s in seqs))
        input_ids = dev["input_ids"]                                                    # [T]
        if "feed_at" in dev:       # inputs that are this cycle's drafts, still on the device only
            input_ids[dev["feed_at"]] = self.draft_tokens[dev["feed_row"], dev["feed_column"]]
        ctx = AttentionContext(self.cache.k, self.cache.v, dev["slots"], self.cache.block_size)
        if dense:
            ctx.dense = self._dense_batch([w for w, _ in dense], dev)
        if sparse:
            ctx.sparse = self._sparse_batch([w for w, _ in sparse], dev, input_ids)
        readout = Readout(**{name: dev.get(name) for name in READOUT_LISTS})
        if drafts:
            readout.draft_flags = verifier.SamplingTensors.host_flags([w.seq.params for w, _ in drafts])
        if checks:
            readout.check_flags = verifier.SamplingTensors.host_flags([w.seq.params for w, _ in checks])
        if self.graphs is not None and all(w.kind != "prefill" for w in works):
            packed = self.graphs.run(input_ids, dev["positions"], ctx, readout)     # one padded static step
        else:
            packed = self._compute(input_ids, dev["positions"], ctx, readout)
        result = StepResult(works, [w for w, _ in checks], num_drafts, packed)
        if wants_scores and checks:
            result.scores = ctx.dense.scores[:, dev["check_dense_index"]]
        result.start_copy()
        return result

    def _compute(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                 readout: Readout) -> torch.Tensor:
        """The step's device work once its inputs are built: the forward, then sampling drafts and verifying.
        A padded static step records this whole function as one CUDA graph. -> packed results [Bv, 3 + M]."""
        hidden = self.model(input_ids, positions, ctx)                              # [T, hidden]
        if readout.draft_row is not None:
            self._sample_drafts(hidden, readout)
        return self._verify(hidden, readout)

    def _token_lists(self, works: list[Work]) -> dict[str, list]:
        """input_ids, positions and KV slots of every token of the step [T]; where inputs come from the draft buffer."""
        ids, positions, slots = [], [], []
        feed_at, feed_row, feed_column = [], [], []     # flat rows whose input is a draft token still on the device
        bs = self.cache.block_size
        for w in works:
            seq = w.seq
            pos = range(w.start, w.start + w.num_tokens)
            if w.kind == "prefill":
                inputs = seq.tokens[w.start:w.start + w.num_tokens]
            elif self.spec.method == "ngram":
                inputs = [seq.tokens[-1]] + seq.ngram_drafts[:w.num_tokens - 1]
            else:  # the pending token, then this cycle's model drafts (fed from the device buffer); a plain step
                   # that runs ahead starts one past the pending token, on the token in flight (column 0)
                inputs = [seq.tokens[-1]] + [0] * (w.num_tokens - 1)
                first_draft = seq.num_verified + 1
                for j, p in enumerate(pos):
                    if p >= first_draft:
                        feed_at.append(len(ids) + j)
                        feed_row.append(seq.row)
                        feed_column.append(p - first_draft)
            table = self.cache.pool.tables[seq.seq_id]
            ids += inputs
            positions += pos
            slots += [table[p // bs] * bs + p % bs for p in pos]
        lists = {"input_ids": ids, "positions": positions, "slots": slots}
        if feed_at:
            lists |= {"feed_at": feed_at, "feed_row": feed_row, "feed_column": feed_column}
        return lists

    @staticmethod
    def _draft_lists(drafts: list[tuple[Work, int]]) -> dict[str, list]:
        return {"draft_logit_row": [r for _, r in drafts], "draft_row": [w.seq.row for w, _ in drafts],
                "draft_index": [w.start - w.seq.num_verified for w, _ in drafts],
                "draft_position": [w.start + 1 for w, _ in drafts]}

    def _sample_drafts(self, hidden: torch.Tensor, r: Readout) -> None:
        logits = self.model.logits(hidden[r.draft_logit_row])                          # [Nd, V]
        st = self.sampling.select(r.draft_row, r.draft_flags)
        probs, tokens = verifier.sample_drafts(logits, st, r.draft_position)           # [Nd, V], [Nd]
        self.draft_tokens[r.draft_row, r.draft_index] = tokens
        if not st.all_greedy:
            if self.draft_probs is None:   # (a graph's first, eager run allocates it: never inside a recording)
                self.draft_probs = torch.zeros(*self.draft_tokens.shape, probs.shape[-1], device=self.device)
            self.draft_probs[r.draft_row, r.draft_index] = probs

    def _check_lists(self, checks: list[tuple[Work, int]], num_drafts: list[int],
                     dense: list[tuple[Work, int]] | None) -> dict[str, list]:
        """Verifications and last prefill chunks; `dense` (when scores are wanted): the step's dense works."""
        m_max = max(num_drafts)
        # Logit rows of each check: a verification's k+1 rows; a last prefill chunk's last row (repeated as padding).
        logit_rows = [[r + min(j, m) for j in range(m_max + 1)] if w.kind == "verify"
                      else [r + w.num_tokens - 1] * (m_max + 1) for (w, r), m in zip(checks, num_drafts)]  # [Bv, M+1]
        lists = {"check_logit_rows": logit_rows, "check_row": [w.seq.row for w, _ in checks],
                 "check_num_drafts": num_drafts,
                 "check_first_position": [w.start + w.num_tokens if w.kind == "prefill" else w.start + 1
                                          for w, _ in checks]}
        if self.spec.method == "ngram":
            lists["ngram_drafts"] = [w.seq.ngram_drafts[:m] + [0] * (m_max - m)
                                     for (w, _), m in zip(checks, num_drafts)]                 # [Bv, M]
        if dense is not None:
            dense_index = {id(w): i for i, (w, _) in enumerate(dense)}
            lists["check_dense_index"] = [dense_index[id(w)] for w, _ in checks]
        return lists

    def _verify(self, hidden: torch.Tensor, r: Readout) -> torch.Tensor:
        """Verify the step's checks -> packed [Bv, 3 + M] (see `StepResult.packed`)."""
        if r.check_row is None:
            return torch.zeros(0, 3, dtype=torch.long, device=self.device)
        num_checks, m_max = r.check_logit_rows.shape[0], r.check_logit_rows.shape[1] - 1
        logits = self.model.logits(hidden[r.check_logit_rows.flatten()]).view(num_checks, m_max + 1, -1)
        st = self.sampling.select(r.check_row, r.check_flags)                           # one row per check
        draft_probs = None
        if r.ngram_drafts is not None:
            draft_tokens = r.ngram_drafts                                               # [Bv, M]
        else:
            draft_tokens = self.draft_tokens[r.check_row, :m_max]                       # [Bv, M] (a copy)
            if self.draft_probs is not None and not st.all_greedy:
                draft_probs = self.draft_probs[r.check_row, :m_max]
        out = verifier.verify_logits(logits, draft_tokens, draft_probs, r.check_num_drafts, st,
                                     r.check_first_position)
        if self.spec.runs_ahead:   # the request's next step, launched before the host sees this token, reads it here
            self.draft_tokens[r.check_row, 0] = out.next_token
        return torch.cat([out.num_accepted[:, None], out.next_token[:, None], out.is_bonus.long()[:, None],
                          draft_tokens], dim=1)
