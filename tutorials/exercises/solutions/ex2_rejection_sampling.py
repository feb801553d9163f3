"""Reference solution of exercise 2 (lossless rejection sampling for one request)."""
import torch


def verify_one(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, u_accept: torch.Tensor,
               u_next: float) -> tuple[int, int]:
    K = draft.shape[0]
    n = 0
    while n < K and u_accept[n] * q[n, draft[n]] < p[n, draft[n]]:
        n += 1
    dist = p[K] if n == K else (p[n] - q[n]).clamp_min(0.0)                  # [V]
    cdf = dist.cumsum(0)                                                      # [V]
    token = int(torch.searchsorted(cdf, u_next * cdf[-1], right=True))      # first i with cdf[i] > u * total
    return n, min(token, dist.shape[0] - 1)
