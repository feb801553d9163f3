"""Attention in plain torch: dense over a request's whole KV, sparse over a copied set, and critical-token selection.

Owns
  * `attend(layer, q, k, v, ctx)`: the one attention call the model makes. It writes this step's K/V into the paged
    pool, then runs
      - dense attention for the requests whose tokens need the whole context (prefill chunks, verification, plain
        decoding, the `full` drafter), and the PillarAttn scores when wanted: per (layer, KV head), the attention
        probabilities averaged over chosen query rows and over the query heads of the GQA group, over positions.
        Gather-then-attend scores each layer from the keys it gathered (a verification's output and scores from one
        set of probabilities); the paged kernel keeps the layer's queries, and `finish` (once per forward, after the
        layers) scores all layers in one batched pass;
      - sparse attention for draft tokens: each draft query attends only to its request's row of the draft buffers:
        the K/V of the critical positions of its layer and KV head, copied there once per selection
        (`fill_draft_buffers`), then of every position written since the last verification (each draft writes its
        own). A draft step reads them where they lie, no gather per step: its cost is that of a decode step over
        the budget plus the window.
    Both are batched over requests and heads: no Python loop over requests x layers x heads.
  * the critical-token selection policies: `select_pillar` (top-B of the verification scores; B per request from
    `SpecConfig.budget`), `select_streaming` (StreamingLLM: sinks + most recent), used as the baseline. The first
    cycle after prefill has no verification yet: its selection comes from the attention of the prompt's last token
    in the last prefill chunk (the same score machinery, one query row instead of k + 1).
  * token lookup for `pillar-lookup` drafts: `lookup_positions` (earlier occurrences of a draft's input token and the
    positions right after them) and `merge_lookup` (they replace the lowest-ranked critical positions, same budget).
  * `compile_kernels()`: the optional torch.compile'd variant of the K/V write, the PillarAttn score pass and the
    drafts' sparse branch (`sparse_drafts`; same math, float tolerance); dense attention runs over gathered K/V
    (torch's fused SDPA, or the explicit probabilities when the scores are wanted), or, with
    `compile_kernels(paged=True)` (the GPU), `paged_dense`: compiled flex_attention reading the pool in place
    through a block mask that `prepare` builds once per step, long contexts cut into chunks (`PAGED_CHUNK`).

Must not know about scheduling or sampling; the engine builds the `AttentionContext` each step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .device import to_device


@dataclass
class DenseBatch:
    """Requests that attend densely this step, padded to Qmax query tokens and Lmax context positions, in runs."""
    q_index: torch.Tensor        # [Bd, Qmax]        row of each query token in the step's flat token list; padding
                                 #                   queries read and write the step's padding row (its last)
    q_valid: torch.Tensor        # [Bd, Qmax]  bool  real query (False: padding)
    block_table: torch.Tensor    # [Bd, Lmax / block] pool blocks holding each request's context, in order; Lmax is
                                 #                   whole blocks (padding columns: any valid block, masked)
    q_start: torch.Tensor        # [Bd]              position of each request's first query row
    runs: tuple                  # ((first request, count, mask, prefill), ...) the requests attended together, each
                                 #   run with its own mask [count, Q, L] bool = `causal_mask` of its requests: Q its
                                 #   query rows, L <= Lmax its context; `prefill`: prefill chunks, whose last row alone
                                 #   can be scored (a final chunk's). One run of the whole batch, or a step's prefill
                                 #   chunks apart from its other requests and from each other by length
                                 #   (runner.StepShape.dense_runs)
    score_weight: torch.Tensor | None = None  # [Bd, Qmax] weight of each query row in the PillarAttn score average
    scores: torch.Tensor | None = None        # [L, Bd, n_kv, Lmax] filled when score_weight is set: by attend()
                                              #   (gathered K/V) or finish() (paged kernel)
    block_mask: object | None = None          # flex_attention BlockMask over the pool, set by `prepare` (paged kernels)
    score_queries: dict = field(default_factory=dict)   # layer -> its queries [Bd, Qmax, n_heads, D], kept by the
                                                        #   paged path until finish()


def causal_mask(q_start: torch.Tensor, q_valid: torch.Tensor, context: int) -> torch.Tensor:
    """q_start: [B]; q_valid: [B, Q] bool -> [B, Q, context] bool: query row q of request b sees the positions up to
    q_start[b] + q; a padding row sees position 0 alone (a finite softmax; its output is discarded)."""
    kv_pos = torch.arange(context, device=q_valid.device)[None, None, :]                 # [1, 1, L]
    q_pos = (q_start[:, None] + torch.arange(q_valid.shape[1], device=q_valid.device))[:, :, None]   # [B, Q, 1]
    return (kv_pos <= q_pos) & (q_valid[:, :, None] | (kv_pos == 0))


@dataclass
class SparseBatch:
    """Draft tokens that attend to their request's row of the draft buffers (`AttentionContext.draft_k` / `draft_v`):
    copies of its critical positions' K/V, made once per selection (`ModelRunner.set_selections`), then the K/V
    its drafts have written since the last verification. A draft step reads them where they lie: no gather."""
    q_index: torch.Tensor        # [Bs]              row of each draft token in the step's flat token list
    read_row: torch.Tensor       # [Bs]              its row in `valid` and in the draft buffers (a padding draft: R,
                                 #                   a row no draft of the step reads)
    write_row: torch.Tensor      # [Bs]              where its own K/V go: its row of the draft buffers (a padding
    write_column: torch.Tensor   # [Bs]              draft: the scratch row) and the column there, every KV head's
    valid: torch.Tensor          # [L, R + 1, n_kv, N] bool  the buffer columns each row attends to (rows no draft
                                 #                   reads: column 0 alone, a finite softmax; their output is dropped.
                                 #                   The matmuls read all N columns of rows 0..R: in a balanced step
                                 #                   ~1 row in k + 1 verifies and is read for nothing)


@dataclass
class AttentionContext:
    k_cache: torch.Tensor        # [L, slots, n_kv, head_dim]
    v_cache: torch.Tensor        # [L, slots, n_kv, head_dim], slot = block * block_size + offset
    slot_mapping: torch.Tensor   # [T]   where this step's K/V are written
    block_size: int              # slots per pool block
    draft_k: torch.Tensor | None = None   # [L, rows + 1, n_kv, C, D] per request row: its critical positions' K/V,
    draft_v: torch.Tensor | None = None   #   then its drafts' since the last verification (`SparseBatch`)
    dense: DenseBatch | None = None
    sparse: SparseBatch | None = None


def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext | None) -> torch.Tensor:
    """q: [T, n_heads, D]; k, v: [T, n_kv, D] -> [T, n_heads, D]."""
    if ctx is None:  # reference path: one sequence, causal, no cache
        group = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
                                             v.repeat_interleave(group, 1).transpose(0, 1), is_causal=True)
        return out.transpose(0, 1)
    _kernels["store"](ctx.k_cache[layer], ctx.v_cache[layer], ctx.slot_mapping, k, v)
    out = torch.zeros_like(q)   # zeros, not empty: a padded step (cuda_graphs.py) has rows no batch writes
    if ctx.dense is not None:
        d = ctx.dense
        if d.block_mask is None:
            # Gathered a whole block at a time (block_size x n_kv x D contiguous elements per index): on the H200
            # this copy runs 8x faster than one index per (position, KV head) (h200/session3/dense_gather.py).
            blocks = ctx.k_cache.shape[1] // ctx.block_size

            def gathered(cache, table):                                                # [B, L, n_kv, D]
                return gather_rows(cache[layer].view(blocks, -1), table).view(table.shape[0], -1, *k.shape[1:])
            for first, B, mask, prefill in d.runs:
                (_, Q, L), requests = mask.shape, slice(first, first + B)
                q_index = d.q_index[requests, :Q]                                      # [B, Q]
                table = d.block_table[requests, :L // ctx.block_size]
                keys = gathered(ctx.k_cache, table)
                # a verification's scores come with its attention (`dense_attention`): from the keys just gathered,
                # not gathered again in `finish` (on the CPU a verification step of 8 x 1,024: 664-674 ms against
                # 732-824)
                weight = None if d.score_weight is None else d.score_weight[requests, :Q]   # [B, Q]
                dense_out, scores = dense_attention(q[q_index], keys, gathered(ctx.v_cache, table), mask,
                                                    None if prefill else weight)
                out[q_index.flatten()] = dense_out.flatten(0, 1)  # padding queries all land in the padding row
                if weight is None:
                    continue
                if prefill:
                    # A final prefill chunk scores its last row alone, so a chunk run scores no other (all of an
                    # 1,800-token prompt's rows cost 21 s on the CPU).
                    last = (d.q_valid[requests, :Q].sum(1, keepdim=True) - 1).clamp(min=0)   # [B, 1] each chunk's
                                                                       #   last row (row 0 for a padding request)
                    mask = mask.gather(1, last[:, :, None].expand(-1, -1, L))          # [B, 1, L]
                    scores = _kernels["scores"](q[q_index.gather(1, last)], keys, mask, weight.gather(1, last))
                d.scores[layer, requests, :, :L] = scores                              # [B, n_kv, L]
        else:   # paged kernel: attention reads the pool in place
            _kernels["paged"](out, q, d.q_index, ctx.k_cache[layer], ctx.v_cache[layer], d.block_mask)
            if d.score_weight is not None:      # scored with all layers' in `finish`
                d.score_queries[layer] = q[d.q_index]                                  # [Bd, Qmax, n_heads, D]
    if ctx.sparse is not None:
        s = ctx.sparse
        _kernels["sparse"](out, q, k, v, ctx.draft_k[layer], ctx.draft_v[layer], s.q_index, s.read_row, s.write_row,
                           s.write_column, s.valid[layer])
    return out


# Bytes the score pass of one `finish` chunk may take (the gathered keys and the logits of its layers): a verification
# step of a few dozen requests scores all layers at once; a lock-step one of 128 long requests in a few chunks.
SCORE_CHUNK_BYTES = 1 << 30


def finish(ctx: AttentionContext) -> None:
    """Once per forward, after the layers: the PillarAttn scores of every layer whose queries the paged path kept
    (`attend`; the gathered-K/V path scores each layer from the keys it gathers).

    Layer by layer, the score pass was ~8 small kernels per layer (its matmuls, reductions and the key gather): on
    the GPU they cost more in launches than in work. Here the layers go through it together, as a batch of
    layers x requests: one gather of their keys, then the same kernels once per chunk of layers. Same math per
    (layer, request) as `pillar_scores` of that layer alone. Fills ctx.dense.scores [L, Bd, n_kv, Lmax]."""
    d = ctx.dense
    if d is None or not d.score_queries:
        return
    queries, d.score_queries = d.score_queries, {}
    (_, B, mask, _), = d.runs                               # the paged kernel attends the batch as one run (`prepare`)
    _, Q, L = mask.shape
    _, slots, n_kv, D = ctx.k_cache.shape
    blocks = slots // ctx.block_size
    G = next(iter(queries.values())).shape[2] // n_kv                                 # query heads per KV head
    layer_bytes = B * L * n_kv * (D * ctx.k_cache.element_size() + 8 * G * Q)          # keys + logits (float)
    for first, n in _layer_runs(sorted(queries), max(1, SCORE_CHUNK_BYTES // layer_bytes)):
        q = torch.stack([queries[layer] for layer in range(first, first + n)])         # [n, B, Q, n_heads, D]
        # The n layers' pool blocks as rows of one table, each layer's block ids offset by its layer, so the gather
        # runs along the first dimension: CUDA's index_select of many ids is a gather, vectorised only there. Along
        # the second (the form before) it took an elementwise kernel at about a third of the bandwidth, one call per
        # chunk of layers: 0.22 ms of the embedded model's SparseSpec step, 7.6 of a Qwen3-8B-shape mixed step
        # (H200 twenty-third session; not yet timed on the GPU since).
        table = d.block_table.flatten() + blocks * torch.arange(n, device=mask.device)[:, None]   # [n, B * nb]
        k = gather_rows(ctx.k_cache[first:first + n].view(n * blocks, -1), table)
        k = k.view(n * B, L, n_kv, D)                                                    # [n*B, L, n_kv, D]
        mask_n = mask.expand(n, -1, -1, -1).flatten(0, 1)                                # [n*B, Q, L]
        weight = d.score_weight.expand(n, -1, -1).flatten(0, 1)                          # [n*B, Q]
        scores = _kernels["scores"](q.flatten(0, 1), k, mask_n, weight)                  # [n*B, n_kv, L]
        d.scores[first:first + n] = scores.view(n, B, n_kv, L)


def _layer_runs(layers: list[int], longest: int) -> list[tuple[int, int]]:
    """Sorted layer ids -> (first, count) of runs of consecutive ids, each at most `longest` long."""
    runs = []
    for layer in layers:
        if runs and runs[-1][0] + runs[-1][1] == layer and runs[-1][1] < longest:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((layer, 1))
    return runs


def store_kv(k_layer: torch.Tensor, v_layer: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Write the step's keys and values into one layer's pool: k_layer, v_layer [slots, n_kv, D]; slots [T];
    k, v [T, n_kv, D]. Compiled (`compile_kernels`), both writes are one kernel instead of two. (The layer's pool is
    passed in, not the whole cache and a layer number: compiled, a write into a slice of an input copied the whole
    slice out and back.)"""
    k_layer[slots] = k
    v_layer[slots] = v


