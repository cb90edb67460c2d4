"""Rejection-sampler selection, flashinfer output parsing, and (GPU) the flashinfer kernel's distribution.

CPU: resolution (auto / explicit / unknown), the -1-padded output parser and its counter check,
the zero-residual guard, the Philox reservation, the dispatcher and the worker's wiring.
GPU (flashinfer): the committed first and second tokens follow the target (chi-square, the same
statistic as test_verification.py), the emitted-count histogram follows the closed form, the
torch and flashinfer paths give the same acceptance-length histogram, per-seed reproducibility;
each with a negative control (a drafter that lies about its probabilities accepts every draft).
"""
from __future__ import annotations

import logging

import pytest
import torch

from tensorrt_llm import DSparkDecodingConfig, SamplingParams
from tensorrt_llm._torch.attention_backend.resolver import Resolution
from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttention
from tensorrt_llm._torch.models.checkpoint import read_config
from tensorrt_llm._torch.models.modeling_dspark import DSparkForCausalLMBase
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.sampler import Sampler, processed_probs
from tensorrt_llm._torch.speculative.dspark_worker import DSparkWorker
from tensorrt_llm._torch.speculative.spec_sampling import (
    committed_from_padded, flashinfer_rejection_accept, resolve_rejection_sampler, run_rejection_accept,
    take_philox_seed_offset, unsupported_last_tokens)
from tensorrt_llm._torch.speculative.verification import rejection_accept

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
NO_FI = "ModuleNotFoundError: No module named 'flashinfer'"
V, K = 8, 3
CHI2_P999 = {3: 16.27, 7: 24.32}   # chi-square 99.9% quantiles by degrees of freedom


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson statistic of observed counts against probabilities (as in test_verification.py)."""
    exp = probs * counts.sum()
    return float(((counts - exp) ** 2 / exp.clamp(min=1e-9)).sum())


def _chi2_two_sample(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson homogeneity statistic of two count histograms (df = categories - 1)."""
    a, b = a.double(), b.double()
    pooled = (a + b) / (a.sum() + b.sum())
    return _chi2(a, pooled) + _chi2(b, pooled)


# ---- selection -----------------------------------------------------------------------------
def test_auto_picks_flashinfer_on_cuda_when_it_imports():
    res = resolve_rejection_sampler(CUDA, import_error="")
    assert res.name == "flashinfer" and "CUDA" in res.reason


def test_auto_falls_back_to_torch_with_reason():
    res = resolve_rejection_sampler(CPU, import_error="")
    assert res.name == "torch" and "CUDA device" in res.reason and "cpu" in res.reason
    res = resolve_rejection_sampler(CUDA, import_error=NO_FI)
    assert res.name == "torch" and "No module named 'flashinfer'" in res.reason


def test_explicit_choices():
    assert resolve_rejection_sampler(CUDA, "torch", import_error="").name == "torch"
    assert resolve_rejection_sampler(CUDA, "flashinfer", import_error="").name == "flashinfer"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_rejection_sampler(CPU, "flashinfer")
    with pytest.raises(ValueError, match="No module named 'flashinfer'"):
        resolve_rejection_sampler(CUDA, "flashinfer", import_error=NO_FI)
    with pytest.raises(ValueError, match="unknown rejection sampler 'cuda'"):
        resolve_rejection_sampler(CUDA, "cuda", import_error="")
    with pytest.raises(ValueError, match="unknown rejection sampler"):
        run_rejection_accept("triton", [1], torch.ones(1, V) / V, torch.ones(2, V) / V, None)


# ---- output parsing ------------------------------------------------------------------------
def test_committed_from_padded_layouts():
    drafts = [[2, 1], [2, 1], [2, 1]]
    rows = [[2, 0, -1], [2, 1, 5], [7, -1, -1]]   # reject at 1, all accepted + bonus, reject at 0
    assert committed_from_padded(rows, [1, 2, 0], drafts) == [[2, 0], [2, 1, 5], [7]]


