"""What a step reads out of its forward: the token rows it samples as drafts and those that
verify, and the LM head over them.

Owns `Readout` (those rows and their requests, from the step's device lists) and its `logits`
(one LM-head matmul over the checks' rows, then the drafts'). The runner samples the drafts and
verifies the checks from these logits (runner.py, verifier.py).
Must not sample or verify.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# the named device lists of a step (step_lists.py) that make up its Readout
READOUT_LISTS = ("draft_logit_row", "draft_row", "draft_index", "draft_position",
                 "check_row", "check_num_drafts", "check_first_position",
                 "ngram_drafts")


@dataclass
class Readout:
    """The token rows a step samples as drafts and those that verify, for which request rows
    (device), with their sampling flags (host); None where the step has no drafts / no checks."""
    draft_logit_row: torch.Tensor | None = None       # [Nd] flat token row that samples the draft
    draft_row: torch.Tensor | None = None             # [Nd] its request's row
    draft_index: torch.Tensor | None = None           # [Nd] the draft buffer column it fills
    draft_position: torch.Tensor | None = None        # [Nd] position it will occupy (its counter)
    check_logit_rows: torch.Tensor | None = None      # [Bv, M+1] m+1 rows (then the last
                                                      #   again), or prefill's last row
    check_row: torch.Tensor | None = None             # [Bv] its request's row
    check_num_drafts: torch.Tensor | None = None      # [Bv] drafts it checks (0..M)
    check_first_position: torch.Tensor | None = None  # [Bv] position its first logit row decides
    ngram_drafts: torch.Tensor | None = None          # [Bv, M] n-gram drafts (method ngram only)
    draft_flags: dict | None = None                   # SamplingTensors.host_flags of the drafts
    check_flags: dict | None = None                   # ... and of the checks

    @staticmethod
    def of(shape, lists: dict[str, torch.Tensor], shift: torch.Tensor) -> "Readout":
        """The readout of a step of `shape` (the runner's `StepShape`) from its device lists;
        shift [T]: how far the device moves each token's position (a draft ahead of its
        verification's result: the accepted count)."""
        r = Readout(**{name: lists.get(name) for name in READOUT_LISTS},
                    draft_flags=dict(shape.draft_flags), check_flags=dict(shape.check_flags))
        if shape.drafts:
            r.draft_position = r.draft_position + shift[r.draft_logit_row]
        if shape.checks:   # a check's m + 1 rows end at its last; padded with the last one
            j = torch.arange(shape.check_drafts + 1, device=shift.device)            # [M+1]
            back = (lists["check_num_drafts"][:, None] - j).clamp(min=0)
            r.check_logit_rows = lists["check_last_row"][:, None] - back         # [Bv, M+1]
        return r

    def logits(self, model, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The LM head of `model` over drafts' and checks' rows of hidden [T, hidden] in one
        matmul -> [Nd, V], [Bv * (M+1), V]. torch.compile specialises a storage offset of 0, so
        each compiled sampler meets its logits at the same kind of place in every step: the
        checks' first, the drafts' never (a step without checks leads with a copy of the first
        draft's row)."""
        none = hidden.new_zeros(0, dtype=torch.long)
        drafts = self.draft_logit_row if self.draft_row is not None else none
        checks = self.check_logit_rows.flatten() if self.check_row is not None else none
        lead = checks if checks.shape[0] else drafts[:1]
        # [Bv * (M+1) + Nd, V] in the weights' dtype: the sampler casts as it reads
        logits = model.logits(hidden[torch.cat([lead, drafts])], dtype=None)
        return logits[lead.shape[0]:], logits[:checks.shape[0]]
