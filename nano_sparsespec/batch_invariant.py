"""Row-invariant arithmetic: a row's result never depends on how many rows share the call.

Why: a verification computes the logits of its k + 1 rows in one forward, a decode step those of
one row per request. Greedy speculation is lossless only if each verification row gets the bits
the decode step would have given it. In float32 the last-place differences of two kernels never
reach the argmax in practice; in bfloat16 they do, at the first near-tie. A library matmul picks
its kernel by shape (a matrix-vector kernel for one row, a different split of the reduction for
more rows), so the same row comes out differently beside 0 or 8 others.

Owns `matmul`, which computes every row inside a tile of `ROW_TILE` rows (padded with zero rows)
so the library always runs the same kernel on the same shape: on the CPU each tile is a call of
its own (the library chooses its kernel, and its split of the work, by the number of rows); on a
GPU one call over the padded rows, in tiles of 32 (cuBLAS computes the rows of one call
independently, but a batch of 16-row products switches kernel with the batch count; the parity
tool, tools/parity.py, checks it on the device). `Linear` is nn.Linear through it.
`mean_of_squares`, the RMS norms' reduction, sums fixed chunks of a row and adds them in order: a
GPU reduction splits a long row over more threads when there are fewer rows. Attention's own
reductions run over fixed-size KV chunks (attention.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ROW_TILE = {"cpu": 16, "cuda": 32}   # rows per matmul tile, by device type
REDUCE_CHUNK = 64   # elements per partial sum of `mean_of_squares`


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] -> [..., M, N], each row computed in a tile of ROW_TILE
    rows."""
    rows, tile = a.shape[-2], ROW_TILE.get(a.device.type, 32)
    if rows % tile:
        a = F.pad(a, (0, 0, 0, -rows % tile))                          # [..., M', K]
    if a.device.type != "cpu" or a.shape[-2] == tile:
        return torch.matmul(a, b)[..., :rows, :]
    return torch.cat([torch.matmul(part, b) for part in a.split(tile, dim=-2)],
                     dim=-2)[..., :rows, :]


def mean_of_squares(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] float -> mean of x^2 over the last dimension [..., 1], row-invariant."""
    D = x.shape[-1]
    if D % REDUCE_CHUNK:
        x = F.pad(x, (0, -D % REDUCE_CHUNK))
    partial = x.pow(2).unflatten(-1, (-1, REDUCE_CHUNK)).sum(-1)
    total = partial[..., 0]
    for i in range(1, partial.shape[-1]):          # in order, elementwise: no reduction kernel
        total = total + partial[..., i]
    return (total / D)[..., None]


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N], row-invariant."""
    return matmul(x.reshape(-1, x.shape[-1]), weight.t()).view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear without bias whose rows are computed independently of each other."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)
