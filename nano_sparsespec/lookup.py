"""pillar-lookup, a drafter beyond the paper: PillarAttn whose selection is refreshed at every
draft step.

A selection made at the last verification goes stale during drafting, and most of what it misses
is what two kinds of heads want: duplicate-token heads attend to earlier occurrences p of the
current token, induction heads to the position p + 1 right after one. Both follow from the
draft's input token alone, so at every draft step the latest few such positions replace the
lowest-ranked critical positions: the positions a draft attends to change, their number (the
budget) does not.

Owns `lookup_positions` (the positions a draft's token finds), `merge_lookup` (the merged
list, as the drafts see it), `CommittedTokens` (what the lookups read on the device) and
`lookup_draft_columns` (the engine's drafts' columns of their draft-buffer rows: critical
positions, then lookups, then the window; through `_kernels`, which the fast path compiles); which
critical positions stay beside the lookups is `pillar_attn.kept_beside`, shared with `keep_first`.
Must not know about scheduling (runner.py copies the K/V).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .device import Packed

from .pillar_attn import kept_beside, merge_ranked, ring_ranks


class CommittedTokens:
    """Each request row's committed tokens mirrored on the device, `tokens` [rows + 1, width]
    (the spare row: a padded step's), sent as they are committed.

    `widen(tensor, width)`: the tensor, or a copy at least `width` wide (the runner's: it drops
    the recorded graphs that read the old one)."""

    def __init__(self, rows: int, width: int, device, widen: Callable):
        self.tokens = torch.zeros(rows + 1, width, dtype=torch.long, device=device)
        self.sent = [(-1, 0)] * rows                       # per row: (seq_id, tokens sent)
        self.widen, self.device = widen, device

    def reserve(self, width: int) -> None:
        """Room for `width` positions in every row."""
        self.tokens = self.widen(self.tokens, width)

    @torch.inference_mode()   # (a widened buffer is an inference tensor, as the steps' are)
    def send(self, seqs: list) -> None:
        """Mirror the committed tokens of requests `seqs` not sent yet into their rows, in one
        copy."""
        rows, columns, tokens = [], [], []
        for seq in seqs:
            owner, sent = self.sent[seq.row]
            sent = sent if owner == seq.seq_id else 0
            n = len(seq.tokens)
            rows += [seq.row] * (n - sent)
            columns += range(sent, n)
            tokens += seq.tokens[sent:n]
            self.sent[seq.row] = (seq.seq_id, n)
        if not tokens:
            return
        self.reserve(max(columns) + 1)
        new = Packed({"rows": rows, "columns": columns, "tokens": tokens}, self.device).views()
        self.tokens[new["rows"], new["columns"]] = new["tokens"]


def lookup_positions(context_tokens: torch.Tensor, tokens: torch.Tensor, context_len: torch.Tensor,
                     matches: int, prev_tokens: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Earlier positions p holding each draft's input token, and p + 1 after each: `matches` of
    them per draft.
    context_tokens: [B, Lc] token at each position (read only below context_len); tokens: [B] the
    drafts' input tokens; context_len: [B] verified positions (device tensor); prev_tokens: [B] the
    tokens just before the drafts' inputs, or None. Which p: latest first; with prev_tokens, the p
    whose previous token matches too (a bigram match, the likelier copy source) come first.
    -> positions [B, 2 * matches] ordered (p0, p0 + 1, p1, p1 + 1, ...), valid [B, 2 * matches]
    bool: p found, p + 1 inside the verified context (later positions are in the draft's recent
    window anyway), and not already listed earlier in the row. Every position, valid or not, is at
    most max(context_len, 1): the runner copies the K/V of all of them."""
    B, Lc = context_tokens.shape
    pos = torch.arange(Lc, device=context_tokens.device)
    hit = (context_tokens == tokens[:, None]) & (pos[None, :] < context_len[:, None])  # [B, Lc]
    key = torch.where(hit, pos + 1, 0)                                                  # 0: no hit
    if prev_tokens is not None:
        # [B, Lc]
        follows = F.pad(context_tokens[:, :-1] == prev_tokens[:, None], (1, 0), value=False)
        key = key + (hit & follows) * Lc                   # bigram hits rank above all others
    top = key.topk(min(matches, Lc), dim=1).values                                      # [B, m]
    top = F.pad(top, (0, matches - top.shape[1]))                   # m > Lc: pad with "no hit"
    # p; none found: 0, so that even a junk position's K/V read stays in the block table
    found = torch.where(top > 0, (top - 1) % Lc, 0)                                    # [B, m]
    positions = torch.stack([found, found + 1], dim=-1).flatten(1)                      # [B, 2m]
    valid = torch.stack([top > 0, (top > 0) & (found + 1 < context_len[:, None])],
                        dim=-1).flatten(1)
    # [j, i]: i < j
    earlier = torch.ones(2 * matches, 2 * matches, dtype=torch.bool, device=pos.device).tril(-1)
    repeated = ((positions[:, :, None] == positions[:, None, :]) & valid[:, None, :]
                & earlier).any(-1)
    return positions, valid & ~repeated


def merge_lookup(selection: torch.Tensor, selection_len: torch.Tensor, lookup: torch.Tensor,
                 lookup_valid: torch.Tensor) -> torch.Tensor:
    """The positions a pillar-lookup draft attends to besides its window, as one list (the
    engine's drafts attend to the same set from their draft buffers: `kept_beside`'s
    columns, then the lookups' own): the kept critical positions in rank order, then the valid
    lookups; arguments and result as `pillar_attn.merge_ranked`."""
    return merge_ranked(selection, selection_len, lookup, lookup_valid, extra_first=False)


def lookup_draft_columns(seen: torch.Tensor, selection: torch.Tensor, rows: torch.Tensor,
                         selection_len: torch.Tensor, selection_start: torch.Tensor,
                         context_tokens: torch.Tensor,
                         tokens: torch.Tensor, verified: torch.Tensor, prev_tokens: torch.Tensor,
                         matches: int) -> tuple[torch.Tensor, ...]:
    """The columns of its draft-buffer row a pillar-lookup draft attends to, and the positions its
    input token finds (`lookup_positions`), whose K/V the runner copies to columns
    selection_len + j: the window's columns, the lookups found, and the critical positions kept
    beside them (`pillar_attn.kept_beside`: the budget stays), each at its ring column
    (`attention.ring_span_writes`).

    seen: [Bs, N] bool, the columns of its critical positions and window; selection: [R + 1, L,
    n_kv, S] each buffer row's ranked critical positions (the first selection_len [Bs] of the
    drafts' rows [Bs], whose draft-buffer rows hold rank 0 at column selection_start [Bs]);
    context_tokens: [R + 1, Lc] (read below verified [Bs]); tokens, prev_tokens: [Bs] as
    `lookup_positions` -> found_at, found_valid [Bs, M], seen [Bs, L, n_kv, N] bool, by
    draft-buffer column.
    Two pieces (`_kernels`): a draft's lists, then its columns in every layer and KV head, which
    read the lists (compiled as one, each layer and head would compute them again)."""
    found_at, found_valid, beyond, column_rank = _kernels["lists"](
        seen, rows, selection_len, selection_start, context_tokens, tokens, verified, prev_tokens,
        matches)
    return found_at, found_valid, _kernels["columns"](
        beyond, selection, rows, selection_len, found_at, found_valid, column_rank)


def lookup_lists(seen, rows, selection_len, selection_start, context_tokens, tokens, verified,
                 prev_tokens, matches: int):
    """`lookup_draft_columns`' lists of each draft, arguments as there -> found_at, found_valid
    [Bs, M]; beyond [Bs, N] bool, the columns past its critical positions it attends to (the
    window's, the lookups'); column_rank [Bs, N], the rank of the selection each column holds
    (`pillar_attn.ring_ranks`)."""
    found_at, found_valid = lookup_positions(context_tokens[rows], tokens, verified, matches,
                                             prev_tokens)
    N, M = seen.shape[1], found_at.shape[1]
    column = torch.arange(N, device=seen.device)                                # [N]
    lookup_column = selection_len[:, None] + torch.arange(M, device=seen.device)  # [Bs, M]
    found = ((column == lookup_column[:, :, None]) & found_valid[:, :, None]).any(1)  # [Bs, N]
    beyond = (seen & (column >= selection_len[:, None])) | found                # [Bs, N]
    return found_at, found_valid, beyond, ring_ranks(selection_start, selection_len, N)


def lookup_columns(beyond, selection, rows, selection_len, found_at, found_valid, column_rank):
    """`lookup_draft_columns`' columns from its lists (`lookup_lists`) -> [Bs, L, n_kv, N] bool:
    the draft's columns `beyond` its critical positions, and those of the critical positions kept
    beside its lookups."""
    ranked = selection[rows]                                              # [Bs, L, n_kv, S]
    keep = kept_beside(ranked, selection_len, found_at, found_valid, column_rank,
                       held_by_lookups(ranked, found_at, found_valid))   # [Bs, L, n_kv, S]
    N = beyond.shape[1]
    return beyond[:, None, None, :] | F.pad(keep, (0, N - keep.shape[-1]))


def held_by_lookups(ranked: torch.Tensor, found_at: torch.Tensor,
                    found_valid: torch.Tensor) -> torch.Tensor:
    """Whether one of its draft's valid lookups holds each ranked position: ranked [Bs, L, n_kv,
    S], found_at, found_valid [Bs, M] -> [Bs, L, n_kv, S] bool. One lookup at a time (M is fixed),
    so that compiled it is one elementwise kernel rather than a reduction over the lookups."""
    held = torch.zeros_like(ranked, dtype=torch.bool)
    for m in range(found_at.shape[1]):
        held = held | ((ranked == found_at[:, m, None, None, None])
                       & found_valid[:, m, None, None, None])
    return held


# what `lookup_draft_columns` calls: the eager pieces, or the fast path's (kernels.py)
EAGER_KERNELS = {"lists": lookup_lists, "columns": lookup_columns}
_kernels = dict(EAGER_KERNELS)
