"""A step's results on the device, and the one host synchronisation that reads them.

Owns `StepResult` (per verification or last prefill chunk: the accepted count, the next token, the
bonus flag and the drafts it checked, packed in one tensor; the PillarAttn scores), its copy to the
host queued right behind the step (`start_copy`), and `fetch`, which waits for that step alone, so
the engine can launch step t before it looks at step t-1.
Must not run the model or decide anything: it carries results.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .scheduler import Work


@dataclass
class StepResult:
    """Device-side results of one step, plus the host-side plan they belong to."""
    works: list[Work]
    verify_works: list[Work]                # verifications and last prefill chunks, in order
    num_drafts: list[int]                   # drafts checked by each of them
    packed: torch.Tensor                    # [Bv, 3 + Mmax] accepted, next token, bonus, drafts
    scores: torch.Tensor | None = None      # [Ls, Bv, n_kv, Lmax] their PillarAttn scores (Ls
                                            #   layers: `SpecConfig.score_every`), or None
    host: torch.Tensor | None = None        # `packed` copied to the host (`start_copy`)
    copied: torch.cuda.Event | None = None  # recorded right after that copy (CUDA only)

    def start_copy(self) -> None:
        """Queue `packed`'s copy to the host right behind this step (not behind step t+1)."""
        if self.packed.device.type == "cuda":
            self.host = torch.empty(self.packed.shape, dtype=self.packed.dtype, pin_memory=True)
            self.host.copy_(self.packed, non_blocking=True)   # pinned: an asynchronous copy
            self.copied = torch.cuda.Event()
            self.copied.record()
        else:
            self.host = self.packed

    def fetch(self) -> dict:
        """What the host bookkeeping needs (the step's one synchronisation, on this step only)."""
        if self.copied is not None:
            self.copied.synchronize()
        rows = self.host.tolist()
        return {"num_accepted": [r[0] for r in rows], "next_token": [r[1] for r in rows],
                "is_bonus": [bool(r[2]) for r in rows], "draft_tokens": [r[3:] for r in rows]}


def joined_results(packed: list[torch.Tensor], scores: list[torch.Tensor | None],
                   device) -> tuple:
    """The parts' results as one step's: packed [Bv_i, 3 + M_i] -> [Bv, 3 + max M] and scores
    [Ls, Bv_i, n_kv, L_i] -> [Ls, Bv, n_kv, max L] (or None), zero-padded past what is read; a
    part without scores (its verifications keep their selections) reads as zeros."""
    if not packed:
        return torch.zeros(0, 3, dtype=torch.long, device=device), None
    if len(packed) == 1:
        return packed[0], scores[0]
    width = max(p.shape[1] for p in packed)
    joined = torch.cat([F.pad(p, (0, width - p.shape[1])) for p in packed])
    present = [s for s in scores if s is not None]
    if not present:
        return joined, None
    length, (layers, _, n_kv, _) = max(s.shape[-1] for s in present), present[0].shape
    return joined, torch.cat([present[0].new_zeros(layers, p.shape[0], n_kv, length) if s is None
                              else F.pad(s, (0, length - s.shape[-1]))
                              for s, p in zip(scores, packed)], dim=1)
