"""Row-invariant matmuls: a row's result never depends on how many rows share the call.

Why: a verification computes the logits of its k + 1 rows in one forward, a decode step those of
one row per request. Greedy speculation is lossless only if each verification row gets the bits
the decode step would have given it. In float32 the last-place differences of two kernels never
reach the argmax in practice; in bfloat16 they do, at the first near-tie. A library matmul picks
its kernel by shape (a matrix-vector kernel for one row, a different split of the reduction for
more rows), so the same row comes out differently beside 0 or 8 others.

Owns `matmul`, which computes every row inside a tile of `ROW_TILE` rows (padded with zero rows)
so the library always runs the same kernel on the same shape: on the CPU each tile is a call of
its own (the library chooses its kernel, and its split of the work, by the number of rows); on a
GPU one call over the padded rows (cuBLAS computes the rows of one call independently; the
parity tool, tools/parity.py, checks it on the device). `Linear` is nn.Linear through it.
Attention's own reductions run over fixed-size KV chunks (attention.py); the norms and the
elementwise pieces (model.py) are per row already.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ROW_TILE = 16   # rows per matmul tile


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] -> [..., M, N], each row computed in a tile of ROW_TILE."""
    rows = a.shape[-2]
    if rows % ROW_TILE:
        a = F.pad(a, (0, 0, 0, -rows % ROW_TILE))                      # [..., M', K]
    if a.device.type != "cpu":
        return torch.matmul(a, b)[..., :rows, :]
    return torch.cat([torch.matmul(tile, b) for tile in a.split(ROW_TILE, dim=-2)],
                     dim=-2)[..., :rows, :]


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N], row-invariant."""
    return matmul(x.reshape(-1, x.shape[-1]), weight.t()).view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear without bias whose rows are computed independently of each other."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)
