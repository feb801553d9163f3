"""attention.py, pillar_attn.py, kernels.py, paged.py: dense / sparse attention kernels against explicit loop references, the attend() dispatcher, and the
critical-token selection policies (PillarAttn top-B, StreamingLLM sink + recent)."""
import itertools
import math
import os
import shutil

import pytest
import torch

from nano_sparsespec import attention, embedded, kernels, lookup, swapped_scores
from nano_sparsespec import paged as paged_kernel
from nano_sparsespec.attention import (AttentionContext, DenseBatch, SparseBatch, attend, dense_attention,
                                       sparse_attention)
from nano_sparsespec.pillar_attn import (attention_logits, kept_beside, pillar_scores, ring_ranks, select_pillar,
                                         select_streaming, spans_kept_first)
from nano_sparsespec.tools.measure import CompiledFrames

H, N_KV, D = 4, 2, 8          # GQA: 4 query heads share 2 KV heads (group of 2)
G = H // N_KV
TOL = 1e-5


@pytest.fixture(autouse=True)
def eager_kernels():
    kernels.use_eager_kernels()
    yield
    kernels.use_eager_kernels()


def softmax_row(logits):
    """Plain softmax of a python list of floats (no torch), for the references."""
    m = max(logits)
    e = [math.exp(x - m) for x in logits]
    s = sum(e)
    return [x / s for x in e]


# --------------------------------------------------------------------------------------------------------------------
# References written with loops: one request, one head, one query row at a time.

def ref_attention_row(q_vec, keys, values, allowed):
    """q_vec [D]; keys, values [L, D]; allowed: list of positions -> (out [D], probs [L] with zeros elsewhere)."""
    q64, k64, v64 = q_vec.double(), keys.double(), values.double()
    logits = [float(q64 @ k64[p]) / math.sqrt(q_vec.shape[0]) for p in allowed]
    p = softmax_row(logits)
    probs = torch.zeros(keys.shape[0], dtype=torch.float64)
    for pos, w in zip(allowed, p):
        probs[pos] = w
    return probs @ v64, probs


def make_padded_batch(q_lens, ctx_lens, seed=0):
    """Queries are the last q_len positions of a context of ctx_len; padding rows may see position 0 only."""
    g = torch.Generator().manual_seed(seed)
    B, Qmax, Lmax = len(q_lens), max(q_lens), max(ctx_lens)
    q = torch.randn(B, Qmax, H, D, generator=g) * 2
    k = torch.randn(B, Lmax, N_KV, D, generator=g) * 2
    v = torch.randn(B, Lmax, N_KV, D, generator=g)
    mask = torch.zeros(B, Qmax, Lmax, dtype=torch.bool)
    q_valid = torch.zeros(B, Qmax, dtype=torch.bool)
    for b, (ql, cl) in enumerate(zip(q_lens, ctx_lens)):
        for i in range(Qmax):
            if i < ql:
                q_valid[b, i] = True
                pos = cl - ql + i
                mask[b, i, :pos + 1] = True
            else:
                mask[b, i, 0] = True
    return q, k, v, mask, q_valid


def ref_dense(q, k, v, q_lens, ctx_lens, weight):
    B, Qmax = q.shape[:2]
    Lmax = k.shape[1]
    out = torch.zeros(B, Qmax, H, D, dtype=torch.float64)
    scores = torch.zeros(B, N_KV, Lmax, dtype=torch.float64)
    for b in range(B):
        ql, cl = q_lens[b], ctx_lens[b]
        for h in range(H):
            j = h // G                                       # KV head of query head h
            for i in range(ql):
                pos = cl - ql + i
                o, p = ref_attention_row(q[b, i, h], k[b, :, j], v[b, :, j], list(range(pos + 1)))
                out[b, i, h] = o
                scores[b, j] += float(weight[b, i]) * p / G
    return out, scores


def test_dense_attention_matches_loop_reference():
    q_lens, ctx_lens = [3, 1, 5], [7, 4, 9]
    q, k, v, mask, q_valid = make_padded_batch(q_lens, ctx_lens)
    # score weights: all rows of request 0, the last row of request 1, rows 1 and 4 of request 2 (0 on padding)
    weight = torch.zeros(3, 5)
    weight[0, :3] = 1 / 3
    weight[1, 0] = 1.0
    weight[2, 1] = weight[2, 4] = 0.5
    out, scores = dense_attention(q, k, v, mask), pillar_scores(q, k, mask, weight)
    ref_out, ref_scores = ref_dense(q, k, v, q_lens, ctx_lens, weight)
    assert out.shape == (3, 5, H, D) and scores.shape == (3, N_KV, 9)
    assert torch.allclose(out[q_valid].double(), ref_out[q_valid], atol=TOL)
    assert torch.allclose(scores.double(), ref_scores, atol=TOL)
    assert not torch.isnan(out[q_valid]).any()
    # the scores of each request are a probability distribution over its context (weights sum to 1)
    assert torch.allclose(scores.sum(-1), torch.ones(3, N_KV), atol=TOL)
    for b, cl in enumerate(ctx_lens):
        assert (scores[b, :, cl:] == 0).all()


def test_dense_attention_single_rows_match_loop_reference():
    """Plain decoding's shape, one query row per request (packed like a verification's rows), in float32 and
    bfloat16."""
    q_lens, ctx_lens = [1, 1, 1], [7, 4, 9]
    q, k, v, mask, _ = make_padded_batch(q_lens, ctx_lens, seed=5)
    ref_out, _ = ref_dense(q, k, v, q_lens, ctx_lens, torch.zeros(3, 1))
    out = dense_attention(q, k, v, mask)
    assert out.shape == (3, 1, H, D) and torch.allclose(out.double(), ref_out, atol=TOL)
    out_bf16 = dense_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    assert torch.allclose(out_bf16.double(), ref_out, atol=0.05)


