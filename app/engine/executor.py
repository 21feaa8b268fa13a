"""Starting the ranks 1..N-1 of a parallel engine: where they run is the launcher's business.

`ProcessLauncher` spawns local processes (one host; benchmarks, tests, a GPU box without Ray).
The serving layer passes its own launcher that starts Ray actors inside the engine replica's
placement group (deployments/workers.py). Both run app.engine.worker.worker_main.
"""
from __future__ import annotations

import multiprocessing
import os
import socket
from typing import Protocol


class WorkerLauncher(Protocol):
    def rendezvous(self) -> str:
        """A torch.distributed init_method every rank can reach; rank 0 listens there."""

    def device(self, rank: int, device: str) -> str:
        """The torch device rank `rank` uses, given the config's device ("cpu", "cuda")."""

    def start(self, rank: int, kwargs: dict) -> None:
        """Run worker_main(**kwargs) for this rank, without waiting for it."""

    def stop(self) -> None:
        """Wait briefly for the workers to leave (after rank 0 told them to), then end them."""


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def cpu_threads_per_rank(world_size: int) -> int:
    """The CPUs this process may run on, shared among the ranks. Not os.cpu_count(), the host's: in a
    container pinned to fewer CPUs, that many threads outnumber the CPUs, and OpenMP's threads then
    sleep at every barrier instead of spinning (app/engine/cpu_team.py says what that costs)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, usable // world_size)


class ProcessLauncher:
    """Ranks as spawned processes on this host; rank r uses cuda:r on a GPU host."""

    def __init__(self):
        self.processes: list[multiprocessing.Process] = []

    def rendezvous(self) -> str:
        return f"tcp://127.0.0.1:{free_port('127.0.0.1')}"

    def device(self, rank: int, device: str) -> str:
        return f"cuda:{rank}" if device == "cuda" else device

    def start(self, rank: int, kwargs: dict) -> None:
        from app.engine.worker import worker_main

        process = multiprocessing.get_context("spawn").Process(target=worker_main, kwargs=kwargs, daemon=True,
                                                               name=f"engine-rank-{rank}")
        process.start()
        self.processes.append(process)

    def stop(self) -> None:
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        self.processes.clear()
