"""The sampler's draw: unseeded rows share one draw from the engine's generator, seeded rows keep
their own generators' draws, whatever else is in the batch."""
import numpy as np
import torch

from app.engine import SamplingParams
from app.engine.sampler import Sampler
from app.engine.sequence import Sequence

CPU = torch.device("cpu")


def _seq(i: int, params: SamplingParams, seed: int | None = None) -> Sequence:
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return Sequence(i, f"r{i}", 0, [0], params, frozenset(), generator)


def test_a_seeded_row_draws_the_same_with_or_without_unseeded_neighbours():
    """A seeded sequence with two rows (guesses) and one with a single row: their tokens and the
    recorded generator states are the same alone and amid unseeded rows, truncating or not."""
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)) * 2
    plain, cut = SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)

    def draw(neighbours: bool) -> tuple[list[int], dict]:
        guessing, single = _seq(0, plain, seed=11), _seq(1, plain, seed=12)
        rows, row_logits = [guessing, guessing, single], [logits[0], logits[1], logits[2]]
        if neighbours:  # unseeded rows before, between and after the seeded ones
            others = [_seq(2 + i, cut if i % 2 else plain) for i in range(4)]
            rows = [others[0], guessing, others[1], guessing, others[2], single, others[3]]
            noise = torch.randn(4, 64)
            row_logits = [noise[0], logits[0], noise[1], logits[1], noise[2], logits[2], noise[3]]
        out = Sampler(seed=0, device=CPU)(torch.stack(row_logits), rows)
        seeded = [i for i, seq in enumerate(rows) if seq.generator is not None]
        states = [out.generator_states[i] for i in seeded if i in out.generator_states]
        assert len(states) == 2  # the guessing sequence's rows only
        return [out.token_ids[i] for i in seeded], states

    for _ in range(5):  # several draws, so that a lucky equal token would not hide a difference
        alone, with_others = draw(False), draw(True)
        assert alone[0] == with_others[0]
        assert all(torch.equal(a, b) for a, b in zip(alone[1], with_others[1]))


def test_unseeded_rows_follow_the_distribution():
    """4000 unseeded rows of one fixed logits row in one call, a few seeded rows among them: the
    unseeded tokens' frequencies are the softmax's (total variation, and chi-square at 7 degrees of
    freedom below its 0.999 quantile, 24.3). Rows sharing one draw must still be independent."""
    logits = torch.tensor([2.0, 1.5, 0.9, 0.3, -0.2, -0.4, 1.0, -1.0])
    params = SamplingParams(temperature=0.9)
    n = 4000
    seqs = [_seq(i, params, seed=i if i % 100 == 0 else None) for i in range(n)]
    tokens = Sampler(seed=1, device=CPU)(logits.repeat(n, 1), seqs).token_ids
    sample = [t for t, seq in zip(tokens, seqs) if seq.generator is None]
    target = torch.softmax(logits / params.temperature, dim=-1).numpy()
    counts = np.bincount(sample, minlength=len(target))
    expected = target * len(sample)
    assert 0.5 * np.abs(counts / len(sample) - target).sum() < 0.03
    assert ((counts - expected) ** 2 / expected).sum() < 24.3
