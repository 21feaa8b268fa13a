"""Keep a CPU engine's process to one OpenMP team: torch's CPU work off the loop runs on threads that end.

libgomp gives each thread that starts a parallel region a team of its own, which lives as long as
that thread. While more team threads are alive than the process may use cores, libgomp spins only
about a hundred times at a barrier before it sleeps, and every thread is then woken through the
kernel, at each of the hundreds of parallel regions in a decode step. A replica that loaded the
model on its constructor's thread and then stepped on the loop thread ran that way
(docs/PERFORMANCE.md: a 2-core engine at one stream through the DAG took 50 ms a token, 43-47 ms
with one team). So the model's load and an adapter's preparation run on a thread that ends with
them, and its team with it.
"""
from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_passing_thread(fn: Callable[..., T], *args) -> T:
    """fn(*args) on a thread that ends when it returns; its result, or its error raised here."""
    once = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=getattr(fn, "__name__", "torch-work"))
    try:
        result = once.submit(fn, *args).result()
    except BaseException:
        once.shutdown(wait=False)  # a Ctrl-C surfaces now, not when a long load ends
        raise
    once.shutdown(wait=True)  # the thread, and its team, gone before the loop steps
    return result
