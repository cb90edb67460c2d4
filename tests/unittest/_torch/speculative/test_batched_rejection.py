"""The "batched" rejection sampler (`batched_rejection.py`) and its wiring, on the CPU.

Distribution: the committed first and second tokens follow the target and the accepted-count
histogram follows the closed form (chi-square, as test_spec_sampling.py does for flashinfer), with
the control of a drafter that lies about its probabilities (it accepts every draft). Batch
invariance: a request commits the same tokens alone and among others with other draft counts.
Wiring: the worker's per-request and per-step entries agree, the executor uses the step entry, and
the seeded end-to-end run repeats.
"""
from __future__ import annotations

import pytest
import torch

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.pyexecutor.sampler import Sampler, draw_key, processed_rows
from tensorrt_llm._torch.speculative.batched_rejection import (accept_uniforms, batched_rejection_accept,
                                                                fine_uniforms)
from tensorrt_llm._torch.speculative.spec_sampling import resolve_rejection_sampler, run_rejection_accept
from test_dspark_engine import drafters  # noqa: F401  (module fixture)
from test_spec_sampling import (CHI2_P999, CPU, K, V, _chi2, _dists, _emitted_probs, _histograms,
                                _sampled_request, _worker)


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


def test_worker_step_and_single_entries_agree(tiny_llama_dir):
    assert resolve_rejection_sampler(CPU, "batched").name == "batched"
    with pytest.raises(ValueError, match="no per-request entry"):
        run_rejection_accept("batched", [0], torch.ones(1, V) / V, torch.ones(2, V) / V, None)
    g = torch.Generator().manual_seed(4)
    rows = [torch.randn(k + 1, V, generator=g) for k in (K, 1, K)]
    qs = [torch.softmax(torch.randn(max(k, 1), V, generator=g), -1) for k in (K, 1, K)]
    drafts = [[0, 1, 2], [5], [7, 7, 7]]

    def reqs():
        return [_sampled_request(rid, d, q[:len(d)]) for rid, d, q in zip((1, 2, 3), drafts, qs)]
    step = _worker(tiny_llama_dir, CPU, "batched")
    batch = reqs()
    pre = step.verify_batch(list(zip(batch, rows)))
    outs = [step.accept(r, x, verified=pre[r.request_id]) for r, x in zip(batch, rows)]
    single = _worker(tiny_llama_dir, CPU, "batched")
    assert outs == [single.accept(r, x) for r, x in zip(reqs(), rows)]    # one at a time: same tokens
    assert all(1 <= len(o) <= len(d) + 1 and o[:-1] == d[:len(o) - 1] for o, d in zip(outs, drafts))
    assert step.stats_.as_dict()["request_steps"] == 3
    with pytest.raises(ValueError, match="request 1: 3 target rows for 3 drafts"):
        step.verify_batch([(reqs()[0], rows[0][:3])])
    torch_worker = _worker(tiny_llama_dir, CPU, "torch")
    assert torch_worker.verify_batch(list(zip(reqs(), rows))) == {}         # other samplers: per request
    # the step entry used the processed (temperature 1) target rows: a hand-built call agrees
    p0 = processed_rows(rows[0], [SamplingParams(temperature=1.0)] * (K + 1))
    fresh = Sampler(0, CPU)
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=11)]
    ak, rk = fresh.stream_keys([1], params, "verify", CPU), fresh.stream_keys([1], params, "verify", CPU)
    a, t = batched_rejection_accept(torch.tensor([drafts[0]]), torch.tensor([K]), qs[0][None], p0[None], ak, rk)
    assert outs[0] == drafts[0][:int(a)] + [int(t)]


def test_engine_runs_batched_verification_and_repeats_per_seed(tiny_llama_dir, drafters, monkeypatch):
    import tensorrt_llm._torch.speculative.dspark_worker as worker_mod
    widths: list[int] = []
    real = worker_mod.batched_rejection_accept
    monkeypatch.setattr(worker_mod, "batched_rejection_accept",
                        lambda ids, *rest: (widths.append(ids.shape[0]), real(ids, *rest))[1])
    spec = {"decoding_type": "DSpark", "speculative_model": str(drafters["gqa"]), "rejection_sampler": "batched"}
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=100 + i, ignore_eos=True) for i in range(6)]
    prompts = ["the quick brown fox", "once upon a time", "paris is", "hello", "a b c", "one two"]

    def run(order):
        with LLM(str(tiny_llama_dir), device="cpu", kv_cache_config={"max_tokens": 2048},
                 speculative_config=spec, max_batch_size=8) as llm:
            assert llm._executor.spec.rejection.name == "batched"
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
