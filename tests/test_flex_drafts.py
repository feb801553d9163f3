"""flex_drafts.py: the drafts' attention on the fast path (flex_attention over the draft buffers in place) against
attention.sparse_drafts, and the block lists its compiled kernel reads (uncompiled, flex_attention ignores them)."""
import torch

from nano_sparsespec import attention, kernels
from nano_sparsespec.flex_drafts import (DRAFT_BLOCK, draft_block_lists, draft_block_mask, drafts_by_reading,
                                         flex_drafts)

H, N_KV, D = 6, 2, 8          # 3 query heads per KV head


def draft_inputs(columns: int, seed: int = 0):
    """A 5-token step whose 4 drafts sit in rows 2, 0, 3 and 5 of 7 buffer rows (rows 1, 4 and 6 read by none), over
    the first `columns` columns of 2 x DRAFT_BLOCK, each (row, KV head) seeing its own random columns."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(5, H, D, generator=g)
    k, v = torch.randn(2, 5, N_KV, D, generator=g).unbind(0)
    buffers = torch.randn(2, 7, N_KV, 2 * DRAFT_BLOCK, D, generator=g)
    valid = torch.rand(7, N_KV, columns, generator=g) < 0.6
    valid[..., 0] = True
    read_row = torch.tensor([2, 0, 3, 5])
    lists = (torch.tensor([1, 3, 0, 4]), read_row, read_row, torch.tensor([5, 3, 0, columns - 1]))
    return q, k, v, buffers, lists, valid


def run_drafts(kernel, q, k, v, buffers, lists, valid, *block_lists):
    """-> the step's output rows and the buffers after one call of `kernel` on copies of the inputs"""
    out, keys, values = torch.zeros(5, H, D), *buffers.clone()
    kernel(out, q, k, v, keys, values, *lists, valid, *block_lists)
    return out, keys, values


def block_lists_of(inputs):
    """-> the step's `draft_block_lists` for `draft_inputs`"""
    _, _, _, buffers, (_, read_row, _, _), valid = inputs
    return draft_block_lists(read_row, valid.shape[0], valid.shape[-1], buffers.shape[3])


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
    """The compiled kernel visits a row's listed blocks only: every row a draft reads lists the blocks that hold its N
    columns, in order, and the rows no draft reads list none; the mask reads `valid`, and nothing past column N."""
    inputs = draft_inputs(DRAFT_BLOCK + 5)
    q, k, v, buffers, (q_index, read_row, _, _), valid = inputs
    mask = draft_block_mask(valid, *block_lists_of(inputs), 3, buffers.shape[3])
    counts = mask.kv_num_blocks.flatten()
    assert counts[read_row].eq(2).all() and counts[[1, 4, 6]].eq(0).all()
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
