"""The drafts' sparse attention on the fast path: flex_attention's decoding kernel over the draft
buffers in place, one fused pass per layer.

attention.py's `sparse_drafts` (the reference) attends with two batched matmuls and a softmax
between them, which write each row's logits and probabilities out and read them back; here one
kernel reads each row's columns once and keeps the softmax in registers.

Owns `flex_drafts` (`attention.sparse_drafts`'s contract, for drafts that read their rows in
place), `draft_block_lists` (once a step), `draft_block_mask` (per layer) and `drafts_by_reading`
(the drafts' kernel of the fast path).
kernels.py compiles `flex_drafts` for a static count of buffer rows (the decoding kernel wants a
static batch); uncompiled, flex_attention is torch's reference implementation (the CPU tests).
"""
from __future__ import annotations

import torch

from .attention import write_draft_kv

# Columns per block of the kernel's block mask: a row reads its first N columns rounded up to
# whole blocks, so the draft buffers' width is a multiple of it on the fast path (runner.py).
DRAFT_BLOCK = 64
# The decoding kernel's Triton settings: one CTA per (row, KV head) (the rows are many and each
# reads a few hundred columns); the fastest of 36 block sizes, warps and stages on the H200 at a
# busy step's shape (BENCHMARKS.md).
DRAFT_KERNEL_OPTIONS = {"SPLIT_KV": 1, "num_stages": 2, "num_warps": 2}


def flex_drafts(out, q, k, v, keys, values, q_index, read_row, write_row, write_column,
                valid, counts, ids, row_queries) -> None:
    """One layer's draft tokens: their K/V join their rows of the draft buffers, then each attends
    to its row in place.

    out: [T, n_heads, D] (the drafts' rows are written); q: [T, n_heads, D]; k, v: [T, n_kv, D];
    keys, values: [rows, n_kv, C, D] the layer's draft buffers (C a multiple of DRAFT_BLOCK);
    q_index, read_row, write_row, write_column: [Bs] (`attention.SparseBatch`); valid:
    [R, n_kv, N] the columns each of the first R <= rows rows attends to, none past its draft's
    own (write_column); counts, ids, row_queries: the step's `draft_block_lists`, the same in
    every layer."""
    from torch.nn.attention.flex_attention import flex_attention

    write_draft_kv(k, v, keys, values, q_index, write_row, write_column)
    R, n_kv, _ = valid.shape
    H, D = q.shape[1:]
    queries = q[row_queries]                                                   # [R, n_heads, D]
    # a KV head's G query heads as G query rows of one head: [R, n_kv, G, D]
    packed = queries.view(R, n_kv, H // n_kv, D)
    block_mask = draft_block_mask(valid, counts, ids, H // n_kv, keys.shape[2])
    attended = flex_attention(packed, keys[:R], values[:R], block_mask=block_mask,
                              kernel_options=DRAFT_KERNEL_OPTIONS)             # [R, n_kv, G, D]
    out[q_index] = attended.reshape(R, H, D)[read_row]


def draft_block_lists(q_index, read_row, last_column, rows: int, columns: int):
    """The blocks each buffer row's drafts visit and the query each row attends with, the same in
    every layer of a step (so built once a step, `paged.paged_prepare`): q_index [Bs] each draft's
    token row; read_row [Bs] the rows drafts read, of `rows`; last_column [Bs] the last column
    each draft attends to (its own: none past it); columns the buffers' width C (a multiple of
    DRAFT_BLOCK) -> counts [rows, 1, 1] int32 (a read row's blocks up to its drafts' last column,
    0 for the others, which read nothing), ids [rows, 1, 1, C / DRAFT_BLOCK] int32, the blocks in
    order (BlockMask's contract: one column per block of the key sequence), and row_queries
    [rows], the token row of the draft that reads each row (0 for a row none reads: its output
    is unread). A row whose selection is narrower than the step's widest skips the blocks it does
    not see; with row_queries each layer gathers its queries in one read, rather than zeroing a
    buffer and scattering into it."""
    counts = torch.zeros(rows, dtype=torch.int32, device=read_row.device)
    blocks = (last_column // DRAFT_BLOCK + 1).to(torch.int32)                     # [Bs]
    counts = counts.scatter_reduce_(0, read_row, blocks, "amax").view(rows, 1, 1)
    ids = torch.arange(columns // DRAFT_BLOCK, dtype=torch.int32, device=read_row.device)
    row_queries = torch.zeros(rows, dtype=q_index.dtype, device=q_index.device)
    return counts, ids.repeat(rows, 1, 1, 1), row_queries.scatter_(0, read_row, q_index)


def draft_block_mask(valid, counts, ids, q_rows: int, columns: int):
    """The BlockMask under which row b's packed queries see the columns valid[b, h] marks:
    valid [R, n_kv, N] bool; counts, ids: `draft_block_lists` of R rows; q_rows: query rows per
    KV head (G); columns: the buffers' width C."""
    from torch.nn.attention.flex_attention import BlockMask

    N = valid.shape[2]

    def visible(b, h, q_idx, kv_idx):   # (compiled, the mask reads a tensor from outside)
        return (kv_idx < N) & valid[b, h, torch.clamp(kv_idx, max=N - 1)]

    return BlockMask.from_kv_blocks(counts, ids, BLOCK_SIZE=(128, DRAFT_BLOCK), mask_mod=visible,
                                    seq_lengths=(q_rows, columns),
                                    compute_q_blocks=False)


def drafts_by_reading(gathered, in_place):
    """The drafts' kernel: `in_place` for drafts that read their rows of the draft buffers in
    place (`SparseBatch.read_row` given), `gathered` for those that copy them out."""
    def sparse(*args):
        return (gathered if args[7] is None else in_place)(*args)
    return sparse
