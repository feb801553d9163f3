"""Issue 7's idea "select per query head instead of per KV group", at the same cost.

A draft gathers B positions per (layer, KV head), shared by the G query heads of the group. PillarAttn ranks them by
the group's mean probability, so one sharp head's targets can rank below what the other heads spread over. Here each
KV head's B positions are instead the round-robin union of its query heads' own rankings: every head's best, then
every head's second best, ... (ties inside a round by the mean). It is encoded as a score, so selection, batching and
the per-step cost stay exactly as they are:  score = -min over heads of the position's rank + 1e-3 x mean probability.

Usage: python benchmarks/drafter/per_head_union.py ACCEPTANCE_ARGS...  (the arguments of nano_sparsespec.acceptance)
"""
import sys

import torch

from nano_sparsespec import acceptance, pillar_attn


def union_scores(q, k, mask, score_weight):
    """Same inputs as pillar_attn.pillar_scores -> [B, n_kv, L] whose descending order is the round-robin union."""
    probs = pillar_attn.attention_probs(q, k, mask)                                   # [B, n_kv, G, Q, L]
    per_head = torch.einsum("bhgql,bq->bhgl", probs, score_weight.float())            # [B, n_kv, G, L]
    order = per_head.sort(dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1]).expand_as(order))
    best_rank = rank.min(dim=2).values.float()                                       # [B, n_kv, L]
    return -best_rank + 1e-3 * per_head.mean(dim=2)


if __name__ == "__main__":
    pillar_attn._kernels["scores"] = union_scores
    sys.exit(acceptance.main(sys.argv[1:]))