def fill_draft_buffers(k_cache: torch.Tensor, v_cache: torch.Tensor, draft_k: torch.Tensor, draft_v: torch.Tensor,
                       block_table: torch.Tensor, block_size: int, positions: torch.Tensor, rows: torch.Tensor,
                       columns: torch.Tensor) -> None:
    """Copy the pool's K/V of positions into rows of the draft buffers, every layer and KV head at once (one read and
    one write of rows per pool).

    k_cache, v_cache: [L, slots, n_kv, D]; draft_k, draft_v: the draft buffers [L, rows + 1, n_kv, C, D];
    block_table: [B, blocks] of the requests in `rows` [B]; positions: [B, L, n_kv, n] per layer and KV head;
    columns: [B, n] where they go in each (layer, KV head) of the row.
    Rows of D through one flat index each way (`gather_rows`, `index_copy_`): on the CPU in bfloat16, indexing by
    (layer, row) index pairs took 3-6x longer (a draft step's lookups, 11,520 rows: 4.7 ms against 0.8;
    benchmarks/cpu/session22_fill.txt), and `scatter_` over indexes expanded to D copied the whole buffer at every
    call (twenty-first session); pillar-lookup copies its lookups at every draft step. Not compiled: on the H200 a
    compiled version that took the buffers whole (and viewed them inside) made the engine's steps ~1.9 ms slower on
    the embedded model (benchmarks/h200/session21/raw/engine_split_head_call5.txt), as writes through a view of an
    input copy the whole input out and back (`store_kv`)."""
    L, pool_slots, n_kv, D = k_cache.shape
    C = draft_k.shape[-2]
    slots = block_table.gather(1, (positions // block_size).flatten(1)).view_as(positions) * block_size \
        + positions % block_size                                                        # [B, L, n_kv, n]
    heads = torch.arange(n_kv, device=positions.device)[:, None]                        # [n_kv, 1]
    layers = torch.arange(L, device=positions.device)[:, None]                           # [L, 1]
    # rows of the caches viewed [L * slots * n_kv, D] and of the buffers viewed [L * (rows + 1) * n_kv * C, D]
    source = layers * pool_slots * n_kv + (slots * n_kv + heads).transpose(0, 1).reshape(L, -1)   # [L, B*n_kv*n]
    target = layers * (draft_k[0].numel() // D) \
        + ((rows[:, None, None] * n_kv + heads) * C + columns[:, None, :]).view(1, -1)            # [L, B*n_kv*n]
    for cache, buffer in ((k_cache, draft_k), (v_cache, draft_v)):
        buffer.view(-1, D).index_copy_(0, target.flatten(), gather_rows(cache.view(-1, D), source.flatten()))


def gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """table[index] for a 2-D table, each row copied whole: [rows, width], index [...] -> [..., width].

    `index_select` rather than advanced indexing, which computes an offset per element: on the CPU, in isolation, it
    gathers a plain step's blocks 4x and rows per (position, KV head) 14x faster (step_anatomy.py sparse cpu, 8 x
    1,024; drafts gathered such rows at every step before they had draft buffers); in whole CPU steps a draft got
    ~20% faster and a plain step did not change beyond the noise. Same speed on the H200.
    The rows move as integers of the elements' size: on the CPU, `index_select` of bfloat16 rows took 1.2-6x as long
    as of the same bytes viewed as int16 (the most for tables the cache holds), of float32 rows up to 3.7x as long as
    viewed as int32 (benchmarks/cpu/session22_gather_dtype.txt); a plain step of 8 x 4,096 spent 29-40 ms in it
    against 54 (benchmarks/cpu/step_ops.py plain 8 4096 bfloat16, profiled beside another job)."""
    raw = table.view(_SAME_SIZE_INTEGER[table.element_size()])
    return raw.index_select(0, index.flatten()).view(table.dtype).view(*index.shape, table.shape[1])


_SAME_SIZE_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}   # element bytes -> dtype


def dense_attention(q, k, v, mask, score_weight=None):
    """Padded dense attention with GQA, optionally returning PillarAttn scores.

    q: [B, Q, n_heads, D]; k, v: [B, L, n_kv, D]; mask: [B, Q, L] bool; score_weight: [B, Q] or None
    -> out [B, Q, n_heads, D], scores [B, n_kv, L] (sum over rows of weight x probability, averaged over the group)

    Without scores, torch's fused SDPA. The G query heads of a KV head are packed into one block of G x Q rows, so
    the kernel reads each KV head once for all of them instead of once per query head: on the H200 a 128 x 2,048
    verification's attention took 0.124 ms per layer packed against 0.296 with SDPA's own GQA
    (benchmarks/h200/session4/step_anatomy.py sdpa). A single row (plain decoding, drafts of the dense methods) is
    packed too: on the CPU in bfloat16 SDPA's own GQA took 7.4 ms per layer of 8 x 1,024 against 1.0 packed (float32:
    1.04 against 0.96; BENCHMARKS.md, CPU sixteenth session). (The H200's eager path ran a single row faster unpacked,
    0.082 against 0.114 ms; its fast path reads the pool with `paged_dense` instead.)
    With scores (a verification), the explicit probabilities the scores need give the output too (probabilities x V)
    instead of SDPA computing the logits a second time. Their logits are float32 whatever the inputs' dtype, as
    SDPA's are (from bfloat16 logits the output's mean error against float64 doubled). On one CPU thread, one layer
    of 8 x 4,096 in bfloat16: 20.1 ms against 24.5 for SDPA + `pillar_scores`, the same error as SDPA's
    (benchmarks/cpu/scored_attention.py).
    """
    B, Q, H, _ = q.shape
    L, n_kv = k.shape[1], k.shape[2]
    if score_weight is not None:
        probs = attention_probs(q.float(), k.float(), mask)                            # [B, n_kv, G, Q, L]
        packed_probs = probs.to(v.dtype).view(B, n_kv, -1, L)                          # [B, n_kv, G*Q, L]
        out = torch.stack([torch.bmm(packed_probs[:, h], v[:, :, h]) for h in range(n_kv)], dim=1)
        return _unpack_groups(out, Q), weighted_scores(probs, score_weight)           # out [B, n_kv, G*Q, D]
    packed_mask = mask[:, None, None].expand(B, 1, H // n_kv, Q, L).reshape(B, 1, -1, L)   # [B, 1, G*Q, L]
    out = F.scaled_dot_product_attention(_pack_groups(q, n_kv), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=packed_mask)                             # [B, n_kv, G*Q, D]
    return _unpack_groups(out, Q), None


def _unpack_groups(out, Q):
    """The inverse of `_pack_groups`: [B, n_kv, G * Q, D] -> [B, Q, n_heads, D]."""
    B, n_kv, GQ, D = out.shape
    return out.view(B, n_kv, GQ // Q, Q, D).permute(0, 3, 1, 2, 4).reshape(B, Q, -1, D)


def _pack_groups(q, n_kv):
    """[B, Q, n_heads, D] -> [B, n_kv, G * Q, D]: per KV head, the rows of its G query heads, ordered (head, query);
    query head h belongs to KV head h // G (the grouping SDPA's enable_gqa uses)."""
    B, Q, H, D = q.shape
    return q.view(B, Q, n_kv, H // n_kv, D).permute(0, 2, 3, 1, 4).reshape(B, n_kv, -1, D)


def pillar_scores(q, k, mask, score_weight):
    """Attention probabilities summed over query rows (weighted) and averaged over each GQA group -> [B, n_kv, L].

    Eager (the CPU), torch's fused softmax: 15.9 ms per layer of 8 x 4,096 in bfloat16 against 30.5 for
    exp(logit - logsumexp), whose logsumexp makes passes of its own over the logits (float32: 12.6 against 16.7;
    benchmarks/cpu/score_forms.py). `compile_kernels` compiles it as one graph."""
    return weighted_scores(attention_probs(q, k, mask), score_weight)


def weighted_scores(probs, score_weight):
    """probs [B, n_kv, G, Q, L] (`attention_probs`), score_weight [B, Q] -> [B, n_kv, L]: each row's probabilities
    times its weight, summed over rows, averaged over the G query heads of each KV head."""
    weight = score_weight.float()[:, None, None, :, None] / probs.shape[2]             # [B, 1, 1, Q, 1]
    return (probs * weight).sum(dim=(2, 3))


def attention_probs(q, k, mask):
    """Explicit float32 attention probabilities, grouped by KV head -> [B, n_kv, G, Q, L] (G query heads per KV head)."""
    return attention_logits(q, k, mask).softmax(dim=-1)


def attention_logits(q, k, mask):
    """Scaled float32 attention logits, grouped by KV head, -inf where masked.

    q: [B, Q, n_heads, D]; k: [B, L, n_kv, D]; mask: [B, Q, L] bool -> [B, n_kv, G, Q, L]
    One matmul per KV head reads that head's keys where they lie in k (a single batched matmul over (B, n_kv) would
    first copy k into head-major order: 2.6 of a verification's 34 ms on the H200, step_anatomy.py kernels); q is
    scaled before the matmuls.
    """
    B, Q, H, D = q.shape
    n_kv = k.shape[2]
    packed = _pack_groups(q * D ** -0.5, n_kv)                                         # [B, n_kv, G*Q, D]
    logits = torch.stack([torch.bmm(packed[:, h], k[:, :, h].transpose(1, 2)) for h in range(n_kv)], dim=1)
    logits = logits.float().view(B, n_kv, H // n_kv, Q, -1)                           # [B, n_kv, G, Q, L]
    return logits.masked_fill(~mask[:, None, None], float("-inf"))


def sparse_drafts(out, q, k, v, keys, values, q_index, read_row, write_row, write_column, valid) -> None:
    """One layer's draft tokens: their K/V join their rows of the draft buffers, then each attends to its row.

    out: [T, n_heads, D] the layer's attention output, the drafts' rows written here; q: [T, n_heads, D]; k, v:
    [T, n_kv, D] the step's; keys, values: the layer's draft buffers [rows + 1, n_kv, C, D]; q_index, read_row,
    write_row, write_column: [Bs] (`SparseBatch`); valid: [R + 1, n_kv, N] the layer's.
    One function, so that `compile_kernels` makes the drafts' moves (the write, the queries to their rows and the
    outputs back) a few kernels with the attention's instead of ~8 small ones per layer. (The buffers are passed in
    whole and written by index, not through a view taken here: see `store_kv`.)"""
    heads = torch.arange(keys.shape[1], device=q.device)                               # [n_kv]
    keys[write_row[:, None], heads, write_column[:, None]] = k[q_index]                # [Bs, n_kv, D]
    values[write_row[:, None], heads, write_column[:, None]] = v[q_index]
    rows_read, _, N = valid.shape
    queries = q.new_zeros(rows_read, *q.shape[1:])                                     # [R + 1, n_heads, D]
    queries[read_row] = q[q_index]
    out[q_index] = sparse_attention(queries, keys[:rows_read, :, :N], values[:rows_read, :, :N], valid)[read_row]


def sparse_attention(q, k, v, valid):
    """Each draft attends to its row of the draft buffers, where the K/V lie (no gather).

    q: [R, n_heads, D] a query per row; k, v: [R, n_kv, N, D] one layer's draft buffers, their first N columns;
    valid: [R, n_kv, N] bool the columns each (row, KV head) attends to -> [R, n_heads, D]
    The G query heads of a KV head read its keys in one matmul (batched over rows x KV heads: each (row, KV head)'s
    columns are contiguous, so no copy is made; but see the CPU's below).
    """
    R, H, D = q.shape
    n_kv = k.shape[1]
    if k.device.type == "cpu":
        # The CPU's batched matmul of q @ k^T over matrices that lie apart (N of a row's C columns) takes a path 4x
        # slower than over a packed copy; the copy costs less than the difference (a layer of the embedded model at
        # batch 8: 200 -> 122 us; benchmarks/cpu/session22_strided_matmul.txt). The GPU's does not care.
        k = k.contiguous()
    q = q.view(R, n_kv, H // n_kv, D)                                                  # [R, n_kv, G, D]
    logits = torch.matmul(q, k.transpose(-1, -2)).float() * D ** -0.5                  # [R, n_kv, G, N]
    probs = logits.masked_fill(~valid[:, :, None], float("-inf")).softmax(dim=-1)
    return torch.matmul(probs.to(v.dtype), v).reshape(R, H, D)


# The kernels `attend` calls; "paged" is None unless the paged path is on (see `prepare`).
_kernels = {"store": store_kv, "scores": pillar_scores, "sparse": sparse_drafts, "paged": None}


def compile_kernels(paged: bool = False) -> None:
    """Swap in torch.compile'd versions of the K/V write, the score pass and the sparse kernel (dynamic shapes; same
    results within float tolerance), and with `paged` the paged dense kernels (static shapes: flex_attention's decoding
    kernel wants them; one compilation per padded step shape, hence the higher recompile limit). Made for the GPU: the
    sparse kernel as matmuls, compiled, ran a 112-draft step's 30 layers in 0.90 ms on the H200 (then with its
    gathers) against 2.96 eager and 2.37 for a fused form of elementwise products that the compiler turned into two
    reductions (benchmarks/h200/session6/sparse_kernel.py; at a Qwen3-8B draft's shape such forms, reading the pool in
    place, were 2.5-2.8x slower than gathers + matmuls: benchmarks/h200/session21/sparse_forms.py, which is why drafts
    got draft buffers instead); on the CPU compiled kernels were not faster
    (step_anatomy.py sparse cpu), and torch 2.13's CPU compiler failed on the paged kernel's verification shape
    (benchmarks/h200/session5/paged.py ... cpu). Without `paged`, dense attention over gathered K/V stays eager
    (compiled, SDPA ran 2x slower than cuDNN's on the H200: BENCHMARKS.md, H200 second session). The score pass
    compiles as one graph: the fifteenth session's two stages (logits from one block-diagonal matmul, then the rows
    summed one at a time) were faster for one layer of 128 x 6,144 alone, but in the engine's steps no faster (H200
    sixteenth session)."""
    _kernels["store"] = torch.compile(store_kv, dynamic=True)
    _kernels["scores"] = torch.compile(pillar_scores, dynamic=True)
    _kernels["sparse"] = torch.compile(sparse_drafts, dynamic=True)
    if paged:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
        _kernels["paged"] = _compiled_paged_dense()


def _compiled_paged_dense():
    """`paged_dense` compiled for static shapes but one: the step's token rows T (of `out` and `q`). The dense batch's
    shape fixes the kernel, but T also counts a step's sparse drafts: compiled once per T, SparseSpec's rows on the
    H200 compiled for 272 s (136 graphs) where the twelfth session's, which compiled `paged_attention` alone, took
    97 s (150 graphs)."""
    compiled = torch.compile(paged_dense, dynamic=False)

    def paged(out, q, *rest):
        torch._dynamo.maybe_mark_dynamic(out, 0)
        torch._dynamo.maybe_mark_dynamic(q, 0)
        compiled(out, q, *rest)
    return paged


def use_eager_kernels() -> None:
    _kernels.update(store=store_kv, scores=pillar_scores, sparse=sparse_drafts, paged=None)


def use_paged_reference() -> None:
    """The paged path with uncompiled flex_attention (torch's reference math over the whole pool: tiny pools only),
    so the CPU tests check the block mask that the compiled GPU kernel relies on."""
    _kernels["paged"] = paged_dense


# ----------------------------------------------------------------------------------------------------------------------
# Critical-token selection. A selection is a LongTensor of positions [L, n_kv, n] for one request, n <= its budget;
# every (layer, KV head) selects the same number of positions, so selections batch without ragged padding per head.

def select_pillar(scores: torch.Tensor, context_len, budget) -> list[torch.Tensor]:
    """PillarAttn: per (layer, KV head), the top-B positions of the verification scores.

    scores: [L, B, n_kv, Lmax] (averaged attention probabilities); context_len: B ints, the positions that stay in the
    cache (later columns are rejected drafts or padding); budget: B ints -> per request [L, n_kv, min(B_b, len_b)].
    Ties break towards the lower position, so the selection is deterministic: a top-k of int64 keys, a score's float32
    bits above (a non-negative float's bits order like its value; -inf's sign bit puts it below them) and its
    position's complement below, picks and orders what a stable descending sort would: on one CPU thread, 30 layers
    of 8 requests, 8 against 31 ms at 1,024 positions and 33 against 153 at 4,096 (benchmarks/cpu/select_topk.py);
    on the H200, 128 verifications, 3.17 against 5.54 ms at 6,144 positions but 1.33 against 0.82 at 2,048
    (benchmarks/h200/session14/verify_split.py). The counts are host ints, so nothing here waits for the device.
    """
    context, budget = [int(c) for c in context_len], [int(b) for b in budget]
    Lmax = scores.shape[-1]
    columns = torch.arange(Lmax, device=scores.device)
    in_context = columns[None, :] < to_device(context, torch.long, scores.device)[:, None]          # [B, Lmax]
    masked = scores.float().masked_fill(~in_context[None, :, None, :], float("-inf"))
    keys = (masked.view(torch.int32).long() << 32) | (0xFFFFFFFF - columns)                         # [L, B, n_kv, Lmax]
    k = min(max(budget), Lmax)
    order = keys.topk(k, dim=-1).indices                                                            # [L, B, n_kv, k]
    return [order[:, b, :, :min(budget[b], context[b])] for b in range(len(context))]


def select_streaming(context_len: int, budget: int, sink_tokens: int, num_layers: int, num_kv_heads: int,
                     device=None) -> torch.Tensor:
    """StreamingLLM: the first `sink_tokens` positions plus the most recent ones, `budget` in all -> [L, n_kv, n]."""
    if context_len <= budget:
        positions = torch.arange(context_len, device=device)
    else:
        sinks = min(sink_tokens, budget)
        recent = budget - sinks
        positions = torch.cat([torch.arange(sinks, device=device),
                               torch.arange(context_len - recent, context_len, device=device)])
    return positions.expand(num_layers, num_kv_heads, -1)


# ----------------------------------------------------------------------------------------------------------------------
# Token lookup (method "pillar-lookup"): a selection made at the last verification goes stale during drafting, and
# most of what it misses is what two kinds of heads want: duplicate-token heads attend to earlier occurrences p of the
# current token, induction heads to the position p + 1 right after one. Both follow from the draft's input token
# alone, so at every draft step the latest few such positions replace the lowest-ranked critical positions: the
# positions a draft attends to change, their number (the budget) does not.

def lookup_positions(context_tokens: torch.Tensor, tokens: torch.Tensor, context_len: torch.Tensor, matches: int,
                     prev_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Earlier positions p holding each draft's input token, and p + 1 after each: `matches` of them per draft.

    context_tokens: [B, Lc] token at each position (read only below context_len); tokens: [B] the drafts' input
    tokens; context_len: [B] verified positions (device tensor); prev_tokens: [B] the tokens just before the drafts'
    inputs, or None. Which p: latest first; with prev_tokens, the p whose previous token matches too (a bigram
    match, the likelier copy source) come before all others.
    -> positions [B, 2 * matches] ordered (p0, p0 + 1, p1, p1 + 1, ...), valid [B, 2 * matches] bool: p found,
    p + 1 inside the verified context (later positions are in the draft's recent window anyway), and not already
    listed earlier in the row.
    """
    B, Lc = context_tokens.shape
    pos = torch.arange(Lc, device=context_tokens.device)
    hit = (context_tokens == tokens[:, None]) & (pos[None, :] < context_len[:, None])             # [B, Lc]
    key = torch.where(hit, pos + 1, 0)                                                             # 0: no hit
    if prev_tokens is not None:
        follows = F.pad(context_tokens[:, :-1] == prev_tokens[:, None], (1, 0), value=False)     # [B, Lc]
        key = key + (hit & follows) * Lc                                   # bigram hits rank above all others
    top = key.topk(min(matches, Lc), dim=1).values                                                 # [B, m]
    if top.shape[1] < matches:
        top = F.pad(top, (0, matches - top.shape[1]))
    found = (top - 1) % Lc                                                                          # p (junk if none)
    positions = torch.stack([found, found + 1], dim=-1).flatten(1)                                 # [B, 2m]
    valid = torch.stack([top > 0, (top > 0) & (found + 1 < context_len[:, None])], dim=-1).flatten(1)
    earlier = torch.ones(2 * matches, 2 * matches, dtype=torch.bool, device=pos.device).tril(-1)   # [j, i]: i < j
    repeated = ((positions[:, :, None] == positions[:, None, :]) & valid[:, None, :] & earlier).any(-1)
    return positions, valid & ~repeated


def kept_beside_lookups(selection: torch.Tensor, selection_len: torch.Tensor, lookup: torch.Tensor,
                        lookup_valid: torch.Tensor) -> torch.Tensor:
    """Which critical positions a pillar-lookup draft keeps beside its lookups, so that their number stays the budget.

    selection: [B, L, n_kv, N] critical positions in rank order (best first, as `select_pillar` returns them), the
    first selection_len [B] of them real; lookup, lookup_valid: [B, M] from `lookup_positions`.
    Per (layer, KV head): drop the positions the lookup already holds, then the lowest-ranked others, so that the
    kept ones plus the valid lookups number exactly selection_len again -> keep [B, L, n_kv, N] bool."""
    N = selection.shape[-1]
    held = ((selection[..., None] == lookup[:, None, None, None, :])
            & lookup_valid[:, None, None, None, :]).any(-1)                                        # [B, L, n_kv, N]
    kept_len = selection_len - lookup_valid.sum(1)                                                 # [B]
    real = torch.arange(N, device=selection.device)[None, :] < selection_len[:, None]              # [B, N]
    keep = ~held & real[:, None, None, :]
    return keep & (keep.cumsum(-1) <= kept_len[:, None, None, None])


def merge_lookup(selection: torch.Tensor, selection_len: torch.Tensor, lookup: torch.Tensor,
                 lookup_valid: torch.Tensor) -> torch.Tensor:
    """The positions a pillar-lookup draft attends to besides its window, as one list (the engine's drafts attend to
    the same set from their draft buffers: `kept_beside_lookups`' columns, then the lookups' own).

    Arguments as `kept_beside_lookups` -> merged [B, L, n_kv, N]: the kept positions in rank order, then the valid
    lookups in lookup order, selection_len of them in all (the rest is padding)."""
    B, L, n_kv, N = selection.shape
    keep = kept_beside_lookups(selection, selection_len, lookup, lookup_valid)
    target = torch.where(keep, keep.cumsum(-1) - 1, N)                    # kept -> front; dropped -> a spare column
    merged = torch.zeros(B, L, n_kv, N + 1, dtype=selection.dtype, device=selection.device)
    merged.scatter_(-1, target, selection)
    # the valid lookups follow the kept ones: column kept_len + their rank among the valid ones (< selection_len)
    kept_len = selection_len - lookup_valid.sum(1)                                                 # [B]
    after = torch.where(lookup_valid, kept_len[:, None] + lookup_valid.cumsum(1) - 1, N)          # [B, M]
    M = lookup.shape[1]
    merged.scatter_(-1, after[:, None, None, :].expand(B, L, n_kv, M), lookup[:, None, None, :].expand(B, L, n_kv, M))
    return merged[..., :N]


# ----------------------------------------------------------------------------------------------------------------------
# Paged dense attention (the `compile_kernels(paged=True)` path, for the GPU): flex_attention reads each request's
# context where it lies in the pool instead of a gathered copy. Uncompiled, flex_attention is torch's reference
# implementation, which materialises scores over the whole pool: the tests run it on tiny pools.

# The paged kernel cuts contexts into chunks of at most this many positions, each a CTA's work (`paged_block_mask`).
# On the H200 (benchmarks/h200/session12/flex_split.py: one layer, us per call, whole contexts -> chunks of 7 blocks of
# 64, contexts of up to 21 blocks): 8 / 16 / 32 verifications (Q = 9) 33.2 / 37.3 / 34.8 -> 21.7 / 28.4 / 29.7;
# 64 / 128 plain decoding rows 40.4 / 51.8 -> 22.2 / 45.1. Up to 36 blocks: 16 verifications 59.1 -> 29.3 (4 chunks)
# and 27.2 (6), 128 plain rows 85.2 -> 74.2 and 72.6 (69.8 at 3).
PAGED_CHUNK = 512
# The decoding kernel's Triton settings. torch's default on the H200 (sm_90) is one pipeline stage and 2 warps (its
# heuristic picks 3 stages for sm_90, and the `else` of the next test sets 1 again, in torch 2.11 and 2.13): with one
# stage a block's loads do not overlap the previous block's math. Two stages, measured on one layer
# (benchmarks/h200/session13/flex_options.py, us per call, default -> these): 128 plain rows 47.1 -> 31.8 (contexts
# up to 1,300) and 73.4 -> 52.9 (up to 2,300); 16 / 32 verifications 25.4 / 29.5 -> 19.7 / 23.8. The best setting
# of those tried was within 1.6 us of this one everywhere.
PAGED_KERNEL_OPTIONS = {"num_stages": 2, "num_warps": 2}


def prepare(ctx: AttentionContext, group: int) -> None:
    """Once per forward, before the layers: the block mask of the paged kernels, for dense batches whose G x Qmax
    packed rows (`group` query heads per KV head) fit flex_attention's decoding kernel (plain decoding,
    verification) and that attend as one run; prefill chunks keep gather + SDPA."""
    d = ctx.dense
    if _kernels["paged"] is None or d is None or len(d.runs) > 1 or group * d.q_index.shape[1] >= 128:
        return
    (_, _, mask, _), = d.runs
    blocks, chunk_blocks = d.block_table.shape[1], max(1, PAGED_CHUNK // ctx.block_size)
    d.block_mask = paged_block_mask(d.block_table, mask, d.q_start, d.q_valid, ctx.block_size,
                                    ctx.k_cache.shape[1], group, splits=-(-blocks // chunk_blocks))


def paged_block_mask(block_table, mask, q_start, q_valid, block_size: int, pool_slots: int, group: int,
                     splits: int = 1):
    """The flex_attention BlockMask that lets packed row (g, q) of request b see exactly mask[b, q, :] of its context.

    block_table: [B, nb]; mask: [B, Q, nb * block_size] bool; q_start: [B]; q_valid: [B, Q] bool.
    The key/value sequence is one layer's whole pool (pool_slots positions, shared by every request). Each request
    lists its pool blocks: `full` ones (every real row sees all of it: the mask is not evaluated there) and `partial`
    ones (the causal edge), where `visible` evaluates the mask's rule from the position: `rank` is a pool block's
    block number within its request, `owner` the request (checked, so the rule holds over the whole pool as
    flex_attention's contract wants, not only on the listed blocks). The padding requests of a padded step
    (cuda_graphs.py) all list the scratch block, which gets one owner: the others see nothing, and their rows are
    discarded. Built on the device, no host sync.

    With `splits` > 1 each request's context is cut into that many chunks of consecutive blocks, and flex_attention
    sees each chunk as a request of its own: mask entry b * splits + s is chunk s of request b (`paged_attention`
    merges the chunks). Why: its decoding kernel gives a (request, KV head) one CTA per split of the key sequence,
    which here is the whole pool, so a request's blocks all fall to one CTA and a verification of 16 requests kept
    48 CTAs busy on the H200's 132 SMs (benchmarks/h200/session12/flex_split.py)."""
    from torch.nn.attention.flex_attention import BlockMask

    B, Q, L = mask.shape
    nb, pool_blocks = L // block_size, pool_slots // block_size
    chunk = -(-nb // splits)                                                           # blocks per chunk
    seen = mask.view(B, Q, nb, block_size)
    used = seen.any(-1).any(1)                                                         # [B, nb]
    full = used & (seen.all(-1) | ~q_valid[:, :, None]).all(1)                         # [B, nb]
    target = torch.where(used, block_table, pool_blocks).flatten()                     # unused columns: a dump entry
    rank = torch.zeros(pool_blocks + 1, dtype=torch.long, device=mask.device)
    rank.scatter_(0, target, torch.arange(nb, device=mask.device).repeat(B))
    owner = torch.full((pool_blocks + 1,), -1, dtype=torch.long, device=mask.device)
    owner.scatter_(0, target, torch.arange(B, device=mask.device).repeat_interleave(nb))

    def visible(b, h, q_idx, kv_idx):     # b: a chunk b * splits + s; q_idx: a packed row g * Q + q (paged_attention)
        request, block, row = b // splits, kv_idx // block_size, q_idx % Q
        position = rank[block] * block_size + kv_idx % block_size
        return ((owner[block] == request) & (rank[block] // chunk == b % splits)
                & (position <= q_start[request] + row) & (q_valid[request, row] | (position == 0)))

    def by_chunk(x):      # [B, nb] -> [B * splits, chunk] (padding columns: 0 / False)
        return F.pad(x, (0, splits * chunk - nb)).view(B * splits, chunk)

    def listed(which):    # [B, nb] bool -> per chunk: counts [B*S, 1, 1], its block ids first [B*S, 1, 1, pool_blocks]
        which, table = by_chunk(which), by_chunk(block_table)
        order = torch.argsort((~which).to(torch.int8), dim=1, stable=True)
        # BlockMask's contract: one column per KV block (a padded table can be wider than the pool)
        ids = torch.zeros(B * splits, 1, 1, pool_blocks, dtype=torch.int32, device=mask.device)
        width = min(chunk, pool_blocks)
        ids[:, 0, 0, :width] = table.gather(1, order)[:, :width]
        return which.sum(1, dtype=torch.int32)[:, None, None], ids

    q_tile = -(-group * Q // 128) * 128
    return BlockMask.from_kv_blocks(*listed(used & ~full), *listed(full), BLOCK_SIZE=(q_tile, block_size),
                                    mask_mod=visible, seq_lengths=(group * Q, pool_slots), compute_q_blocks=False)


def paged_dense(out, q, q_index, k_layer, v_layer, block_mask) -> None:
    """The dense batch's paged attention, from and into the step's token rows: out[q_index] = paged attention of
    q[q_index]. out, q: [T, n_heads, D]; q_index: [Bd, Qmax]. Compiled as one function, the queries' gather fuses
    with the kernel's packing of them, and the output's scatter with the merge of the chunks: two kernels per layer
    fewer than gathering and scattering around a compiled `paged_attention`."""
    out[q_index.flatten()] = paged_attention(q[q_index], k_layer, v_layer, block_mask).flatten(0, 1)


def paged_attention(q, k_layer, v_layer, block_mask, kernel_options: dict = PAGED_KERNEL_OPTIONS):
    """q: [B, Q, n_heads, D]; k_layer, v_layer: [slots, n_kv, D] one layer's pool -> [B, Q, n_heads, D].

    The G query heads of a KV head are packed into G x Q rows (as `dense_attention` does for SDPA): flex_attention
    then sees one query head per KV head, which lets it use its decoding kernel (it needs a power-of-two group; the
    embedded model's is 3). That kernel's tiles are at most one pool block: blocks of 16 positions made it slower
    than gather + SDPA on the H200, blocks of 64 1.7x faster (benchmarks/h200/session5/paged.py). A block mask
    made with splits S > 1 has B * S entries, one per chunk of a context: the chunks' outputs are averaged weighted
    by the softmax of their logsumexps, which is attention over the whole context. `kernel_options` go to the
    compiled kernel (`PAGED_KERNEL_OPTIONS`; the uncompiled reference ignores them)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    B, Q = q.shape[:2]
    keys, values = k_layer.permute(1, 0, 2)[None], v_layer.permute(1, 0, 2)[None]    # [1, n_kv, slots, D]
    packed = _pack_groups(q, k_layer.shape[1])                                        # [B, n_kv, G*Q, D]
    splits = block_mask.kv_num_blocks.shape[0] // B
    if splits == 1:
        return _unpack_groups(flex_attention(packed, keys, values, block_mask=block_mask,
                                             kernel_options=kernel_options), Q)
    # one request per chunk of each request's context (`paged_block_mask`), merged by their logsumexps
    out, aux = flex_attention(packed.repeat_interleave(splits, 0), keys, values, block_mask=block_mask,
                              return_aux=AuxRequest(lse=True), kernel_options=kernel_options)   # [B * S, n_kv, G*Q, D]
    # [B, S, n_kv, G*Q]; a row that sees nothing (a padding request's) has no finite logsumexp: weights 0, out 0
    weight = aux.lse.view(B, splits, *packed.shape[1:3]).softmax(dim=1).nan_to_num()
    out = (out.view(B, splits, *packed.shape[1:]).float() * weight[..., None]).sum(1)  # [B, n_kv, G*Q, D]
    return _unpack_groups(out.to(q.dtype), Q)
