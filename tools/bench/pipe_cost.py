"""What one step's outputs cost to cross the engine process's pipe (app/engine/engine_process.py),
on this CPU: the RequestOutput dataclasses as they are, against pack_outputs' tuples. Plain decode
deltas, one token each, as a step at N streams sends them.

    python -m tools.bench.pipe_cost --streams 256 [--json FILE]

- pickle: building the message, on the engine loop's thread;
- send: pickling and writing it into a multiprocessing Pipe read by another process, as the
  engine's process sends to its replica (a reader that falls behind makes the writer wait);
- receive: unpickling, and for the tuples rebuilding the RequestOutputs, on the replica's reader
  thread.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import pickle
import statistics
import time

from app.engine.outputs import CompletionOutput, RequestOutput, pack_outputs, unpack_outputs


def _ms(fn, repeats: int) -> float:
    """Median of 5 rounds, each the mean of `repeats` calls, in ms."""
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        rounds.append((time.perf_counter() - start) / repeats * 1e3)
    return statistics.median(rounds)


def _drain(receiver) -> None:
    """The other process's end: read messages until the sender closes."""
    while True:
        try:
            receiver.recv()
        except (EOFError, OSError):
            return


def measure(streams: int, repeats: int) -> dict:
    outputs = [RequestOutput(f"bench-{i}", [CompletionOutput(0, [1000 + i], None, 0.0)], False) for i in range(streams)]
    forms = {"dataclasses": lambda: outputs, "tuples": lambda: pack_outputs(outputs)}
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    reader = context.Process(target=_drain, args=(receiver,), daemon=True)
    reader.start()
    receiver.close()
    result = {}
    for name, form in forms.items():
        message = pickle.dumps(("outputs", form(), None))
        unpack = unpack_outputs if name == "tuples" else (lambda packed: packed)
        result[name] = {
            "pickle_ms": _ms(lambda: pickle.dumps(("outputs", form(), None)), repeats),
            "send_ms": _ms(lambda: sender.send(("outputs", form(), None)), repeats),
            "receive_ms": _ms(lambda: unpack(pickle.loads(message)[1]), repeats),
            "bytes": len(message)}
    sender.close()
    reader.join(timeout=10)
    return {"streams": streams, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = [measure(n, args.repeats) for n in args.streams]
    for row in rows:
        for name in ("dataclasses", "tuples"):
            r = row[name]
            print(f"{row['streams']:>4} streams, {name:<11}: pickle {r['pickle_ms']:.3f} ms, send {r['send_ms']:.3f} ms, "
                  f"receive {r['receive_ms']:.3f} ms, {r['bytes']} bytes")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": _cpu(), "rows": rows}, f, indent=1)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


if __name__ == "__main__":
    main()
