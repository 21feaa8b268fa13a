"""Keep a CPU engine's process to one OpenMP team: torch's CPU work off the loop runs on threads that end.

libgomp gives each thread that starts a parallel region a team of its own, which lives as long as
that thread. While more team threads are alive than the process may use cores, libgomp stops
spinning at barriers: every thread sleeps at once and is woken through the kernel, at each of the
hundreds of parallel regions in a decode step. A replica that loaded the model on its constructor's
thread and then stepped on the loop thread ran that way (docs/PERFORMANCE.md: a 2-core engine at
one stream went from 37 to 50 ms a token). So whatever torch work runs off the loop thread (the
model's load, an adapter's preparation) runs on a thread that ends with it, and its team with it.
"""
from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_passing_thread(fn: Callable[..., T], *args) -> T:
    """fn(*args) on a thread that ends when it returns; its result, or its error raised here."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=getattr(fn, "__name__", "torch-work")) as once:
        return once.submit(fn, *args).result()
