"""The torch backend (the default) in-process, without Ray: what it adds to the engine."""
import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app.backends.torch_backend import TorchBackend
from app.config import ServiceConfig
from app.engine import SamplingParams
from app.protocol.messages import AdapterRef


def test_concurrent_first_uses_of_an_adapter_share_one_load(smollm2_dir, lora_root):
    """Three requests name a new adapter at once: it is read and folded once, and all three get the
    adapter's answer (before, each prepared it, and each registration dropped the device copy)."""
    backend = TorchBackend(ServiceConfig(model=str(smollm2_dir), lora_roots=[str(lora_root)],
                                         kv_cache_config={"max_tokens": 4096}), {})
    prepared = []
    prepare = backend.engine.engine.prepare_lora
    backend.engine.engine.prepare_lora = lambda *args: prepared.append(args[0]) or prepare(*args)
    adapter = AdapterRef("chef", str(lora_root / "chef"), "lora_path")

    async def answer():
        tokens = []
        async for out in backend.generate(f"r{len(tokens)}-{id(tokens)}", [1, 2, 3, 4, 5],
                                          SamplingParams(max_tokens=8, temperature=0.0), adapter):
            tokens += out.outputs[0].token_ids
        return tokens

    async def main():
        return await asyncio.gather(answer(), answer(), answer())
    try:
        answers = asyncio.run(main())
    finally:
        backend.shutdown()
    assert prepared == ["chef"] and answers[0] == answers[1] == answers[2] and len(answers[0]) == 8


def test_more_new_adapters_at_once_than_the_host_cache_holds_all_answer(smollm2_dir, lora_root):
    """Four requests bring four new adapters at once to a host cache of two: each adapter's load
    evicted the one before it, whose request had not reached the engine yet ('not loaded'). Now an
    adapter loaded for a request on its way is kept until it arrives, and one evicted meanwhile is
    loaded again; every answer is the adapter's own, as one request at a time gives it."""
    names = ["sql", "poet", "pirate", "chef"]
    params = SamplingParams(max_tokens=6, temperature=0.0)

    def backend(max_cpu_loras):
        return TorchBackend(ServiceConfig(model=str(smollm2_dir), lora_roots=[str(lora_root)],
                                          max_cpu_loras=max_cpu_loras, kv_cache_config={"max_tokens": 4096}), {})

    async def answer(b, name):
        tokens = []
        async for out in b.generate(f"r-{name}", [1, 2, 3, 4, 5], params,
                                    AdapterRef(name, str(lora_root / name), "lora_path")):
            tokens += out.outputs[0].token_ids
        return tokens

    async def together(b):
        return await asyncio.gather(*(answer(b, name) for name in names))

    async def one_by_one(b):
        return [await answer(b, name) for name in names]

    small, roomy = backend(2), backend(8)
    try:
        got, want = asyncio.run(together(small)), asyncio.run(one_by_one(roomy))
    finally:
        small.shutdown()
        roomy.shutdown()
    assert got == want and len(set(map(tuple, want))) == len(names)


REPO = Path(__file__).resolve().parents[2]
# In a fresh interpreter: pytest's own thread has run torch's CPU ops (an OpenMP team of its own).
ONE_TEAM_SCRIPT = textwrap.dedent("""
    import asyncio, json, os, sys
    import torch
    from app.backends.torch_backend import TorchBackend
    from app.config import ServiceConfig
    from app.engine import SamplingParams
    from app.protocol.messages import AdapterRef

    model, lora_root = sys.argv[1:]
    backend = TorchBackend(ServiceConfig(model=model, lora_roots=[lora_root], cpu_threads=len(os.sched_getaffinity(0)),
                                         kv_cache_config={"max_tokens": 4096}), {})

    async def answer(n, adapter=None):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        async for _ in backend.generate(f"r{n}", list(range(1, 65)), params, adapter):
            pass

    def switches():
        with open(f"/proc/self/task/{backend.engine._thread.native_id}/status") as status:
            return int(status.read().split("\\nvoluntary_ctxt_switches:")[1].split()[0])

    # The loader's thread too. Folding an 8B-shape adapter runs parallel regions; SmolLM2's small
    # test adapters do not, so a large product stands in for that part of the work.
    prepare = backend.engine.engine.prepare_lora
    def prepare_large(*args):  # every torch op here, even making the operands, on the loader's side
        torch.ones(1024, 1024) @ torch.ones(1024, 1024)
        return prepare(*args)
    backend.engine.engine.prepare_lora = prepare_large
    asyncio.run(answer(2, AdapterRef("chef", f"{lora_root}/chef", "lora_path")))
    before, steps = switches(), backend.engine.engine.num_steps
    asyncio.run(answer(48))
    print(json.dumps({"switches": switches() - before, "steps": backend.engine.engine.num_steps - steps}))
    backend.shutdown()
""")


def test_the_engine_loop_keeps_the_only_openmp_team(smollm2_dir, lora_root):
    """While more OpenMP team threads live than there are cores, libgomp has them sleep at every
    barrier instead of spinning (app/engine/cpu_team.py), and the loop thread then waits on the
    kernel in each of a step's hundreds of parallel regions. The model was loaded on the
    constructor's thread, whose team lived on beside the loop's: the loop thread slept about a
    hundred times a decode step (through the DAG a 2-core engine at one stream took 50 ms a token,
    43-47 ms with one team). With the loop's team the only one it sleeps only now and then, when
    another process takes its core (under 1 a step alone, up to ~1.5 a step on a busy 2-core box)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: a team has no second thread to sleep")
    # As torch's defaults have it: an inherited wait policy would make even one team sleep.
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OMP_", "GOMP_"))}
    run = subprocess.run([sys.executable, "-c", ONE_TEAM_SCRIPT, str(smollm2_dir), str(lora_root)],
                         capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**env, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr[-2000:]
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    assert measured["steps"] >= 48 and measured["switches"] < 20 * measured["steps"], measured
