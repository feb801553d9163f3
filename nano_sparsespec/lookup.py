"""pillar-lookup, a drafter beyond the paper: PillarAttn whose selection is refreshed at every
draft step.

A selection made at the last verification goes stale during drafting, and most of what it misses
is what two kinds of heads want: duplicate-token heads attend to earlier occurrences p of the
current token, induction heads to the position p + 1 right after one. Both follow from the
draft's input token alone, so at every draft step the latest few such positions replace the
lowest-ranked critical positions: the positions a draft attends to change, their number (the
budget) does not.

Owns `lookup_positions` (the positions a draft's token finds), `merge_lookup` (the merged
list, as the drafts see it) and `CommittedTokens` (what the lookups read on the device); which
critical positions stay beside them is `pillar_attn.kept_beside`, shared with `keep_first`; the
engine's drafts find theirs through `attention.lookup_draft_columns`.
Must not know about scheduling or the draft buffers' layout (runner.py copies the K/V).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .device import Packed

from .pillar_attn import merge_ranked


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
    window anyway), and not already listed earlier in the row."""
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
    found = (top - 1) % Lc                                                    # p (junk if none)
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