def test_committed_from_padded_rejects_a_counter_that_was_not_zeroed():
    # Negative control: the kernel adds into its counters; a buffer left at 1 from the last
    # launch reads 2 for a row with one accepted draft and would commit the -1 padding.
    with pytest.raises(ValueError, match="does not match emitted=2"):
        committed_from_padded([[2, 0, -1]], [2], [[2, 1]])
    with pytest.raises(ValueError, match="0 <= emitted <= K"):
        committed_from_padded([[2, 1, 5]], [3], [[2, 1]])
    with pytest.raises(ValueError, match="does not match"):   # accepted prefix != drafts
        committed_from_padded([[4, 0, -1]], [1], [[2, 1]])
    with pytest.raises(ValueError, match="K\\+1 outputs"):
        committed_from_padded([[2, 0]], [1], [[2, 1]])
    with pytest.raises(ValueError, match="batch mismatch"):
        committed_from_padded([[2, 0, -1]], [1, 0], [[2, 1]])


def test_unsupported_last_tokens_flags_zero_residual_and_garbage():
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])          # [K=2, V=4]
    p = torch.tensor([[0.2, 0.3, 0.5, 0.0], [0.1, 0.6, 0.3, 0.0], [0.0, 0.0, 0.4, 0.6]])
    out = torch.tensor([[2, -1, -1],      # rejected at 0, token 2: residual 0.5 > 0 -> ok
                        [0, -1, -1],      # token 0: p 0.2 < q 0.5, residual 0 -> flagged
                        [-1, -1, -1],     # uninitialised fallback read as -1 -> flagged
                        [0, 99, -1],      # out of vocab -> flagged
                        [0, 1, 3],        # bonus token 3: p 0.6 -> ok
                        [0, 1, 0]])       # bonus token 0: p 0 -> flagged
    emitted = torch.tensor([0, 0, 0, 1, 2, 2], dtype=torch.int32)
    b = out.shape[0]
    bad = unsupported_last_tokens(out, emitted, q.expand(b, 2, 4), p.expand(b, 3, 4))
    assert bad.tolist() == [False, True, True, True, False, True]


class _FakeCudaGenerator:
    """get_state / set_state of a CUDA generator: (seed, offset) as 16 bytes."""

    device = CUDA

    def __init__(self, seed: int, offset: int):
        self.state = torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8)

    def get_state(self) -> torch.Tensor:
        return self.state.clone()

    def set_state(self, state: torch.Tensor) -> None:
        self.state = state.clone()


def test_philox_reservation_uses_the_current_offset_and_skips_past_it():
    g = _FakeCudaGenerator(-7, 8)   # negative: a seed >= 2**63 read as int64
    assert take_philox_seed_offset(g, K + 1) == (-7, 8)
    assert g.state.view(torch.int64).tolist() == [-7, 12]
    assert take_philox_seed_offset(g, 5) == (-7, 12)   # rounded up to 4 like torch
    assert g.state.view(torch.int64).tolist() == [-7, 20]
    with pytest.raises(ValueError, match="CUDA torch.Generator"):
        take_philox_seed_offset(torch.Generator().manual_seed(0), K + 1)


def test_flashinfer_entry_validates_before_importing():
    q, p = torch.ones(1, K, V) / V, torch.ones(1, K + 1, V) / V
    ids = torch.zeros(1, K, dtype=torch.int32)
    with pytest.raises(ValueError, match="one CUDA device"):
        flashinfer_rejection_accept(ids, q, p, None)
    with pytest.raises(ValueError, match="K\\+1, V"):
        flashinfer_rejection_accept(ids, q, p[:, :K], None)
    with pytest.raises(ValueError, match="K >= 1"):
        flashinfer_rejection_accept(ids[:, :0], q[:, :0], p[:, :1], None)
    with pytest.raises(ValueError, match="must be \\[B, K\\]"):
        flashinfer_rejection_accept(ids[0], q, p, None)


