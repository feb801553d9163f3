"""tools/parity.py: the per-row check names the first piece of the forward whose bits differ between a verification
row and the decode row of its position, on the eager path and on the fast path's padded steps."""
import pytest
import torch

from nano_sparsespec import LLM, SamplingParams
from nano_sparsespec.tools import parity

PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True)


def rows_of(path, prompt, perturb_layer=None, **options):
    """Plain and pillar-lookup (naive) decoding of `prompt` alone in bfloat16 -> the first differing piece of each
    compared verification row (`parity.compare`). With `perturb_layer`, the drafter's model adds 1e-2 to that layer's
    attention output (the output projection's input): a planted difference."""
    options = dict(dtype="bfloat16", runner_class=parity.UnrecordedRunner, block_size=16, stride=4, min_budget=8,
                   budget_ratio=0.1, **options)
    plain = LLM(str(path), method="plain", **options)
    spec = LLM(str(path), method="pillar-lookup", batch_policy="naive", **options)
    if perturb_layer is not None:
        spec.model.layers[perturb_layer].self_attn.o_proj.register_forward_pre_hook(lambda m, args: (args[0] + 1e-2,))
    _, plain_rows = parity.record_rows(plain, prompt, PARAMS)
    _, spec_rows = parity.record_rows(spec, prompt, PARAMS)
    return parity.compare(plain_rows, spec_rows, parity.pieces_in_order(plain.model.config.num_layers))


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_verification_rows_are_the_decode_rows_bit_for_bit(tiny_qwen3, prompts, cuda_graphs):
    """In bfloat16 every compared verification row equals its decode row in every piece, on the eager path and on
    the padded steps of the fast path (decode steps padded to 2 rows, verifications to a bucket: the rows are told
    apart by their request's query rows, not by the forward's)."""
    firsts = rows_of(tiny_qwen3[0], prompts[2], cuda_graphs=cuda_graphs)
    assert firsts[None] >= 10 and set(firsts) == {None}


def test_the_first_piece_that_differs_is_named(tiny_qwen3, prompts):
    """A difference planted in layer 1's attention of the drafter's model: every compared verification row names
    that piece (layer 0 and the qkv projection of layer 1 still agree)."""
    firsts = rows_of(tiny_qwen3[0], prompts[2], perturb_layer=1, cuda_graphs=True)
    assert sum(firsts.values()) >= 3 and set(firsts) == {"layer 1 attention"}


def test_dense_rows_leave_out_padding_and_sparse_drafts():
    """Two dense requests (a decode row, a 3-row verification) padded to 3 query rows, a padding request, and rows of
    the forward outside the dense batch (sparse drafts)."""
    from types import SimpleNamespace
    dense = SimpleNamespace(q_index=torch.tensor([[0, 7, 7], [1, 2, 3], [7, 7, 7]]),
                            q_valid=torch.tensor([[True, False, False], [True, True, True], [False] * 3]))
    positions = [40, 10, 11, 12, 55, 56, 0, 0]
    assert parity.dense_rows(positions, SimpleNamespace(dense=dense)) == {0: (40, 1), 1: (10, 3), 2: (11, 3),
                                                                          3: (12, 3)}
    assert parity.dense_rows(positions, SimpleNamespace(dense=None)) == {}
