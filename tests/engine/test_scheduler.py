"""Scheduler over a real BlockManager, no model: budgets, phases, policies, and what update()
makes of a step's samples (stops, overlapped placeholders, beams)."""
from app.engine.beam_search import BeamGroup
from app.engine.block_manager import BlockManager
from app.engine.config import BatchingType, SchedulerPolicy
from app.engine.outputs import FinishReason
from app.engine.sampler import SamplerOutput
from app.engine.sampling_params import SamplingParams
from app.engine.scheduler import Scheduler, SchedulerLimits
from app.engine.sequence import PENDING_TOKEN, Sequence


def make_scheduler(num_blocks=64, block_size=4, max_batch_size=8, max_num_tokens=32, chunked=True,
                   policy=SchedulerPolicy.GUARANTEED_NO_EVICT, batching=BatchingType.INFLIGHT):
    limits = SchedulerLimits(max_batch_size, max_num_tokens, chunked, policy, batching)
    return Scheduler(limits, BlockManager(num_blocks, block_size))


def make_seq(seq_id, prompt_len, max_tokens=8):
    tokens = list(range(seq_id * 100, seq_id * 100 + prompt_len))  # distinct, so no prefix reuse
    return Sequence(seq_id, f"r{seq_id}", 0, tokens, SamplingParams(max_tokens=max_tokens),
                    frozenset(), None)


def sampled(*token_ids, beams=None):
    return SamplerOutput(list(token_ids), [0.0] * len(token_ids), beams or {})


def run_step(sched):
    """One step with the model left out: token 7 wherever the step reaches the end of a sequence."""
    plan = sched.schedule()
    rows = [item.seq for item in plan.scheduled if item.samples]
    sched.update(plan, rows, sampled(*[7] * len(rows)))
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


def test_overlapped_steps_hold_placeholders_until_read_back():
    """The engine's overlap: step k + 1 is planned and launched before step k is read back."""
    sched = make_scheduler()
    a = make_seq(0, 5, max_tokens=2)
    b = Sequence(1, "r1", 0, list(range(100, 105)), SamplingParams(max_tokens=8, end_id=99), frozenset(), None)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    sched.update(first, [a, b], None)  # launched
    assert (a.pending_row, b.pending_row, a.token_ids[-1]) == (0, 1, PENDING_TOKEN)
    second = sched.schedule()  # computes the placeholders (the runner reads them on the device)
    assert [(s.seq.seq_id, s.start, s.num_tokens) for s in second.scheduled] == [(0, 5, 1), (1, 5, 1)]
    assert sched.update(first, [a, b], sampled(7, 99)) == [a, b]  # read back: b ends on its end id
    assert b.finish_reason is FinishReason.STOP and b.is_finished and not b.block_table
    sched.update(second, [a, b], None)  # a's placeholder is its last token: it leaves while in flight
    assert a.is_finished and not a.block_table and b.pending_row is None
    assert sched.update(second, [a, b], sampled(8, 5)) == [a]  # b's row is dropped
    assert a.output_token_ids == [7, 8] and a.finish_reason is FinishReason.LENGTH and b.output_token_ids == []
    assert not sched.has_work() and sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_beams_fork_share_blocks_and_leave_through_update():
    sched = make_scheduler(block_size=4)
    root = Sequence(0, "r0", 0, list(range(6)), SamplingParams(max_tokens=3, beam_width=2), frozenset(), None)
    group = BeamGroup(root, 2)
    sched.add(root)
    plan = sched.schedule()
    # Both continuations extend the root: a child forks, sharing the full block and copying the partial one.
    sched.update(plan, [root], sampled(-1, beams={0: ([-0.1, -0.2, -3.0, -4.0], [10, 11, 12, 13])}))
    child = group.running[1]
    assert sched.running == group.running == [root, child] and group.seqs == [root, child]
    assert child.block_table[0] == root.block_table[0]
    assert sched.pending_copies == [(root.block_table[1], child.block_table[1])]
    plan = sched.schedule()
    assert plan.block_copies == [(root.block_table[1], child.block_table[1])]
    # Both continuations extend the child: the root leaves with its blocks, the child forks again.
    sched.update(plan, [root, child], sampled(-1, -1, beams={0: ([-5.0, -6.0, -7.0, -8.0], [20, 21, 22, 23]),
                                                             1: ([-0.1, -0.2, -9.0, -9.0], [30, 31, 32, 33])}))
    grandchild = group.running[1]
    assert root.is_finished and not root.block_table and group.running == [child, grandchild]
    assert [child.output_token_ids, grandchild.output_token_ids] == [[11, 30], [11, 31]]
    plan = sched.schedule()
    sched.update(plan, [child, grandchild], sampled(-1, -1, beams={0: ([-1.0, -2.0, -3.0, -4.0], [40, 41, 42, 43]),
                                                                   1: ([-1.0, -2.0, -3.0, -4.0], [50, 51, 52, 53])}))
    assert group.done and len(group.finished) == 2 and not sched.has_work()  # max_tokens: the search ends
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks
