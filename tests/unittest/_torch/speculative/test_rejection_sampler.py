"""RejectionSampler (`rejection_sampler.py`), the one verification path, on the CPU.

Distribution: the committed first and second tokens follow the target and the accepted-count
histogram follows the closed form (chi-square), with the control of a drafter that lies about its
probabilities (it accepts every draft). Greedy rows equal the per-request oracle (`oracle.py`).
Batch invariance: a request commits the same tokens alone and among others (greedy and random rows
mixed, other draft counts). Out-of-vocab drafts are never accepted. The engine's seeded run repeats.
"""
from __future__ import annotations

import pytest
import torch

from tensorrt_llm import LLM, SamplingParams
from oracle import CHI2_P999, K, V, dists, emitted_probs, greedy_accept, histograms
from oracle import chi2 as _chi2
from test_dspark_engine import drafters  # noqa: F401  (module fixture)

from tensorrt_llm._torch.runtime.sampler import Sampler, draw_key
from tensorrt_llm._torch.speculative.rejection_sampler import (RejectionSampler, SpecDecodeMetadata, accept_uniforms,
                                                               batched_rejection_accept, fine_uniforms,
                                                               stack_verify_rows)

CPU = torch.device("cpu")
_dists, _emitted_probs, _histograms = dists, emitted_probs, histograms


def _keys(seeds: range, draw: int) -> torch.Tensor:
    return torch.tensor([draw_key(s, draw, "verify") for s in seeds], dtype=torch.int64)


def _trials(n: int, lie: bool = False) -> list[list[int]]:
    """n independent requests in one call (seeds 0..n-1); lie=True claims q := p."""
    p, q = _dists(CPU)
    g = torch.Generator().manual_seed(5)
    drafts = torch.multinomial(q, n, replacement=True, generator=g).T.contiguous()   # [n, K] ~ q
    claimed = (p[:K] if lie else q).expand(n, K, V)
    acc, tok = batched_rejection_accept(drafts, torch.full((n,), K), claimed, p.expand(n, K + 1, V),
                                     _keys(range(n), 0), _keys(range(n), 1))
    return [drafts[b, :a].tolist() + [t] for b, (a, t) in enumerate(zip(acc.tolist(), tok.tolist()))]


def test_matches_the_target_distribution():
    p, q = _dists(CPU)
    first, second, acc = _histograms(_trials(40000))
    assert _chi2(first, p[0]) < CHI2_P999[7]
    assert _chi2(second, p[1]) < CHI2_P999[7]
    assert _chi2(acc, _emitted_probs(p, q).float()) < CHI2_P999[3]


def test_accept_every_draft_is_biased_negative_control():
    p, q = _dists(CPU)
    first, _, acc = _histograms(_trials(40000, lie=True))
    assert acc[K] == acc.sum()
    assert _chi2(first, p[0]) > 10 * CHI2_P999[7]
    assert _chi2(acc, _emitted_probs(p, q).float()) > 10 * CHI2_P999[3]


def test_uniforms_are_uniform_and_differ_by_position():
    u = accept_uniforms(_keys(range(20000), 0), 4)
    assert 0 < float(u.min()) and float(u.max()) < 1
    counts = torch.histc(u[:, 2], bins=10, min=0, max=1)
    assert _chi2(counts, torch.full((10,), 0.1)) < 27.9                    # dof 9, p = 0.999
    assert float(torch.corrcoef(u[:, :2].T)[0, 1]).__abs__() < 0.03
    same = accept_uniforms(_keys(range(20000), 0).fill_(7), 4)              # control: one key for all
    assert _chi2(torch.histc(same[:, 2], bins=10, min=0, max=1), torch.full((10,), 0.1)) > 1000


def test_the_drawn_token_follows_a_sparse_distribution_and_never_one_without_mass():
    n = 20000
    p = torch.zeros(V)
    p[2], p[5], p[7] = 0.7, 0.2999, 1e-4
    tok = batched_rejection_accept(torch.zeros(n, 0, dtype=torch.int64), torch.zeros(n, dtype=torch.int64),
                                   torch.zeros(n, 0, V), p.expand(n, 1, V), _keys(range(n), 0), _keys(range(n), 1))[1]
    counts = torch.bincount(tok, minlength=V).float()
    assert set(torch.nonzero(counts).flatten().tolist()) <= {2, 5, 7}
    assert _chi2(counts[[2, 5]], torch.tensor([0.7, 0.3])) < CHI2_P999[3]
    u = fine_uniforms(_keys(range(n), 1))
    assert u.dtype == torch.float64 and 0 < float(u.min()) and float(u.max()) < 1
    assert len(set(u.tolist())) == n                                        # 48 bits: no ties
    assert _chi2(torch.histc(u.float(), bins=10, min=0, max=1), torch.full((10,), 0.1)) < 27.9
    # control: a draw that ignores the mass (uniform over V) lands on massless tokens
    flat = batched_rejection_accept(torch.zeros(n, 0, dtype=torch.int64), torch.zeros(n, dtype=torch.int64),
                                    torch.zeros(n, 0, V), torch.full((n, 1, V), 1.0 / V), _keys(range(n), 0),
                                    _keys(range(n), 1))[1]
    assert len(set(flat.tolist()) - {2, 5, 7}) == V - 3


def test_a_request_commits_the_same_alone_and_in_a_batch():
    g = torch.Generator().manual_seed(3)
    counts = [3, 0, 1, 2, 3]
    b = len(counts)
    p = torch.softmax(torch.randn(b, K + 1, V, generator=g), -1)
    q = torch.softmax(torch.randn(b, K, V, generator=g), -1)
    d = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(b, K)
    n = torch.tensor(counts)
    ak, rk = _keys(range(10, 10 + b), 0), _keys(range(10, 10 + b), 1)
    together = torch.stack(batched_rejection_accept(d, n, q, p, ak, rk), 1).tolist()
    for i, c in enumerate(counts):   # alone, with only its own drafts (K = c)
        alone = batched_rejection_accept(d[i:i + 1, :c], n[i:i + 1], q[i:i + 1, :c], p[i:i + 1, :c + 1],
                                      ak[i:i + 1], rk[i:i + 1])
        assert [int(alone[0]), int(alone[1])] == together[i]
    assert together[1][0] == 0                                              # no drafts: nothing accepted
    # control: other keys give other outcomes for some request
    other = torch.stack(batched_rejection_accept(d, n, q, p, ak + 1, rk + 1), 1).tolist()
    assert other != together
    with pytest.raises(ValueError, match="shapes"):
        batched_rejection_accept(d, n, q, p[:, :K], ak, rk)


def _meta(logits, drafts, params, probs=None, rids=None):
    k = logits.shape[1] - 1
    ids = torch.tensor([d + [0] * (k - len(d)) for d in drafts], dtype=torch.int64)
    return SpecDecodeMetadata(rids or list(range(len(drafts))), params, ids,
                              torch.tensor([len(d) for d in drafts]), logits, probs)


def _rows(out: torch.Tensor) -> list[list[int]]:
    return [[t for t in r if t != -1] for r in out.tolist()]


def test_greedy_rows_equal_the_oracle():
    g = torch.Generator().manual_seed(7)
    greedy = SamplingParams(max_tokens=8)
    for trial in range(50):
        b = 1 + trial % 5
        logits = torch.randn(b, K + 1, V, generator=g)
        target = logits.argmax(-1)
        # drafts agree with the target for a random prefix, then differ; some requests draft fewer
        drafts = []
        for i in range(b):
            n = int(torch.randint(0, K + 1, (1,), generator=g))
            agree = int(torch.randint(0, n + 1, (1,), generator=g))
            d = target[i, :n].tolist()
            if agree < n:
                d[agree] = (d[agree] + 1) % V
            drafts.append(d)
        out = _rows(RejectionSampler(Sampler(0, CPU)).forward(_meta(logits, drafts, [greedy] * b)))
        assert out == [greedy_accept(d, logits[i, :len(d) + 1]) for i, d in enumerate(drafts)]
    # control: a sampler that accepts every draft disagrees with the oracle
    d = [(target[0, :K] + 1) % V]
    assert greedy_accept(d[0].tolist(), logits[0]) != d[0].tolist() + [int(target[0, K])]


def _batch_equals_each_alone(logits, drafts, params, probs):
    """Verify the rows together, then each alone: every row must commit the same; returns the batch's rows."""
    together = _rows(RejectionSampler(Sampler(0, CPU)).forward(_meta(logits, drafts, params, probs)))
    for i in range(len(drafts)):
        n = len(drafts[i])
        alone = _rows(RejectionSampler(Sampler(0, CPU)).forward(
            SpecDecodeMetadata([i], [params[i]], torch.tensor([drafts[i]]), torch.tensor([n]),
                               logits[i:i + 1, :n + 1], [probs[i]])))[0]
        assert alone == together[i], i
    return together


def test_greedy_and_random_rows_in_one_step_equal_each_alone():
    g = torch.Generator().manual_seed(8)
    b = 6
    logits = torch.randn(b, K + 1, V, generator=g)
    q = torch.softmax(torch.randn(b, K, V, generator=g), -1)
    params = [SamplingParams(max_tokens=8) if i % 2 else SamplingParams(max_tokens=8, temperature=0.9, seed=i)
              for i in range(b)]
    drafts = [torch.multinomial(q[i], 1, generator=g).view(-1).tolist()[:1 + i % K] for i in range(b)]
    probs = [None if p.greedy else q[i, :len(drafts[i])] for i, p in enumerate(params)]
    together = _batch_equals_each_alone(logits, drafts, params, probs)
    # control: other seeds move some random row
    other = [p if p.greedy else SamplingParams(max_tokens=8, temperature=0.9, seed=100 + i) for i, p in enumerate(params)]
    moved = _rows(RejectionSampler(Sampler(0, CPU)).forward(_meta(logits, drafts, other, probs)))
    assert moved != together and all(moved[i] == together[i] for i in range(1, b, 2))


