"""Where a PillarAttn verification step's time goes beyond its attention, at long context: the score pass of `finish`
(the keys gathered from the pool, then the compiled score pass `pillar_attn.pillar_scores`) and the selection of the next
critical positions (`pillar_attn.select_pillar`: a stable sort of every (layer, request, KV head) row of scores).

Why (fourteenth session, `bench --profile-steps --cuda-graphs --compile`, 128 x 6,144 on the H200): a verification
step of 128 requests took 48.7 ms, 7.2x a plain step (6.8 ms), and the balanced step 1.44x the lock-step mean; the
attention that verifies reads what a plain step reads, so the rest is these parts. This times each for one layer's
share (x 30 layers; at this size `finish` scores one layer per chunk: SCORE_CHUNK_BYTES), and a candidate selection
for comparison: a top-k over int64 keys (the score's float bits above, the position's complement below), which picks
the same positions in the same order as the stable sort (checked here) while reading each row once.

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


def select_by_topk(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """[L, B, n_kv, Lmax] scores >= 0 (or -inf) -> [L, B, n_kv, budget] positions: the highest scores, ties to the
    lower position. A non-negative float's bits order like its value, and -inf's sign bit puts it below them."""
    positions = torch.arange(scores.shape[-1], device=scores.device)
    keys = (scores.contiguous().view(torch.int32).long() << 32) | (0xFFFFFFFF - positions)
    return keys.topk(budget, dim=-1).indices


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
    by_sort = pillar_attn.select_pillar(all_scores, context_len, [budget] * batch)
    masked = all_scores.masked_fill(torch.arange(L, device=device) >= b.lengths.to(device)[None, :, None, None],
                                    float("-inf"))
    by_topk = select_by_topk(masked, budget)
    same = all(torch.equal(by_sort[i], by_topk[:, i, :, :by_sort[i].shape[-1]]) for i in range(batch))

    parts = {
        "gather the keys (x 30 layers)": LAYERS * timed_ms(gather, device),
        "pillar_scores (x 30 layers)": LAYERS * timed_ms(lambda: scores_kernel(b.q, keys, b.mask, weight), device),
        "select_pillar: stable sort (30 layers at once)":
            timed_ms(lambda: pillar_attn.select_pillar(all_scores, context_len, [budget] * batch), device),
        "candidate: top-k of int64 keys (30 layers at once)": timed_ms(lambda: select_by_topk(masked, budget), device),
    }
    print(f"batch {batch}, context up to {context} (mean {b.lengths.float().mean():.0f}), Q {Q}, budget {budget}, "
          f"{device}; top-k picks what the sort picks: {same}")
    for name, ms in parts.items():
        print(f"  {name:52s} {ms:8.2f} ms")


if __name__ == "__main__":
    main()