def test_dense_attention_mha_and_bfloat16():
    q_lens, ctx_lens = [2, 4], [6, 4]
    q, k, v, mask, q_valid = make_padded_batch(q_lens, ctx_lens, seed=3)
    # MHA: as many KV heads as query heads -> repeat each KV head so the GQA reference applies
    k4, v4 = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)
    out_mha = dense_attention(q, k4, v4, mask)
    out_gqa = dense_attention(q, k, v, mask)
    assert torch.allclose(out_mha[q_valid], out_gqa[q_valid], atol=TOL)
    out_bf16 = dense_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    assert out_bf16.dtype == torch.bfloat16
    assert torch.allclose(out_bf16[q_valid].float(), out_gqa[q_valid], atol=0.1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_attends_alike_whatever_its_neighbours_and_padding(dtype):
    """Greedy speculation in bfloat16 is lossless only if a verification row (one of k + 1 rows of its request, in a
    batch of others, padded to the widest context) gets the bits of the decode row of its position (one row, alone,
    unpadded): dense attention's arithmetic per row must not depend on Q, B or the padded width."""
    g = torch.Generator().manual_seed(7)
    ctx = 150                                                # the verified context: rows at positions 141..149
    q = (torch.randn(1, 9, H, D, generator=g) * 2).to(dtype)
    k, v = ((torch.randn(1, 300, N_KV, D, generator=g) * 2).to(dtype) for _ in range(2))
    verify_mask = torch.arange(300)[None, None, :] <= torch.arange(ctx - 9, ctx)[None, :, None]   # [1, 9, 300]
    # the verification: 9 rows, beside a request with a longer context, padded to 300 positions
    other = torch.ones(1, 9, 300, dtype=torch.bool)
    verified = dense_attention(torch.cat([q, q.flip(1)]), torch.cat([k, k.flip(1)]), torch.cat([v, v.flip(1)]),
                               torch.cat([verify_mask, other]))[0]
    for row in range(9):                                     # each row decoded alone over exactly its context
        length = ctx - 9 + row + 1
        decoded = dense_attention(q[:, row:row + 1], k[:, :length], v[:, :length],
                                  torch.ones(1, 1, length, dtype=torch.bool))[0, 0]
        assert torch.equal(decoded, verified[row]), row


def test_dense_attention_head_to_kv_group_mapping():
    """Query head h must read KV head h // G (transformers' repeat_interleave convention), not h % n_kv."""
    q, k, v, mask, q_valid = make_padded_batch([1], [5], seed=4)
    v = torch.zeros_like(v)
    v[..., 0, :] = 1.0                                       # KV head 0 values: all ones
    v[..., 1, :] = -1.0                                      # KV head 1 values: all minus ones
    out = dense_attention(q, k, v, mask)
    for h in range(H):
        assert torch.allclose(out[0, 0, h], torch.full((D,), 1.0 if h // G == 0 else -1.0), atol=TOL)


# --------------------------------------------------------------------------------------------------------------------
# Sparse attention

def buffer_rows(K, V, idx, valid, garbage_k=100.0, garbage_v=1e4):
    """Draft buffers holding the K/V of positions idx [B, n_kv, S] of contexts K, V [B, Lctx, n_kv, D]: k, v
    [B, n_kv, S, D] and valid [B, n_kv, S]; padding entries (valid [B, S] False) hold garbage that would dominate if
    it were not masked."""
    B, n_kv = K.shape[0], K.shape[2]
    b, head = torch.arange(B)[:, None, None], torch.arange(n_kv)[None, :, None]
    padding = ~valid[:, None, :, None]
    k, v = K[b, idx, head].masked_fill(padding, garbage_k), V[b, idx, head].masked_fill(padding, garbage_v)
    return k, v, valid[:, None, :].expand(-1, n_kv, -1)


def test_sparse_attention_equals_masked_dense():
    g = torch.Generator().manual_seed(1)
    B, Lctx, S = 3, 12, 5
    q = torch.randn(B, H, D, generator=g) * 2
    K = torch.randn(B, Lctx, N_KV, D, generator=g) * 2
    V = torch.randn(B, Lctx, N_KV, D, generator=g)
    n_valid = [5, 3, 1]
    idx = torch.zeros(B, N_KV, S, dtype=torch.long)
    for b in range(B):
        for j in range(N_KV):                                # a different set per KV head
            idx[b, j] = torch.randperm(Lctx, generator=g)[:S]
    valid = torch.arange(S)[None] < torch.tensor(n_valid)[:, None]              # [B, S]
    out = sparse_attention(q, *buffer_rows(K, V, idx, valid))
    assert out.shape == (B, H, D)
    for b in range(B):
        for h in range(H):
            j = h // G
            allowed = torch.zeros(Lctx, dtype=torch.bool)
            allowed[idx[b, j, :n_valid[b]]] = True
            logits = (K[b, :, j].double() @ q[b, h].double()) / math.sqrt(D)    # dense logits over the context
            probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
            ref = probs @ V[b, :, j].double()
            assert torch.allclose(out[b, h].double(), ref, atol=TOL), (b, h)


def test_sparse_attention_full_set_is_dense_attention():
    """A draft that gathers every position equals a dense decode step over the same context."""
    q_all, k, v, mask, _ = make_padded_batch([1], [9], seed=2)
    dense_out = dense_attention(q_all, k, v, mask)
    every = torch.arange(9).expand(1, N_KV, 9)
    valid = torch.ones(1, 9, dtype=torch.bool)
    out = sparse_attention(q_all[:, 0], *buffer_rows(k, v, every, valid))
    assert torch.allclose(out, dense_out[:, 0], atol=TOL)


def test_drafts_reading_copies_of_their_rows_equal_drafts_reading_them_in_place():
    """`sparse_drafts` with read_row None (few drafts: each attends to a copy of its row) writes the same K/V into the
    buffers and the same outputs as reading the rows in place; `gathered` picks the copy under a third of the rows."""
    g = torch.Generator().manual_seed(3)
    R, C, N, T = 7, 12, 10, 5                     # buffer rows (+ the scratch row), columns, columns read, tokens
    q, k, v = (torch.randn(T, heads, D, generator=g) for heads in (H, N_KV, N_KV))
    keys, values = (torch.randn(R + 1, N_KV, C, D, generator=g) for _ in range(2))
    q_index, rows = torch.tensor([1, 3]), torch.tensor([5, 2])          # two drafts, at rows 5 and 2
    write_column = torch.tensor([4, 7])
    seen = torch.rand(2, N_KV, N, generator=g) < 0.6
    seen[:, :, 0] = True
    outputs = []
    for read_row in (rows, None):
        valid = seen
        if read_row is not None:
            valid = (torch.arange(N) == 0).expand(R + 1, N_KV, N).clone()
            valid[read_row] = seen
        out, kb, vb = torch.zeros_like(q), keys.clone(), values.clone()
        attention.sparse_drafts(out, q, k, v, kb, vb, q_index, read_row, rows, write_column, valid)
        outputs.append((out, kb, vb))
    for in_place, copied in zip(*outputs):
        assert torch.equal(in_place, copied)
    assert outputs[0][0][q_index].abs().sum() > 0 and outputs[0][0][[0, 2, 4]].abs().sum() == 0
    assert attention.gathered(2, 7) and not attention.gathered(3, 9) and not attention.gathered(900, 1025)


# --------------------------------------------------------------------------------------------------------------------
# attend(): the dispatcher the model calls

def ref_causal(q, k, v):
    T = q.shape[0]
    out = torch.zeros(T, H, D, dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            out[t, h] = ref_attention_row(q[t, h], k[:, h // G], v[:, h // G], list(range(t + 1)))[0]
    return out


def test_attend_without_context_is_causal_attention():
    g = torch.Generator().manual_seed(5)
    T = 7
    q, k, v = torch.randn(T, H, D, generator=g), torch.randn(T, N_KV, D, generator=g), torch.randn(T, N_KV, D, generator=g)
    out = attend(0, q, k, v, None)
    assert out.shape == (T, H, D)
    assert torch.allclose(out.double(), ref_causal(q, k, v), atol=TOL)


@pytest.mark.parametrize("paged", [False, True], ids=["gather+sdpa", "paged"])
def test_attend_with_context_writes_cache_and_routes_rows(paged):
    """One step, tokens flattened as [A0, S0, A1, C0, A2, pad] (dense rows by gather + SDPA, or paged: flex_attention
    over the pool through a block mask, scores from its logsumexp; the uncompiled reference of the GPU kernels):
    A: dense, 3 new tokens at positions 2..4 after 2 cached ones (prefill chunk / verification), with scores;
    C: dense, 1 new token at position 3 after 3 cached ones (plain decode);
    S: sparse draft token at position 6 of a context whose positions 0..5 are cached, attending to {0, 2, 6} on KV
       head 0 and {1, 5, 6} on KV head 1: its row of the draft buffers holds the critical ones, {0, 2} and {1, 5},
       and takes its own K/V in the next column;
    pad: the padding row, where C's padding queries read and write (its K/V go to a slot no request uses)."""
    g = torch.Generator().manual_seed(6)
    Lyr, slots, layer = 2, 40, 1
    k_cache = torch.randn(Lyr, slots, N_KV, D, generator=g)
    v_cache = torch.randn(Lyr, slots, N_KV, D, generator=g)
    before = (k_cache.clone(), v_cache.clone())
    # slots of each request's positions: pool blocks of 2 slots, scattered and out of order
    block = 2
    table_A, table_C = torch.tensor([5, 6, 10]), torch.tensor([15, 2])
    slots_A = torch.tensor([10, 11, 12, 13, 20])
    slots_C = torch.tensor([30, 31, 4, 5])
    slots_S = torch.tensor([0, 1, 2, 3, 25, 26, 27])
    T = 6
    q = torch.randn(T, H, D, generator=g)
    k = torch.randn(T, N_KV, D, generator=g)
    v = torch.randn(T, N_KV, D, generator=g)
    rows_A, row_S, row_C, pad_row = [0, 2, 4], 1, 3, 5
    slot_mapping = torch.empty(T, dtype=torch.long)
    slot_mapping[rows_A] = slots_A[2:]
    slot_mapping[row_S] = slots_S[6]
    slot_mapping[row_C] = slots_C[3]
    slot_mapping[pad_row] = 39

    # dense batch: A (3 queries, context 5) and C (1 query, context 4), Qmax 3, Lmax 6 (three whole blocks)
    q_index = torch.tensor([[0, 2, 4], [3, pad_row, pad_row]])
    q_valid = torch.tensor([[True, True, True], [True, False, False]])
    block_table = torch.stack([table_A, torch.cat([table_C, table_C[:1]])])          # C padded with a valid block
    q_pos = torch.tensor([[2, 3, 4], [3, 0, 0]])
    kv_pos = torch.arange(6)
    mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < torch.tensor([5, 4])[:, None, None])
    mask &= q_valid[:, :, None] | (kv_pos[None, None, :] == 0)
    weight = torch.tensor([[1 / 3, 1 / 3, 1 / 3], [1.0, 0.0, 0.0]])
    dense = DenseBatch(q_index, q_valid, block_table, q_pos[:, 0], runs=((0, 2, mask, False),),
                       score_weight=weight, scores=torch.full((Lyr, 2, N_KV, 6), -1.0))
    # sparse batch: one draft in row 1 of the draft buffers (rows 0..2 read), 4 columns: 2 critical positions, its
    # own, and garbage (masked)
    sel = {0: [0, 2, 6], 1: [1, 5, 6]}
    columns = 8
    draft_k = torch.randn(Lyr, 3, N_KV, columns, D, generator=g) * 100
    draft_v = torch.randn(Lyr, 3, N_KV, columns, D, generator=g) * 100
    for j, positions in sel.items():
        draft_k[layer, 1, j, :2] = k_cache[layer, slots_S[positions[:2]], j]
        draft_v[layer, 1, j, :2] = v_cache[layer, slots_S[positions[:2]], j]
    buffers_before = (draft_k.clone(), draft_v.clone())
    valid = torch.zeros(Lyr, 3, N_KV, 4, dtype=torch.bool)
    valid[..., 0] = True
    valid[:, 1, :, :3] = True
    sparse = SparseBatch(torch.tensor([row_S]), torch.tensor([1]), torch.tensor([1]), torch.tensor([2]), valid)
    ctx = AttentionContext(k_cache, v_cache, slot_mapping, block, draft_k, draft_v, dense=dense, sparse=sparse,
                           context_capacity=block_table.shape[1] * block)
    if paged:
        kernels.use_paged_reference()
    attention.prepare(ctx, G)
    assert (dense.block_mask is not None) == paged

    out = attend(layer, q, k, v, ctx)
    assert out.shape == (T, H, D)

    # K/V written at slot_mapping of this layer only; every other slot untouched
    assert torch.equal(k_cache[layer, slot_mapping], k) and torch.equal(v_cache[layer, slot_mapping], v)
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[slot_mapping] = False
    assert torch.equal(k_cache[layer, untouched], before[0][layer, untouched])
    assert torch.equal(v_cache[layer, untouched], before[1][layer, untouched])
    assert torch.equal(k_cache[0], before[0][0]) and torch.equal(v_cache[0], before[1][0])

    # dense rows: A's tokens attend causally over A's (updated) context
    KA, VA = k_cache[layer, slots_A], v_cache[layer, slots_A]                      # [5, n_kv, D]
    score_ref = torch.zeros(N_KV, 6, dtype=torch.float64)
    for i, row in enumerate(rows_A):
        for h in range(H):
            o, p = ref_attention_row(q[row, h], KA[:, h // G], VA[:, h // G], list(range(2 + i + 1)))
            assert torch.allclose(out[row, h].double(), o, atol=TOL), ("A", i, h)
            score_ref[h // G, :5] += p / 3 / G
    KC, VC = k_cache[layer, slots_C], v_cache[layer, slots_C]
    score_ref_C = torch.zeros(N_KV, 6, dtype=torch.float64)
    for h in range(H):
        o, p = ref_attention_row(q[row_C, h], KC[:, h // G], VC[:, h // G], list(range(4)))
        assert torch.allclose(out[row_C, h].double(), o, atol=TOL), ("C", h)
        score_ref_C[h // G, :4] += p / G
    # scores filled for this layer only
    assert torch.allclose(dense.scores[layer, 0].double(), score_ref, atol=TOL)
    assert torch.allclose(dense.scores[layer, 1].double(), score_ref_C, atol=TOL)
    assert (dense.scores[0] == -1).all()

    # the draft's own K/V join its row of the draft buffers, in this layer only
    written = torch.zeros(Lyr, 3, N_KV, columns, dtype=torch.bool)
    written[layer, 1, :, 2] = True
    assert torch.equal(draft_k[written], k[row_S]) and torch.equal(draft_v[written], v[row_S])
    assert torch.equal(draft_k[~written], buffers_before[0][~written])
    assert torch.equal(draft_v[~written], buffers_before[1][~written])
    # sparse row: the draft attends to its critical positions and its own freshly written K/V
    KS, VS = k_cache[layer, slots_S], v_cache[layer, slots_S]
    for h in range(H):
        j = h // G
        o, _ = ref_attention_row(q[row_S, h], KS[:, j], VS[:, j], sel[j])
        assert torch.allclose(out[row_S, h].double(), o, atol=TOL), ("S", h)


@pytest.mark.parametrize("chunk,splits", [(None, 1), (3, 2), (2, 3), (1, 5), (2, 4)])
def test_paged_attention_in_chunks_is_dense_attention(chunk, splits):
    """The paged kernel (torch's uncompiled flex_attention over the pool) with each request's context cut into
    `splits` chunks of `chunk` blocks, merged by their logsumexps: dense attention over the gathered context. Contexts
    of 1 to 5 blocks (some chunks empty, one past every context); two padding requests list the scratch block, whose
    one owner sees position 0 and the other nothing: its rows come out 0, not NaN."""
    g = torch.Generator().manual_seed(7)
    block, nb, pool_blocks = 4, 5, 24
    scratch = pool_blocks - 1
    k_pool = torch.randn(pool_blocks * block, N_KV, D, generator=g)
    v_pool = torch.randn(pool_blocks * block, N_KV, D, generator=g)
    table = torch.randperm(scratch, generator=g)[:3 * nb].view(3, nb)
    table = torch.cat([table, torch.full((2, nb), scratch)])                          # [5, nb]: 2 padding requests
    q_len, context = torch.tensor([3, 1, 2, 0, 0]), torch.tensor([20, 3, 9, 1, 1])
    q_start = (context - q_len).clamp(min=0)
    Q = 3
    q = torch.randn(5, Q, H, D, generator=g)
    q_valid = torch.arange(Q)[None, :] < q_len[:, None]
    positions = torch.arange(nb * block)[None, None, :]
    mask = (positions <= (q_start[:, None] + torch.arange(Q))[:, :, None]) & (q_valid[:, :, None] | (positions == 0))

    block_mask = paged_kernel.paged_block_mask(table, mask, q_start, q_valid, block, pool_blocks * block, G, chunk,
                                               splits)
    out = paged_kernel.paged_attention(q, k_pool, v_pool, block_mask)                           # [5, Q, H, D]

    def gathered(pool):                                                               # [5, nb * block, N_KV, D]
        return pool.view(pool_blocks, block, N_KV, D)[table].view(5, nb * block, N_KV, D)
    ref = dense_attention(q, gathered(k_pool), gathered(v_pool), mask)
    owner = 4                                                   # the scratch block's owner: the last to list it
    sees = q_valid.clone()
    sees[owner] = True
    assert torch.allclose(out[sees], ref[sees], atol=TOL)
    assert torch.equal(out[3], torch.zeros_like(out[3]))        # the other padding request sees nothing


def test_exact_rows_list_every_block_for_the_mask_in_table_order():
    """The decoding kernel visits blocks listed full (seen whole by every row) after the others, on a path whose
    rounding can differ: for exact rows the block mask lists every used block for the mask, in table order, none
    full, so that a row sums its context in the same order, with the same arithmetic, whatever rows share its step.
    Otherwise the blocks before the edge are full."""
    block, nb, chunk, splits = 4, 6, 2, 3
    table = torch.tensor([[5, 0, 3, 1, 4, 2]])                       # one request, 6 blocks in 3 chunks of 2
    q_start, q_valid = torch.tensor([13]), torch.ones(1, 1, dtype=torch.bool)
    mask = torch.arange(nb * block)[None, None] <= 13                  # position 13: blocks 0-3, block 3 the edge
    exact = paged_kernel.paged_block_mask(table, mask, q_start, q_valid, block, (nb + 1) * block, G, chunk, splits,
                                          full_blocks=False)
    padding = [0] * (paged_kernel.kernel_batch(1) - 1) * splits     # the kernel's batch: padded, requests seeing none
    assert exact.full_kv_num_blocks is None
    assert exact.kv_num_blocks.flatten().tolist() == [2, 2, 0] + padding
    assert exact.kv_indices[:2, 0, 0, :2].tolist() == [[5, 0], [3, 1]]
    fast = paged_kernel.paged_block_mask(table, mask, q_start, q_valid, block, (nb + 1) * block, G, chunk, splits)
    assert fast.full_kv_num_blocks.flatten().tolist() == [2, 1, 0] + padding
    assert fast.kv_num_blocks.flatten().tolist() == [0, 1, 0] + padding


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_chunks_merge_alike_whatever_their_count(device):
    """`merge_chunks` folds a row's chunks one after the other, elementwise: the empty chunks after a row's last (lse
    -inf, output 0) add exact zeros, so eagerly 3 chunks and the same 3 followed by 5 empty ones merge to the same
    bits (compiled for two counts, the H200's kernels can round differently: exact rows fix the count); a row that
    sees nothing comes out 0 with lse -inf."""
    g = torch.Generator().manual_seed(3)
    out = torch.randn(4, 3, N_KV, 5, D, generator=g).bfloat16().to(device)          # [B, S, H, R, D]
    lse = (torch.randn(4, 3, N_KV, 5, generator=g) * 4).to(device)
    lse[:, 2, :, :2] = float("-inf")                                  # rows whose context ends in the second chunk
    out[:, 2, :, :2] = 0
    lse[3], out[3] = float("-inf"), 0                                 # a request that sees nothing
    padded_out = torch.cat([out, out.new_zeros(4, 5, N_KV, 5, D)], 1)
    padded_lse = torch.cat([lse, lse.new_full((4, 5, N_KV, 5), float("-inf"))], 1)
    merged, merged_lse = paged_kernel.merge_chunks(out, lse)
    padded, padded_lse_out = paged_kernel.merge_chunks(padded_out, padded_lse)
    assert torch.equal(merged, padded) and torch.equal(merged_lse, padded_lse_out)
    assert torch.equal(merged[3], torch.zeros_like(merged[3])) and (merged_lse[3] == float("-inf")).all()
    weight = lse[:3].softmax(1).nan_to_num()                                         # the plain formula
    torch.testing.assert_close(merged[:3], (weight[..., None] * out[:3].float()).sum(1))
    torch.testing.assert_close(merged_lse[:3], lse[:3].logsumexp(1))


def test_model_forward_with_dense_context_matches_full_logits(tmp_path):
    """The cached path through attend() (one prefill request, dense, slots out of order) equals the reference path."""
    from conftest import make_tiny_checkpoint
    from nano_sparsespec.model import load_model

    path, _ = make_tiny_checkpoint(tmp_path, "qwen3")
    model = load_model(path)
    cfg = model.config
    T = 10
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(0))
    slots = blocks = torch.randperm(16, generator=torch.Generator().manual_seed(1))[:T]
    k_cache = torch.zeros(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
    v_cache = torch.zeros_like(k_cache)
    pos = torch.arange(T)
    dense = DenseBatch(pos[None], torch.ones(1, T, dtype=torch.bool), blocks[None], pos[:1],
                       runs=((0, 1, (pos[None, :] <= pos[:, None])[None], True),))
    ctx = AttentionContext(k_cache, v_cache, slots, 1, dense=dense)                  # blocks of one slot
    with torch.inference_mode():
        logits = model.logits(model(ids, pos, ctx))
    assert torch.allclose(logits, model.full_logits(ids), atol=1e-4)
    assert k_cache[:, slots].abs().sum() > 0



def test_paged_scores_of_every_layer_are_gather_and_sdpa_scores(tmp_path):
    """A whole forward on the paged path (attention and scores from flex_attention: `column_scores`' swapped pass)
    scores every layer as gather + SDPA does (explicit probabilities), a verification and a last prefill chunk alike:
    each a distribution over the context."""
    from conftest import make_tiny_checkpoint
    from nano_sparsespec.model import load_model

    path, _ = make_tiny_checkpoint(tmp_path, "qwen3")
    model = load_model(path)
    cfg = model.config
    T, Lmax = 6, 8
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(T)
    # two requests of 3 queries each, contexts 3 and 3 (positions 0..2), blocks of 4 slots, padded to 8 positions
    q_index, q_valid = torch.arange(T).view(2, 3), torch.ones(2, 3, dtype=torch.bool)
    kv = torch.arange(Lmax)
    mask = kv[None, None, :] <= torch.arange(3)[None, :, None].expand(2, 3, 1)
    weight = torch.tensor([[1 / 3, 1 / 3, 1 / 3], [0.0, 0.0, 1.0]])      # a verification, a last prefill chunk

    def scores_with(paged):
        kernels.use_paged_reference() if paged else kernels.use_eager_kernels()
        k_cache = torch.zeros(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
        dense = DenseBatch(q_index, q_valid, torch.tensor([[1, 2], [3, 0]]), torch.zeros(2),
                           runs=((0, 2, mask, False),), score_weight=weight,
                           scores=torch.full((cfg.num_layers, 2, cfg.num_kv_heads, Lmax), -1.0))
        slots = torch.tensor([4, 5, 6, 12, 13, 14])
        ctx = AttentionContext(k_cache, torch.zeros_like(k_cache), slots, 4, dense=dense, context_capacity=Lmax)
        with torch.inference_mode():
            model(ids, pos % 3, ctx)
        assert (dense.block_mask is not None) == paged
        return dense.scores

    paged = scores_with(True)
    assert cfg.num_layers > 1 and (paged != -1).all()
    torch.testing.assert_close(paged, scores_with(False), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(paged.sum(-1), torch.ones(cfg.num_layers, 2, cfg.num_kv_heads))
    assert (paged[..., 3:] == 0).all()               # nothing beyond the context


@pytest.mark.parametrize("rows_per_block", [swapped_scores.SCORE_ROWS, 3])
def test_column_scores_are_weighted_probabilities(monkeypatch, rows_per_block):
    """`column_scores` (queries and keys swapped, each row's logsumexp subtracted) equals `pillar_scores`' explicit
    probabilities: rows of weight 0 (padding, an unscored row) drop out, and a padding request whose rows see
    nothing and weigh nothing scores 0, not NaN. The G x Q = 8 rows in one key block, or in three."""
    monkeypatch.setattr(swapped_scores, "SCORE_ROWS", rows_per_block)
    g = torch.Generator().manual_seed(3)
    B, Q, L = 3, 4, 40
    q = torch.randn(B, Q, H, D, generator=g)
    k = torch.randn(B, L, N_KV, D, generator=g) * 2
    q_start, q_len = torch.tensor([30, 5, 0]), torch.tensor([4, 2, 0])
    q_valid = torch.arange(Q)[None, :] < q_len[:, None]
    mask = attention.causal_mask(q_start, q_valid, L)
    weight = q_valid.float() / q_len.clamp(min=1)[:, None]
    weight[1] = torch.tensor([0.0, 1.0, 0.0, 0.0])                               # the last row alone
    logits = attention_logits(q, k, mask)                                       # [B, n_kv, G, Q, L]
    lse = logits.logsumexp(-1).flatten(2)                                       # [B, n_kv, G*Q]
    lse[2] = float("-inf")                                                      # sees nothing
    scores = swapped_scores.column_scores(q, k.transpose(1, 2), q_start, weight, lse)
    expected = pillar_scores(q, k, mask, weight)
    torch.testing.assert_close(scores[:2], expected[:2], atol=1e-6, rtol=1e-4)
    assert torch.equal(scores[2], torch.zeros(N_KV, L))


def test_the_score_pass_visits_the_tiles_of_each_context_only():
    """The swapped score pass lists every block of rows for a tile of positions that starts at or before its
    request's last row's position, and none for a tile past it (the compiled kernel skips those; torch's reference
    flex_attention ignores block lists, so the lists are checked here)."""
    T = swapped_scores.SCORE_TILE
    counts = swapped_scores.row_blocks_per_tile(torch.tensor([0, T - 1, T, 3 * T + 5]), 4, 2, heads=3)
    assert counts.dtype == torch.int32 and counts.shape == (4, 3, 4) and counts.is_contiguous()
    for head in range(3):
        assert counts[:, head].tolist() == [[2, 0, 0, 0], [2, 0, 0, 0], [2, 2, 0, 0], [2, 2, 2, 2]]


def test_runs_attend_and_score_as_one_batch(tmp_path):
    """A dense batch attended in runs (a step's prefill chunks apart from its decoding requests: `DenseBatch.runs`),
    each run with its own query rows and context, gives the outputs and the PillarAttn scores of the same batch
    attended at once, padded to its longest query count and context."""
    from conftest import make_tiny_checkpoint
    from nano_sparsespec.model import load_model

    model = load_model(make_tiny_checkpoint(tmp_path, "qwen3")[0])
    cfg = model.config
    Lmax = 8
    # request 0 decodes one token at position 2 (row 0); request 1 prefills positions 0..2 (rows 1-3), its last
    # chunk; row 4 is the step's padding row. Blocks of 4 slots; slot 16 (block 4) takes the padding row's K/V.
    ids = torch.randint(0, cfg.vocab_size, (5,), generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([2, 0, 1, 2, 0])
    q_index, q_valid = torch.tensor([[0, 4, 4], [1, 2, 3]]), torch.tensor([[True, False, False], [True] * 3])
    q_start = torch.tensor([2, 0])
    kv = torch.arange(Lmax)[None, None, :]
    q_pos = (q_start[:, None] + torch.arange(3))[:, :, None]
    mask = (kv <= q_pos) & (q_valid[:, :, None] | (kv == 0))
    assert torch.equal(attention.causal_mask(q_start, q_valid, Lmax), mask)
    weight = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    k_cache = torch.randn(cfg.num_layers, 20, cfg.num_kv_heads, cfg.head_dim,
                          generator=torch.Generator().manual_seed(4))

    def forward(runs):
        dense = DenseBatch(q_index, q_valid, torch.tensor([[1, 2], [3, 0]]), q_start, runs=runs,
                           score_weight=weight, scores=torch.zeros(cfg.num_layers, 2, cfg.num_kv_heads, Lmax))
        ctx = AttentionContext(k_cache.clone(), k_cache.clone(), torch.tensor([6, 12, 13, 14, 16]), 4, dense=dense,
                               context_capacity=8)
        with torch.inference_mode():
            hidden = model(ids, positions, ctx)
        return hidden[:4], dense.scores

    # apart: request 0 with its one query row and both blocks, request 1 with its 3 rows and its first block alone,
    # as a run of prefill chunks (scored from its last row alone)
    (hidden, scores) = forward(((0, 2, mask, False),))
    (hidden_runs, scores_runs) = forward(((0, 1, mask[:1, :1], False), (1, 1, mask[1:, :, :4], True)))
    torch.testing.assert_close(hidden_runs, hidden)
    torch.testing.assert_close(scores_runs, scores)
    assert (scores.sum(-1) - 1).abs().max() < 1e-5


# --------------------------------------------------------------------------------------------------------------------
# Critical-token selection

def ref_select(scores, context_len, budget):
    """Per request a nested list [L][n_kv] of positions: top-`budget` by score, ties to the lower position."""
    L, B, n_kv, _ = scores.shape
    result = []
    for b in range(B):
        per_layer = []
        for layer in range(L):
            per_head = []
            for j in range(n_kv):
                cand = sorted(range(int(context_len[b])), key=lambda p: (-float(scores[layer, b, j, p]), p))
                per_head.append(cand[:min(int(budget[b]), int(context_len[b]))])
            per_layer.append(per_head)
        result.append(per_layer)
    return result


def test_select_pillar_matches_reference_with_ties_and_per_request_budgets():
    g = torch.Generator().manual_seed(7)
    L, B, Lmax = 3, 4, 20
    # few distinct values -> many ties; columns past a request's context are the largest (must never be chosen)
    scores = torch.randint(0, 4, (L, B, N_KV, Lmax), generator=g).float() / 4
    context_len = torch.tensor([20, 13, 6, 9])
    budget = torch.tensor([5, 4, 10, 9])                         # request 2: budget > context; request 3: ==
    for b in range(B):
        scores[:, b, :, int(context_len[b]):] = 10.0
    sel = select_pillar(scores, context_len, budget)
    ref = ref_select(scores, context_len, budget)
    assert len(sel) == B
    for b in range(B):
        n = min(int(budget[b]), int(context_len[b]))
        assert sel[b].shape == (L, N_KV, n) and sel[b].dtype == torch.long
        assert sel[b].tolist() == ref[b], b
        assert (sel[b] < context_len[b]).all()
    # budget >= context: every position of the context, exactly once
    for layer in range(L):
        for j in range(N_KV):
            assert sorted(sel[2][layer, j].tolist()) == list(range(6))
            assert sorted(sel[3][layer, j].tolist()) == list(range(9))


def test_select_pillar_tie_break_towards_lower_positions():
    scores = torch.zeros(1, 1, 1, 8)
    scores[..., [1, 3, 6]] = 0.5                                  # three tied maxima
    sel = select_pillar(scores, torch.tensor([8]), torch.tensor([2]))
    assert sel[0].tolist() == [[[1, 3]]]
    sel = select_pillar(torch.zeros(1, 1, 1, 8), torch.tensor([8]), torch.tensor([3]))
    assert sel[0].tolist() == [[[0, 1, 2]]]


def test_select_pillar_ranks_scores_to_the_precision_its_keys_keep():
    """Scores that differ in more than the mantissa bits the position takes are ranked by score at any
    magnitude; scores that agree to 1 part in 2^(23 - ceil(log2 Lmax)) are tied and go to the lower position."""
    Lmax = 8                                                          # 3 position bits: 20 mantissa bits kept
    scores = torch.tensor([1e-30, 3e30, 0.0, 2.5e-3, 2.5e-3 * (1 + 2 ** -18), 7.0, 1.0, 1.0 + 2 ** -22])
    order = select_pillar(scores.view(1, 1, 1, Lmax), torch.tensor([Lmax]), torch.tensor([Lmax]))[0]
    assert order.flatten().tolist() == [1, 5, 6, 7, 4, 3, 0, 2]


def test_select_pillar_per_layer_and_head():
    """Each (layer, KV head) picks its own top positions."""
    L, Lmax = 2, 10
    scores = torch.zeros(L, 1, N_KV, Lmax)
    scores[0, 0, 0, [7, 2]] = torch.tensor([0.9, 0.5])
    scores[0, 0, 1, [4, 8]] = torch.tensor([0.6, 0.7])
    scores[1, 0, 0, [0, 9]] = torch.tensor([0.3, 0.2])
    scores[1, 0, 1, [5, 1]] = torch.tensor([0.8, 0.1])
    sel = select_pillar(scores, torch.tensor([10]), torch.tensor([2]))[0]
    assert sel.tolist() == [[[7, 2], [8, 4]], [[0, 9], [5, 1]]]


def test_pillars_from_gqa_averaged_probabilities():
    """Scores average the probabilities over the group's heads and the chosen query rows: a position that is second
    best for both heads of a group wins over positions that are best for only one head; a row with weight 0 (e.g. a
    rejected draft) does not vote. Probabilities are set exactly by one-hot keys and queries that carry log p."""
    L = 6                                                  # context positions
    Dk = 8                                                 # >= L: key p is the one-hot vector e_p
    Q = 2                                                  # query rows: row 0 chosen, row 1 weight 0
    probs = torch.full((H, Q, L), 0.01)
    # KV head 0 = query heads 0, 1
    probs[0, 0, [2, 3]] = torch.tensor([0.60, 0.35])
    probs[1, 0, [5, 3]] = torch.tensor([0.58, 0.35])
    # KV head 1 = query heads 2, 3: position 1 carries the group
    probs[2, 0, [1, 4]] = torch.tensor([0.45, 0.50])
    probs[3, 0, [1, 0]] = torch.tensor([0.45, 0.52])
    # row 1 (not chosen) puts everything on position 4 for every head
    probs[:, 1, 4] = 0.9
    probs = probs / probs.sum(-1, keepdim=True)
    k = torch.zeros(1, L, N_KV, Dk)
    for p in range(L):
        k[0, p, :, p] = 1.0
    q = torch.zeros(1, Q, H, Dk)
    q[0, :, :, :L] = probs.log().permute(1, 0, 2) * math.sqrt(Dk)          # logit of position p = log probs[p]
    mask = torch.ones(1, Q, L, dtype=torch.bool)
    weight = torch.tensor([[1.0, 0.0]])
    scores = pillar_scores(q, k, mask, weight)                              # [1, n_kv, L]
    expected = torch.stack([probs[0:2, 0].mean(0), probs[2:4, 0].mean(0)])  # [n_kv, L]
    assert torch.allclose(scores[0], expected, atol=TOL)
    sel = select_pillar(scores[None], torch.tensor([L]), torch.tensor([1]))[0]
    assert sel.tolist() == [[[3], [1]]]
    sel = select_pillar(scores[None], torch.tensor([L]), torch.tensor([3]))[0]
    assert sel[0, 0].tolist() == [3, 2, 5] and sel[0, 1].tolist() == [1, 0, 4]


def test_keep_first_ranks_the_kept_positions_first_within_the_budget():
    """`keep_first`: the kept positions lead, the selection's others follow in rank order without
    duplicates, and the lowest-ranked make room, so each request keeps its own budget."""
    from nano_sparsespec.pillar_attn import keep_first
    selection = torch.tensor([[[[5, 3, 9, 1, 0, 0]]], [[[7, 2, 4, 6, 8, 0]]]])      # [B, L, n_kv, N]
    keep = torch.tensor([[9, 10, 0], [1, 0, 0]])
    valid = torch.tensor([[True, True, False], [True, False, False]])
    out = keep_first(selection, torch.tensor([4, 5]), keep, valid)
    assert out[0, 0, 0, :4].tolist() == [9, 10, 5, 3]
    assert out[1, 0, 0, :5].tolist() == [1, 7, 2, 4, 6]


@pytest.mark.parametrize("method", ["pillar", "pillar-lookup"])
def test_keeping_the_accepted_positions_is_lossless(tiny_qwen3, prompts, plain_greedy, method):
    """With `keep_accepted`, greedy speculation still equals plain greedy decoding, and every
    selection holds the positions its verification just accepted."""
    from conftest import GREEDY
    from nano_sparsespec import LLM
    seen = {}                              # request -> (verified context, selection) per refresh

    def selected(seq, scores, chosen):
        seen.setdefault(seq.seq_id, []).append((seq.num_verified, chosen))
    llm = LLM(str(tiny_qwen3[0]), method=method, stride=4, min_budget=16, budget_ratio=0.1,
              keep_accepted=True)
    outs = llm.generate(None, GREEDY, prompt_token_ids=prompts, on_selection=selected)
    assert [o.token_ids for o in outs] == plain_greedy
    after_verification = [pair for refreshes in seen.values() for pair in refreshes[1:]]
    assert after_verification
    assert all((chosen == verified - 1).any(-1).all() for verified, chosen in after_verification)


@pytest.mark.parametrize("method", ["pillar", "pillar-lookup"])
def test_scoring_every_other_layer_is_lossless_and_shares_the_scored_selection(tiny_qwen3, prompts, plain_greedy,
                                                                                method):
    """With `score_every=2` only layer 0 of the two-layer model scores: greedy speculation still equals plain greedy
    decoding, layer 1 drafts with layer 0's selection, and each request's first selection at layer 0 (from its
    prompt's last row) is the one made when every layer scores."""
    from conftest import GREEDY
    from nano_sparsespec import LLM

    def run(score_every):
        seen = {}                          # request -> (scores, selection) per refresh

        def selected(seq, scores, chosen):
            seen.setdefault(seq.seq_id, []).append((scores, chosen))
        llm = LLM(str(tiny_qwen3[0]), method=method, stride=4, min_budget=16, budget_ratio=0.1,
                  score_every=score_every)
        outs = llm.generate(None, GREEDY, prompt_token_ids=prompts, on_selection=selected)
        return [o.token_ids for o in outs], seen
    tokens, shared = run(2)
    _, own = run(1)
    assert tokens == plain_greedy
    refreshes = [pair for pairs in shared.values() for pair in pairs]
    assert refreshes and all(torch.equal(chosen[1], chosen[0]) and torch.equal(scores[1], scores[0])
                             for scores, chosen in refreshes)
    assert all(torch.equal(shared[seq][0][1][0], own[seq][0][1][0]) for seq in own)
    assert any(not torch.equal(chosen[1], chosen[0]) for pairs in own.values() for _, chosen in pairs)


@pytest.mark.parametrize("method,keep_accepted", [("pillar", True), ("pillar-lookup", True), ("pillar", False)])
def test_verifications_between_reselections_keep_their_selection(tiny_qwen3, prompts, plain_greedy, method,
                                                                  keep_accepted):
    """With `refresh_every=2` verifications re-select in every other period of the phase clock; in the others they
    compute no scores and keep the selection they had, the positions they just accepted ranked first (keep_accepted)
    or not: greedy speculation still equals plain greedy decoding."""
    from conftest import GREEDY
    from nano_sparsespec import LLM
    seen = {}                              # request -> (scores, selection, positions just committed) per refresh

    def selected(seq, scores, chosen):
        committed = sum(seq.commit_log[-1])
        seen.setdefault(seq.seq_id, []).append((scores, chosen, range(seq.num_verified - committed,
                                                                          seq.num_verified)))
    llm = LLM(str(tiny_qwen3[0]), method=method, stride=4, min_budget=16, budget_ratio=0.1, refresh_every=2,
              keep_accepted=keep_accepted)
    outs = llm.generate(None, GREEDY, prompt_token_ids=prompts, on_selection=selected)
    assert [o.token_ids for o in outs] == plain_greedy
    kept = 0
    for refreshes in seen.values():
        for (_, before, _), (scores, chosen, accepted) in zip(refreshes, refreshes[1:]):
            if scores is not None:
                continue
            kept += 1
            assert chosen.shape == before.shape
            for was, now in zip(before.flatten(0, 1).tolist(), chosen.flatten(0, 1).tolist()):
                assert now == (list(accepted) * keep_accepted + [p for p in was if p not in accepted])[:len(was)]
    assert kept and all(refreshes[0][0] is not None for refreshes in seen.values())


def test_only_the_scored_layers_have_scores():
    """`DenseBatch.layer_scores`: with score_every n, layer l writes scores[l // n] when n divides l, else nothing."""
    scores = torch.zeros(2, 1, N_KV, 8)
    batch = attention.DenseBatch(None, None, None, None, (), score_weight=torch.ones(1, 1), scores=scores,
                                 score_every=3)
    assert [None if s is None else s.data_ptr() for s in map(batch.layer_scores, range(5))] == [
        scores[0].data_ptr(), None, None, scores[1].data_ptr(), None]
    assert attention.DenseBatch(None, None, None, None, (), scores=scores).layer_scores(0) is None


def test_select_streaming():
    sel = select_streaming(context_len=20, budget=8, sink_tokens=3, num_layers=2, num_kv_heads=N_KV)
    assert sel.shape == (2, N_KV, 8)
    for layer in range(2):
        for j in range(N_KV):
            assert sel[layer, j].tolist() == [0, 1, 2, 15, 16, 17, 18, 19]
    # context <= budget: every position
    for n in (5, 8):
        sel = select_streaming(context_len=n, budget=8, sink_tokens=3, num_layers=1, num_kv_heads=1)
        assert sel.tolist() == [[list(range(n))]]
    # no sinks: just the recent window
    sel = select_streaming(context_len=9, budget=4, sink_tokens=0, num_layers=1, num_kv_heads=1)
    assert sel.tolist() == [[[5, 6, 7, 8]]]
    sel = select_streaming(context_len=9, budget=4, sink_tokens=1, num_layers=1, num_kv_heads=1)
    assert sel.tolist() == [[[0, 6, 7, 8]]]
    # more sinks than budget: still exactly `budget` positions, the first ones
    sel = select_streaming(context_len=20, budget=3, sink_tokens=5, num_layers=1, num_kv_heads=1)
    assert sel.tolist() == [[[0, 1, 2]]]


# --------------------------------------------------------------------------------------------------------------------
# torch.compile variant

def _compile_available():
    if not hasattr(torch, "compile") or shutil.which("cc") is None and shutil.which("gcc") is None:
        return False
    try:
        from torch import _dynamo
        return _dynamo.is_dynamo_supported()
    except Exception:
        return False


# ~25-35 s on a 2-core CPU with a cold inductor cache, ~13 s warm (under the 60 s line for a `slow` mark)
@pytest.mark.skipif(not _compile_available(), reason="torch.compile (dynamo + a C compiler) unavailable")
def test_compiled_kernels_match_eager():
    q_lens, ctx_lens = [3, 2], [7, 5]
    q, k, v, mask, q_valid = make_padded_batch(q_lens, ctx_lens, seed=8)
    weight = q_valid.float() / q_valid.sum(1, keepdim=True)
    g = torch.Generator().manual_seed(9)
    # the drafts' branch: three drafts of a 4-token step in rows 2 and 0 and a padding one (reads row R = 3, writes
    # the scratch row 4), over 6 of the buffers' 8 columns
    sq = torch.randn(4, H, D, generator=g)
    sk, sv = torch.randn(2, 4, N_KV, D, generator=g).unbind(0)
    buffers = torch.randn(2, 5, N_KV, 8, D, generator=g)
    svalid = torch.rand(4, N_KV, 6, generator=g) < 0.7
    svalid[..., 0] = True
    draft_lists = (torch.tensor([1, 3, 0]), torch.tensor([2, 0, 3]), torch.tensor([2, 0, 4]), torch.tensor([5, 3, 0]))

    def sparse_branch(kernel):
        """-> the step's output rows and the buffers after one call of `kernel` on copies of the inputs"""
        out, keys, values = torch.zeros(4, H, D), *buffers.clone()
        kernel(out, sq, sk, sv, keys, values, *draft_lists, svalid)
        return out, keys, values
    eager_scores = pillar_scores(q, k, mask, weight)
    eager_sparse = sparse_branch(attention.sparse_drafts)
    # the K/V write into one layer of a pool of 4: q | k | v side by side as the model's projection lays them out
    pool_k, pool_v = torch.zeros(2, 4, 16, N_KV, D).unbind(0)
    qkv, slots = torch.randn(5, H + 2 * N_KV, D, generator=g), torch.tensor([3, 9, 0, 15, 7])
    k_new, v_new = qkv[:, H:H + N_KV], qkv[:, H + N_KV:]
    # ... with window writes: tokens 4, 1, 2 also into draft-buffer rows 2, 0, 2 at columns 5, 7, 6
    window = (torch.tensor([4, 1, 2]), torch.tensor([2, 0, 2]), torch.tensor([5, 7, 6]))

    def stored(kernel, *windowed):
        """-> the pool [2, 16, N_KV, D] and draft buffers [2, 5, N_KV, 8, D] after `kernel` stores into zeroed ones"""
        pool, drafts = torch.zeros(2, 16, N_KV, D), torch.zeros(2, 5, N_KV, 8, D)
        kernel(*pool, slots, k_new, v_new, *((*drafts, *window) if windowed else ()))
        return pool, drafts
    eager_stored = stored(attention.store_kv, True)
    # pillar-lookup's draft columns: drafts in buffer rows 2, 0, 3 of 4, each row 6 ranked positions per (layer, KV
    # head) of a 12-position context over 5 tokens (so lookups find some), their rings from columns 0, 3, 4, 16 columns
    selection = torch.stack([torch.randperm(12, generator=g)[:6] for _ in range(4 * 2 * N_KV)]).view(4, 2, N_KV, 6)
    lookup_args = (torch.rand(3, 16, generator=g) < 0.5, selection, torch.tensor([2, 0, 3]), torch.tensor([6, 4, 5]),
                   torch.tensor([0, 3, 4]), torch.randint(0, 5, (4, 12), generator=g), torch.tensor([1, 2, 3]),
                   torch.tensor([12, 9, 11]), torch.tensor([0, 4, 2]), 2)
    eager_lookup = lookup.lookup_draft_columns(*lookup_args)
    # the draft buffers' fill: two requests' 3 blocks of 4 positions in a pool of 8 blocks, into rows 3 and 1 of the
    # buffers [2 layers, 5 rows, N_KV, 8 columns] (the rows a view into a longer list); positions per (layer, KV
    # head), then one list for all of them (of one position each); then one request (row 2) alone, both ways; then two
    # requests of one block each (rows 0, 4)
    fill_pool = torch.randn(2, 2, 8 * 4, N_KV, D, generator=g).unbind(0)
    fill_lists = [(torch.tensor([[5, 0, 2], [7, 1, 4]]), 4, torch.randint(0, 12, (2, 2, N_KV, 5), generator=g),
                   torch.tensor([9, 9, 3, 1])[2:], torch.arange(5).expand(2, -1) + torch.tensor([[0], [3]])),
                  (torch.tensor([[5, 0, 2], [7, 1, 4]]), 4, torch.tensor([[[[9]]], [[[2]]]]), torch.tensor([3, 1]),
                   torch.tensor([[6], [0]])),
                  (torch.tensor([[3, 6]]), 4, torch.randint(0, 8, (1, 2, N_KV, 3), generator=g), torch.tensor([2]),
                   torch.tensor([[0, 1, 2]])),
                  (torch.tensor([[3, 6]]), 4, torch.tensor([[[[1, 7]]]]), torch.tensor([2]), torch.tensor([[3, 4]])),
                  (torch.tensor([[5], [2]]), 4, torch.randint(0, 4, (2, 2, N_KV, 2), generator=g),
                   torch.tensor([0, 4]), torch.tensor([[0, 1], [6, 7]]))]

    def filled(kernel):
        """-> the draft buffers after `kernel` fills each of `fill_lists` in turn into zeroed ones"""
        keys, values = torch.zeros(2, 2, 5, N_KV, 8, D).unbind(0)
        for table, block_size, positions, rows, columns in fill_lists:
            kernel(*fill_pool, keys, values, table, block_size, positions, rows, columns)
        return keys, values
    eager_filled = filled(attention.fill_draft_buffers)

    kernels.compile_kernels()
    try:
        assert all(attention._kernels[name] is not eager for name, eager in
                   [("store", attention.store_kv), ("scores", pillar_scores), ("sparse", attention.sparse_drafts),
                    ("fill", attention.fill_draft_buffers)])
        assert all(lookup._kernels[name] is not eager for name, eager in lookup.EAGER_KERNELS.items())
        scores = attention._kernels["scores"](q, k, mask, weight)         # the compiled score pass
        sparse_out = sparse_branch(attention._kernels["sparse"])
        lookup_columns = lookup.lookup_draft_columns(*lookup_args)     # through the compiled pieces
        with CompiledFrames() as compiled:
            attention._kernels["store"](pool_k[2], pool_v[2], slots, k_new, v_new)
            compiled_stored = stored(attention._kernels["store"], True)
            # fewer token rows and window writes: the same two compilations
            attention._kernels["store"](*torch.zeros(2, 16, N_KV, D), slots[:4], k_new[:4], v_new[:4],
                                        *torch.zeros(2, 5, N_KV, 8, D), *(x[1:] for x in window))
            compiled_filled = filled(attention._kernels["fill"])
    finally:
        kernels.use_eager_kernels()
    assert all(torch.equal(a, b) for a, b in zip(lookup_columns, eager_lookup)) and eager_lookup[1].any()
    assert all(torch.equal(a, b) for a, b in zip(compiled_filled, eager_filled))
    # per (layer, KV head): 5 + 1 columns of row 3, 5 + 1 of row 1, 3 + 2 of row 2, 2 of rows 0 and 4, nothing else
    assert eager_filled[0].abs().sum(-1).gt(0).sum() == 2 * N_KV * 21
    assert compiled.frames["fill_draft_buffers"][0] == 2         # positions per layer and head, or shared
    assert compiled.frames["store_kv"][0] == 2                   # with and without window writes
    assert torch.allclose(scores, eager_scores, atol=1e-4)
    assert torch.allclose(sparse_out[0], eager_sparse[0], atol=1e-4)
    assert torch.equal(sparse_out[1], eager_sparse[1]) and torch.equal(sparse_out[2], eager_sparse[2])
    assert not torch.equal(eager_sparse[1], buffers[0]) and eager_sparse[0][[1, 3, 0]].abs().sum(-1).gt(0).all()
    written = torch.zeros(4, 16, dtype=torch.bool)
    written[2, slots] = True
    assert torch.equal(pool_k[2, slots], k_new) and torch.equal(pool_v[2, slots], v_new)
    assert not pool_k[~written].any() and not pool_v[~written].any()          # no other slot or layer touched
    assert torch.equal(compiled_stored[0], eager_stored[0]) and torch.equal(compiled_stored[1], eager_stored[1])
    (eager_pool_k, _), (draft_k, draft_v) = eager_stored
    assert torch.equal(eager_pool_k[slots], k_new)
    assert torch.equal(draft_k[2, :, 5], k_new[4]) and torch.equal(draft_v[0, :, 7], v_new[1])
    assert torch.equal(draft_k[2, :, 6], k_new[2]) and draft_k.abs().sum(-1).gt(0).sum() == 3 * N_KV   # nothing else
    assert attention._kernels["scores"] is pillar_scores and attention._kernels["sparse"] is attention.sparse_drafts
    assert attention._kernels["store"] is attention.store_kv
    assert lookup._kernels == lookup.EAGER_KERNELS
    assert attention._kernels["fill"] is attention.fill_draft_buffers


@pytest.mark.skipif(not _compile_available(), reason="torch.compile (dynamo + a C compiler) unavailable")
def test_compiled_selection_pieces_match_the_eager_ones():
    """The selection's keys and its re-ranking (`keep_first`) as `compile_kernels` compiles them (a few kernels
    instead of dozens of eager ones) equal the eager ones bit for bit, for a subset of a step's requests, a request
    alone and growing contexts and selections (one compilation for them all, and one for a request alone: torch
    specialises a size of 1); so the fast path selects exactly the positions the eager path selects."""
    from nano_sparsespec import pillar_attn
    g = torch.Generator().manual_seed(11)
    cases = [(5, [3, 0, 4], 20), (6, [2], 100), (9, [8, 1, 5, 0], 1000), (2, [1, 0], 4100)]   # (Bs, rows, Lmax)
    keys_inputs, keep_inputs = [], []
    for requests, rows, Lmax in cases:
        scores = (torch.rand(2, requests, N_KV, Lmax, generator=g) * 64).floor() / 64        # many ties
        context = torch.randint(Lmax // 2, Lmax + 1, (len(rows),), generator=g)
        keys_inputs.append((scores, torch.tensor(rows), context, max(1, (Lmax - 1).bit_length())))
        B, N, M = len(rows), Lmax // 10, 3 + len(rows)        # ranked selections, M positions to keep first
        selection = torch.stack([torch.randperm(Lmax, generator=g)[:N] for _ in range(B * 2 * N_KV)])
        keep = torch.stack([torch.randperm(Lmax, generator=g)[:M] for _ in range(B)])
        keep_inputs.append((selection.view(B, 2, N_KV, N), torch.randint(N // 2, N + 1, (B,), generator=g), keep,
                            torch.rand(B, M, generator=g) < 0.7))
    eager_keys = [pillar_attn.selection_keys(*args) for args in keys_inputs]
    eager_kept = [pillar_attn.keep_first(*args) for args in keep_inputs]
    kernels.compile_kernels(paged=True)            # (the re-ranking is compiled for the GPU's paged path)
    try:
        assert all(pillar_attn._kernels[name] is not fn for name, fn in pillar_attn.EAGER_KERNELS.items())
        with CompiledFrames() as compiled:
            fast_keys = [pillar_attn._kernels["keys"](*args) for args in keys_inputs]
            fast_kept = [pillar_attn.keep_first(*args) for args in keep_inputs]
            scores, rows, context, _ = keys_inputs[2]
            chosen, widths = pillar_attn.top_positions(scores, context, [50, 600, 9, 300], rows.tolist())
    finally:
        kernels.use_eager_kernels()
    assert pillar_attn._kernels == pillar_attn.EAGER_KERNELS
    assert all(torch.equal(a, b) for a, b in zip(fast_keys, eager_keys))
    assert all(torch.equal(a, b) for a, b in zip(fast_kept, eager_kept))
    assert compiled.frames["selection_keys"][0] == 2 and compiled.frames["merge_ranked"][0] == 2
    reference, reference_widths = pillar_attn.top_positions(scores[:, rows], context, [50, 600, 9, 300])
    assert widths == reference_widths and torch.equal(chosen, reference)


@pytest.mark.skipif(not _compile_available(), reason="torch.compile (dynamo + a C compiler) unavailable")
def test_static_dims_stay_static_for_the_output_of_a_dynamic_function(monkeypatch):
    """A compiled paged piece (`_static_but`) is specialised on every dim but those it names, also for a tensor that
    a function compiled for dynamic shapes returned (the rope's q), which carries that function's dynamic dims: the
    heads and head dim stay constants of the kernel."""
    import torch._dynamo
    produce = torch.compile(lambda x: x + 1, dynamic=True, backend="aot_eager")
    shapes = []

    def backend(gm, example_inputs):                 # the dims the graph was traced with (SymInt: dynamic)
        shapes.extend(tuple(n.meta["example_value"].shape) for n in gm.graph.nodes
                      if n.op == "placeholder" and isinstance(n.meta["example_value"], torch.Tensor))
        return gm.forward
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **options: compile_(fn, backend=backend, **options))
    consume = kernels._static_but(lambda q: q * 2, {0: (0,)})
    torch._dynamo.reset()
    try:
        consume(produce(torch.randn(5, 3, 4)))
    finally:
        torch._dynamo.reset()
    (tokens, heads, dim), = shapes
    assert isinstance(tokens, torch.SymInt) and (heads, dim) == (3, 4)
    assert type(heads) is int and type(dim) is int                                # not SymInts


@pytest.mark.skipif(not _compile_available(), reason="torch.compile (dynamo + a C compiler) unavailable")
@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_compiled_paged_kernel_is_compiled_once_per_dense_batch(device):
    """The compiled paged kernel (`compile_kernels(paged=True)`, static shapes) writes what the reference writes into
    the step's rows, and steps that differ only in their token count (their sparse drafts) or in a small dense
    batch of one power of two (3 or 4 requests, attended as 4) share one compilation.
    On the CPU plain decoding rows in one piece (torch's CPU compiler has no logsumexp); on CUDA contexts cut in two
    chunks, merged by their logsumexps."""
    from torch._dynamo.utils import counters
    block, head_dim, chunk, splits = 16, 16, *((None, 1) if device == "cpu" else (2, 2))
    pool_slots = (4 * 4 + 1) * block
    g = torch.Generator().manual_seed(11)
    k_pool, v_pool = torch.randn(2, pool_slots, N_KV, head_dim, generator=g).to(device).unbind(0)
    steps = []
    for B, rows, T in ((4, [0, 2, 3, 5], 7), (3, [0, 3, 5], 9), (4, [1, 2, 5, 6], 12)):
        block_table = torch.randperm(B * 4, generator=g).view(B, 4).to(device)
        q_start = torch.tensor([40, 50, 20, 63][:B], device=device)
        q_valid = torch.ones(B, 1, dtype=torch.bool, device=device)
        mask = torch.arange(4 * block, device=device)[None, None] <= q_start[:, None, None]    # [B, 1, 64]
        block_mask = paged_kernel.paged_block_mask(block_table, mask, q_start, q_valid, block, pool_slots, G, chunk,
                                                   splits)
        q_index = torch.tensor(rows, device=device)[:, None]                            # the dense rows of the step
        q = torch.randn(T, H, head_dim, generator=g).to(device)
        reference = torch.zeros_like(q)
        paged_kernel.paged_dense(reference, q, q_index, k_pool, v_pool, block_mask)
        steps.append((q, q_index, block_mask, reference))
    counters.clear()
    kernels.compile_kernels(paged=True)
    try:
        for q, q_index, block_mask, reference in steps:
            out = torch.zeros_like(q)
            attention._kernels["paged"](out, q, q_index, k_pool, v_pool, block_mask)
            torch.testing.assert_close(out, reference, atol=1e-4, rtol=1e-4)
            untouched = torch.ones(len(q), dtype=torch.bool, device=device)
            untouched[q_index.flatten()] = False
            assert not out[untouched].any()                                    # rows of no dense request
    finally:
        kernels.use_eager_kernels()
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.skipif(not _compile_available(), reason="torch.compile (dynamo + a C compiler) unavailable")
def test_compiled_score_inputs_serve_every_batch_and_context():
    """The score pass's inputs (`score_inputs`: keys gathered head-major from the pool, the packed rows and their
    shifts), as `compile_kernels(paged=True)` compiles them, equal the eager ones for verification batches of other
    sizes and contexts, from one compilation: a run's growing contexts do not recompile them."""
    from torch._dynamo.utils import counters
    block, head_dim, Q = 16, 16, 3
    g = torch.Generator().manual_seed(13)
    k_pool = torch.randn(100 * block, N_KV, head_dim, generator=g)
    kernels.compile_kernels(paged=True)
    counters.clear()
    try:
        for B, blocks in ((5, 7), (7, 9), (9, 11)):        # (no size equal to another: dynamo's duck sizing)
            q = torch.randn(B * Q + 2, H, head_dim, generator=g)
            q_index = torch.randperm(B * Q, generator=g).view(B, Q)
            table = torch.randperm(100, generator=g)[:B * blocks].view(B, blocks)
            weight = torch.rand(B, Q, generator=g) * (torch.rand(B, Q, generator=g) > 0.3)
            lse = torch.randn(B, N_KV, G * Q, generator=g)
            expected = swapped_scores.score_inputs(q, q_index, k_pool, table, block, weight, lse)
            got = paged_kernel._paged["score_inputs"](q, q_index, k_pool, table, block, weight, lse)
            for got_part, want in zip(got, expected):
                torch.testing.assert_close(got_part, want)
    finally:
        kernels.use_eager_kernels()
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's CPU compiler returns no logsumexp")
def test_compiled_score_pass_serves_every_batch_and_context():
    """The swapped score pass as `compile_kernels(paged=True)` compiles it equals the eager one for verification
    batches of other sizes and contexts, from one compilation: growing contexts and changing batches of a run do not
    recompile it."""
    from torch._dynamo.utils import counters
    head_dim, Q, R = 16, 3, swapped_scores.SCORE_ROWS
    g = torch.Generator().manual_seed(14)
    cases = []
    for B, L in ((5, 256), (7, 384), (3, 1024), (4, 320)):
        keys = torch.randn(B, N_KV, L, head_dim, generator=g).cuda()
        rows = torch.randn(B, N_KV, R, head_dim, generator=g).cuda()
        shift = (torch.randn(B, N_KV, R, generator=g) + 5).cuda()
        q_start = torch.randint(0, L - Q, (B,), generator=g).cuda()
        expected = torch.empty(B, N_KV, L, device="cuda")
        swapped_scores.score_pass(expected, keys, rows, shift, q_start, Q)
        cases.append(((keys, rows, shift, q_start, Q), expected))
    kernels.compile_kernels(paged=True)
    counters.clear()
    try:
        for args, expected in cases:
            got = torch.empty_like(expected)
            paged_kernel._paged["score_pass"](got, *args)
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-4)
    finally:
        kernels.use_eager_kernels()
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's CPU compiler returns no logsumexp")
def test_compiled_paged_kernel_scores_verifications():
    """Compiled on the GPU, the paged kernel of a verification batch (3 rows a request, contexts cut in two chunks)
    attends as the reference does and scores as `pillar_scores` over the gathered keys."""
    B, Q, block, head_dim, chunk, splits = 4, 3, 16, 16, 2, 2
    pool_slots = (B * 4 + 1) * block
    g = torch.Generator().manual_seed(12)
    k_pool, v_pool = torch.randn(2, pool_slots, N_KV, head_dim, generator=g).cuda().unbind(0)
    block_table = torch.randperm(B * 4, generator=g).view(B, 4).cuda()
    q_start = torch.tensor([40, 50, 20, 61], device="cuda")
    q_valid = torch.tensor([[True] * 3, [True] * 3, [True, False, False], [True] * 3], device="cuda")
    mask = attention.causal_mask(q_start, q_valid, 4 * block)                              # [B, Q, 64]
    weight = q_valid.float() / q_valid.sum(1, keepdim=True)
    block_mask = paged_kernel.paged_block_mask(block_table, mask, q_start, q_valid, block, pool_slots, G, chunk, splits)
    q_index = torch.arange(B * Q, device="cuda").view(B, Q)
    q = torch.randn(B * Q + 1, H, head_dim, generator=g).cuda()
    expected = torch.zeros_like(q)
    paged_kernel.paged_dense(expected, q, q_index, k_pool, v_pool, block_mask)
    keys = k_pool.view(-1, block, N_KV, head_dim)[block_table].flatten(1, 2)              # [B, 64, n_kv, D]
    expected_scores = pillar_scores(q[q_index], keys, mask, weight)
    kernels.compile_kernels(paged=True)
    try:
        out, scores = torch.zeros_like(q), torch.full_like(expected_scores, -1.0)
        attention._kernels["paged"](out, q, q_index, k_pool, v_pool, block_mask, scores, block_table, q_start, weight)
    finally:
        kernels.use_eager_kernels()
    real = q_index[q_valid]                     # a padding row sees whole blocks of the compiled kernel: dropped
    torch.testing.assert_close(out[real], expected[real], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(scores, expected_scores, atol=1e-5, rtol=1e-4)


def test_compiled_kernels_are_cached_in_the_project(monkeypatch, tmp_path):
    """torch.compile's cache goes under the project's cache, also after torch has looked up (and written) its default
    place; a place the user chose stays. Choosing the place swaps in no compiled piece."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    from nano_sparsespec import model as model_module, verifier
    monkeypatch.setenv("NANO_SPARSESPEC_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cache_dir()                                                    # torch writes its default into the environment
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.abspath(default_cache_dir())
    embedded.use_project_compile_cache()
    assert cache_dir() == str(tmp_path / "torch-compile")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    embedded.use_project_compile_cache()
    assert cache_dir() == str(tmp_path / "mine")
    assert model_module._ops == model_module._eager_ops and verifier._fused["verify"] is verifier._verify_logits


def test_the_fast_path_switches_on_every_compiled_piece(monkeypatch, tmp_path):
    """`compile_fast_path` swaps compiled versions into all three tables: attention's kernels, the model's elementwise
    pieces and the verifier's sampling (compiling happens at first use, not here)."""
    from nano_sparsespec import model as model_module, verifier
    monkeypatch.setenv("NANO_SPARSESPEC_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    kernels.compile_fast_path(torch.device("cpu"), cuda_graphs=False)
    try:
        assert attention._kernels["sparse"] is not attention.EAGER_KERNELS["sparse"]
        assert model_module._ops["rms_norm"] is not model_module._eager_ops["rms_norm"]
        assert verifier._fused["verify"] is not verifier._verify_logits
    finally:
        kernels.use_eager_kernels()
        model_module.use_eager_elementwise()
        verifier.use_eager_sampling()


@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float32, 6), (torch.float16, 3)])
def test_draft_buffers_receive_the_pools_rows_of_their_positions(dtype, head_dim):
    """fill_draft_buffers copies, for each (request, layer, KV head), the pool's K and V rows of its positions into its
    columns of its row of the draft buffers, in any dtype; nothing else changes. Positions given once for all layers
    and heads ([B, 1, 1, n]) fill as the same positions given for each."""
    g = torch.Generator().manual_seed(0)
    L, n_kv, bs, blocks, rows_total, C = 2, 3, 4, 12, 5, 7
    k_cache, v_cache = (torch.randn(L, blocks * bs, n_kv, head_dim, generator=g).to(dtype) for _ in range(2))
    draft_k, draft_v = (torch.zeros(L, rows_total + 1, n_kv, C, head_dim, dtype=dtype) for _ in range(2))
    rows = torch.tensor([3, 0])
    block_table = torch.stack([torch.randperm(blocks, generator=g)[:3] for _ in rows])    # [B, 3]: 12 positions
    positions = torch.randint(0, 3 * bs, (2, L, n_kv, 4), generator=g)
    columns = torch.tensor([[0, 1, 2, 3], [2, 3, 4, 5]])
    attention.fill_draft_buffers(k_cache, v_cache, draft_k, draft_v, block_table, bs, positions, rows, columns)
    expected_k, expected_v = torch.zeros_like(draft_k), torch.zeros_like(draft_v)
    for b, row in enumerate(rows.tolist()):
        for layer in range(L):
            for head in range(n_kv):
                for n, column in enumerate(columns[b].tolist()):
                    pos = int(positions[b, layer, head, n])
                    slot = int(block_table[b, pos // bs]) * bs + pos % bs
                    expected_k[layer, row, head, column] = k_cache[layer, slot, head]
                    expected_v[layer, row, head, column] = v_cache[layer, slot, head]
    assert torch.equal(draft_k, expected_k) and torch.equal(draft_v, expected_v)
    shared = positions[:, :1, :1]                                                       # [B, 1, 1, 4]
    for buffers in ((draft_k, draft_v), (expected_k, expected_v)):
        buffers[0].zero_(), buffers[1].zero_()
    attention.fill_draft_buffers(k_cache, v_cache, draft_k, draft_v, block_table, bs, shared, rows, columns)
    attention.fill_draft_buffers(k_cache, v_cache, expected_k, expected_v, block_table, bs,
                                 shared.expand(-1, L, n_kv, -1), rows, columns)
    assert torch.equal(draft_k, expected_k) and torch.equal(draft_v, expected_v) and draft_k.any()


def test_kept_beside_keeps_the_best_ranks_no_extra_holds_by_rank_and_by_ring_column():
    """`kept_beside`: of a ranked selection's first width positions, those no valid extra position holds stay, the
    best width - (valid extras) of them; read by rank, and by column of a ring that starts at `start` (rank r at
    column (start + r) mod width). Widths 0, 1 and the whole row; extras in the selection, outside it, invalid."""
    g = torch.Generator().manual_seed(8)
    B, L, n_kv, N, M = 6, 2, 3, 7, 4
    selection = torch.stack([torch.randperm(12, generator=g)[:N] for _ in range(B * L * n_kv)]).view(B, L, n_kv, N)
    widths, start = torch.tensor([7, 5, 1, 0, 6, 3]), torch.tensor([3, 4, 0, 0, 5, 2])
    extra = torch.stack([torch.randperm(12, generator=g)[:M] for _ in range(B)])
    valid = torch.rand(B, M, generator=g) < 0.75
    by_rank = kept_beside(selection, widths, extra, valid)
    by_column = kept_beside(selection, widths, extra, valid, ring_ranks(start, widths, N + 2))
    for b, l, h in itertools.product(range(B), range(L), range(n_kv)):
        width, held = int(widths[b]), set(extra[b][valid[b]].tolist())
        ranked = selection[b, l, h, :width].tolist()
        best = [r for r, p in enumerate(ranked) if p not in held][:max(0, width - len(held))]
        expected = [r in best for r in range(N)]
        assert by_rank[b, l, h].tolist() == expected
        columns = [(int(start[b]) + r) % width for r in range(width)]
        assert [by_column[b, l, h, c].item() for c in columns] == expected[:width]
        assert not by_column[b, l, h, width:].any()


def test_a_kept_selections_ring_holds_it_after_each_span_ranked_first():
    """A kept selection's draft-buffer row, written only where `ring_span_writes` says (each verification's accepted
    span, at most `longest` + 1 columns), holds its ranked selection as a ring from `start` after every refresh that
    ranks a new span first (`spans_kept_first`, as the runner keeps it): spans shorter and longer than the budget,
    empty ones, a width of one. The pending position goes to the window's column."""
    g = torch.Generator().manual_seed(5)
    widths, longest, window = torch.tensor([6, 3, 1, 0]), 4, 9
    B, W = len(widths), int(widths.max())
    selection = torch.stack([torch.randperm(20, generator=g)[:W] for _ in widths])          # [B, W], in rank order
    buffer = torch.full((B, window + 1), -1)
    buffer[:, :W] = selection                                      # a new selection is copied whole: start 0
    start, verified = torch.zeros(B, dtype=torch.long), torch.full((B,), 20)
    for _ in range(12):
        count = torch.randint(0, longest + 1, (B,), generator=g)
        first, pending = verified, verified + count
        selection = spans_kept_first(selection[:, None, None], widths, first, count, longest)[:, 0, 0]
        start, positions, columns = attention.ring_span_writes(start, widths, first, count, pending,
                                                               torch.full((B,), window), longest)
        assert columns.shape == (B, longest + 1)
        buffer.scatter_(1, columns, positions)
        for b, width in enumerate(widths.tolist()):
            ring = (start[b] + torch.arange(width)) % max(width, 1)
            assert buffer[b, ring].tolist() == selection[b, :width].tolist()
            assert buffer[b, window] == pending[b]
        verified = pending + 1