def test_dispatcher_torch_and_empty_flashinfer_match_the_reference():
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(K + 1, V, generator=g), -1)
    q = torch.softmax(torch.randn(K, V, generator=g), -1)
    drafts = [1, 2, 3]
    ref = rejection_accept(drafts, q, p, torch.Generator().manual_seed(5))
    assert run_rejection_accept("torch", drafts, q, p, torch.Generator().manual_seed(5)) == ref
    # K = 0: nothing to verify; flashinfer is not imported and the torch path draws from p_0
    ref0 = rejection_accept([], q[:0], p[:1], torch.Generator().manual_seed(5))
    assert run_rejection_accept("flashinfer", [], q[:0], p[:1], torch.Generator().manual_seed(5)) == ref0


# ---- worker wiring -------------------------------------------------------------------------
def _worker(tiny_llama_dir, device: torch.device, rejection_sampler=None) -> DSparkWorker:
    tc = LlamaConfig.from_dict(read_config(tiny_llama_dir), "t")
    drafter = DSparkForCausalLMBase.random_init("gqa", tc, block_size=4)
    cfg = DSparkDecodingConfig(speculative_model="unused")
    worker = DSparkWorker(cfg, drafter, VanillaAttention(), Resolution("VANILLA", "test"), device,
                          torch.float32, "test", rejection_sampler=rejection_sampler)
    worker.sampler = Sampler(0, device)   # accept() needs only the sampler, not the KV pools
    return worker


def _sampled_request(rid: int, drafts: list[int], q: torch.Tensor) -> LlmRequest:
    req = LlmRequest(rid, [3, 4, 5], SamplingParams(max_tokens=16, temperature=1.0, seed=11))
    req.draft_tokens, req.draft_probs = list(drafts), q
    return req


def test_worker_resolves_torch_on_cpu_and_accepts_through_it(tiny_llama_dir, caplog):
    with caplog.at_level(logging.INFO, logger="tensorrt_llm"):
        worker = _worker(tiny_llama_dir, CPU)
    assert worker.rejection.name == "torch"
    assert "rejection sampling: torch" in caplog.text and "CUDA device" in caplog.text
    assert worker.describe()["rejection_sampler"]["name"] == "torch"
    with pytest.raises(ValueError, match="'flashinfer' cannot run"):
        _worker(tiny_llama_dir, CPU, "flashinfer")

    g = torch.Generator().manual_seed(2)
    rows = torch.randn(K + 1, V, generator=g)
    q = torch.softmax(torch.randn(K, V, generator=g), -1)
    drafts = [0, 1, 2]
    out = worker.accept(_sampled_request(1, drafts, q), rows)
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=11)
    ref = rejection_accept(drafts, q, processed_probs(rows, params), torch.Generator().manual_seed(11))
    assert out == ref
    assert worker.stats_.as_dict()["request_steps"] == 1


