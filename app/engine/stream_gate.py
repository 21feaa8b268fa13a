"""A gate on a CUDA stream that the host opens later, from any thread: work queued behind `close()`
runs once `open()` is called with the ticket it returned. The sampler queues a guided step's
sampling at once and fills the step's token masks on a thread while the host goes on to the next
step; the device waits at the gate only if the fill is not done by the time it gets there.

It is the CUDA driver's stream memory operation cuStreamWaitValue32 on a word of pinned host
memory (through ctypes: torch does not expose it). The word counts tickets up and wraps; the driver
compares `(int32)(word - ticket) >= 0`, so the wrap is safe.

Whoever closes the gate must open it whatever happens: a ticket never opened stalls the stream,
and every later step behind it. The opener must not need anything that a thread waiting on the
stream holds: the sampler's fill thread needs the GIL only to start and to open, and whoever waits
for the stream waits for the fill first (DeviceSample.result) or inside torch, which lets go of the
GIL while it blocks. Anything that waits for the device while the gate is closed waits for the
opener too, and that includes a kernel's first launch (CUDA loads modules lazily, and loading one
waits for the device, and so does a cudaFree when the allocator gives memory back): so the opener
is on its way before anything else is queued behind the gate (Sampler._mask submits the fill
first), and such a wait costs the rest of one fill.
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np
import torch

CU_STREAM_WAIT_VALUE_GEQ = 0x0


class StreamGate:
    def __init__(self, device: torch.device):
        self.device = device
        self._driver = ctypes.CDLL("libcuda.so.1")
        self._wait = _symbol(self._driver, "cuStreamWaitValue32_v2", "cuStreamWaitValue32")
        self._host = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # kept: the word's memory
        self._word = self._host.numpy().view(np.uint32)
        address = ctypes.c_uint64()
        _check(_symbol(self._driver, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")(
            ctypes.byref(address), ctypes.c_void_p(self._host.data_ptr()), ctypes.c_uint(0)), "cuMemHostGetDevicePointer")
        self._address = address.value
        self._tickets = 0
        self._opened, self._lock = 0, threading.Lock()

    @classmethod
    def for_device(cls, device: torch.device) -> StreamGate | None:
        """A gate where the device is CUDA and its driver has stream memory operations (tried once:
        closed, opened, passed), else None."""
        if device.type != "cuda":
            return None
        try:
            gate = cls(device)
            gate.open(gate.close())
            torch.cuda.current_stream(device).synchronize()
            return gate
        except (OSError, AttributeError, RuntimeError):
            return None

    def close(self) -> int:
        """Queue a wait on the device's current stream; returns the ticket that opens it."""
        self._tickets = (self._tickets + 1) & 0xFFFFFFFF
        stream = torch.cuda.current_stream(self.device).cuda_stream
        _check(self._wait(ctypes.c_void_p(stream), ctypes.c_uint64(self._address), ctypes.c_uint32(self._tickets),
                          ctypes.c_uint(CU_STREAM_WAIT_VALUE_GEQ)), "cuStreamWaitValue32")
        return self._tickets

    def open(self, ticket: int) -> None:
        """Let the stream past the wait of `ticket` and of every ticket before it. The word only
        moves forward: a ticket opened late never closes a later one opened first (that wait
        would never end)."""
        with self._lock:
            if (ticket - self._opened) & 0xFFFFFFFF < 0x80000000:
                self._opened = ticket
                self._word[0] = ticket


def _symbol(library, *names):
    for name in names:
        if hasattr(library, name):
            return getattr(library, name)
    raise AttributeError(f"the CUDA driver has none of {names}")


def _check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed with CUDA driver error {status}")
