"""Host-to-device copies that never wait for the device on purpose: non-blocking, so that a step's
inputs are queued behind the step already on the device (the overlap scheduler) instead of waiting
for it; `torch.tensor(..., device=cuda)` would.

Pinning the host tensors first (a true DMA in stream order) was measured on an H200 and not kept:
no clear gain, and a slower arrival-heavy run (docs/PERFORMANCE.md, guided decoding).
"""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device, non_blocking=True)


def list_to_device(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=dtype), device)
