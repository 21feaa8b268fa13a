"""The engine loop in a process of its own, behind AsyncLLMEngine's API.

Inside a Serve replica the loop shares one interpreter with Ray's serialization and asyncio
threads, and the GIL throttles it: on an H200 the bare engine fell from 15,114 to 471 tok/s beside
two busy pickling threads (tools/bench/loop_contention.py). Here the loop owns its interpreter.
The replica's side sends commands down a pipe and reads one message per step carrying every
request's outputs, which a reader thread (blocked in recv, without the GIL) hands to the streams.

Child loop:
  1. apply queued commands (add, abort), blocking while nothing is in flight, and with late planning
     (`late_planning: true`) while a step is in flight until just before it ends
     (app/engine/step_clock.py); an adapter to add goes to a loader thread (reading, checking,
     folding it takes hundreds of ms on the 8B shape);
  2. register the adapters the loader has prepared, in the order they were asked for;
  3. run one step;
  4. send its outputs, with a stats snapshot when idle or every STATS_INTERVAL_S.
The child exits when the replica's end of the pipe closes, so a killed replica leaves no engine.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import multiprocessing
import threading
import time
from collections.abc import AsyncIterator

from app.engine.async_engine import STATS_INTERVAL_S, Command, _Stream, deliver, fail_request, stream_request
from app.engine.config import EngineConfig
from app.engine.cpu_team import on_passing_thread
from app.engine.errors import EngineDeadError
from app.engine.outputs import EngineStats, pack_outputs, unpack_outputs
from app.engine.sampling_params import SamplingParams, validate_request
from app.heap import freeze_startup_heap

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 1800.0  # loading a large model from a slow disk
LOAD_POLL_S = 0.01  # how often an idle loop looks for a prepared adapter


class EngineProcess:
    """AsyncLLMEngine's API (generate, add_lora, has_lora, abort, stats, healthy, shutdown) over an
    LLMEngine in a child process. `adapters` (name -> path) load before the first request."""

    def __init__(self, config: EngineConfig, adapters: dict[str, str] | None = None, step_timeout_s: float = 60.0,
                 cpu_threads: int | None = None):
        self.step_timeout_s = step_timeout_s
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_child_main, args=(config, dict(adapters or {}), cpu_threads, child),
                                        name="engine-core", daemon=True)
        self._process.start()
        child.close()
        kind, *rest = self._recv_start()
        if kind != "ready":
            self._process.join(timeout=10)
            raise rest[0]
        self.limits, self._stats = rest
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._pending_loras: dict[int, concurrent.futures.Future] = {}
        self._tokens = itertools.count()
        self._dead: str | None = None  # why the engine is gone, as EngineDeadError says it
        self._stopping = False  # shutdown() asked the child to stop: its end is no death to report
        self._last_heard = time.monotonic()
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)
        self._reader.start()

    def _recv_start(self):
        if not self._conn.poll(START_TIMEOUT_S):
            self._process.kill()
            raise RuntimeError(f"the engine process did not start within {START_TIMEOUT_S:g} s")
        try:
            return self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the engine process exited while starting (exit code {self._process.exitcode})") \
                from None

    # -- the API (AsyncLLMEngine's) ------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       adapter_id: str | None = None) -> AsyncIterator:
        params = validate_request(prompt_token_ids, params, self.limits)
        command = (Command.ADD, (request_id, prompt_token_ids, params, adapter_id, time.time_ns()))
        async for item in stream_request(self, request_id, lambda: self._send(command)):
            yield item

    async def add_lora(self, name: str, path: str) -> None:
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._raise_if_dead()
            token = next(self._tokens)
            self._pending_loras[token] = done
        self._send((Command.ADD_LORA, (token, name, path)))
        await asyncio.wrap_future(done)

    def has_lora(self, name: str) -> bool:
        return name in self._stats.lora.get("host", ())

    def abort(self, request_id: str) -> None:
        self._send((Command.ABORT, request_id))

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def healthy(self) -> bool:
        stuck = bool(self._streams) and time.monotonic() - self._last_heard > self.step_timeout_s
        return self._dead is None and self._process.is_alive() and not stuck

    def shutdown(self) -> None:
        self._stopping = True
        self._send((Command.STOP, None))
        self._process.join(timeout=30)
        if self._process.is_alive():
            logger.warning("the engine process did not stop within 30 s of being asked: killed")
            self._process.kill()
        elif self._process.exitcode != 0:
            logger.warning("the engine process exited with code %s on shutdown", self._process.exitcode)
        self._conn.close()

    # -- the replica's side of the pipe --------------------------------------------------------------
    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _send(self, message) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError):  # the child is gone; the reader fails what was in flight
            pass

    def _read(self) -> None:
        """One message per step from the child: outputs, adapter results, failures."""
        try:
            while True:
                kind, *rest = self._conn.recv()
                self._last_heard = time.monotonic()
                if kind == "outputs":
                    packed, stats = rest
                    if stats is not None:
                        self._stats = stats
                    deliver(self, unpack_outputs(packed))
                elif kind == "failed":  # a request the engine refused when it arrived
                    fail_request(self, *rest)
                elif kind == "lora":
                    token, error, stats = rest
                    self._stats = stats
                    done = self._pending_loras.pop(token)
                    if error is not None:
                        done.set_exception(error)
                    else:
                        done.set_result(None)
                elif kind == "dead":
                    raise RuntimeError(rest[0])
        except (EOFError, OSError, RuntimeError) as exc:
            self._fail_everything(str(exc) or f"exit code {self._process.exitcode}")
        except Exception as exc:  # noqa: BLE001 - a message this side cannot take: without its reader
            # every stream would stall until the stuck check, and new ones would still be taken.
            self._fail_everything(f"its reader failed ({type(exc).__name__}: {exc})")

    def _fail_everything(self, reason: str) -> None:
        if self._stopping:  # what is still open ends as the in-thread engine's does at shutdown
            dead = EngineDeadError("the engine was shut down")
        else:
            logger.error("engine process died: %s", reason)
            dead = EngineDeadError(f"engine process died: {reason}")
        with self._lock:
            self._dead = str(dead)
            streams, self._streams = list(self._streams.values()), {}
            loras, self._pending_loras = list(self._pending_loras.values()), {}
        for stream in streams:
            stream.put(dead)
        for done in loras:
            done.set_exception(dead)


def _child_main(config: EngineConfig, adapters: dict[str, str], cpu_threads: int | None, conn) -> None:
    """The engine's process: build it, then step while there is work, until told to stop or orphaned."""
    import torch

    from app.engine.llm_engine import LLMEngine

    if cpu_threads:
        torch.set_num_threads(cpu_threads)
    try:
        engine = LLMEngine(config)
        for name, path in adapters.items():
            engine.add_lora(name, path)
    except BaseException as exc:  # noqa: BLE001 - the replica raises it, with its message
        conn.send(("error", RuntimeError(f"the engine could not start: {type(exc).__name__}: {exc}")))
        return
    freeze_startup_heap()  # app/heap.py: a full collection would stop the loop for 100+ ms
    conn.send(("ready", engine.limits, engine.stats()))
    stats_at = time.monotonic()
    loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="adapter-loader")
    loads: collections.deque = collections.deque()  # (token, name, path, future of the prepared adapter)
    try:
        while True:
            busy = engine.has_unfinished_requests()
            # Busy: take commands until the step computing is nearly done (LLMEngine.seconds_to_plan).
            while conn.poll(engine.seconds_to_plan() if busy else LOAD_POLL_S if loads else None):
                command, arg = conn.recv()
                if command is Command.STOP:
                    return
                if command is Command.ADD_LORA:
                    token, name, path = arg
                    loads.append((token, name, path, loader.submit(on_passing_thread, engine.prepare_lora, name, path)))
                else:
                    _apply(engine, conn, command, arg)
                busy = engine.has_unfinished_requests()
            while loads and loads[0][3].done():
                _register(engine, conn, *loads.popleft())
            if not busy:
                continue
            outputs = engine.step()
            stats = None
            if not engine.has_unfinished_requests() or time.monotonic() - stats_at > STATS_INTERVAL_S:
                stats, stats_at = engine.stats(), time.monotonic()
            conn.send(("outputs", pack_outputs(outputs), stats))
    except EOFError:  # the replica is gone: nobody is left to serve
        return
    except BaseException as exc:  # noqa: BLE001 - the engine is gone; say why before leaving
        logger.exception("engine loop died")
        conn.send(("dead", f"{type(exc).__name__}: {exc}"))
    finally:
        loader.shutdown(wait=False, cancel_futures=True)
        engine.shutdown()


def _apply(engine, conn, command: Command, arg) -> None:
    if command is Command.ADD:
        request_id, prompt, params, adapter_id, arrival = arg
        try:
            engine.add_request(request_id, prompt, params, adapter_id, arrival, validated=True)  # by generate
        except Exception as exc:  # noqa: BLE001 - a bad request fails alone
            conn.send(("failed", request_id, exc))
    elif command is Command.ABORT:
        output = engine.abort_request(arg)
        if output is not None:
            stats = engine.stats() if not engine.has_unfinished_requests() else None
            conn.send(("outputs", pack_outputs([output]), stats))


def _register(engine, conn, token: int, name: str, path: str, prepared: concurrent.futures.Future) -> None:
    try:
        engine.add_lora(name, path, prepared.result())
        conn.send(("lora", token, None, engine.stats()))
    except Exception as exc:  # noqa: BLE001 - the caller's problem (a bad adapter), not the loop's
        conn.send(("lora", token, exc, engine.stats()))
