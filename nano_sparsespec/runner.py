"""One device step: the step's lists become tensors, the model runs once, drafts are sampled and
verifications checked on the device.

Owns
  * running a step: the host's lists (step_lists.py) go to the device in one copy; `_compute`
    builds the flat inputs and the `AttentionContext`, runs the forward, samples the drafts and
    verifies the checks (their rows: readout.py). A padded static step records `_compute` as one
    CUDA graph.
  * the per-request device buffers: draft tokens (and distributions), each row's pending position
    (where a draft ahead of a verification's result goes), the draft buffers and selections
    (stored and kept by its base class, selections.py), pillar-lookup's committed tokens,
    sampling parameters and a mirror of each block table (changes only).
Everything `launch` returns stays on the device; `StepResult.fetch` is the step's one host
synchronisation, so the engine can launch step t before it looks at step t-1.

Must not decide who runs (the scheduler does) or re-implement attention or sampling.
"""
from __future__ import annotations

import time

import torch

from . import attention, lookup, verifier
from .attention import AttentionContext, DenseBatch, SparseBatch, gathered
from .config import SamplingParams, SpecConfig
from .cuda_graphs import Graphs, StepGraphs, round_up
from .device import Packed, to_device
from .kv_cache import KVCache
from .lookup import CommittedTokens
from .model import CausalLM
from .scheduler import Sequence, Work
from .selections import SelectionStore
from .readout import Readout
from .refresh_graphs import SelectionRefresh
from .step_lists import StepLists, StepPlan, StepShape
from .step_result import StepResult, joined_results


