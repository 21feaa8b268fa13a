"""Scheduler over a real BlockManager, no model: budgets, phases, policies."""
from app.engine.block_manager import BlockManager
from app.engine.config import BatchingType, SchedulerPolicy
from app.engine.sampling_params import SamplingParams
from app.engine.scheduler import Scheduler, SchedulerLimits
from app.engine.sequence import Sequence


def make_scheduler(num_blocks=64, block_size=4, max_batch_size=8, max_num_tokens=32, chunked=True,
                   policy=SchedulerPolicy.GUARANTEED_NO_EVICT, batching=BatchingType.INFLIGHT):
    limits = SchedulerLimits(max_batch_size, max_num_tokens, chunked, policy, batching)
    return Scheduler(limits, BlockManager(num_blocks, block_size))


def make_seq(seq_id, prompt_len, max_tokens=8):
    tokens = list(range(seq_id * 100, seq_id * 100 + prompt_len))  # distinct, so no prefix reuse
    return Sequence(seq_id, f"r{seq_id}", 0, tokens, SamplingParams(max_tokens=max_tokens),
                    frozenset(), None)


def run_step(sched):
    """Apply a plan as the engine would, sampling token 7 wherever a step reaches the end."""
    plan = sched.schedule()
    for item in plan.scheduled:
        samples = item.samples
        item.seq.num_computed_tokens += item.num_tokens
        sched.blocks.register_full_blocks(item.seq)
        if samples:
            item.seq.append_token(7, 0.0)
            if item.seq.num_output_tokens >= item.seq.params.max_tokens:
                sched.remove(item.seq)
    return plan


def test_token_budget_and_chunked_prefill():
    sched = make_scheduler(max_num_tokens=16)
    a, b = make_seq(0, 20), make_seq(1, 5)
    sched.add(a)
    sched.add(b)
    plan = run_step(sched)
    assert [(s.seq.seq_id, s.num_tokens) for s in plan.scheduled] == [(0, 16)]
    plan = run_step(sched)  # a finishes its prompt (4), b starts (5)
    assert [(s.seq.seq_id, s.num_tokens) for s in plan.scheduled] == [(0, 4), (1, 5)]
    plan = run_step(sched)
    assert [(s.seq.seq_id, s.num_tokens) for s in plan.scheduled] == [(0, 1), (1, 1)]


def test_whole_prompts_wait_when_chunking_is_off():
    sched = make_scheduler(max_num_tokens=16, chunked=False)
    for i, n in enumerate([10, 10]):
        sched.add(make_seq(i, n))
    plan = run_step(sched)
    assert [(s.seq.seq_id, s.num_tokens) for s in plan.scheduled] == [(0, 10)]


def test_decodes_go_before_prefill_chunks():
    sched = make_scheduler(max_num_tokens=8)
    sched.add(make_seq(0, 4))
    run_step(sched)
    sched.add(make_seq(1, 30))
    plan = run_step(sched)
    assert [(s.seq.seq_id, s.num_tokens) for s in plan.scheduled] == [(0, 1), (1, 7)]


def test_max_batch_size():
    sched = make_scheduler(max_batch_size=2)
    for i in range(3):
        sched.add(make_seq(i, 3))
    plan = run_step(sched)
    assert len(plan.scheduled) == 2 and len(sched.waiting) == 1


def test_guaranteed_no_evict_admits_only_what_can_finish():
    sched = make_scheduler(num_blocks=8, block_size=4)  # each request needs ceil((8 + 8) / 4) = 4 blocks
    for i in range(3):
        sched.add(make_seq(i, 8))
    plan = run_step(sched)
    assert {s.seq.seq_id for s in plan.scheduled} == {0, 1}
    while sched.has_work():
        assert not run_step(sched).preempted
    assert sched.num_preempted_total == 0


def test_max_utilization_preempts_the_latest_and_resumes_it():
    sched = make_scheduler(num_blocks=6, block_size=4, policy=SchedulerPolicy.MAX_UTILIZATION)
    seqs = [make_seq(i, 8) for i in range(3)]
    for s in seqs:
        sched.add(s)
    preempted = []
    while sched.has_work():
        preempted += [s.seq_id for s in run_step(sched).preempted]
    assert preempted and preempted[0] == 2
    assert all(s.num_output_tokens == 8 for s in seqs)
    assert sched.blocks.num_free_blocks == 6


def test_static_batching_admits_a_new_batch_only_when_empty():
    sched = make_scheduler(batching=BatchingType.STATIC)
    sched.add(make_seq(0, 3, max_tokens=4))
    run_step(sched)
    sched.add(make_seq(1, 3))
    for _ in range(3):
        assert [s.seq.seq_id for s in run_step(sched).scheduled] == [0]
    assert [s.seq.seq_id for s in run_step(sched).scheduled] == [1]
