"""The test oracle itself: rejection sampling follows the target (chi-square) with a biased control;
the greedy oracle's prefix rule; the AL formula."""
from __future__ import annotations

import torch

from oracle import CHI2_P999, chi2, greedy_accept, rejection_accept

from tensorrt_llm._torch.speculative.accept_stats import AcceptStats

V6 = 6


def _onehot_logits(ids):
    x = torch.full((len(ids), 10), -5.0)
    x[torch.arange(len(ids)), torch.tensor(ids)] = 5.0
    return x


def test_greedy_accept_prefix_and_bonus():
    assert greedy_accept([3, 4, 5], _onehot_logits([3, 4, 5, 6])) == [3, 4, 5, 6]
    assert greedy_accept([3, 9, 5], _onehot_logits([3, 4, 5, 6])) == [3, 4]
    assert greedy_accept([1, 4, 5], _onehot_logits([3, 4, 5, 6])) == [3]
    assert greedy_accept([], _onehot_logits([3])) == [3]


def _run(trials: int, accept_fn):
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, V6, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(2, V6, generator=g) * 1.5, -1)
    first, second = torch.zeros(V6), torch.zeros(V6)
    for _ in range(trials):
        d = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        out = accept_fn(d, q, p, g)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first, second, p, q


def test_rejection_sampling_matches_target_distribution():
    first, second, p, _ = _run(20000, rejection_accept)
    assert chi2(first, p[0]) < CHI2_P999[5]
    assert chi2(second, p[1]) < CHI2_P999[5]


def test_naive_acceptance_is_biased_negative_control():
    def accept_always(d, q, p, g):   # wrong: keeps the draft's distribution
        return list(d) + [int(torch.multinomial(p[2], 1, generator=g))]
    first, _, p, _ = _run(20000, accept_always)
    assert chi2(first, p[0]) > 10 * CHI2_P999[5]


def test_acceptance_length_formula():
    assert AcceptStats.acceptance_length([2, 3, 1]) == 1 + (0 * 2 + 1 * 3 + 2 * 1) / 6
    s = AcceptStats(4)
    for a, k in [(0, 4), (4, 4), (2, 4), (2, 3)]:
        s.record(a, k)
    d = s.as_dict()
    assert d["request_steps"] == 4 and d["acceptance_length"] == 1 + 8 / 4
    assert d["accepted_tokens"] == 8 and d["draft_tokens"] == 15
