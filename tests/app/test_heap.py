"""A serving process's start-up heap is frozen out of full collections; what it makes later is not.
Each check runs in a fresh interpreter: freezing is for the life of the process it runs in."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = """
import gc, weakref
from app.heap import freeze_startup_heap, startup_heap_frozen

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a

def tracked(obj):
    return any(o is obj for o in gc.get_objects())
"""


def run(script: str) -> None:
    result = subprocess.run([sys.executable, "-c", PRELUDE + script], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


def test_the_startup_heap_leaves_the_collector_and_later_garbage_is_still_collected():
    run("""
kept = cycle()
dropped = weakref.ref(cycle())  # garbage already: collected before freezing, not kept for good
freeze_startup_heap()
assert dropped() is None
assert gc.get_freeze_count() > 0 and not tracked(kept) and not tracked(kept.other)
later = weakref.ref(cycle())  # garbage made while serving
gc.collect()
assert later() is None
""")


def test_a_measurement_thaws_the_heap_so_its_engine_can_be_freed():
    run("""
engine = cycle()
gone = weakref.ref(engine)
with startup_heap_frozen():
    assert not tracked(engine)
assert gc.get_freeze_count() == 0 and tracked(engine)
del engine
gc.collect()
assert gone() is None
""")
