"""Starting the ranks 1..N-1 of a parallel engine: where they run is the launcher's business.

`ProcessLauncher` spawns local processes (one host; benchmarks, tests, a GPU box without Ray).
The serving layer passes its own launcher that starts Ray actors inside the engine replica's
placement group (deployments/workers.py). Both run app.engine.worker.worker_main.
"""
from __future__ import annotations

import multiprocessing
import os
import random
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


# Ray's own listeners sit below this: GCS 6379, the dashboard 8265, its client 10001, workers 10002-19999.
_FIRST_QUIET_PORT = 20000


def free_port(host: str) -> int:
    """A port nobody listens on now, taken from below the kernel's ephemeral range. A port bound to 0
    comes from inside that range, which every outgoing connection also draws its local port from:
    Ray opens hundreds as it starts, and one took such a port before our listener bound it (a
    Serve proxy's "Failed to bind to address" failed a whole CI run)."""
    first_ephemeral = _first_ephemeral_port()
    if first_ephemeral - _FIRST_QUIET_PORT < 1000:  # an unusual kernel setting: take what it gives
        return _bind(host, 0)
    # The OS's randomness, not the random module's: a process that seeded that (a benchmark, a test)
    # would draw the same ports as every other process seeded alike.
    for port in random.SystemRandom().sample(range(_FIRST_QUIET_PORT, first_ephemeral), 100):
        try:
            return _bind(host, port)
        except OSError:
            continue
    raise OSError(f"no free port on {host} in {_FIRST_QUIET_PORT}-{first_ephemeral - 1} after 100 tries")


def _first_ephemeral_port() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except OSError:  # not Linux: IANA's dynamic range, where macOS and Windows draw
        return 49152


def _bind(host: str, port: int) -> int:
    with socket.socket() as s:
        s.bind((host, port))
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
