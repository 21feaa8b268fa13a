"""Host-to-device copies that never wait for the device.

A copy from pageable host memory goes through the driver's staging buffer, and the driver may make
it wait for the stream: with a step already queued (the overlap scheduler), the host then waits for
that step, which overlap exists to avoid. A copy from pinned memory is a DMA queued in stream order
and returns at once; torch's caching host allocator keeps the pinned block until the copy has run.
"""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def list_to_device(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list on the device (`torch.tensor(..., device=cuda)` would wait for the stream)."""
    return to_device(torch.tensor(values, dtype=dtype), device)
