"""A verification's PillarAttn scores on the fast path: a second flex_attention pass with
queries and keys swapped, so that the attention probabilities are never in memory.

Owns `column_scores` (`pillar_scores` from the rows' log-sum-exps), `score_rows` (the pass's
keys: the packed rows, and their shifts), `score_pass` (the pass; `row_blocks_per_tile`, the
tiles of positions it visits) and `score_inputs` (its inputs
on the paged path: the keys gathered head-major from the pool, and `score_rows`), which
paged.py's kernel runs, compiled, after its attention. Uncompiled, flex_attention is
torch's reference implementation (the CPU tests).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import pack_groups

# The swapped score pass (`column_scores`): positions per query tile, verification rows per key
# block (a verification has G x (k + 1) rows per KV head, 27 for the embedded model), and its
# Triton settings (one key block of rows a tile: nothing to pipeline; four warps read a tile
# fastest both for a balanced step's ~B/9 verifications and for a whole batch's, BENCHMARKS.md).
SCORE_TILE, SCORE_ROWS = 128, 32
SCORE_KERNEL_OPTIONS = {"BLOCK_M": SCORE_TILE, "BLOCK_N": SCORE_ROWS, "num_stages": 1,
                        "num_warps": 4}
# Width of the values of the swapped score pass: only its log-sum-exps are used, and
# flex_attention's smallest value width keeps the output it writes anyway small.
SCORE_VALUE_DIM = 16


def column_scores(q, keys, q_start, score_weight, lse):
    """`pillar_scores` without the probabilities in memory: q [B, Q, n_heads, D];
    keys [B, n_kv, L, D] head-major; row q of request b at position q_start[b] + q;
    score_weight [B, Q]; lse [B, n_kv, G*Q] the packed rows' log-sum-exps over their attention
    (`paged_attention`) -> scores [B, n_kv, L] float32.

    A second flex_attention pass with queries and keys swapped: each context position's key is a
    query that attends to the G*Q packed rows of its KV head under the transposed causal mask. Its
    score for row r minus (lse_r - log(weight_r / G)) is log(weight_r / G * p_r(position)), so the
    pass's log-sum-exp is the log of the position's score: the keys are read once, and nothing of
    size rows x positions is written."""
    B, n_kv, L = keys.shape[:3]
    scores = torch.empty(B, n_kv, L, dtype=torch.float32, device=keys.device)
    score_pass(scores, keys, *score_rows(q, score_weight, lse, n_kv), q_start, q.shape[1])
    return scores


def score_rows(q, score_weight, lse, n_kv: int):
    """The score pass's keys and shifts: q [B, Q, n_heads, D] packed per KV head and padded to
    whole key blocks -> rows [B, n_kv, R, D]; each row's shift lse - log(weight / G), +inf for a
    row of weight 0 (padding, unscored), which then drops out -> shift [B, n_kv, R] float32."""
    B, Q, H, D = q.shape
    G = H // n_kv
    R = -(-G * Q // SCORE_ROWS) * SCORE_ROWS     # rows padded to whole key blocks: the kernel
    pad = (0, R - G * Q)                          #   reads score_mod's tensor over whole blocks
    rows = F.pad(pack_groups(q, n_kv), (0, 0) + pad)                        # [B, n_kv, R, D]
    weight = F.pad(score_weight.float().repeat(1, G), pad)[:, None, :] / G  # [B, 1, R]
    shift = torch.where(weight > 0, F.pad(lse, pad) - weight.log(), float("inf"))
    return rows, shift


def score_pass(scores, keys, rows, shift, q_start, Q: int) -> None:
    """scores [B, n_kv, L] = exp of the log-sum-exp over rows [B, n_kv, R, D] of each key's
    (keys [B, n_kv, L, D]) score minus the row's shift [B, n_kv, R], row r (query row r % Q)
    seen by the positions up to q_start[b] + r % Q (`column_scores`)."""
    from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

    B, n_kv, L, D = keys.shape
    R = rows.shape[2]

    def minus_shift(score, b, h, position, row):
        return score - shift[b, h, row]

    def seen_by(b, h, position, row):             # the causal mask, transposed
        return position <= q_start[b] + row % Q

    tiles, row_blocks = -(-L // SCORE_TILE), R // SCORE_ROWS
    # a tile of positions within its request's context sees every block of rows, through
    # `seen_by`; one past it lists none (its positions score 0)
    block_mask = BlockMask.from_kv_blocks(
        row_blocks_per_tile(q_start + Q - 1, tiles, row_blocks, n_kv),
        torch.arange(row_blocks, dtype=torch.int32, device=keys.device).repeat(B, n_kv, tiles, 1),
        BLOCK_SIZE=(SCORE_TILE, SCORE_ROWS), mask_mod=seen_by, seq_lengths=(L, R),
        compute_q_blocks=False)                   # (the transposed lists serve only a backward)
    values = rows.new_zeros(B, n_kv, R, SCORE_VALUE_DIM)
    _, aux = flex_attention(keys, rows, values, score_mod=minus_shift, block_mask=block_mask,
                            scale=D ** -0.5, return_aux=AuxRequest(lse=True),
                            kernel_options=SCORE_KERNEL_OPTIONS)
    scores.copy_(aux.lse.float().exp())


def row_blocks_per_tile(last_position, tiles: int, row_blocks: int, heads: int) -> torch.Tensor:
    """The score pass's block counts [B, heads, tiles] int32: all `row_blocks` blocks of rows for a
    tile of SCORE_TILE positions that starts at or before its request's last row's position
    last_position [B], none past it: a verification's rows see nothing there, and the kernel
    skips a tile that lists nothing, so the pass costs a request's context, not the longest.
    One list per KV head, written out: compiled (torch 2.11), lists of one head broadcast over the
    heads were read at other requests' offsets, and some requests' later tiles scored 0."""
    first = torch.arange(tiles, device=last_position.device) * SCORE_TILE             # [tiles]
    within = first[None, :] <= last_position[:, None]                                  # [B, tiles]
    counts = (within * row_blocks).to(torch.int32)[:, None]                          # [B, 1, tiles]
    return counts.expand(-1, heads, -1).contiguous()


def score_inputs(q, q_index, k_layer, block_table, block_size: int, score_weight, lse):
    """What the score pass reads: the requests' keys head-major [Bd, n_kv, Lmax, D] (block_table
    [Bd, Lmax / block_size] gathered from the pool in one pass), and `score_rows`."""
    n_kv, D = k_layer.shape[1:]
    keys = (k_layer.view(-1, block_size, n_kv, D)[block_table].permute(0, 3, 1, 2, 4)
            .flatten(2, 3))
    return (keys, *score_rows(q[q_index], score_weight, lse, n_kv))