class ModelRunner(SelectionStore):
    def __init__(self, model: CausalLM, cache: KVCache, spec: SpecConfig, cuda_graphs=False):
        self.model, self.cache, self.spec = model, cache, spec
        cfg, self.device = model.config, cache.device
        self.num_layers, self.n_kv = cfg.num_layers, cfg.num_kv_heads
        rows, k = spec.max_batch, max(spec.stride, 1)
        long = dict(dtype=torch.long, device=self.device)
        # one row more than requests: the scratch row, where a step's padding reads and writes
        self.scratch_row = rows
        # each row's drafts, then its latest verification's next token after those it accepted
        self.draft_tokens = torch.zeros(rows + 1, k + 1, **long)              # [rows + 1, k + 1]
        # each row's pending position as its latest verification left it (drafts ahead read it)
        self.pending_position = torch.zeros(rows + 1, **long)                 # [rows + 1]
        # pillar-lookup: each draft-buffer row's columns for the lookups' K/V (twice the matches:
        # each found position and the one after it)
        self.lookups = 2 * spec.num_lookups if spec.method == "pillar-lookup" else 0
        self.graphs = (StepGraphs(self._compute, cache.block_size,
                                  [self.draft_tokens, self.pending_position], rows, k,
                                  spec.budget, speculates=spec.method != "plain",
                                  lookups=self.lookups)
                       if cuda_graphs else None)
        self.draft_probs: torch.Tensor | None = None                          # [rows + 1, k, V]
        self.queue_seconds = 0.0   # host time queuing steps (replays, eager kernels, recording)
        # Graphs read the buffers below at fixed addresses: growing one drops them (`_widen`).
        max_blocks = -(-cfg.max_position_embeddings // cache.block_size) + 1
        # each row's block table on the device, the scratch block past it (the scratch row: all)
        self.block_tables = torch.full((rows + 1, max_blocks), cache.scratch_block, **long)
        # pillar-lookup: each row's committed tokens mirrored on the device, for drafts' lookups
        lookup_width = cfg.max_position_embeddings if spec.method == "pillar-lookup" else 0
        self.committed = CommittedTokens(rows, lookup_width, self.device, self._widen)
        # columns a selection may take; with graphs, the longest context's budget from the start
        self.selection_room = 0
        if cuda_graphs and spec.method in ("pillar", "pillar-lookup", "streaming"):
            self.selection_room = round_up(spec.budget(cfg.max_position_embeddings),
                                           self.graphs.width_step)
        self.step_lists = StepLists(spec, cache, rows)      # the host side of each step
        self.selection_len = self.step_lists.selection_len  # [rows] critical positions per row
        # each row's critical positions in rank order, for pillar-lookup (`pillar_attn.kept_beside`)
        # and for verifications that keep them (`kept_selections`)
        self.keeps_selection = bool(self.lookups) or spec.refresh_every > 1
        width = self.selection_room if self.keeps_selection else 0  # [rows + 1, L, n_kv, width]
        self.selection = torch.zeros(rows + 1, self.num_layers, self.n_kv, width, **long)
        # the draft-buffer column of each row's top-ranked critical position; its selection lies
        # there as a ring, so a kept one copies only its new span (`attention.ring_span_writes`)
        self.selection_start = torch.zeros(rows + 1, **long)                  # [rows + 1]
        # with graphs, kept selections' refresh is recorded too (refresh_graphs.py)
        self.refresh = SelectionRefresh(self) if cuda_graphs and self.keeps_selection else None
        # Draft buffers, per row: K/V of its critical positions, its lookups, then its drafts'
        # (`selection_room` + `lookups` + k columns); made by the first selection or draft step.
        self.draft_k: torch.Tensor | None = None                       # [L, rows + 1, n_kv, C, D]
        self.draft_v: torch.Tensor | None = None
        # each row's sampling parameters, sent once per request
        self.sampling = verifier.SamplingTensors.from_params(
            [SamplingParams()] * (rows + 1), [0] * (rows + 1), self.device)
        self.params_sent = [-1] * rows                                  # seq_id holding a row

    def release(self) -> None:
        """Once its run is over, drop the recorded graphs and what calls back into this runner,
        so that the runner and its KV pool are freed as soon as its engine is, not when the
        collector next runs."""
        for graphs in self.graph_tables():
            graphs.release()
        self.committed = self.graphs = self.refresh = None     # (the mirror holds `_widen`)

    def _widen(self, buffer: torch.Tensor, width: int) -> torch.Tensor:
        """`buffer` [..., w] itself, or a copy twice as wide for `width` (graphs dropped)."""
        if width <= buffer.shape[-1]:
            return buffer
        grown = buffer.new_zeros(*buffer.shape[:-1], max(width, 2 * buffer.shape[-1]))
        grown[..., :buffer.shape[-1]] = buffer
        for graphs in self.graph_tables():
            graphs.forget()
        return grown

    def graph_tables(self) -> list[Graphs]:
        """The recorded steps' graphs and the refresh's (none without CUDA graphs)."""
        return [g for g in (self.graphs, self.refresh and self.refresh.graphs) if g is not None]

    # --- the step's shape and lists ----------------------------------------------------------
    def _apply_table_changes(self, changes: torch.Tensor | None, width: int) -> None:
        """Widen the tables to `width` columns and write `changes` [C, 3] (row, column, block)."""
        tables = self._widen(self.block_tables, width)
        if tables is not self.block_tables:
            tables[:, self.block_tables.shape[1]:] = self.cache.scratch_block  # past every table
            self.block_tables = tables
        if changes is not None:
            row, column, block = changes.unbind(1)
            self.block_tables[row, column] = block

    def _send_sampling_params(self, seqs: list[Sequence]) -> None:
        """Write the sampling parameters of requests new in their rows (once per request)."""
        new = [s for s in seqs if self.params_sent[s.row] != s.seq_id]
        if not new:
            return
        fresh = verifier.SamplingTensors.from_params([s.params for s in new],
                                                     [s.seed for s in new], self.device)
        rows = to_device([s.row for s in new], torch.long, self.device)
        for name in ("temperature", "top_k", "top_p", "seed", "greedy"):
            getattr(self.sampling, name)[rows] = getattr(fresh, name)
        for s in new:
            self.params_sent[s.row] = s.seq_id

    # --- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, works: list[Work], growth: float = 1.0) -> StepResult:
        """Queue the step's device work; its results stay on the device (`StepResult.fetch`).
        `growth`: how many times as many requests will decode soon (`StepGraphs.bucket`).
        With CUDA graphs its prefill chunks run as a static step of their own (mixed in, they
        would send the whole step down the eager path)."""
        parts = [works] if self.graphs is None else [
            part for part in ([w for w in works if w.kind != "prefill"],
                              [w for w in works if w.kind == "prefill"]) if part]
        checks, num_drafts, packed, scores = [], [], [], []
        for part in parts:
            plan = StepPlan.of(part, self.spec.method)
            shape = self.step_lists.shape(plan)
            if self.graphs is not None:
                shape = self.graphs.bucket(shape, growth)
            part_packed, part_scores = self._run(plan, shape, static=self.graphs is not None)
            checks += [w for w, _ in plan.checks]
            num_drafts += plan.num_drafts
            if plan.checks:   # (a replay's outputs last until the next replay: one memory pool)
                packed.append(part_packed.clone() if len(parts) > 1 else part_packed)
                scores.append(part_scores)               # gathered by `_run`, outside the graph
        joined = joined_results(packed, scores, self.device)
        result = StepResult(works, checks, num_drafts, *joined)
        result.start_copy()
        return result

    def _run(self, plan: StepPlan, shape: StepShape,
             static: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Send the lists, update the block tables, run the step (static: `shape` is a bucket)
        -> the real checks' packed [Bv, 3 + M] and their scores [Ls, Bv, n_kv, Lmax] or None."""
        seqs = [w.seq for w in plan.works]
        lists = self.step_lists.lists(plan, shape)
        names = list(lists)                      # the fixed-length lists; table changes come last
        changes = self.step_lists.table_changes(seqs)
        if changes:
            lists["table_changes"] = changes
        self._send_sampling_params(seqs)
        upload = Packed(lists, self.device)
        # every column in use came in a change once: the changes (and the dense context) say width
        self._apply_table_changes(upload.view("table_changes") if changes else None,
                                  max([shape.dense_blocks] + [col + 1 for _, col, _ in changes]))
        self.committed.reserve(shape.lookup_context)
        if plan.sparse:
            self._widen_draft_buffers(self.selection_room)
        queued = time.perf_counter()
        packed, scores = (self.graphs.run(shape, upload, names) if static  # valid until next replay
                          else self._compute(shape, upload.views()))
        self.queue_seconds += time.perf_counter() - queued
        checks = len(plan.checks)
        if scores is not None:   # gathered outside the graph: read after the next replay
            scores = scores[:, upload.view("check_dense_index")[:checks]]
        return packed[:checks], scores

    def _compute(self, shape: StepShape,
                 lists: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The device step from its uploaded lists (recorded whole as one CUDA graph)
        -> packed results [Bv, 3 + M], and the dense batch's scores [Ls, Bd, n_kv, Lmax] or None."""
        # a draft ahead of its verification's result moves on by the accepted count: its
        # position is the one that verification left pending, its input that one's token
        positions, bs = lists["positions"], self.cache.block_size                  # [T]
        shift = lists["ahead"] * (self.pending_position[lists["token_row"]] - positions)
        positions, feed = positions + shift, lists["feed_from"] + shift            # [T]
        input_ids = torch.where(feed >= 0, self.draft_tokens.view(-1)[feed.clamp(min=0)],
                                lists["input_ids"])
        # where the step's K/V go: each token's slot, from its row's block table
        slots = self.block_tables[lists["token_row"], positions // bs] * bs + positions % bs
        ctx = AttentionContext(self.cache.k, self.cache.v, slots, self.cache.block_size,
                               draft_k=self.draft_k, draft_v=self.draft_v,
                               context_capacity=self.block_tables.shape[1] * self.cache.block_size)
        if shape.dense_batch:
            ctx.dense = self._dense_batch(shape, lists)
        if shape.sparse_batch:
            ctx.sparse = self._sparse_batch(shape, lists, input_ids, shift)
        readout = Readout.of(shape, lists, shift)
        if "check_n_sel" in lists:   # a check's row j: column j of its request's window
            j = torch.arange(shape.check_drafts + 1, device=self.device)                # [M+1]
            columns = (lists["check_n_sel"] + self.lookups)[:, None] + j             # [Bv, M+1]
            rows = lists["check_row"][:, None].expand_as(columns)
            ctx.window_writes = (readout.check_logit_rows.flatten(), rows.flatten(),
                                 columns.flatten())
        hidden = self.model(input_ids, positions, ctx)                              # [T, hidden]
        draft_logits, check_logits = readout.logits(self.model, hidden)
        if readout.draft_row is not None:
            self._sample_drafts(draft_logits, readout)
        scores = ctx.dense.scores if ctx.dense is not None else None
        return self._verify(check_logits, readout), scores

    # --- the step's tensors, on the device ---------------------------------------------------
    def _dense_batch(self, shape: StepShape, dev: dict[str, torch.Tensor]) -> DenseBatch:
        bs = self.cache.block_size
        Q, L = shape.dense_queries, shape.dense_blocks * bs
        starts, q_lens = dev["dense_start"], dev["dense_q_len"]                    # [Bd]
        qi = torch.arange(Q, device=self.device)
        q_valid = qi[None, :] < q_lens[:, None]                                     # [Bd, Qmax]
        q_index = (dev["dense_first_row"][:, None] + qi).where(q_valid, shape.tokens - 1)  # pad
        block_table = self.block_tables[dev["dense_row"], :shape.dense_blocks]  # [Bd, Lmax / bs]
        runs = tuple((first, n, attention.causal_mask(starts[first:first + n],
                                                      q_valid[first:first + n, :q], blocks * bs),
                      prefill)
                     for first, n, q, blocks, prefill in shape.dense_runs
                     or ((0, shape.dense_batch, Q, shape.dense_blocks, False),))
        batch = DenseBatch(q_index, q_valid, block_table, starts, runs)
        if shape.scores:
            rule = dev["score_rows"][:, None]                                       # [Bd, 1]
            last = qi[None, :] == (q_lens - 1)[:, None]
            rows = q_valid & ((rule == 1) | ((rule == 2) & last))
            batch.score_weight = rows.float() / rows.sum(1, keepdim=True).clamp(min=1)
            every = batch.score_every = self.spec.score_every          # layers that score
            batch.scores = torch.zeros(-(-self.num_layers // every), shape.dense_batch, self.n_kv,
                                       L, device=self.device)
        return batch

    def _sparse_batch(self, shape: StepShape, dev: dict[str, torch.Tensor],
                      input_ids: torch.Tensor, shift: torch.Tensor) -> SparseBatch:
        """A draft attends to its row of the draft buffers: [n_sel critical positions | lookups
        | window (positions written since the last verification, its own included)]. A draft
        ahead (`shift` [T]: its accepted count) sees there the verification's K/V of the pending
        position and the accepted drafts' (`AttentionContext.window_writes`), then its own."""
        rows, n_sel = dev["sparse_row"], dev["sparse_n_sel"]                        # [Bs]
        shift = shift[dev["sparse_first_row"]]                                      # [Bs]
        window = dev["sparse_window"] + shift
        L, n_kv, M, R = self.num_layers, self.n_kv, self.lookups, shape.sparse_rows
        N = round_up(shape.selection_width + M + shape.window, 8)   # 8-aligned (bucket)
        column = torch.arange(N, device=self.device)                               # [N]
        first_window = (n_sel + M)[:, None]                                         # [Bs, 1]
        seen = ((column < n_sel[:, None])                                           # [Bs, N]
                | ((column >= first_window) & (column < first_window + window[:, None])))
        if self.spec.method == "pillar-lookup":
            # positions found from the input token replace the lowest-ranked critical ones
            committed = self.committed.tokens[rows, dev["prev_committed"]]
            drafted = self.draft_tokens[rows, dev["prev_drafted"] + (shift - 1).clamp(min=0)]
            prev = torch.where((dev["prev_in_context"] != 0) & (shift == 0), committed, drafted)
            # found_at, found_valid: [Bs, M]; seen: [Bs, L, n_kv, N]
            found_at, found_valid, seen = lookup.lookup_draft_columns(
                seen, self.selection[:, :, :, :shape.selection_width], rows, n_sel,
                self.selection_start[rows],
                self.committed.tokens[:, :shape.lookup_context], input_ids[dev["sparse_first_row"]],
                dev["sparse_verified"], prev, self.spec.num_lookups)
            self._fill_draft_buffers(self.block_tables[rows], found_at[:, None, None, :], rows,
                                     n_sel[:, None] + torch.arange(M, device=self.device))
        else:
            seen = seen[:, None, None, :].expand(-1, L, n_kv, -1)            # [Bs, L, n_kv, N]
        read_row, valid = None, seen.transpose(0, 1)  # gathered: [L, Bs, n_kv, N], each draft's
        if not gathered(shape.sparse_batch, R + 1):           # else the rows read in place
            read_row = rows.clamp(max=R)                      # padding drafts: row R
            # each buffer row's draft, so that one gather moves the flags (a row no draft reads
            # takes draft 0's: a finite softmax, its output unread). Layer-major, with spare rows
            # that start each layer's flags 16-byte aligned: compiled code copies an input that is
            # not (were it a strided view, the whole span of all the layers' flags).
            spare = -(R + 1) % 16
            draft_of_row = torch.zeros(R + 1 + spare, dtype=torch.long, device=self.device)
            draft_of_row.scatter_(0, read_row, torch.arange(len(rows), device=self.device))
            flags = seen.transpose(0, 1).index_select(1, draft_of_row)   # [L, R+1+spare, n_kv, N]
            valid = flags[:, :R + 1]                                        # [L, R + 1, n_kv, N]
        return SparseBatch(dev["sparse_first_row"], read_row, rows,
                           first_window[:, 0] + window - 1, valid)

    # --- drafts and checks from the readout's logits -----------------------------------------
    def _sample_drafts(self, logits: torch.Tensor, r: Readout) -> None:
        """Sample drafts from logits [Nd, V] into the draft buffer (their distributions into
        `draft_probs`, but where every row is greedy)."""
        st = self.sampling.select(r.draft_row, r.draft_flags)
        stored = None if st.all_greedy else self._draft_probs(logits.shape[-1])  # [rows + 1, k, V]
        tokens = verifier.sample_drafts(logits, st, r.draft_position, stored, r.draft_row,
                                        r.draft_index)                                # [Nd]
        self.draft_tokens[r.draft_row, r.draft_index] = tokens

    def _draft_probs(self, vocab: int) -> torch.Tensor:
        """The distributions the drafts were sampled from [rows + 1, k, V], allocated by the
        first step that samples or verifies drafts at a temperature (a graph's first, eager run)."""
        if self.draft_probs is None:
            self.draft_probs = torch.zeros(*self.draft_tokens.shape, vocab, device=self.device)
        return self.draft_probs

    def _verify(self, logits: torch.Tensor, r: Readout) -> torch.Tensor:
        """Verify the checks from their logits [Bv * (M+1), V] -> packed [Bv, 3 + M]."""
        if r.check_row is None:
            return torch.zeros(0, 3, dtype=torch.long, device=self.device)
        num_checks, m_max = r.check_logit_rows.shape[0], r.check_logit_rows.shape[1] - 1
        logits = logits.view(num_checks, m_max + 1, -1)                            # [Bv, M+1, V]
        st = self.sampling.select(r.check_row, r.check_flags)                       # per check
        draft_tokens, draft_probs, draft_rows = r.ngram_drafts, None, None          # [Bv, M]
        if draft_tokens is None:
            draft_tokens = self.draft_tokens[r.check_row, :m_max]                   # a copy
            if m_max and not st.all_greedy:   # (a last prefill chunk's padded check reads none)
                draft_probs = self._draft_probs(logits.shape[-1])              # [rows + 1, k, V]
                draft_rows = r.check_row      # read in place
        out = verifier.verify_logits(logits, draft_tokens, draft_probs, r.check_num_drafts, st,
                                     r.check_first_position, draft_rows)
        # where a request that runs or drafts ahead reads it in its next step, launched already
        self.draft_tokens[r.check_row, out.num_accepted] = out.next_token
        self.pending_position[r.check_row] = r.check_first_position + out.num_accepted
        return torch.cat([out.num_accepted[:, None], out.next_token[:, None],
                          out.is_bonus.long()[:, None], draft_tokens], dim=1)
