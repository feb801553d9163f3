"""Host-to-device copies that do not stall the host.

Owns `to_device`: a Python list becomes a tensor on the device through a pinned staging buffer and a non-blocking
copy. A plain `torch.tensor(data, device="cuda")` waits for the copy, and so for everything queued before it: with
delayed verification that would make the host wait for the GPU step it wanted to overlap.
"""
from __future__ import annotations

import torch


def to_device(data, dtype: torch.dtype, device=None) -> torch.Tensor:
    device = torch.device(device or "cpu")
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype).pin_memory().to(device, non_blocking=True)