def test_out_of_vocab_drafts_are_never_accepted():
    """#19 defect 6: the old batched path clamped -1 / V+1 to a valid id, accepted it, and committed
    the raw id; the old torch path wrapped -1 to V-1. Now such a draft is rejected there."""
    logits = torch.zeros(2, K + 1, V)
    logits[:, :, V - 1] = 10.0                                  # the target wants V-1 everywhere
    greedy, hot = SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=1.0, seed=1)
    for params in (greedy, hot):
        out = _rows(RejectionSampler(Sampler(0, CPU)).forward(_meta(logits, [[-1, V - 1], [V + 1, 2]], [params] * 2)))
        assert all(0 <= t < V for r in out for t in r)
        assert [r[0] for r in out] == [V - 1, V - 1]            # rejected at 0, the target's token
    # control: an in-vocab draft equal to the target's choice is accepted
    ok = _rows(RejectionSampler(Sampler(0, CPU)).forward(_meta(logits[:1], [[V - 1] * K], [greedy])))
    assert ok == [[V - 1] * (K + 1)]


def test_stack_verify_rows_pads_short_requests_with_their_last_row():
    x = torch.arange(10.0).view(10, 1)
    assert stack_verify_rows(x, [0, 4], [4, 4]).view(2, 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert stack_verify_rows(x, [5, 0], [2, 4]).view(2, 4).tolist() == [[5, 6, 6, 6], [0, 1, 2, 3]]
    with pytest.raises(ValueError, match="SpecDecodeMetadata shapes"):
        SpecDecodeMetadata([0], [SamplingParams()], torch.zeros(1, 2, dtype=torch.long), torch.tensor([2]),
                           torch.zeros(1, 2, V))


def test_engine_verifies_sampled_requests_in_one_call_and_repeats_per_seed(tiny_llama_dir, drafters, monkeypatch):
    import tensorrt_llm._torch.speculative.rejection_sampler as rs
    widths: list[int] = []
    real = rs.batched_rejection_accept
    monkeypatch.setattr(rs, "batched_rejection_accept",
                        lambda ids, *rest: (widths.append(ids.shape[0]), real(ids, *rest))[1])
    spec = {"decoding_type": "DSpark", "speculative_model": str(drafters["gqa"])}
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=100 + i, ignore_eos=True) for i in range(6)]
    prompts = ["the quick brown fox", "once upon a time", "paris is", "hello", "a b c", "one two"]

    def run(order):
        with LLM(str(tiny_llama_dir), device="cpu", kv_cache_config={"max_tokens": 2048},
                 speculative_config=spec, max_batch_size=8) as llm:
            outs = llm.generate([prompts[i] for i in order], [params[i] for i in order])
            steps = llm.get_stats()["speculative"]["request_steps"]
        return {i: o.outputs[0].token_ids for i, o in zip(order, outs)}, steps
    a, steps = run(range(6))
    b, _ = run([5, 3, 1, 0, 2, 4])                      # other batch order and rows: same tokens
    assert a == b and steps >= 6 and all(len(t) == 12 for t in a.values())
    assert max(widths) == 6                            # the executor verified the six requests in one call
    params[0] = SamplingParams(max_tokens=12, temperature=0.8, seed=999, ignore_eos=True)
    c, _ = run(range(6))
    assert c[0] != a[0] and all(c[i] == a[i] for i in range(1, 6))   # control: a new seed moves only its request


def test_random_rows_with_and_without_draft_probs_in_one_step_equal_each_alone():
    """Sampled rows whose drafter gave distributions (of different lengths) next to sampled rows
    drafted without them (one-hot q on the draft): the batch equals each row alone."""
    g = torch.Generator().manual_seed(9)
    b = 5
    logits = torch.randn(b, K + 1, V, generator=g)
    q = torch.softmax(torch.randn(b, K, V, generator=g), -1)
    params = [SamplingParams(max_tokens=8, temperature=0.8, seed=10 + i) for i in range(b)]
    drafts = [torch.multinomial(q[i], 1, generator=g).view(-1).tolist()[:1 + (2 * i) % K] for i in range(b)]
    probs = [q[i, :len(drafts[i])] if i % 2 == 0 else None for i in range(b)]
    together = _batch_equals_each_alone(logits, drafts, params, probs)
    # control: q one-hot everywhere changes some row that had a distribution
    flat = _rows(RejectionSampler(Sampler(0, CPU)).forward(_meta(logits, drafts, params, [None] * b)))
    assert any(flat[i] != together[i] for i in range(0, b, 2))
