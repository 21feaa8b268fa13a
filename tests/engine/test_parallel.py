"""Tensor and pipeline parallel engines (gloo on CPU, ranks as local processes) produce what one
device produces: greedy tokens equal transformers', logprobs and beams equal the single-device
engine's, LoRA adapters sharded with the layers, under preemption and block reuse."""
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.engine import SamplingParams
from app.engine.executor import free_port
from app.engine.parallel import CONTROL_BYTES, Distributed, ParallelLayout
from tests.conftest import hf_greedy, make_engine
from tests.engine.test_exactness import GREEDY, SMALL_POOL, _tiny_prompts, check_preempting_reuse
from tests.engine.test_lora import _run, adapter_dirs, expected  # noqa: F401 - fixtures


@pytest.fixture(scope="module", params=[(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2-pp2"])
def parallel_engine(request, tiny_llama_dir):
    tp, pp = request.param
    engine = make_engine(tiny_llama_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, max_loras=2,
                         **SMALL_POOL)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def single_engine(tiny_llama_dir):
    return make_engine(tiny_llama_dir, max_loras=2, **SMALL_POOL)


def test_greedy_matches_transformers(parallel_engine, tiny_hf):
    check_preempting_reuse(parallel_engine, [hf_greedy(tiny_hf, p, GREEDY.max_tokens) for p in _tiny_prompts()])


def test_logprobs_and_beams_match_one_device(parallel_engine, single_engine):
    prompts = _tiny_prompts()[:3]
    for params in (SamplingParams(max_tokens=12, temperature=0.0, logprobs=True),
                   SamplingParams(max_tokens=10, beam_width=2, n=2, logprobs=True)):
        ours, ref = parallel_engine.generate(prompts, params), single_engine.generate(prompts, params)
        for a, b in zip(ours, ref):
            assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
            for ca, cb in zip(a.outputs, b.outputs):
                assert ca.logprobs == pytest.approx(cb.logprobs, abs=1e-4)


def test_adapters_are_sharded_with_the_layers(parallel_engine, adapter_dirs, expected):  # noqa: F811
    prompts, out = expected
    for name, path in adapter_dirs.items():
        parallel_engine.add_lora(name, path)
    pairs = [(i % 3, name) for i, name in enumerate(["a", "b", "c", "d", "e", "a", None, "d"])]
    assert _run(parallel_engine, prompts, pairs, [0, 0, 1, 2, 3, 4, 5, 6]) == [out[p] for p in pairs]


def test_a_split_the_model_cannot_take_is_refused(smollm2_dir):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 must divide the model's num_attention_heads \(9\)"):
        make_engine(smollm2_dir, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="pipeline_parallel_size 64 exceeds the model's 30 layers"):
        make_engine(smollm2_dir, pipeline_parallel_size=64)


SMALL, LARGE = ("step", [(1, 2)], []), ("add_lora", "x" * (3 * CONTROL_BYTES), set())


def _broadcast_rank(rank: int, init_method: str, results) -> None:
    """Both ranks in child processes: this test process may hold an engine's process group already."""
    dist = Distributed(ParallelLayout(2, 1, rank=rank), init_method, torch.device("cpu"))
    received = [dist.broadcast(SMALL if rank == 0 else None), dist.broadcast(LARGE if rank == 0 else None)]
    results.put((rank, received))
    dist.close()


def test_control_broadcast_carries_messages_larger_than_its_buffer():
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    init_method = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    ranks = [context.Process(target=_broadcast_rank, args=(rank, init_method, results)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    got = dict(results.get(timeout=120) for _ in ranks)
    for process in ranks:
        process.join(timeout=30)
    assert got == {0: [SMALL, LARGE], 1: [SMALL, LARGE]}


def test_a_rank_refuses_a_command_it_does_not_know(single_engine):
    """A rank that skipped a command would fall out of step with rank 0: it stops, naming it."""
    from app.engine.worker import RankCommand, run_command

    shard = single_engine.runner.shard
    with pytest.raises(ValueError, match="unknown command 'resize' from rank 0"):
        run_command(shard, "resize")
    assert run_command(shard, RankCommand.STOP) is False


def test_cpu_ranks_share_the_cpus_this_process_may_run_on():
    """A process pinned to one CPU gives each rank one thread, whatever the host has: more threads
    than CPUs would make OpenMP's threads sleep at every barrier (app/engine/cpu_team.py)."""
    script = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
              "from app.engine.executor import cpu_threads_per_rank; "
              "print(os.cpu_count(), cpu_threads_per_rank(1), cpu_threads_per_rank(2))")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr
    host, one_rank, two_ranks = map(int, run.stdout.split())
    assert (one_rank, two_ranks) == (1, 1), f"pinned to one of the host's {host} CPUs"


def test_free_ports_lie_below_the_ephemeral_range_and_bind():
    """Our listeners' ports (rendezvous, Serve's HTTP, a test cluster's GCS) come from below the
    range the kernel hands outgoing connections, so no connection can hold one before it binds."""
    import socket

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        first_ephemeral = int(f.read().split()[0])
    ports = {free_port("127.0.0.1") for _ in range(20)}
    assert all(20000 <= port < first_ephemeral for port in ports), sorted(ports)
    assert len(ports) > 1  # drawn at random: two processes asking at once rarely meet
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))
