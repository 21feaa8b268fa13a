"""Async front of the engine for the serving layer: the model steps in its own thread.

Loop (one thread, the only one touching LLMEngine's state):
  1. apply queued commands (add, abort, add adapter) in arrival order;
  2. if nothing is in flight, block until a command arrives; if a step is and late planning is on
     (`late_planning: true`), keep taking commands until just before it ends (app/engine/step_clock.py);
  3. run one step;
  4. publish a stats snapshot (when idle, else at most every STATS_INTERVAL_S): other threads read
     only that, never the engine's live structures (iterating them mid-step raised at random);
  5. hand each request's output to its asyncio queue.
A step that raises fails the requests it computed (EngineStepError, see LLMEngine.step); when steps
keep failing the loop dies: every open stream gets EngineDeadError and `healthy` turns false.
A step that runs longer than `step_timeout_s` makes `healthy` false too (a stuck loop), so the
serving layer can have the replica replaced. An adapter is read, checked and folded on a loader
thread (LLMEngine.prepare_lora, hundreds of ms on the 8B shape) and only registered by the loop, so
running streams do not wait for it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from app.engine.config import EngineConfig
from app.engine.cpu_team import on_passing_thread
from app.engine.errors import EngineDeadError, EngineStepError, InvalidRequestError
from app.engine.llm_engine import LLMEngine
from app.engine.outputs import EngineStats, RequestOutput
from app.engine.sampling_params import SamplingParams, validate_request

logger = logging.getLogger(__name__)
STATS_INTERVAL_S = 0.05


class Command(enum.Enum):
    ADD = enum.auto()
    ABORT = enum.auto()
    ADD_LORA = enum.auto()
    STOP = enum.auto()


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop has closed: nobody is left to read it
            pass

    async def outputs(self, abort: Callable[[], None]) -> AsyncIterator[RequestOutput]:
        """The request's outputs until the last; a failure is raised; leaving early calls `abort`."""
        finished = False
        try:
            while not finished:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item.error, InvalidRequestError):
                    raise item.error
                if item.error is not None:
                    raise EngineStepError(item.error)
                finished = item.finished
                yield item
        finally:
            if not finished:
                abort()


def deliver(engine, outputs: list[RequestOutput]) -> None:
    """Both engines': each output to its request's stream (a finished one's stream is let go), with
    one wakeup of each event loop for them all: call_soon_threadsafe writes to the loop's self-pipe
    every time it is called, so one call per output would cost a step at 256 streams 256 writes."""
    with engine._lock:
        found = [(engine._streams.pop(out.request_id, None) if out.finished else engine._streams.get(out.request_id),
                  out) for out in outputs]
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, out in found:
        if stream is not None:
            by_loop.setdefault(stream.loop, []).append((stream.queue, out))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the event loop has closed: nobody is left to read them
            pass


def fail_request(engine, request_id: str, exc: BaseException) -> None:
    """Both engines': a request refused on arrival ends its stream with `exc`."""
    with engine._lock:
        stream = engine._streams.pop(request_id, None)
    if stream is not None:
        stream.put(exc)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue_, out in items:
        queue_.put_nowait(out)


