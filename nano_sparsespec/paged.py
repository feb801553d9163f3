"""The fast path's paged dense kernel: flex_attention's decoding kernel reading one layer's KV pool
in place, for plain decoding and verification.

Owns `paged_prepare` (once per forward: the BlockMask over the pool, the drafts' block lists),
`paged_block_mask`, `paged_dense` and `paged_attention` (contexts cut into chunks, each a CTA's
work, that `merge_chunks` merges by their log-sum-exps; with exact rows every step cuts and visits
a context alike, so a verification row gets its decode row's bits), the batch classes the kernel
is compiled for (`kernel_batch`) and the pieces `paged_dense` runs (`_paged`: the attention, the
score pass's inputs and swapped_scores.py's pass), which kernels.py swaps for compiled ones.
Uncompiled, flex_attention is torch's reference implementation over the whole pool: the CPU tests
run it on tiny pools (`kernels.use_paged_reference`).

Must not change what the eager path computes, or shape it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import AttentionContext, pack_groups, unpack_groups
from .flex_drafts import draft_block_lists
from .swapped_scores import score_inputs, score_pass

# The paged kernel cuts every context at the same positions into chunks (each a CTA's work) of at
# least PAGED_CHUNK positions, no more than bring a batch's CTAs to PAGED_CTAS (about 8 per SM of
# an H200; more only add merging: BENCHMARKS.md). A batch of several query rows a request
# (verifications, k + 1 rows served by each key load) aims at CHECK_CTAS: fewer chunks merge less,
# and with spread contexts they attend faster. With exact rows
# (`kernels.compile_kernels(exact=True)`) chunks grow so that the longest context the block tables
# hold needs at most MAX_CHUNKS.
PAGED_CHUNK = 512
PAGED_CTAS = 1024
CHECK_CTAS = 512
MAX_CHUNKS = 16
# Dense batches of at most this many requests (a balanced step's verifications): the paged kernel
# sees them padded to a power of two (`kernel_batch`): one compilation serves each such class.
SMALL_BATCH = 128
# The smallest batch the paged kernel attends (`kernel_batch`): the engine's usual dense batch
# (`kernels.compile_fast_path`), so that a run's smaller start and tail steps attend in its class.
smallest_kernel_batch = 2
# Triton settings of the decoding kernel: three pipeline stages overlap a block's loads with the
# math of the blocks before (torch's default for sm_90 is one); a verification's 27 rows per KV
# head need the third to keep the loads streaming (a plain row's attention is as fast with two).
# One CTA per chunk: by default the kernel splits a context further, by a count chosen from the
# batch size.
PAGED_KERNEL_OPTIONS = {"num_stages": 3, "num_warps": 2, "SPLIT_KV": 1}
# Whether the paged kernel computes a row with the same arithmetic in every step, whatever the
# rows beside it (`kernels.compile_kernels(exact=True)`): every step cuts contexts into the same
# chunks (`exact_chunks`) and lists no block full (`paged_block_mask`). It costs speed
# (BENCHMARKS.md).
exact_rows = False


def set_smallest_kernel_batch(dense_batch: int) -> None:
    """The paged kernel's smallest batch class holds `dense_batch` requests (`kernel_batch`)."""
    global smallest_kernel_batch
    smallest_kernel_batch = min(max(dense_batch, 2), SMALL_BATCH)


