"""Short full collections in a serving process: its start-up heap frozen out of the collector's reach.

CPython's collector walks every object it tracks in its oldest generation whenever the objects that
survived since the last full collection reach a quarter of those it holds. A serving process holds
a large heap for its whole life (torch, transformers, the model's modules, Ray, Serve, FastAPI):
377,000 objects and about 170 ms a full collection in a replica on the 2-core CPU box; 120-142 ms in
the engine's loop on the 8B shape on an H200, 7 times in 20 s of load (docs/PERFORMANCE.md). The
collector holds the GIL while it walks, so the loop and every stream of the process stand still.

`gc.freeze()` moves every object alive at that moment into a generation the collector never walks.
What is made afterwards is collected as before (full collections then took 3-5 ms), and a frozen
object is still freed by reference counting once unused; only a reference cycle among frozen
objects would stay. vLLM's and SGLang's engine processes freeze their heaps after start-up too.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze_startup_heap() -> None:
    """Once a serving process is built, before it serves: today's garbage is freed, the rest frozen."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def startup_heap_frozen() -> Iterator[None]:
    """The same for a measurement that tears its engine down after (tools/benchmark.py): thawed on the
    way out, so that the engine's own reference cycles are collected and its memory comes back."""
    freeze_startup_heap()
    try:
        yield
    finally:
        gc.unfreeze()
