"""Each request row's critical positions and draft buffers: the part of `ModelRunner` (a base
class of it) that stores a new selection, keeps one, and copies their K/V where drafts read them.

A row's draft buffer holds, per layer and KV head, the K/V of its critical positions, then of its
lookups (pillar-lookup), then of its window (the positions written since its last verification).
A new selection is copied whole; a kept one (pillar-lookup, or `refresh_every` > 1) changes only by
the positions its verification just accepted, ranked first: the selection lies in its columns as a
ring (`attention.ring_span_writes`), so only those positions are copied, over the columns of the
lowest-ranked ones they displace. `selection` keeps each row's positions in rank order.

Must not change what a draft attends to: the same positions as a selection stored whole.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import attention, pillar_attn
from .cuda_graphs import DRAFT_WIDTH_PADDING, round_up
from .device import Packed, to_device
from .flex_drafts import DRAFT_BLOCK
from .scheduler import Sequence


class SelectionStore:
    """`ModelRunner`'s selections and draft buffers (its attributes: `selection`,
    `selection_start`, `selection_len`, `draft_k`, `draft_v`, `block_tables`, `cache`, ...)."""

    def _widen_draft_buffers(self, selection_width: int) -> None:
        """Make the draft buffers wide enough for `selection_width` positions (as `_widen`)."""
        # (a draft ahead's window: up to k + 2 positions; a bucket's, up to a fast width)
        window = round_up(self.spec.stride + 2, 8)
        if self.graphs is not None:
            window += DRAFT_WIDTH_PADDING
        columns = round_up(selection_width + self.lookups + window, 8)
        if self.graphs is not None:   # whole blocks of the fast path's drafts' kernel
            columns = round_up(columns, DRAFT_BLOCK)
        old = (self.draft_k, self.draft_v)
        had = 0 if old[0] is None else old[0].shape[-2]
        if columns <= had:
            return
        shape = (self.num_layers, self.scratch_row + 1, self.n_kv, max(columns, 2 * had),
                 self.model.config.head_dim)
        self.draft_k, self.draft_v = (self.cache.k.new_zeros(shape) for _ in range(2))
        if had:
            self.draft_k[..., :had, :], self.draft_v[..., :had, :] = old
            for graphs in self.graph_tables():
                graphs.forget()

    def kept_selections(self, seqs: list[Sequence]) -> tuple[torch.Tensor, list[int]]:
        """The selections last stored or kept for `seqs`, in rank order as `set_selections` takes
        them: positions [B, L, n_kv, n] (request b's first widths[b]) and the widths."""
        widths, rows = [self.selection_len[s.row] for s in seqs], [s.row for s in seqs]
        return self.selection[to_device(rows, torch.long, self.device), ..., :max(widths)], widths

    @torch.inference_mode()   # (a widened buffer is an inference tensor, as the steps' are)
    def set_selections(self, seqs: list[Sequence], positions: torch.Tensor,
                       widths: list[int]) -> None:
        """Store each request's critical positions, positions[b, :, :, :widths[b]] of
        [B, L, n_kv, n] (`pillar_attn.top_positions`); copy their K/V to its drafts'."""
        n = positions.shape[-1]
        self.make_selection_room(seqs, n)
        for seq, width in zip(seqs, widths):
            self.selection_len[seq.row] = width
        lists = Packed(self.refresh_lists(seqs, widths), self.device).views()
        ahead = [width + self.lookups + 1 for s, width in zip(seqs, widths) if s.num_drafts]
        self.store_selections(lists, positions, max([n] + ahead))

    def make_selection_room(self, seqs: list[Sequence], n: int) -> None:
        """Room in the selections and draft buffers for n columns and the budget of the longest
        context `seqs` may reach (growing budgets then do not widen again)."""
        if self.graphs is None:   # (with graphs it holds the longest context's budget already)
            cap = self.model.config.max_position_embeddings
            columns = max(n, self.spec.budget(max(min(cap, s.final_length) for s in seqs)))
            self.selection_room = max(self.selection_room, columns)
        if self.keeps_selection:
            self.selection = self._widen(self.selection, self.selection_room)
        self._widen_draft_buffers(self.selection_room)

    def refresh_lists(self, seqs: list[Sequence], widths: list[int]) -> dict[str, list[int]]:
        """`store_selections`' lists: each request's row; its window's first column if it drafted
        ahead of this refresh (else -1), where its pending position's K/V goes; that position."""
        return {"rows": [s.row for s in seqs],
                "window": [w + self.lookups if s.num_drafts else -1 for s, w in zip(seqs, widths)],
                "pending": [s.num_verified for s in seqs]}

    def store_selections(self, lists: dict[str, torch.Tensor], positions: torch.Tensor,
                         copied: int) -> None:
        """Store positions [B, L, n_kv, n] as the selections of rows lists["rows"] [B] and copy
        their K/V into the first `copied` columns of those rows of the draft buffers, a draft
        ahead's (its pending position's) at column lists["window"] [B]."""
        rows, n = lists["rows"], positions.shape[-1]
        if self.keeps_selection:
            self.selection[rows, :, :, :n] = positions
            self.selection_start.index_fill_(0, rows, 0)
        # past a request's width the copies are padding (unread: its lookups and drafts write there)
        columns = torch.arange(copied, device=self.device)                          # [copied]
        ahead = (columns == lists["window"][:, None])[:, None, None, :]     # [B, 1, 1, copied]
        positions = torch.where(ahead, lists["pending"][:, None, None, None],
                                F.pad(positions, (0, copied - n)))     # [B, L, n_kv, copied]
        # the device's block tables cover every position read here: a selection's (verified) and
        # a draft ahead's came in the launches of the steps that wrote them, all queued before this
        self._fill_draft_buffers(self.block_tables[rows], positions, rows,
                                 columns.expand(rows.shape[0], -1))

    @torch.inference_mode()   # (as `set_selections`)
    def keep_selections(self, seqs: list[Sequence], first: list[int], count: list[int]) -> None:
        """Keep the selections of `seqs`, request b's span first[b] .. first[b] + count[b] - 1
        ranked first (`store_kept`), from host lists (one upload)."""
        lists = self.kept_lists(seqs, first, count)
        self.store_kept(Packed(lists, self.device).views(), max(lists["width"]), max(count))

    def kept_lists(self, seqs: list[Sequence], first: list[int], count: list[int]
                   ) -> dict[str, list[int]]:
        """`store_kept`'s lists: `refresh_lists`, each selection's width and accepted span."""
        widths = [self.selection_len[s.row] for s in seqs]
        return self.refresh_lists(seqs, widths) | {"width": widths, "first": first, "count": count}

    def store_kept(self, lists: dict[str, torch.Tensor], width: int, longest: int) -> None:
        """Keep the selections of rows lists["rows"] [B] (widths lists["width"], at most `width`),
        with the positions each verification just accepted, lists["first"] .. + lists["count"] - 1
        (at most `longest`), ranked first (`keep_accepted`); copy only those positions' K/V, and a
        draft ahead's pending position's, to the draft buffers (`attention.ring_span_writes`)."""
        rows, count = lists["rows"], lists["count"]
        if self.spec.keep_accepted:
            self.selection[rows, :, :, :width] = pillar_attn.spans_kept_first(
                self.selection[rows, :, :, :width], lists["width"], lists["first"], count,
                longest)
        else:
            count, longest = torch.zeros_like(count), 0
        window = torch.where(lists["window"] >= 0, lists["window"], lists["width"] + self.lookups)
        start, positions, columns = attention.ring_span_writes(
            self.selection_start[rows], lists["width"], lists["first"], count, lists["pending"],
            window, longest)
        self.selection_start[rows] = start
        self._fill_draft_buffers(self.block_tables[rows], positions[:, None, None, :], rows,
                                 columns)

    def _fill_draft_buffers(self, block_table: torch.Tensor, positions: torch.Tensor,
                            rows: torch.Tensor, columns: torch.Tensor) -> None:
        """`attention.fill_draft_buffers` into this runner's draft buffers."""
        attention._kernels["fill"](self.cache.k, self.cache.v, self.draft_k, self.draft_v,
                                   block_table, self.cache.block_size, positions, rows, columns)

