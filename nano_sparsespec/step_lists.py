"""A step's plan and the index lists it sends to the device: the host side of a step.

Owns
  * `StepPlan`: a step's works sorted by what they need (dense attention, sparse drafts, draft
    sampling, verification), each with its first row in the step's flat token list;
  * `StepShape`: the sizes its device tensors are built with (its own, or a CUDA-graph bucket's);
  * `WorkColumns`: what a step's works need, one column per quantity: most of a step's works are
    one-token drafts or decodes, and their lists come from these columns in a few tensor
    operations each, not request by request;
  * `StepLists`: every index list the device step is built from (token inputs, positions and KV
    slots, the dense and sparse batches, the draft and check rows), each padded to the step's
    shape so that they travel in one copy (`device.Packed`), and the block-table changes.

Must not touch device tensors: it writes Python lists and CPU tensors; runner.py sends them.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import verifier
from .config import PILLAR_METHODS, SpecConfig
from .device import common_prefix, long_tensor
from .kv_cache import KVCache
from .scheduler import Sequence, Work


@dataclass(frozen=True)
class StepShape:
    """The lengths of a step's lists and tensors: its own, or its bucket's (`StepGraphs.bucket`)."""
    tokens: int              # T: token rows; with padding, the last one is the padding row
    dense_batch: int         # Bd: requests attending densely
    dense_queries: int       # Qmax: query rows per dense request (1 decode, k + 1 verification)
    dense_blocks: int        # Lmax / block_size: context blocks per dense request
    scores: bool             # PillarAttn scores wanted
    sparse_batch: int        # Bs: draft tokens attending sparsely
    sparse_rows: int         # R: draft-buffer rows a draft step reads (highest row + 1)
    selection_width: int     # Nsel: critical positions per (layer, KV head) a draft attends to
    window: int              # W: recent positions it attends to (since the last verification)
    lookup_context: int      # Lc: verified positions a pillar-lookup draft searches (else 0)
    drafts: int              # Nd: draft tokens sampled
    checks: int              # Bv: verifications and last prefill chunks
    check_drafts: int        # M: drafts per check (its logit rows: M + 1)
    draft_flags: tuple       # SamplingTensors.host_flags of the drafts' requests, as items
    check_flags: tuple       # ... and of the checks' requests
    dense_runs: tuple = ()   # (first, count, query rows, blocks, prefill) per dense run, with
                             #   prefill chunks (`StepLists._dense_runs`); () all together


class WorkColumns(NamedTuple):
    """A step's works (or its drafts only), one [W] Long CPU tensor per quantity."""
    first_row: torch.Tensor    # its first row in the step's flat token list
    num_tokens: torch.Tensor   # its token rows (`Work.num_tokens`)
    start: torch.Tensor        # the position of its first token (a draft ahead's if none of the
                               #   drafts in flight is accepted)
    row: torch.Tensor          # its request's runner row
    verified: torch.Tensor     # its request's verified positions (`Sequence.num_verified`)
    pending: torch.Tensor      # its request's pending token, the one at position `verified`
    ahead: torch.Tensor        # 1 for a draft ahead of its verification's result (`Work.ahead`)
    in_flight: torch.Tensor    # ... the drafts that verification checks; 0 for other works
    n_sel: torch.Tensor        # critical positions its request's latest selection holds
    is_draft: torch.Tensor     # 1 for a draft


@dataclass
class StepPlan:
    """A step's works sorted by what they need, each with its first row in the flat token list."""
    works: list[Work]
    dense: list[tuple[Work, int]] = field(default_factory=list)    # attend to whole context
    sparse: list[tuple[Work, int]] = field(default_factory=list)   # drafts, gathered positions
    drafts: list[tuple[Work, int]] = field(default_factory=list)   # sample a draft token
    checks: list[tuple[Work, int]] = field(default_factory=list)   # verifications, last chunks
    chunks: list[tuple[Work, int]] = field(default_factory=list)   # prefill chunks
    num_drafts: list[int] = field(default_factory=list)            # drafts each check checks
    num_tokens: int = 0                                            # T: the step's token rows
    # (`StepLists.columns`: made once, the shape and the lists both read them)
    work_matrix: torch.Tensor | None = None                         # [W, 10] the works' columns
    columns: tuple[WorkColumns, WorkColumns] | None = None          # (works, drafts)

    @staticmethod
    def of(works: list[Work], method: str) -> "StepPlan":
        plan, row = StepPlan(works), 0
        drafts_attend = plan.dense if method == "full" else plan.sparse
        for w in works:
            entry = (w, row)
            if w.kind == "verify":
                plan.dense.append(entry)
                plan.checks.append(entry)
                plan.num_drafts.append(w.num_tokens - 1)
            elif w.kind == "draft":
                drafts_attend.append(entry)
                plan.drafts.append(entry)
            else:
                plan.chunks.append(entry)
                if w.final_prefill:
                    plan.checks.append(entry)
                    plan.num_drafts.append(0)
            row += w.num_tokens
        plan.num_tokens = row
        # prefill chunks attend densely too, last and longest first (`StepLists._dense_runs`)
        plan.dense += sorted(plan.chunks, key=lambda chunk: -chunk[0].num_tokens)
        return plan