def paged_prepare(ctx: AttentionContext, group: int) -> None:
    """Before the layers: the block lists of the drafts that read their rows in place, and the
    block mask of the paged kernel, for dense batches that attend as one run and whose G x Qmax
    packed rows (`group` query heads per KV head) fit flex_attention's decoding kernel (plain
    decoding, verification); prefill chunks keep gather + SDPA."""
    s = ctx.sparse
    if s is not None and s.read_row is not None:
        s.block_lists = draft_block_lists(s.q_index, s.read_row, s.write_column, s.valid.shape[1],
                                          ctx.draft_k.shape[3])
    d = ctx.dense
    if d is None or len(d.runs) > 1 or group * d.q_index.shape[1] >= 128:
        return
    (_, _, mask, _), = d.runs
    capacity = max(ctx.context_capacity // ctx.block_size, d.block_table.shape[1])     # blocks
    chunk, splits = (exact_chunks(capacity, ctx.block_size) if exact_rows else
                     batch_chunks(d.block_table.shape, capacity, ctx.block_size,
                                  ctx.k_cache.shape[2], d.q_index.shape[1]))
    d.block_mask = paged_block_mask(d.block_table, mask, d.q_start, d.q_valid, ctx.block_size,
                                    ctx.k_cache.shape[1], group, chunk, splits,
                                    full_blocks=not exact_rows)


def batch_chunks(table_shape, capacity: int, block_size: int, kv_heads: int,
                 rows: int) -> tuple[int, int]:
    """`paged_chunks` of a dense batch whose block tables are table_shape (requests, blocks), as
    the kernel attends it: padded to `kernel_batch`, each request with `kv_heads` KV heads."""
    requests, blocks = table_shape
    return paged_chunks(blocks, capacity, block_size, kernel_batch(requests) * kv_heads, rows)


def paged_chunks(blocks: int, capacity: int, block_size: int, heads: int,
                 rows: int = 1) -> tuple[int, int]:
    """(blocks per chunk, chunks) for a dense batch of `heads` (request, KV head) pairs of `rows`
    query rows each, whose block tables hold `blocks` blocks, of at most `capacity`: as many
    PAGED_CHUNK-position chunks as its longest context needs, rounded up to a power of two, but no
    more than bring its CTAs to PAGED_CTAS, CHECK_CTAS for several rows (then chunks a power of two
    times longer): a few compilations serve a batch class (empty chunks merge as zeros). One chunk
    spans the widest table, `capacity`: one compilation."""
    chunk = max(1, PAGED_CHUNK // block_size)
    needed = 1 << (-(-blocks // chunk) - 1).bit_length()
    ctas = PAGED_CTAS if rows == 1 else CHECK_CTAS
    enough = 1 << (-(-ctas // heads) - 1).bit_length()
    while needed > enough:
        chunk, needed = chunk * 2, needed // 2
    splits = min(needed, -(-capacity // chunk))
    return (capacity, 1) if splits == 1 else (chunk, splits)


def exact_chunks(capacity: int, block_size: int) -> tuple[int, int]:
    """(blocks per chunk, chunks) that cut any context of up to `capacity` blocks at the same
    positions, in a count of chunks fixed for every step (`merge_chunks` of two counts can
    round differently once compiled)."""
    chunk = max(PAGED_CHUNK // block_size, -(-capacity // MAX_CHUNKS), 1)
    return chunk, -(-capacity // chunk)


def paged_block_mask(block_table, mask, q_start, q_valid, block_size: int, pool_slots: int,
                     group: int, chunk: int | None = None, splits: int = 1,
                     full_blocks: bool = True):
    """The flex_attention BlockMask that lets packed row (g, q) of request b see exactly
    mask[b, q, :]. block_table: [B, nb]; mask: [B, Q, nb * block_size] bool; q_start: [B];
    q_valid: [B, Q] bool.
    The key/value sequence is one layer's whole pool (pool_slots positions, shared by all
    requests). A batch of at most SMALL_BATCH requests is padded with requests that see nothing,
    up to a power of two (`kernel_batch`): flex_attention's decoding kernel is compiled for a
    static batch. Each request lists the pool blocks it uses, in table order, where `visible`
    evaluates the mask's rule from the position: `rank` is a pool block's number within its
    request, `owner` the request (checked, so the rule holds over the whole pool). With
    `full_blocks` the blocks that every real row sees whole are listed `full`, where the kernel
    skips the rule; it visits them after the others, on a second path that can round differently,
    so a row's bits then depend on the rows beside it. The padding requests of a padded step all
    list the scratch block, which gets one owner: the others see nothing (rows discarded). Built
    on the device, no host sync.
    With `chunk` each context is cut into `splits` chunks of `chunk` blocks (at least enough for
    the context; the last ones may be empty), each seen as a request of its own (entry
    b * splits + s is chunk s of request b; `paged_attention` merges them): the decoding kernel
    gives a (request, KV head) one CTA per split of the key sequence (`paged_chunks`). Without
    `chunk` the context is one chunk."""
    from torch.nn.attention.flex_attention import BlockMask

    padding = kernel_batch(mask.shape[0]) - mask.shape[0]
    block_table, q_start = F.pad(block_table, (0, 0, 0, padding)), F.pad(q_start, (0, padding))
    mask = torch.cat([mask, mask.new_zeros(padding, *mask.shape[1:])])
    q_valid = torch.cat([q_valid, q_valid.new_zeros(padding, *q_valid.shape[1:])])
    B, Q, L = mask.shape
    nb, pool_blocks = L // block_size, pool_slots // block_size
    chunk = chunk or nb                                                # blocks per chunk
    if splits * chunk < nb:
        raise ValueError(f"{splits} chunks of {chunk} blocks do not cover {nb} blocks")
    seen = mask.view(B, Q, nb, block_size)
    used = seen.any(-1).any(1)                                         # [B, nb]
    full = used & (seen.all(-1) | ~q_valid[:, :, None]).all(1) & full_blocks          # [B, nb]
    target = torch.where(used, block_table, pool_blocks).flatten()     # unused: a dump entry
    rank = torch.zeros(pool_blocks + 1, dtype=torch.long, device=mask.device)
    rank.scatter_(0, target, torch.arange(nb, device=mask.device).repeat(B))
    owner = torch.full((pool_blocks + 1,), -1, dtype=torch.long, device=mask.device)
    owner.scatter_(0, target, torch.arange(B, device=mask.device).repeat_interleave(nb))

    def visible(b, h, q_idx, kv_idx):   # b: chunk b * splits + s; q_idx: packed row g * Q + q
        request, block, row = b // splits, kv_idx // block_size, q_idx % Q
        position = rank[block] * block_size + kv_idx % block_size
        return ((owner[block] == request) & (rank[block] // chunk == b % splits)
                & (position <= q_start[request] + row) & (q_valid[request, row] | (position == 0)))

    def by_chunk(x):      # [B, nb] -> [B * splits, chunk] (padding columns: 0 / False)
        return F.pad(x, (0, splits * chunk - nb)).view(B * splits, chunk)

    # [B, nb] bool -> counts [B*S, 1, 1], block ids first [B*S, 1, 1, pool_blocks]
    def listed(which):
        which, table = by_chunk(which), by_chunk(block_table)
        order = torch.argsort((~which).to(torch.int8), dim=1, stable=True)
        # BlockMask's contract: one column per KV block (a padded table can be wider than the pool);
        # the kernel reads a row's first `count` columns only, so the rest stay unwritten
        ids = torch.empty(B * splits, 1, 1, pool_blocks, dtype=torch.int32, device=mask.device)
        width = min(chunk, pool_blocks)
        ids[:, 0, 0, :width] = table.gather(1, order)[:, :width]
        return which.sum(1, dtype=torch.int32)[:, None, None], ids

    q_tile = -(-group * Q // 128) * 128
    return BlockMask.from_kv_blocks(*listed(used & ~full),
                                    *(listed(full) if full_blocks else (None, None)),
                                    BLOCK_SIZE=(q_tile, block_size),
                                    mask_mod=visible, seq_lengths=(group * Q, pool_slots),
                                    compute_q_blocks=False)


def kernel_batch(batch: int) -> int:
    """The requests the paged kernel attends for a dense batch of `batch` (`paged_block_mask`):
    up to SMALL_BATCH, the power of two at or above it and `smallest_kernel_batch`, so that
    compiled for a dynamic batch (a size the comparisons guard) the kernel still sees a static
    one; past it, `batch`. Compiled, each comparison with `batch` becomes a guard, so the smallest
    class is reached without one: all the batches it holds share one compilation."""
    if batch > SMALL_BATCH:
        return batch
    padded = 2
    while padded < smallest_kernel_batch:
        padded *= 2
    while padded < batch:
        padded *= 2
    return padded


def paged_dense(out, q, q_index, k_layer, v_layer, block_mask, scores=None, block_table=None,
                q_start=None, score_weight=None) -> None:
    """out[q_index] = paged attention of q[q_index]: out, q [T, n_heads, D]; q_index [Bd, Qmax].
    With `scores` [Bd, n_kv, Lmax], also the PillarAttn scores of the rows score_weight [Bd, Qmax]
    weighs (swapped_scores.py's pass over the keys of block_table [Bd, Lmax / block]; row q of
    request b sits at position q_start[b] + q).
    Three pieces (`_paged`), each one graph when compiled: the attention, the score pass's inputs,
    the score pass (its score_mod reads a tensor that must come into its graph from outside)."""
    lse = _paged["attend"](out, q, q_index, k_layer, v_layer, block_mask, scores is not None)
    if scores is not None:
        block_size = scores.shape[-1] // block_table.shape[1]
        keys, rows, shift = _paged["score_inputs"](q, q_index, k_layer, block_table, block_size,
                                                   score_weight, lse)
        _paged["score_pass"](scores, keys, rows, shift, q_start, q_index.shape[1])


def paged_attend(out, q, q_index, k_layer, v_layer, block_mask, with_lse: bool):
    """out[q_index] = paged attention of q[q_index]; returns the packed rows' log-sum-exps
    [Bd, n_kv, G*Qmax] with `with_lse`, else None. One function, so that compiled, the queries'
    gather and the output's scatter fuse with the kernel's packing and the merge of the chunks."""
    queries = q[q_index]                                                   # [Bd, Qmax, n_heads, D]
    attended = paged_attention(queries, k_layer, v_layer, block_mask, with_lse=with_lse)
    attended, lse = attended if with_lse else (attended, None)
    out[q_index.flatten()] = attended.flatten(0, 1)
    return lse


def paged_attention(q, k_layer, v_layer, block_mask, with_lse: bool = False,
                    kernel_options: dict = PAGED_KERNEL_OPTIONS):
    """q: [B, Q, n_heads, D]; k_layer, v_layer: [slots, n_kv, D] one layer's pool ->
    [B, Q, n_heads, D], and with `with_lse` each packed row's log-sum-exp [B, n_kv, G*Q] (float32;
    -inf for a row that sees nothing).

    The G query heads of a KV head are packed into G x Q rows, so flex_attention sees one query
    head per KV head and can use its decoding kernel (which wants a power-of-two group). A block
    mask made with splits S > 1 has Bk * S entries (Bk = `kernel_batch(B)`: the requests past B
    see nothing), one per chunk of a context, which `merge_chunks` folds into attention over the
    whole context."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    B, Q = q.shape[:2]
    Bk = kernel_batch(B)
    # [1, n_kv, slots, D]
    keys, values = k_layer.permute(1, 0, 2)[None], v_layer.permute(1, 0, 2)[None]
    packed = pack_groups(q, k_layer.shape[1])                          # [B, n_kv, G*Q, D]
    padded = F.pad(packed, (0, 0, 0, 0, 0, 0, 0, Bk - B))              # [Bk, n_kv, G*Q, D]
    splits = block_mask.kv_num_blocks.shape[0] // Bk
    if splits == 1 and not with_lse and q.device.type == "cpu":
        # torch's CPU compiler returns no log-sum-exp (the CPU runs the paged path in tests only)
        return unpack_groups(flex_attention(padded, keys, values, block_mask=block_mask,
                                            kernel_options=kernel_options)[:B], Q)
    out, aux = flex_attention(padded.repeat_interleave(splits, 0), keys, values,
                              block_mask=block_mask, return_aux=AuxRequest(lse=True),
                              kernel_options=kernel_options)
    out, lse = merge_chunks(out.view(Bk, splits, *packed.shape[1:])[:B],
                            aux.lse.view(Bk, splits, *packed.shape[1:3])[:B])
    out = unpack_groups(out.to(q.dtype), Q)
    return (out, lse) if with_lse else out


def merge_chunks(out, lse):
    """Attention over whole contexts from that over their chunks: out [B, S, H, R, D], lse
    [B, S, H, R] (-inf: the chunk's row sees nothing) -> out [B, H, R, D] float32 and lse
    [B, H, R] (-inf for a row that sees nothing, whose output is 0). The chunks are weighted by
    the softmax of their log-sum-exps, summed one after the other in chunk order: elementwise
    operations only, so that a row's result does not depend on the kernel's shape (a
    reduction's order can). Compiled for another count of chunks, the trailing empty ones add
    zeros but the kernel can round differently (`exact_chunks`)."""
    top = lse.amax(1)                                                  # [B, H, R]
    top = torch.where(top == float("-inf"), 0.0, top)
    total = torch.zeros_like(top)
    merged = torch.zeros(out[:, 0].shape, dtype=torch.float32, device=out.device)
    for s in range(lse.shape[1]):
        weight = torch.exp(lse[:, s] - top)                            # [B, H, R]
        total = total + weight
        merged = merged + weight[..., None] * out[:, s].float()
    return merged / torch.where(total == 0, 1.0, total)[..., None], top + total.log()


# the pieces of `paged_dense`, uncompiled; `kernels.compile_kernels(paged=True)` swaps in compiled
# ones
PAGED_PIECES = {"attend": paged_attend, "score_inputs": score_inputs, "score_pass": score_pass}
_paged = dict(PAGED_PIECES)
