"""Host-to-device copies that do not stall the host, and sending only what changed.

Owns `to_device`: a Python list becomes a tensor on the device through a pinned staging buffer and a non-blocking
copy. A plain `torch.tensor(data, device="cuda")` waits for the copy, and so for everything queued before it: with
delayed verification that would make the host wait for the GPU step it wanted to overlap.
Also `common_prefix`, how much of a list mirrored on the device is still current (the rest must be sent again).
"""
from __future__ import annotations

import torch


def to_device(data, dtype: torch.dtype, device=None) -> torch.Tensor:
    device = torch.device(device or "cpu")
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype).pin_memory().to(device, non_blocking=True)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:          # the usual case, compared at C speed
        return n
    return next(i for i in range(n) if a[i] != b[i])
