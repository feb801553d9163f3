"""The selection refresh after verifications, recorded as CUDA graphs: the fast path's
(`--cuda-graphs`) version of the refresh the engine otherwise runs eagerly.

After its verification, a drafting request's critical positions for the next cycle are new ones
from the verification's scores, or its last selection, with the positions it just accepted ranked
first (`pillar_attn.keep_first`). A new selection is stored and its K/V copied into its row of the
draft buffers (`ModelRunner.store_selections`); a kept one copies only the accepted positions'
(`ModelRunner.store_kept`, selections.py). Run eagerly that is about twenty small device
operations and a few uploads a step, each costing the host tens of microseconds on a GPU;
recorded, it costs one upload, one copy and one replay for each of the two kinds.

Owns
  * `RefreshShape`, the bucket: the refreshed requests of one kind rounded with `batch_bucket`,
    the selections' width rounded to the step graphs' `width_step`;
  * `SelectionRefresh.run`: new selections written in place, the lists padded to the bucket
    (padding rows: the runner's scratch row, width 0, no span, no draft ahead), then the replays.
Used where the runner keeps each row's selection (pillar-lookup, or `refresh_every` > 1).
Must not change what a request's selection or draft buffers hold: the eager refresh
(`ModelRunner.set_selections`, `keep_selections`) is the reference the tests compare it with.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import pillar_attn
from .cuda_graphs import Graphs, batch_bucket, round_up
from .device import Packed


@dataclass(frozen=True)
class RefreshShape:
    batch: int    # refreshed requests, padding rows included
    width: int    # columns of each selection re-ranked and stored
    kept: bool    # the requests keep their selections (else: new ones, copied whole)


class SelectionRefresh:
    """A runner's selection refresh (`ModelRunner` with CUDA graphs) as one graph per
    `RefreshShape`."""

    def __init__(self, runner):
        self.runner, self.width_step = runner, runner.graphs.width_step
        # the spans just accepted are ranked first (`SpecConfig.keep_accepted`), k + 1 at most
        self.keep_accepted, self.span = runner.spec.keep_accepted, runner.spec.stride + 1
        # A refresh run twice stores what it stores once (`keep_first` ranks a span that is
        # first already first again), but for where a kept selection's ring starts: the
        # recording's warm-up run puts that back.
        self.graphs = Graphs(self._compute, state=[runner.selection_start])

    @torch.inference_mode()   # (as `ModelRunner.set_selections`)
    def run(self, seqs: list, chosen: torch.Tensor | None, widths: list[int], first: list[int],
            count: list[int]) -> None:
        """Refresh the selections of `seqs`: the first F take new ones, chosen [F, L, n_kv, n]
        (request b's first widths[b]; None if F = 0), the rest keep theirs; request b's span
        first[b] .. first[b] + count[b] - 1 is ranked first (`keep_accepted`)."""
        r, F = self.runner, len(widths)
        if F:
            r.make_selection_room(seqs[:F], chosen.shape[-1])
            for seq, width in zip(seqs, widths):
                r.selection_len[seq.row] = width
            lists = r.refresh_lists(seqs[:F], widths) | {"width": widths, "first": first[:F],
                                                         "count": count[:F]}
            packed = self._padded(lists)
            r.selection[packed.view("rows")[:F], :, :, :chosen.shape[-1]] = chosen
            self.graphs.run(RefreshShape(*self._bucket(lists), False), packed, list(lists))
        if len(seqs) > F:
            lists = r.kept_lists(seqs[F:], first[F:], count[F:])
            self.graphs.run(RefreshShape(*self._bucket(lists), True),
                            self._padded(lists), list(lists))

    def _bucket(self, lists: dict[str, list[int]]) -> tuple[int, int]:
        """The batch and width of a refresh of these lists, rounded (`RefreshShape`)."""
        return batch_bucket(len(lists["rows"])), round_up(max(lists["width"]), self.width_step)

    def _padded(self, lists: dict[str, list[int]]) -> Packed:
        """The lists padded to their bucket (padding rows: the runner's scratch row, width 0, no
        span, no draft ahead), uploaded."""
        padding = {"rows": self.runner.scratch_row, "window": -1}                # the rest: 0
        extra = batch_bucket(len(lists["rows"])) - len(lists["rows"])
        return Packed({name: values + [padding.get(name, 0)] * extra
                       for name, values in lists.items()}, self.runner.device)

    def _compute(self, shape: RefreshShape, lists: dict[str, torch.Tensor]) -> None:
        """The recorded refresh, from lists [batch] each."""
        r = self.runner
        if shape.kept:
            r.store_kept(lists, shape.width, self.span)
            return
        chosen = r.selection[lists["rows"], :, :, :shape.width]           # [batch, L, n_kv, N]
        if self.keep_accepted:
            chosen = pillar_attn.spans_kept_first(chosen, lists["width"], lists["first"],
                                                  lists["count"], self.span)
        r.store_selections(lists, chosen, round_up(shape.width + r.lookups + 1, 8))