async def stream_request(engine, request_id: str, submit: Callable[[], None]) -> AsyncIterator[RequestOutput]:
    """Both engines' generate (this loop thread's and EngineProcess'): register the request's stream
    (one per id in flight), `submit` its ADD command, yield its outputs; leaving early aborts it at
    once. Submitted outside the lock: a loop that dies after the stream is registered fails it."""
    stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
    with engine._lock:
        engine._raise_if_dead()
        if request_id in engine._streams:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
        engine._streams[request_id] = stream
    submit()
    async with aclosing(stream.outputs(lambda: engine.abort(request_id))) as outputs:
        async for item in outputs:
            yield item


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None, step_timeout_s: float = 60.0):
        self.engine = engine or on_passing_thread(LLMEngine, config)  # app/engine/cpu_team.py
        self.step_timeout_s = step_timeout_s
        self._step_started: float | None = None  # monotonic start of the step in progress
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # One thread: adapters are prepared, and so registered, in the order they were asked for.
        self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="adapter-loader")
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._dead: BaseException | None = None
        self._stats = self.engine.stats()  # the loop's latest snapshot (replaced whole, never mutated)
        self._stats_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # -- the API -----------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       adapter_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they are produced; the last has finished=True.
        Raises InvalidRequestError before the first output; leaving the iteration early aborts."""
        params = validate_request(prompt_token_ids, params, self.engine.limits)
        command = (Command.ADD, (request_id, prompt_token_ids, params, adapter_id, time.time_ns()))
        async for item in stream_request(self, request_id, lambda: self._commands.put(command)):
            yield item

    async def add_lora(self, name: str, path: str) -> None:
        """Prepare an adapter off the loop (app/engine/cpu_team.py), then register it on the loop thread."""
        self._raise_if_dead()
        try:
            preparing = self._loader.submit(on_passing_thread, self.engine.prepare_lora, name, path)
            prepared = await asyncio.wrap_future(preparing)
        except asyncio.CancelledError:
            self._raise_if_dead()  # shut down with the load still queued: say so, not "cancelled"
            raise
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:  # the loop's death fails what is queued under this lock: nothing waits forever
            self._raise_if_dead()
            self._commands.put((Command.ADD_LORA, (name, path, prepared, done)))
        await asyncio.wrap_future(done)

    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise self._dead_error()

    def _dead_error(self) -> EngineDeadError:
        if isinstance(self._dead, EngineDeadError):
            return self._dead
        return EngineDeadError(f"engine loop died: {type(self._dead).__name__}")

    def has_lora(self, name: str) -> bool:
        return name in self._stats.lora.get("host", ())

    def abort(self, request_id: str) -> None:
        self._commands.put((Command.ABORT, request_id))

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def healthy(self) -> bool:
        started = self._step_started
        stuck = started is not None and time.monotonic() - started > self.step_timeout_s
        return self._dead is None and self._thread.is_alive() and not stuck

    def shutdown(self) -> None:
        self._commands.put((Command.STOP, None))
        self._thread.join(timeout=30)
        # Streams still open and adapters still loading end now, rather than wait for a loop that is gone.
        # Dead first: a load whose preparation is cancelled below must find it so (not a bare cancel).
        self._fail_everything(EngineDeadError("the engine was shut down"))
        self._loader.shutdown(wait=False, cancel_futures=True)
        if not self._thread.is_alive():  # the loop thread is the only one that touches the engine
            self.engine.shutdown()

    # -- the loop ----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                if not self._apply_commands(block):
                    return
                self._step_started = time.monotonic()
                outputs = self.engine.step()
                self._step_started = None
                if not self.engine.has_unfinished_requests() or time.monotonic() - self._stats_at > STATS_INTERVAL_S:
                    self._publish_stats()
                deliver(self, outputs)
        except BaseException as exc:  # noqa: BLE001 - any escape means the engine is gone
            logger.exception("engine loop died")
            self._fail_everything(exc)

    def _publish_stats(self) -> None:
        self._stats, self._stats_at = self.engine.stats(), time.monotonic()

    def _fail_everything(self, exc: BaseException) -> None:
        """Every open stream and every queued adapter load fails now, none is left waiting."""
        with self._lock:
            self._dead = exc
            dead = self._dead_error()
            streams, self._streams = list(self._streams.values()), {}
            while True:
                try:
                    command, arg = self._commands.get_nowait()
                except queue.Empty:
                    break
                if command is Command.ADD_LORA:
                    arg[-1].set_exception(dead)
        for stream in streams:
            stream.put(dead)

    def _apply_commands(self, block: bool) -> bool:
        """Apply commands until there are none, waiting for one when `block`, and while a step is in
        flight until just before it ends (LLMEngine.seconds_to_plan). False: told to stop."""
        while True:
            wait = None if block else self.engine.seconds_to_plan()
            try:
                command, arg = self._commands.get(timeout=wait) if wait != 0 else self._commands.get_nowait()
            except queue.Empty:
                return True
            block = False
            if command is Command.STOP:
                return False
            if command is Command.ADD:
                request_id, prompt, params, adapter_id, arrival = arg  # params: as generate validated them
                try:
                    self.engine.add_request(request_id, prompt, params, adapter_id, arrival, validated=True)
                except Exception as exc:  # noqa: BLE001 - a bad request fails alone
                    fail_request(self, request_id, exc)
            elif command is Command.ADD_LORA:
                name, path, prepared, done = arg
                try:
                    self.engine.add_lora(name, path, prepared)
                    self._publish_stats()
                    done.set_result(None)
                except Exception as exc:  # noqa: BLE001 - the caller's problem, not the loop's
                    done.set_exception(exc)
            elif command is Command.ABORT:
                output = self.engine.abort_request(arg)
                if output is not None:
                    deliver(self, [output])
