"""Attention in plain torch: dense over a request's whole paged KV, sparse over its draft buffers.

Owns
  * `attend(layer, q, k, v, ctx)`: the one attention call the model makes. It writes the step's
    K/V into the paged pool, then runs
      - dense attention for the requests whose tokens see their whole context (prefill chunks,
        verification, plain decoding, the `full` drafter), with the PillarAttn scores of a
        verification's rows when `DenseBatch.score_weight` asks for them (pillar_attn.py);
      - sparse attention for draft tokens: each draft query attends only to its request's row of
        the draft buffers, which hold the K/V of its critical positions (copied there once per
        selection, `fill_draft_buffers`) and then of every position its drafts wrote since the
        last verification.
    Both are batched over requests and heads: no Python loop over requests x layers x heads.
  * the step's attention batches (`AttentionContext`, `DenseBatch`, `SparseBatch`), built by the
    runner.
  * `_kernels`, the functions `attend` calls: the eager ones here, or the fast path's compiled and
    paged ones (kernels.py swaps them in; `prepare` runs once per forward before the layers).

Must not know about scheduling or sampling.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import batch_invariant
from .pillar_attn import pillar_scores


@dataclass
class DenseBatch:
    """Requests that attend densely this step, padded to Qmax query rows and Lmax context
    positions."""
    q_index: torch.Tensor        # [Bd, Qmax]   row of each query in the step's flat token list;
                                 #   padding queries read and write the step's last (padding) row
    q_valid: torch.Tensor        # [Bd, Qmax]   bool: real query (False: padding)
    block_table: torch.Tensor    # [Bd, Lmax / block]  pool blocks of each request's context
    q_start: torch.Tensor        # [Bd]         position of each request's first query row
    runs: tuple                  # ((first request, count, mask [count, Q, L] bool, prefill), ...):
                                 #   the requests attended together, each run padded to its own Q
                                 #   and L; one run of the whole batch, or prefill chunks apart
                                 #   (`prefill`: only a final chunk's last row can be scored)
    score_weight: torch.Tensor | None = None  # [Bd, Qmax] weight of each row in PillarAttn scores
    scores: torch.Tensor | None = None        # [L / n, Bd, n_kv, Lmax] filled when score_weight
    score_every: int = 1                      #   is set: layers 0, n, 2n, ... score (SpecConfig)
    block_mask: object | None = None          # the paged kernel's BlockMask (fast path,
                                              #   paged.py): then `runs` is one run

    def layer_scores(self, layer: int) -> torch.Tensor | None:
        """Where `layer` writes its PillarAttn scores, [Bd, n_kv, Lmax]; None if it scores none."""
        if self.score_weight is None or layer % self.score_every:
            return None
        return self.scores[layer // self.score_every]


def causal_mask(q_start: torch.Tensor, q_valid: torch.Tensor, context: int) -> torch.Tensor:
    """q_start: [B]; q_valid: [B, Q] bool -> [B, Q, context] bool: row q of request b sees
    positions up to q_start[b] + q; a padding row sees position 0 alone (a finite softmax; its
    output is dropped)."""
    kv_pos = torch.arange(context, device=q_valid.device)[None, None, :]          # [1, 1, L]
    rows = torch.arange(q_valid.shape[1], device=q_valid.device)
    q_pos = (q_start[:, None] + rows)[:, :, None]                                 # [B, Q, 1]
    return (kv_pos <= q_pos) & (q_valid[:, :, None] | (kv_pos == 0))


@dataclass
class SparseBatch:
    """Draft tokens that attend to their request's row of the draft buffers
    (`AttentionContext.draft_k` / `draft_v`): its critical positions' K/V, then those its drafts
    wrote since the last verification."""
    q_index: torch.Tensor        # [Bs] row of each draft token in the step's flat token list
    read_row: torch.Tensor | None  # [Bs] its row in `valid` and the buffers (padding: R, unread);
                                 #   None: the drafts' rows are copied out (`gathered`)
    write_row: torch.Tensor      # [Bs] the buffer row its own K/V go to (padding: the scratch row)
    write_column: torch.Tensor   # [Bs] ... and the column there
    valid: torch.Tensor          # [L, R + 1, n_kv, N] bool: the columns each row attends to
                                 #   (a row no draft reads: another row's, its output unread);
                                 #   gathered: [L, Bs, n_kv, N], each draft's
    block_lists: tuple | None = None   # the fast path's kernel: its block lists, the same in
                                       #   every layer (flex_drafts.py, built by paged.py)


def gathered(drafts: int, rows_read: int) -> bool:
    """Whether a draft step copies its drafts' rows of the draft buffers out before attending
    (read, write, read: three row moves per draft) rather than attending over the first
    `rows_read` rows in place (one read each, also of the rows no draft reads): when the drafts
    are under a third of those rows, as when few requests are left."""
    return 3 * drafts < rows_read


@dataclass
class AttentionContext:
    k_cache: torch.Tensor        # [L, slots, n_kv, head_dim], slot = block * block_size + offset
    v_cache: torch.Tensor        # [L, slots, n_kv, head_dim]
    slot_mapping: torch.Tensor   # [T] where this step's K/V are written
    block_size: int              # slots per pool block
    draft_k: torch.Tensor | None = None   # [L, rows + 1, n_kv, C, D] per request row: its critical
    draft_v: torch.Tensor | None = None   #   positions' K/V, then its drafts' (`SparseBatch`)
    dense: DenseBatch | None = None
    sparse: SparseBatch | None = None
    context_capacity: int = 0    # positions a request's block table can hold
    # (token [Tw], draft-buffer row [Tw], column [Tw]): K/V the verifications also write to their
    # requests' draft-buffer windows, for the drafts made ahead of their results (runner.py)
    window_writes: tuple | None = None


def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           ctx: AttentionContext | None) -> torch.Tensor:
    """q: [T, n_heads, D]; k, v: [T, n_kv, D] -> [T, n_heads, D]. With ctx None: one sequence,
    causal, no cache (the reference path of `CausalLM.full_logits`)."""
    if ctx is None:
        group = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(q.transpose(0, 1),
                                             k.repeat_interleave(group, 1).transpose(0, 1),
                                             v.repeat_interleave(group, 1).transpose(0, 1),
                                             is_causal=True)
        return out.transpose(0, 1)
    window = ()
    if ctx.window_writes is not None and ctx.draft_k is not None:
        window = (ctx.draft_k[layer], ctx.draft_v[layer], *ctx.window_writes)
    _kernels["store"](ctx.k_cache[layer], ctx.v_cache[layer], ctx.slot_mapping, k, v, *window)
    out = torch.zeros_like(q)   # zeros: a padded step (cuda_graphs.py) has rows no batch writes
    if ctx.dense is not None:
        if ctx.dense.block_mask is None:
            _dense_gathered(layer, out, q, k.shape[1:], ctx)
        else:   # the fast path's paged kernel reads the pool in place
            d, scores = ctx.dense, ctx.dense.layer_scores(layer)
            scored = () if scores is None else (scores, d.block_table, d.q_start, d.score_weight)
            _kernels["paged"](out, q, d.q_index, ctx.k_cache[layer], ctx.v_cache[layer],
                              d.block_mask, *scored)
    if ctx.sparse is not None:
        s = ctx.sparse
        _kernels["sparse"](out, q, k, v, ctx.draft_k[layer], ctx.draft_v[layer], s.q_index,
                           s.read_row, s.write_row, s.write_column, s.valid[layer],
                           *(s.block_lists or ()))
    return out


def _dense_gathered(layer: int, out: torch.Tensor, q: torch.Tensor, kv_shape: torch.Size,
                    ctx: AttentionContext) -> None:
    """Dense attention of each run over its requests' K/V gathered a whole pool block at a time,
    and the PillarAttn scores of the rows `score_weight` marks, from the same keys. Writes
    out[q_index]."""
    d, scores = ctx.dense, ctx.dense.layer_scores(layer)
    blocks = ctx.k_cache.shape[1] // ctx.block_size

    def gathered(cache, table):                                            # [B, L, n_kv, D]
        return gather_rows(cache[layer].view(blocks, -1), table).view(table.shape[0], -1,
                                                                       *kv_shape)

    for first, B, mask, prefill in d.runs:
        (_, Q, L), requests = mask.shape, slice(first, first + B)
        q_index = d.q_index[requests, :Q]                                  # [B, Q]
        table = d.block_table[requests, :L // ctx.block_size]
        keys = gathered(ctx.k_cache, table)
        dense_out = dense_attention(q[q_index], keys, gathered(ctx.v_cache, table), mask)
        out[q_index.flatten()] = dense_out.flatten(0, 1)   # padding queries: the padding row
        if scores is None:
            continue
        rows, weight = q_index, d.score_weight[requests, :Q]                          # [B, Q]
        if prefill:   # a final prefill chunk scores its last row alone (all rows cost far more)
            last = (d.q_valid[requests, :Q].sum(1, keepdim=True) - 1).clamp(min=0)   # [B, 1]
            rows, weight = q_index.gather(1, last), weight.gather(1, last)
            mask = mask.gather(1, last[:, :, None].expand(-1, -1, L))              # [B, 1, L]
        # [B, n_kv, L]
        scores[requests, :, :L] = _kernels["scores"](q[rows], keys, mask, weight)


def store_kv(k_layer: torch.Tensor, v_layer: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, draft_k: torch.Tensor | None = None,
             draft_v: torch.Tensor | None = None, tokens: torch.Tensor | None = None,
             rows: torch.Tensor | None = None, columns: torch.Tensor | None = None) -> None:
    """Write the step's keys and values into one layer's pool: k_layer, v_layer [slots, n_kv, D];
    slots [T]; k, v [T, n_kv, D]. With `draft_k`, `draft_v` (one layer's draft buffers
    [rows + 1, n_kv, C, D]), also token tokens[i]'s into row rows[i], column columns[i] of them
    (`AttentionContext.window_writes`, each [Tw]). (The layer's pool and buffers are passed in,
    not the whole cache: compiled, a write into a slice of an input copies the whole slice out
    and back.)"""
    k_layer[slots] = k
    v_layer[slots] = v
    if draft_k is not None:
        heads = torch.arange(k.shape[1], device=k.device)                          # [n_kv]
        draft_k[rows[:, None], heads, columns[:, None]] = k[tokens]               # [Tw, n_kv, D]
        draft_v[rows[:, None], heads, columns[:, None]] = v[tokens]


def fill_draft_buffers(k_cache: torch.Tensor, v_cache: torch.Tensor, draft_k: torch.Tensor,
                       draft_v: torch.Tensor, block_table: torch.Tensor, block_size: int,
                       positions: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> None:
    """Copy the pool's K/V of `positions` into rows of the draft buffers, all layers and KV heads
    at once.

    k_cache, v_cache: [L, slots, n_kv, D]; draft_k, draft_v: [L, rows + 1, n_kv, C, D];
    block_table: [B, blocks] of the requests in `rows` [B]; positions: [B, L, n_kv, n] per layer
    and KV head, or [B, 1, 1, n] the same for all; columns: [B, n] where they go in each (layer,
    KV head) of the row. One indexed assignment per buffer: compiled (kernels.py), both become
    one kernel that finds a row's slot as it copies it."""
    L, _, n_kv, _ = k_cache.shape
    # [B, L or 1, n_kv or 1, n]
    slots = (block_table.gather(1, (positions // block_size).flatten(1)).view_as(positions)
             * block_size + positions % block_size)
    layer = torch.arange(L, device=positions.device).view(1, L, 1, 1)
    head = torch.arange(n_kv, device=positions.device).view(1, 1, n_kv, 1)
    row, column = rows.view(-1, 1, 1, 1), columns[:, None, None, :]            # [B, 1, 1, 1|n]
    for cache, buffer in ((k_cache, draft_k), (v_cache, draft_v)):
        buffer[layer, row, head, column] = cache[layer, slots, head]      # [B, L, n_kv, n, D]


def ring_span_writes(start: torch.Tensor, width: torch.Tensor, first: torch.Tensor,
                     count: torch.Tensor, pending: torch.Tensor, window: torch.Tensor,
                     longest: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where a kept selection's new first-ranked span goes in its draft-buffer row, so that only
    the span's K/V is copied. A row's selection lies in its columns 0 .. width - 1 as a ring,
    rank i at column (start + i) mod width: ranking c new positions first (within the budget)
    drops the c lowest-ranked, whose columns are the c before `start`; the span goes there and
    `start` moves back by c. A draft ahead's pending position goes to column `window`.

    start, width, first, count, pending: [B]; window: [B], a column the padding writes may
    take; counts at most `longest` -> start [B], positions [B, longest + 1], columns [B, longest
    + 1] (the span's, then the pending position's, repeated)."""
    kept = count.minimum(width)                                    # [B] span positions kept
    ring = width.clamp(min=1)
    start = (start - kept) % ring
    j = torch.arange(longest + 1, device=start.device)                                # [J]
    in_span = j < kept[:, None]                                                        # [B, J]
    positions = torch.where(in_span, first[:, None] + j, pending[:, None])
    columns = torch.where(in_span, (start[:, None] + j) % ring[:, None], window[:, None])
    return start, positions, columns


def gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """table[index] for a 2-D table, each row copied whole: [rows, width], index [...] ->
    [..., width], through `index_select` over the rows' words (`as_words`)."""
    words = as_words(table).index_select(0, index.flatten())
    return words.view(table.dtype).view(*index.shape, table.shape[1])


def as_words(table: torch.Tensor) -> torch.Tensor:
    """A table whose rows (its last dim) are contiguous, viewed as integers, the widest that tile
    a row: [..., width] -> [..., width * element size / word size]. A copy of rows then moves
    a quarter as many elements of a bfloat16 row, each four times as wide; on the CPU, integer
    rows also copy far faster than advanced indexing of floating-point ones."""
    row_bytes = table.shape[-1] * table.element_size()
    word = next(size for size in (8, 4, 2, 1) if row_bytes % size == 0)
    return table.view(_INTEGER_OF_SIZE[table.element_size()]).view(_INTEGER_OF_SIZE[word])


_INTEGER_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


KV_CHUNK = 256  # positions per step of dense attention's online softmax (see dense_attention)


def dense_attention(q, k, v, mask):
    """Padded dense attention with GQA.

    q: [B, Q, n_heads, D]; k, v: [B, L, n_kv, D]; mask: [B, Q, L] bool -> [B, Q, n_heads, D].
    The G query heads of a KV head are packed into G x Q rows, so each KV head is read once for
    all of them. Each row's arithmetic is the same whatever Q, B and the padding L: float32, an
    online softmax over chunks of KV_CHUNK positions in order (a chunk a row cannot see changes
    nothing: it adds exact zeros), and row-invariant matmuls. So a verification row equals the
    decode row of its position bit for bit, in bfloat16 too."""
    B, Q, H, D = q.shape
    n_kv, pad = k.shape[2], -k.shape[1] % KV_CHUNK
    compute = torch.promote_types(q.dtype, torch.float32)
    queries = pack_groups(q, n_kv).to(compute) * D ** -0.5                   # [B, n_kv, G*Q, D]
    keys, values = (F.pad(x, (0, 0, 0, 0, 0, pad)).to(compute).transpose(1, 2)
                    for x in (k, v))                                         # [B, n_kv, L', D]
    seen = F.pad(mask, (0, pad))[:, None, None].expand(B, 1, H // n_kv, Q, -1)
    seen = seen.reshape(B, 1, queries.shape[2], -1)                          # [B, 1, G*Q, L']
    row_max = queries.new_full((*queries.shape[:3], 1), float("-inf"))       # [B, n_kv, G*Q, 1]
    row_sum = torch.zeros_like(row_max)
    acc = torch.zeros_like(queries)                                          # [B, n_kv, G*Q, D]
    for start in range(0, keys.shape[2], KV_CHUNK):
        chunk = slice(start, start + KV_CHUNK)
        logits = batch_invariant.matmul(queries, keys[:, :, chunk].transpose(-1, -2))
        logits = logits.masked_fill(~seen[..., chunk], float("-inf"))        # [B, n_kv, G*Q, C]
        new_max = torch.maximum(row_max, logits.amax(-1, keepdim=True))  # finite: all see pos 0
        rescale, probs = torch.exp(row_max - new_max), torch.exp(logits - new_max)
        row_sum = row_sum * rescale + probs.sum(-1, keepdim=True)
        acc = acc * rescale + batch_invariant.matmul(probs, values[:, :, chunk])
        row_max = new_max
    return unpack_groups((acc / row_sum).to(v.dtype), Q)


def pack_groups(q, n_kv):
    """[B, Q, n_heads, D] -> [B, n_kv, G * Q, D]: per KV head, the rows of its G query heads,
    ordered (head, query); query head h belongs to KV head h // G (the grouping of SDPA's
    enable_gqa)."""
    B, Q, H, D = q.shape
    return q.view(B, Q, n_kv, H // n_kv, D).permute(0, 2, 3, 1, 4).reshape(B, n_kv, -1, D)


def unpack_groups(out, Q):
    """The inverse of `pack_groups`: [B, n_kv, G * Q, D] -> [B, Q, n_heads, D]."""
    B, n_kv, GQ, D = out.shape
    return out.view(B, n_kv, GQ // Q, Q, D).permute(0, 3, 1, 2, 4).reshape(B, Q, -1, D)


def sparse_drafts(out, q, k, v, keys, values, q_index, read_row, write_row, write_column,
                  valid) -> None:
    """One layer's draft tokens: their K/V join their rows of the draft buffers, then each attends
    to its row.

    out: [T, n_heads, D] the layer's attention output (the drafts' rows are written);
    q: [T, n_heads, D]; k, v: [T, n_kv, D]; keys, values: the layer's draft buffers
    [rows + 1, n_kv, C, D]; q_index, read_row, write_row, write_column: [Bs] (`SparseBatch`);
    valid: [R + 1, n_kv, N] the layer's; read_row None (`gathered`): valid [Bs, n_kv, N], and
    each draft reads a copy of its row (write_row).
    One function, so that the fast path compiles the moves and the attention into a few
    kernels."""
    write_draft_kv(k, v, keys, values, q_index, write_row, write_column)
    rows_read, _, N = valid.shape
    if read_row is None:                      # the drafts' rows copied out: [Bs, n_kv, N, D]
        out[q_index] = sparse_attention(q[q_index], keys[write_row, :, :N],
                                        values[write_row, :, :N], valid)
        return
    queries = queries_by_row(q, q_index, read_row, rows_read)                  # [R + 1, n_heads, D]
    out[q_index] = sparse_attention(queries, keys[:rows_read, :, :N], values[:rows_read, :, :N],
                                    valid)[read_row]


def write_draft_kv(k, v, keys, values, q_index, write_row, write_column) -> None:
    """The drafts' own K/V (k, v [T, n_kv, D] at rows q_index [Bs]) into column write_column of
    row write_row [Bs] of one layer's draft buffers keys, values [rows + 1, n_kv, C, D]."""
    heads = torch.arange(keys.shape[1], device=k.device)                       # [n_kv]
    keys[write_row[:, None], heads, write_column[:, None]] = k[q_index]        # [Bs, n_kv, D]
    values[write_row[:, None], heads, write_column[:, None]] = v[q_index]


def queries_by_row(q, q_index, read_row, rows: int):
    """q [T, n_heads, D] -> [rows, n_heads, D]: each draft's query (row q_index) in its buffer row
    read_row [Bs]; zeros in the rows no draft reads."""
    queries = q.new_zeros(rows, *q.shape[1:])
    queries[read_row] = q[q_index]
    return queries


def sparse_attention(q, k, v, valid):
    """Each row's query attends to its row of the draft buffers, where the K/V lie (no gather).

    q: [R, n_heads, D]; k, v: [R, n_kv, N, D] the buffers' first N columns; valid: [R, n_kv, N]
    bool -> [R, n_heads, D]. The G query heads of a KV head read its keys in one matmul."""
    R, H, D = q.shape
    n_kv = k.shape[1]
    if k.device.type == "cpu":
        k = k.contiguous()   # the CPU's batched matmul over strided matrices is much slower
    q = q.view(R, n_kv, H // n_kv, D)                                          # [R, n_kv, G, D]
    logits = torch.matmul(q, k.transpose(-1, -2)).float() * D ** -0.5          # [R, n_kv, G, N]
    probs = logits.masked_fill(~valid[:, :, None], float("-inf")).softmax(dim=-1)
    return torch.matmul(probs.to(v.dtype), v).reshape(R, H, D)


def prepare(ctx: AttentionContext, group: int) -> None:
    """Once per forward, before the layers (the fast path's paged kernel builds its block mask
    here)."""
    if _kernels["prepare"] is not None:
        _kernels["prepare"](ctx, group)


EAGER_KERNELS = {"store": store_kv, "scores": pillar_scores, "sparse": sparse_drafts,
                 "fill": fill_draft_buffers, "paged": None, "prepare": None}
_kernels = dict(EAGER_KERNELS)   # what `attend` calls; kernels.py swaps in the fast path's