def work_of_row(first_row: torch.Tensor, rows: int) -> torch.Tensor:
    """The work each of a step's token rows belongs to: first_row [W] (strictly ascending from
    0: every work has a row) -> [T].

    Built from a scatter and a cumulative sum, not `repeat_interleave` or indexing by a tensor,
    whose CPU kernels start the intra-op thread pool even for a few hundred rows: with a GPU
    host's many threads that costs tenths of a millisecond a step, more when other work holds the
    cores (`index_select` and `nonzero` do not)."""
    starts = torch.zeros(rows, dtype=torch.long)
    starts.scatter_(0, first_row[1:], 1)                      # 1 where the next work begins
    return starts.cumsum(0)


class StepLists:
    """Writes the index lists of each step. `selection_len[row]`: critical positions the latest
    selection of the request in that row holds (its drafts attend to that many)."""

    def __init__(self, spec: SpecConfig, cache: KVCache, scratch_row: int):
        self.spec, self.cache, self.scratch_row = spec, cache, scratch_row
        # columns of the runner's draft-token buffer: k drafts and a verification's next token
        self.token_columns = max(spec.stride, 1) + 1
        self.selection_len = [0] * scratch_row
        self.tables_sent: list[tuple[int, list[int]]] = [(-1, [])] * scratch_row  # (seq_id, table)

    def shape(self, plan: StepPlan) -> StepShape:
        """The step's own sizes (no rounding)."""
        dense = [w for w, _ in plan.dense]
        q_max = max((w.num_tokens for w in dense), default=0)
        # shorter dense requests' padding queries need a padding row (a whole token's work)
        has_padding = len(dense) * q_max > sum(w.num_tokens for w in dense)
        def flags(ws):   # SamplingTensors.host_flags of these works' requests, as items
            # one request's params per kind of sampling (`Sequence.sampling_kind`): usually one
            params = {w.seq.sampling_kind: w.seq.params for w, _ in ws}
            return tuple(verifier.SamplingTensors.host_flags(list(params.values())).items())
        context = max((w.start + w.num_tokens for w in dense), default=0)
        pillar = self.spec.method in PILLAR_METHODS
        # the drafts' widest reads; a draft's window: the positions since its request's last
        # verification, its own included, and a draft ahead's the drafts in flight too (all of
        # them may be accepted)
        sparse_rows = selection_width = window = verified = 0
        if plan.sparse:
            _, c = self.columns(plan)
            sparse_rows, selection_width = int(c.row.max()) + 1, int(c.n_sel.max())
            window = int((c.start + 1 - c.verified + c.in_flight).max())
            verified = int(c.verified.max())
        return StepShape(
            tokens=plan.num_tokens + has_padding,
            dense_batch=len(dense), dense_queries=q_max,
            dense_blocks=-(-context // self.cache.block_size),
            # (checks: verifications, last chunks) that choose a selection for more drafts
            scores=pillar and any(w.reselects and not w.seq.decodes_plainly
                                  for w, _ in plan.checks),
            sparse_batch=len(plan.sparse), sparse_rows=sparse_rows,
            selection_width=selection_width, window=window,
            lookup_context=verified if self.spec.method == "pillar-lookup" else 0,
            drafts=len(plan.drafts), checks=len(plan.checks),
            check_drafts=max(plan.num_drafts, default=0),
            draft_flags=flags(plan.drafts) if plan.drafts else (),
            check_flags=flags(plan.checks) if plan.checks else (),
            dense_runs=self._dense_runs(dense))

    def _dense_runs(self, dense: list[Work]) -> tuple:
        """(first, count, query rows, context blocks, prefill) of each run of dense requests,
        padded to its own longest; () without prefill chunks. Chunks (last, longest first) run
        apart from the rest; one under half its run's longest starts a new run (padding <= 2x)."""
        chunks = sum(w.kind == "prefill" for w in dense)
        if not chunks:
            return ()
        first_chunk = len(dense) - chunks
        runs = [[0, first_chunk]] if first_chunk else []
        for i in range(first_chunk, len(dense)):
            if i == first_chunk or 2 * dense[i].num_tokens < dense[runs[-1][0]].num_tokens:
                runs.append([i, 0])
            runs[-1][1] += 1
        bs = self.cache.block_size
        return tuple((first, n, max(w.num_tokens for w in dense[first:first + n]),
                      -(-max(w.start + w.num_tokens for w in dense[first:first + n]) // bs),
                      first >= first_chunk)
                     for first, n in runs)

    def _padding(self, shape: StepShape) -> dict[str, int]:
        """What each list's padding entries hold (0 unless listed): harmless finite values that
        write only scratch places (the scratch block, the padding row, the runner's scratch row)
        and read the scratch row's block table (the scratch block only) at position 0."""
        pad_row, scratch_row = shape.tokens - 1, self.scratch_row
        return defaultdict(int, token_row=scratch_row, feed_from=-1, sparse_window=1,
                           dense_first_row=pad_row, sparse_first_row=pad_row,
                           draft_logit_row=pad_row, check_last_row=pad_row,
                           dense_row=scratch_row, sparse_row=scratch_row,
                           draft_row=scratch_row, check_row=scratch_row)

    def lists(self, plan: StepPlan, shape: StepShape) -> dict[str, list | torch.Tensor]:
        """Every index list the step's tensors are built from, padded to its length in `shape`."""
        groups = [(self._token_lists(plan), shape.tokens)]
        if plan.dense:
            groups.append((self._dense_lists(plan.dense, shape.scores), shape.dense_batch))
        if plan.sparse:
            groups.append((self._sparse_lists(plan), shape.sparse_batch))
        if plan.drafts:
            groups.append((self._draft_lists(plan), shape.drafts))
        if plan.checks:
            groups.append((self._check_lists(plan, shape.scores, shape.check_drafts),
                           shape.checks))
        padding, lists = self._padding(shape), {}
        for group, length in groups:
            for name, values in group.items():
                fill = padding[name]
                if isinstance(values, torch.Tensor):
                    lists[name] = F.pad(values, (0, length - len(values)), value=fill)
                    continue
                entry = [fill] * len(values[0]) if isinstance(values[0], list) else fill
                lists[name] = values + [entry] * (length - len(values))
        return lists

    def columns(self, plan: StepPlan) -> tuple[WorkColumns, WorkColumns]:
        """The `WorkColumns` of the plan's works, and of its drafts only."""
        if plan.columns is None:
            flat, sel, first_row = [], self.selection_len, 0
            for w in plan.works:        # the one pass over the works, into one flat list
                seq, row = w.seq, w.seq.row
                flat += (first_row, w.num_tokens, w.start, row, len(seq.tokens) - 1, seq.tokens[-1],
                         w.ahead, seq.num_drafts if w.ahead else 0, sel[row], w.kind == "draft")
                first_row += w.num_tokens
            matrix = long_tensor(flat).view(len(plan.works), len(WorkColumns._fields))   # [W, 10]
            plan.work_matrix = matrix
            # (index_select, not a boolean mask: see `work_of_row`)
            drafts = matrix.index_select(0, matrix[:, -1].nonzero().squeeze(1))           # [Nd, 10]
            plan.columns = WorkColumns(*matrix.unbind(1)), WorkColumns(*drafts.unbind(1))
        return plan.columns

    def _token_lists(self, plan: StepPlan) -> dict[str, torch.Tensor]:
        """input_ids, positions and runner rows of the step's tokens [T] (the device finds each
        token's KV slot in its row's block table); feed_from: a device draft input's flat index in
        the draft buffer [rows + 1, k + 1], else -1. Drafts are fed from the device: the draft at
        position p sits in column p - (num_verified + 1) of its request's row, and a
        verification's next token right after the drafts it accepted. ahead: 1 for a draft ahead
        of its verification's result, whose position and input the device moves on by the
        accepted count (`Work.ahead`)."""
        c, _ = self.columns(plan)
        # [T] per token row: its work's columns
        work = work_of_row(c.first_row, plan.num_tokens)                                  # [T]
        t = WorkColumns(*plan.work_matrix.index_select(0, work).unbind(1))
        positions = t.start + torch.arange(plan.num_tokens) - t.first_row                # [T]
        feed_from = torch.where(positions > t.verified,
                                t.row * self.token_columns + positions - t.verified - 1, -1)
        # the pending token is fed from the host; a draft (or a drafted position) from the device
        input_ids = torch.where(positions == t.verified, t.pending, 0)
        # prefill chunks and verifications of n-gram drafts bring every token from the host
        host_fed = plan.chunks + ([(w, r) for w, r in plan.checks
                                   if w.kind == "verify" and w.num_tokens > 1]
                                  if self.spec.method == "ngram" else [])
        for w, r in host_fed:
            seq, n = w.seq, w.num_tokens
            ids = (seq.tokens[w.start:w.start + n] if w.kind == "prefill"
                   else [seq.tokens[-1]] + seq.ngram_drafts[:n - 1])
            input_ids[r:r + n], feed_from[r:r + n] = long_tensor(ids), -1
        return {"input_ids": input_ids, "positions": positions, "token_row": t.row,
                "feed_from": feed_from, "ahead": t.ahead}

    @staticmethod
    def _dense_lists(dense: list[tuple[Work, int]], with_scores: bool) -> dict[str, list]:
        lists = {"dense_first_row": [r for _, r in dense],
                 "dense_start": [w.start for w, _ in dense],
                 "dense_q_len": [w.num_tokens for w, _ in dense],
                 "dense_row": [w.seq.row for w, _ in dense]}
        if with_scores:
            # query rows counted in the scores: 1 all real rows (a verification that re-selects),
            # 2 the last row only (a last prefill chunk), 0 none (an earlier prefill chunk, a
            # verification that keeps its selection)
            lists["score_rows"] = [1 if w.kind == "verify" and w.reselects else
                                   2 if w.final_prefill else 0 for w, _ in dense]
        return lists

    def _sparse_lists(self, plan: StepPlan) -> dict[str, torch.Tensor]:
        _, c = self.columns(plan)
        # its window (`shape`); for a draft ahead the device adds the drafts accepted
        lists = {"sparse_first_row": c.first_row, "sparse_row": c.row, "sparse_n_sel": c.n_sel,
                 "sparse_window": c.start - c.verified + 1}
        if self.spec.method == "pillar-lookup":
            # The token before the draft's input: committed (in CommittedTokens, the pending one
            # included) or a draft (draft_tokens index j holds position num_verified + 1 + j).
            prev = c.start - 1
            lists.update(sparse_verified=c.verified, prev_committed=torch.minimum(prev, c.verified),
                         prev_drafted=(prev - c.verified - 1).clamp(min=0),
                         prev_in_context=(prev <= c.verified).long())
        return lists

    def _draft_lists(self, plan: StepPlan) -> dict[str, torch.Tensor]:
        _, c = self.columns(plan)
        return {"draft_logit_row": c.first_row, "draft_row": c.row,
                # (a draft ahead is its request's next cycle's first)
                "draft_index": (c.start - c.verified) * (1 - c.ahead),
                "draft_position": c.start + 1}

    def _check_lists(self, plan: StepPlan, with_scores: bool, m_max: int) -> dict[str, list]:
        """Verifications and last prefill chunks: each one's last token row (a verification's
        m + 1 rows end there; a prefill chunk's last row is its only one); with scores, each
        one's dense batch index."""
        checks, num_drafts = plan.checks, plan.num_drafts
        # the device takes each check's logit rows back from its last one (`readout.Readout`)
        lists = {"check_last_row": [r + w.num_tokens - 1 for w, r in checks],
                 "check_row": [w.seq.row for w, _ in checks], "check_num_drafts": num_drafts,
                 "check_first_position": [w.start + w.num_tokens if w.kind == "prefill"
                                          else w.start + 1 for w, _ in checks]}
        if self.spec.drafts_ahead:   # where its K/V go in the draft buffers (runner._compute)
            lists["check_n_sel"] = [self.selection_len[w.seq.row] for w, _ in checks]
        if self.spec.method == "ngram":
            lists["ngram_drafts"] = [w.seq.ngram_drafts[:m] + [0] * (m_max - m)
                                     for (w, _), m in zip(checks, num_drafts)]   # [Bv, M]
        if with_scores:
            dense_index = {id(w): i for i, (w, _) in enumerate(plan.dense)}
            lists["check_dense_index"] = [dense_index[id(w)] for w, _ in checks]
        return lists

    def table_changes(self, seqs: list[Sequence]) -> list[list[int]]:
        """(row, column, block) entries of the device tables that differ from the host tables of
        `seqs` (only ends change). Columns past a table hold the scratch block: a step gathers
        keys over its widest table, and past a request's context it then reads one block the
        cache keeps rather than blocks of the row's earlier requests (masked either way).
        Only the tables the pool marks changed are compared (a request's first table too)."""
        changes, pool, scratch = [], self.cache.pool, self.cache.scratch_block
        for seq in [s for s in seqs if s.seq_id in pool.changed]:
            pool.changed.discard(seq.seq_id)
            table = pool.tables[seq.seq_id]
            owner, sent = self.tables_sent[seq.row]
            same = common_prefix(sent, table) if owner == seq.seq_id else 0
            changes += [[seq.row, j, table[j]] for j in range(same, len(table))]
            changes += [[seq.row, j, scratch] for j in range(len(table), len(sent))]
            self.tables_sent[seq.row] = (seq.seq_id, list(table))
        return changes
