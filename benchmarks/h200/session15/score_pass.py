"""Forms of the PillarAttn score pass (`pillar_attn.pillar_scores`) on one layer of a verification batch (k + 1 = 9
query rows), compiled (dynamic shapes unless said) and timed as replayed CUDA graphs.

Why (fifteenth session, session14/verify_split.py on the H200): at 128 x 6,144 the compiled score pass took 22.6 ms
of a 48.7 ms verification step (0.75 ms per layer, for ~0.3 GB of keys and ~0.25 GB of logits), the key gather 5.3 ms
and the selection's sort 5.5 ms.

    PYTHONPATH=. python benchmarks/h200/session15/score_pass.py BATCH CONTEXT [cuda|cpu] [engine]

Forms: "rows last (session 14)" (what the engine compiled until this session: per-head logits [B, n_kv, G, Q, L],
logsumexp over the last dimension, then one reduction over the G x Q rows, a non-contiguous dimension); "positions
first" (logits [B, n_kv, L, G * Q] from keys x queries: the row sum runs over the contiguous dimension, the
logsumexp over L does not); "block-diagonal" (one matmul of a request's keys as they lie, [L, n_kv * D], with
block-diagonal queries); two-stage forms (logits + logsumexp compiled apart from the row sum, which is a reduction or
unrolled row by row); the matmuls alone of each (what no form can go below); and the engine's
(`compile_kernels`: the session-15 two stages until session 16, which went back to one graph of `pillar_scores`).
`engine` times only the engine's and session 14's.
Measured rows: BENCHMARKS.md, H200 fifteenth session.
"""
import sys
from pathlib import Path

import torch

from nano_sparsespec import pillar_attn

sys.path.insert(0, str(Path(__file__).parent.parent))
from graph_timing import timed_ms  # noqa: E402  (benchmarks/h200/graph_timing.py)
from paged_batch import BLOCK, N_KV, from_command_line  # noqa: E402  (benchmarks/h200/paged_batch.py)

Q = 9


def session14_form(q, k, mask, score_weight):
    """What the engine compiled until this session: one graph, per-head logits, the rows summed as one reduction (its
    logits now from this session's `attention_logits`, which scales q before the matmul rather than the logits)."""
    logits = pillar_attn.attention_logits(q, k, mask)                                  # [B, n_kv, G, Q, L]
    lse = logits.logsumexp(dim=-1, keepdim=True)
    weight = score_weight.float()[:, None, None, :, None] / logits.shape[2]
    return (torch.exp(logits - lse) * weight).sum(dim=(2, 3))


def positions_first(q, k, mask, score_weight):
    B, Q, H, D = q.shape
    n_kv, L = k.shape[2], k.shape[1]
    G = H // n_kv
    packed = pillar_attn._pack_groups(q, n_kv)                                         # [B, n_kv, G*Q, D]
    logits = torch.stack([torch.bmm(k[:, :, h], packed[:, h].transpose(1, 2)) for h in range(n_kv)], dim=1)
    logits = (logits.float() * D ** -0.5).view(B, n_kv, L, G, Q)                       # [B, n_kv, L, G, Q]
    logits = logits.masked_fill(~mask.transpose(1, 2)[:, None, :, None, :], float("-inf"))
    lse = logits.logsumexp(dim=2, keepdim=True)                                        # [B, n_kv, 1, G, Q]
    weight = score_weight.float()[:, None, None, None, :] / G
    return (torch.exp(logits - lse) * weight).sum(dim=(3, 4))                          # [B, n_kv, L]


def block_diagonal(q, k, mask, score_weight):
    B, Q, H, D = q.shape
    n_kv, L = k.shape[2], k.shape[1]
    G = H // n_kv
    logits = torch.bmm(block_diagonal_queries(q, n_kv), k.view(B, L, n_kv * D).transpose(1, 2))
    logits = (logits.float() * D ** -0.5).view(B, n_kv, G, Q, L)
    logits = logits.masked_fill(~mask[:, None, None], float("-inf"))
    lse = logits.logsumexp(dim=-1, keepdim=True)
    weight = score_weight.float()[:, None, None, :, None] / G
    return (torch.exp(logits - lse) * weight).sum(dim=(2, 3))


def block_diagonal_queries(q, n_kv):
    """[B, Q, n_heads, D] -> [B, n_kv * G * Q, n_kv * D]: KV head h's G x Q packed rows hold their queries in columns
    h * D .. (h + 1) * D and zeros elsewhere, so one matmul with a request's keys [L, n_kv * D] gives every head's
    logits."""
    B, Q, H, D = q.shape
    packed = pillar_attn._pack_groups(q, n_kv)                                         # [B, n_kv, G*Q, D]
    eye = torch.eye(n_kv, dtype=q.dtype, device=q.device)
    return (packed[:, :, :, None, :] * eye[None, :, None, :, None]).reshape(B, n_kv * packed.shape[2], n_kv * D)


