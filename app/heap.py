"""Short full collections in the engine's processes: their start-up heap frozen out of the collector's reach.

CPython's collector walks every object it tracks in its oldest generation whenever the objects that
survived since the last full collection reach a quarter of those it holds. The engine's process
holds a large heap for its whole life (torch, transformers, the model's modules): about 283,000
objects on the 8B shape, and 110-180 ms a full collection, every few seconds under load on an
H200 (docs/PERFORMANCE.md). The collector holds the GIL while it walks, so the loop stands still,
and once the step already queued is done, so does the GPU.

`gc.freeze()` moves every object alive at that moment into a generation the collector never walks.
What is made afterwards is collected as before (full collections then took 1-5 ms), and a frozen
object is still freed by reference counting once unused; only a reference cycle among frozen
objects would stay. vLLM's engine core does the same after start-up.

Ray Serve already freezes each replica once its constructor returns, and its proxy
(RAY_SERVE_FREEZE_GC_ON_STARTUP, on by default): that covers an engine whose loop runs in its
replica. What Serve does not start as a replica freezes here: the engine's own process
(engine_process.py) and the other ranks of a parallel engine (worker.py).
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
    way out, so that the engine's own reference cycles are collected. Thawing thaws everything, so
    this does not nest inside another freeze."""
    freeze_startup_heap()
    try:
        yield
    finally:
        gc.unfreeze()
