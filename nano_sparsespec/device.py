"""Host-to-device copies that do not stall the host, and sending only what changed.

Owns `to_device`: a Python list becomes a tensor on the device through a pinned staging buffer and
a non-blocking copy. A plain `torch.tensor(data, device="cuda")` waits for the copy, and so for
everything queued before it: with delayed verification that would make the host wait for the GPU
step it wanted to overlap.
`Packed` sends many integer lists at once: a step needs a few dozen small index lists, and each
copy costs the host more than its bytes, so a step sends them as one.
Also `common_prefix`: how much of a list mirrored on the device is still current.
Must not know about models, requests or scheduling.
"""
from __future__ import annotations

import math
import struct

import torch


def to_device(data, dtype: torch.dtype, device=None) -> torch.Tensor:
    """`data` (a list or a CPU tensor) as a `dtype` tensor on `device`, not waiting for the copy."""
    device = torch.device(device or "cpu")
    host = data.to(dtype) if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def long_tensor(ints: list[int]) -> torch.Tensor:
    """A flat list of Python ints as a Long CPU tensor [len(ints)].

    Packed as 64-bit ints by `struct`, which converts a list several times faster than
    `torch.tensor` or `array`; OverflowError naming the first int out of range."""
    if not ints:
        return torch.zeros(0, dtype=torch.long)
    try:
        data = bytearray(struct.pack(f"{len(ints)}q", *ints))
    except struct.error:
        bad = next((i for i in ints if not -2**63 <= i < 2**63), None)
        if bad is None:
            raise
        raise OverflowError(f"{bad} does not fit a 64-bit integer") from None
    return torch.frombuffer(data, dtype=torch.long)


class Packed:
    """Named integer lists sent to the device in one copy.

    `flat` [N] Long on the device; `shapes` (name -> shape, in order) its layout. A value is a flat
    list of ints ([N]), a non-empty list of equal-length lists ([N, M]), or a Long CPU tensor of
    either shape (lists computed at once for a whole batch)."""

    def __init__(self, lists: dict[str, list | torch.Tensor], device=None):
        parts, ints, self.shapes = [], [], {}      # ints: the lists since the last tensor
        for name, values in lists.items():
            if isinstance(values, torch.Tensor):
                self.shapes[name] = tuple(values.shape)
                parts += ([long_tensor(ints)] if ints else []) + [values.to(torch.long).flatten()]
                ints = []
            elif values and isinstance(values[0], (list, tuple)):
                self.shapes[name] = (len(values), len(values[0]))
                for row in values:
                    if len(row) != len(values[0]):
                        raise ValueError(f"{name}: rows of {len(values[0])} and {len(row)} values")
                    ints += row
            else:
                self.shapes[name] = (len(values),)
                ints += values
        flat = torch.cat(parts + [long_tensor(ints)]) if parts else long_tensor(ints)
        self.flat = to_device(flat, torch.long, device)

    def size(self, names) -> int:
        """Elements the lists `names` take."""
        return sum(math.prod(self.shapes[name]) for name in names)

    def view(self, name: str) -> torch.Tensor:
        """The sent copy of one list (where a step needs a few of its lists, not all `views`)."""
        names = list(self.shapes)
        start = self.size(names[:names.index(name)])
        return self.flat[start:start + math.prod(self.shapes[name])].view(self.shapes[name])

    def views(self, flat: torch.Tensor | None = None, names=None) -> dict[str, torch.Tensor]:
        """name -> a view of `flat` (default: the sent copy) in this layout.

        `names`: the first few names only, so that `flat` needs to hold only those (a static copy
        of the lists whose sizes do not vary)."""
        names = list(self.shapes) if names is None else list(names)
        if names != list(self.shapes)[:len(names)]:
            raise ValueError(f"{names} is not a leading part of the layout {list(self.shapes)}")
        flat = self.flat if flat is None else flat
        # one split for all the views: a slice per name costs host time, with dozens of names a step
        parts = flat[:self.size(names)].split([math.prod(self.shapes[name]) for name in names])
        return {name: part.view(self.shapes[name]) for name, part in zip(names, parts)}


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:          # the usual case, compared at C speed
        return n
    return next(i for i in range(n) if a[i] != b[i])
