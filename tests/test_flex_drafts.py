"""flex_drafts.py: the drafts' attention on the fast path (flex_attention over the draft buffers in place) against
attention.sparse_drafts, and the block lists its compiled kernel reads (uncompiled, flex_attention ignores them)."""
import pytest
import torch

from nano_sparsespec import attention, kernels
from nano_sparsespec.flex_drafts import (DRAFT_BLOCK, draft_block_lists, draft_block_mask, drafts_by_reading,
                                         flex_drafts)

H, N_KV, D = 6, 2, 8          # 3 query heads per KV head


def draft_inputs(columns: int, seed: int = 0, device: str = "cpu", head_dim: int = D):
    """A 5-token step whose 4 drafts sit in rows 2, 0, 3 and 5 of 7 buffer rows (rows 1, 4 and 6 read by none), over
    the first `columns` columns of 2 x DRAFT_BLOCK, each (row, KV head) seeing its own random columns up to its draft's
    own (the first block's or the second's), which it sees."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(5, H, head_dim, generator=g)
    k, v = torch.randn(2, 5, N_KV, head_dim, generator=g).unbind(0)
    buffers = torch.randn(2, 7, N_KV, 2 * DRAFT_BLOCK, head_dim, generator=g)
    valid = torch.rand(7, N_KV, columns, generator=g) < 0.6
    valid[..., 0] = True
    read_row, own = torch.tensor([2, 0, 3, 5]), torch.tensor([5, min(DRAFT_BLOCK + 3, columns - 1), 0, columns - 1])
    valid[read_row] &= torch.arange(columns) <= own[:, None, None]
    valid[read_row, :, own] = True
    lists = (torch.tensor([1, 3, 0, 4]), read_row, read_row, own)
    return (*(x.to(device) for x in (q, k, v, buffers)), tuple(x.to(device) for x in lists), valid.to(device))


def run_drafts(kernel, q, k, v, buffers, lists, valid, *block_lists):
    """-> the step's output rows and the buffers after one call of `kernel` on copies of the inputs"""
    out, keys, values = torch.zeros_like(q), *buffers.clone()
    kernel(out, q, k, v, keys, values, *lists, valid, *block_lists)
    return out, keys, values


def block_lists_of(inputs):
    """-> the step's `draft_block_lists` for `draft_inputs`"""
    _, _, _, buffers, (q_index, read_row, _, own), valid = inputs
    return draft_block_lists(q_index, read_row, own, valid.shape[0], buffers.shape[3])


def test_flex_drafts_attend_as_the_reference():
    """Each draft attends to the columns its (row, KV head) marks, its own K/V written first: as sparse_drafts, over a
    width that is not a whole number of blocks; only the drafts' output rows are written."""
    inputs = draft_inputs(DRAFT_BLOCK + 5)
    reference = run_drafts(attention.sparse_drafts, *inputs)
    out, keys, values = run_drafts(flex_drafts, *inputs, *block_lists_of(inputs))
    assert torch.allclose(out, reference[0], atol=1e-5)
    assert torch.equal(keys, reference[1]) and torch.equal(values, reference[2])
    assert out[[1, 3, 0, 4]].abs().sum(-1).gt(0).all() and not out[2].any()
    # a mask ignored would change the rows: the columns each draft does not see matter
    unmasked = run_drafts(attention.sparse_drafts, *inputs[:5], torch.ones_like(inputs[5]))
    assert not torch.allclose(unmasked[0], out, atol=1e-3)


def test_the_block_lists_cover_each_read_row_and_nothing_else():
    """The compiled kernel visits a row's listed blocks only: every row a draft reads lists the blocks that hold its
    columns up to its draft's own, in order, and the rows no draft reads list none; the mask reads `valid`, and nothing
    past column N. Each row a draft reads takes that draft's query."""
    inputs = draft_inputs(DRAFT_BLOCK + 5)
    q, k, v, buffers, (q_index, read_row, _, _), valid = inputs
    counts, ids, row_queries = block_lists_of(inputs)
    mask = draft_block_mask(valid, counts, ids, 3, buffers.shape[3])
    counts = mask.kv_num_blocks.flatten()
    assert counts[read_row].tolist() == [1, 2, 1, 2] and counts[[1, 4, 6]].eq(0).all()
    assert row_queries[read_row].tolist() == q_index.tolist()
    assert torch.equal(mask.kv_indices[:, 0, 0, :2], torch.tensor([[0, 1]] * 7, dtype=torch.int32))
    b, h, kv = torch.meshgrid(torch.arange(7), torch.arange(N_KV), torch.arange(2 * DRAFT_BLOCK), indexing="ij")
    seen = mask.mask_mod(b, h, torch.zeros_like(b), kv)
    assert torch.equal(seen[..., :DRAFT_BLOCK + 5], valid) and not seen[..., DRAFT_BLOCK + 5:].any()


def test_the_paged_fast_path_sends_drafts_read_in_place_to_flex():
    """With the paged path on, drafts that read their rows in place go to flex_drafts, those that copy their rows
    out (read_row None) to the reference."""
    calls = []
    dispatch = drafts_by_reading(lambda *a: calls.append("gathered"), lambda *a: calls.append("in place"))
    dispatch(*[None] * 7, torch.tensor([0]), None, None, None)
    dispatch(*[None] * 7, None, None, None, None)
    assert calls == ["in place", "gathered"]
    kernels.use_paged_reference()
    try:
        inputs = draft_inputs(DRAFT_BLOCK)
        assert torch.allclose(run_drafts(attention._kernels["sparse"], *inputs, *block_lists_of(inputs))[0],
                              run_drafts(attention.sparse_drafts, *inputs)[0], atol=1e-5)
    finally:
        kernels.use_eager_kernels()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention's kernel reads block lists on a GPU alone")
def test_compiled_drafts_visit_the_blocks_they_see_and_attend_as_the_reference():
    """Compiled on the GPU, the kernel visits only each row's listed blocks (its draft's own column's and those
    before): the drafts attend as sparse_drafts does, and a row listed a block short would not."""
    inputs = draft_inputs(DRAFT_BLOCK + 5, device="cuda", head_dim=16)
    reference = run_drafts(attention.sparse_drafts, *inputs)
    compiled = torch.compile(flex_drafts, dynamic=False)
    counts, ids, row_queries = block_lists_of(inputs)
    out, keys, values = run_drafts(compiled, *inputs, counts, ids, row_queries)
    assert torch.allclose(out, reference[0], atol=1e-5)
    assert torch.equal(keys, reference[1]) and torch.equal(values, reference[2])
    short = counts.clone()
    short[5] = 1                                                  # row 5's draft sees columns of the second block
    assert not torch.allclose(run_drafts(compiled, *inputs, short, ids, row_queries)[0][4], reference[0][4],
                              atol=1e-3)
