"""Where a PillarAttn verification step's time goes beyond its attention, at long context: the score pass of `finish`
(the keys gathered from the pool, then the compiled score pass `pillar_attn.pillar_scores`) and the selection of the next
critical positions (`pillar_attn.select_pillar`: a stable sort of every (layer, request, KV head) row of scores until
the sixteenth session, a top-k of int64 keys since).

Why (fourteenth session, `bench --profile-steps --cuda-graphs --compile`, 128 x 6,144 on the H200): a verification
step of 128 requests took 48.7 ms, 7.2x a plain step (6.8 ms), and the balanced step 1.44x the lock-step mean; the
attention that verifies reads what a plain step reads, so the rest is these parts. This times each for one layer's
share (x 30 layers; at this size `finish` scores one layer per chunk: SCORE_CHUNK_BYTES), and two selections: the
stable sort and a top-k over int64 keys (the score's float bits above, the position's complement below), which picks
the same positions in the same order (checked here) while reading each row once. Until the sixteenth session the
engine's `select_pillar` was the sort and the top-k the candidate; now it is the top-k and the sort is kept here.

    PYTHONPATH=. python benchmarks/h200/session14/verify_split.py BATCH CONTEXT [cuda|cpu]

On a GPU each part is timed as a replayed CUDA graph (graph_timing.replay_ms); on a CPU (a smoke test) by the clock.
"""
import sys
from pathlib import Path

import torch

from nano_sparsespec import pillar_attn

sys.path.insert(0, str(Path(__file__).parent.parent))
from graph_timing import timed_ms  # noqa: E402  (benchmarks/h200/graph_timing.py)
from paged_batch import BLOCK, N_KV, from_command_line  # noqa: E402  (benchmarks/h200/paged_batch.py)

LAYERS, Q = 30, 9          # the embedded model's layers; k + 1 query rows per verification (k = 8)


def select_by_stable_sort(scores: torch.Tensor, context_len: list[int], lengths: torch.Tensor,
                          budget: int) -> list[torch.Tensor]:
    """`pillar_attn.select_pillar` until the sixteenth session: [L, B, n_kv, Lmax] scores -> per request [L, n_kv, n]
    positions, a stable descending sort of each row. `lengths`: context_len on the scores' device, made outside (a
    host-to-device copy cannot be captured in the CUDA graph that times this)."""
    in_context = torch.arange(scores.shape[-1], device=scores.device) < lengths[:, None]              # [B, Lmax]
    masked = scores.masked_fill(~in_context[None, :, None, :], float("-inf"))
    order = masked.sort(dim=-1, descending=True, stable=True).indices[..., :budget]
    return [order[:, b, :, :min(budget, c)] for b, c in enumerate(context_len)]


def main():
    b = from_command_line(Q)
    batch, context, device = b.q.shape[0], int(sys.argv[2]), b.device
    blocks, L = b.k_pool.shape[0] // BLOCK, b.mask.shape[-1]
    weight = b.q_valid.float() / Q     # a verification scores all its rows (`ModelRunner._dense_batch` rule 1)
    # the engine's score pass, compiled on the GPU as `compile_kernels` does (one graph; two stages in session 15)
    scores_kernel = torch.compile(pillar_attn.pillar_scores, dynamic=True) if device == "cuda" else \
        pillar_attn.pillar_scores
    table = b.block_table.flatten()

    def gather():
        return b.k_pool.view(blocks, -1).index_select(0, table).view(batch, L, N_KV, -1)
    keys = gather()
    layer_scores = scores_kernel(b.q, keys, b.mask, weight)                            # [B, n_kv, L]
    all_scores = layer_scores.expand(LAYERS, -1, -1, -1).contiguous()
    all_scores += torch.rand_like(all_scores) * 1e-6    # layers differ a little; most rows have no exact ties
    context_len = b.lengths.tolist()
    budget = max(128, int(0.05 * context))              # SpecConfig.budget at the default ratio
    by_topk = pillar_attn.select_pillar(all_scores, context_len, [budget] * batch)
    lengths = torch.tensor(context_len, device=device)
    by_sort = select_by_stable_sort(all_scores, context_len, lengths, budget)
    same = all(torch.equal(a, s) for a, s in zip(by_topk, by_sort))

    parts = {
        "gather the keys (x 30 layers)": LAYERS * timed_ms(gather, device),
        "pillar_scores (x 30 layers)": LAYERS * timed_ms(lambda: scores_kernel(b.q, keys, b.mask, weight), device),
        "stable sort (30 layers at once)":
            timed_ms(lambda: select_by_stable_sort(all_scores, context_len, lengths, budget), device),
        "select_pillar: top-k of int64 keys (30 layers at once)":
            timed_ms(lambda: pillar_attn.select_pillar(all_scores, context_len, [budget] * batch), device),
    }
    print(f"batch {batch}, context up to {context} (mean {b.lengths.float().mean():.0f}), Q {Q}, budget {budget}, "
          f"{device}; top-k picks what the sort picks: {same}")
    for name, ms in parts.items():
        print(f"  {name:52s} {ms:8.2f} ms")


if __name__ == "__main__":
    main()