def logits_and_lse(q, k, mask):
    """Stage one of the two-stage forms: block-diagonal logits [B, n_kv, G, Q, L] (bf16, unscaled) and the rows'
    logsumexp [B, n_kv, G, Q, 1]."""
    B, Q, H, D = q.shape
    n_kv, L = k.shape[2], k.shape[1]
    logits = torch.bmm(block_diagonal_queries(q, n_kv), k.view(B, L, n_kv * D).transpose(1, 2))
    logits = logits.view(B, n_kv, H // n_kv, Q, L)
    scaled = (logits.float() * D ** -0.5).masked_fill(~mask[:, None, None], float("-inf"))
    return logits, scaled.logsumexp(dim=-1, keepdim=True)


def weighted_sum(logits, lse, mask, score_weight):
    D = 64
    G = logits.shape[2]
    scaled = (logits.float() * D ** -0.5).masked_fill(~mask[:, None, None], float("-inf"))
    weight = score_weight.float()[:, None, None, :, None] / G
    return (torch.exp(scaled - lse) * weight).sum(dim=(2, 3))


def weighted_sum_unrolled(logits, lse, mask, score_weight):
    D = 64
    G, Q = logits.shape[2], logits.shape[3]
    total = None
    for g in range(G):
        for r in range(Q):
            term = torch.exp((logits[:, :, g, r].float() * D ** -0.5).masked_fill(~mask[:, None, r], float("-inf"))
                             - lse[:, :, g, r]) * (score_weight[:, r, None, None].float() / G)
            total = term if total is None else total + term
    return total


def block_diagonal_unrolled(q, k, mask, score_weight):
    logits, lse = logits_and_lse(q, k, mask)
    return weighted_sum_unrolled(logits, lse, mask, score_weight)


def per_head_unrolled(q, k, mask, score_weight):
    logits = pillar_attn.attention_logits(q, k, mask)                                  # [B, n_kv, G, Q, L] float
    lse = logits.logsumexp(dim=-1, keepdim=True)
    G, Q = logits.shape[2], logits.shape[3]
    total = None
    for g in range(G):
        for r in range(Q):
            term = torch.exp(logits[:, :, g, r] - lse[:, :, g, r]) * (score_weight[:, r, None, None].float() / G)
            total = term if total is None else total + term
    return total


def matmuls_block_diagonal(q, k, mask, score_weight):
    B, L = k.shape[:2]
    return torch.bmm(block_diagonal_queries(q, k.shape[2]), k.view(B, L, -1).transpose(1, 2))


def matmuls_rows_last(q, k, mask, score_weight):
    packed = pillar_attn._pack_groups(q, k.shape[2])
    return torch.stack([torch.bmm(packed[:, h], k[:, :, h].transpose(1, 2)) for h in range(k.shape[2])], dim=1)


def matmuls_positions_first(q, k, mask, score_weight):
    packed = pillar_attn._pack_groups(q, k.shape[2])
    return torch.stack([torch.bmm(k[:, :, h], packed[:, h].transpose(1, 2)) for h in range(k.shape[2])], dim=1)


def main():
    b = from_command_line(Q)
    batch, context, device = b.q.shape[0], int(sys.argv[2]), b.device
    blocks, L = b.k_pool.shape[0] // BLOCK, b.mask.shape[-1]
    keys = b.k_pool.view(blocks, -1).index_select(0, b.block_table.flatten()).view(batch, L, N_KV, -1)
    weight = b.q_valid.float() / Q                                  # a verification scores all its rows
    forms = {"engine (compile_kernels)": pillar_attn.pillar_scores,     # compiled below, as `compile_kernels` does
             "rows last (session 14)": session14_form, "positions first": positions_first,
             "block-diagonal queries": block_diagonal, "matmul of block-diagonal": matmuls_block_diagonal,
             "one graph: block-diag, unrolled": block_diagonal_unrolled,
             "one graph: per head, unrolled": per_head_unrolled,
             "matmuls of rows last": matmuls_rows_last, "matmuls of positions first": matmuls_positions_first}
    reference = session14_form(b.q, keys, b.mask, weight)
    print(f"batch {batch}, context up to {context}, Q {Q}, {device}; "
          f"keys {keys.numel() * keys.element_size() / 1e9:.2f} GB")
    if "engine" in sys.argv:
        forms = {name: form for name, form in forms.items() if name.startswith(("engine", "rows last"))}
    for dynamic in (True, False) if "engine" not in sys.argv else ():
        stage_one = torch.compile(logits_and_lse, dynamic=dynamic)
        logits, lse = stage_one(b.q, keys, b.mask)
        print(f"  {'two-stage: logits + lse':28s} {timed_ms(lambda: stage_one(b.q, keys, b.mask), device):7.3f} ms "
              f"per layer (dynamic {dynamic})")
    for name, stage_two in {"sum over dims": weighted_sum, "sum unrolled": weighted_sum_unrolled}.items() \
            if "engine" not in sys.argv else ():
        compiled = torch.compile(stage_two, dynamic=True)
        out = compiled(logits, lse, b.mask, weight)
        ms = timed_ms(lambda: compiled(logits, lse, b.mask, weight), device)
        print(f"  {'two-stage: ' + name:28s} {ms:7.3f} ms per layer  max |diff| vs session 14 "
              f"{float((out - reference).abs().max()):.2e}")
    for name, form in forms.items():
        compiled = torch.compile(form, dynamic=True)
        out = compiled(b.q, keys, b.mask, weight)
        same = "" if out.shape != reference.shape else \
            f"  max |diff| vs session 14 {float((out - reference).abs().max()):.2e} (max {float(reference.max()):.2e})"
        ms = timed_ms(lambda: compiled(b.q, keys, b.mask, weight), device)
        print(f"  {name:28s} {ms:7.3f} ms per layer{same}")


if __name__ == "__main__":
    main()