# ---- GPU: the flashinfer kernel --------------------------------------------------------------
def _dists(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed target p [K+1, V] and drafter q [K, V], as in test_verification.py."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(K + 1, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(K, V, generator=g) * 1.5, -1)
    return p.to(device), q.to(device)


def _emitted_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[K+1] P(n drafts accepted): alpha_i = sum min(p_i, q_i); P(n) = prod_{i<n} alpha_i (1 - alpha_n)."""
    alpha = torch.minimum(p[:K], q).sum(-1).double().cpu()
    out = torch.empty(K + 1, dtype=torch.float64)
    run = 1.0
    for n in range(K):
        out[n] = run * (1 - alpha[n])
        run *= float(alpha[n])
    out[K] = run
    return out


def _histograms(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Committed rows -> (first-token counts [V], second-token counts [V], accepted-count counts [K+1])."""
    first, second, acc = torch.zeros(V), torch.zeros(V), torch.zeros(K + 1)
    for r in rows:
        first[r[0]] += 1
        if len(r) > 1:
            second[r[1]] += 1
        acc[len(r) - 1] += 1
    return first, second, acc


def _batched(n: int, seed: int, lie: bool = False) -> list[list[int]]:
    """n independent trials in one launch; lie=True reports q := p (accepts every draft)."""
    p, q = _dists(CUDA)
    g = torch.Generator(device=CUDA).manual_seed(seed)
    drafts = torch.multinomial(q, n, replacement=True, generator=g).T.contiguous()   # [n, K] ~ q
    claimed = p[:K] if lie else q
    rows = flashinfer_rejection_accept(drafts, claimed.expand(n, K, V), p.expand(n, K + 1, V), g)
    assert all(1 <= len(r) <= K + 1 and all(0 <= t < V for t in r) for r in rows)
    return rows


@pytest.mark.gpu
def test_flashinfer_matches_target_distribution():
    pytest.importorskip("flashinfer")
    p, q = _dists(CPU)
    first, second, acc = _histograms(_batched(40000, seed=0))
    assert _chi2(first, p[0]) < CHI2_P999[7]
    assert _chi2(second, p[1]) < CHI2_P999[7]
    assert _chi2(acc, _emitted_probs(p, q).float()) < CHI2_P999[3]


@pytest.mark.gpu
def test_flashinfer_accept_every_draft_is_biased_negative_control():
    pytest.importorskip("flashinfer")
    p, q = _dists(CPU)
    first, _, acc = _histograms(_batched(40000, seed=0, lie=True))
    assert acc[K] == acc.sum()                       # every draft accepted
    assert _chi2(first, p[0]) > 10 * CHI2_P999[7]    # committed token follows q, not p
    assert _chi2(acc, _emitted_probs(p, q).float()) > 10 * CHI2_P999[3]


@pytest.mark.gpu
def test_torch_and_flashinfer_acceptance_lengths_agree():
    """Per-request calls (as DSparkWorker.accept makes them) on both paths, same inputs."""
    pytest.importorskip("flashinfer")
    p, q = _dists(CUDA)
    n = 8000
    g = torch.Generator(device=CUDA).manual_seed(1)
    drafts = torch.multinomial(q, n, replacement=True, generator=g).T.tolist()
    hist = {}
    for name in ("torch", "flashinfer"):
        gen = torch.Generator(device=CUDA).manual_seed(2)
        rows = [run_rejection_accept(name, d, q, p, gen) for d in drafts]
        hist[name] = _histograms(rows)
    for i in range(3):   # first token, second token, accepted count
        df = (V if i < 2 else K + 1) - 1
        assert _chi2_two_sample(hist["torch"][i], hist["flashinfer"][i]) < CHI2_P999[df]
    biased = _histograms(_batched(n, seed=3, lie=True))[2]
    assert _chi2_two_sample(hist["torch"][2], biased) > 10 * CHI2_P999[3]


@pytest.mark.gpu
def test_flashinfer_is_reproducible_per_seed_and_advances_the_generator():
    pytest.importorskip("flashinfer")
    p, q = _dists(CUDA)
    drafts = [int(torch.argmax(q[i])) for i in range(K)]

    def run(seed: int) -> list[list[int]]:
        gen = torch.Generator(device=CUDA).manual_seed(seed)
        out = [run_rejection_accept("flashinfer", drafts, q, p, gen) for _ in range(64)]
        assert gen.get_state().view(torch.int64).tolist()[1] == 64 * 4   # K+1 = 4 draws per call
        return out

    a, b = run(7), run(7)
    assert a == b
    assert len({tuple(r) for r in a}) > 1    # the offset moves: calls are not all identical
    assert run(8) != a


@pytest.mark.gpu
def test_worker_accepts_through_flashinfer_on_cuda(tiny_llama_dir):
    pytest.importorskip("flashinfer")
    worker = _worker(tiny_llama_dir, CUDA)
    assert worker.rejection.name == "flashinfer"
    assert worker.describe()["rejection_sampler"]["name"] == "flashinfer"
    p, q = _dists(CUDA)
    rows = torch.log(p)   # temperature 1: processed_probs gives back p
    outs = [worker.accept(_sampled_request(rid, [0, 1, 2], q), rows) for rid in (1, 1, 2)]
    for out in outs:
        assert 1 <= len(out) <= K + 1 and all(0 <= t < V for t in out)
        n = len(out) - 1
        assert out[:n] == [0, 1, 2][:n]
    assert worker.stats_.as_dict()["request_steps"] == 3
