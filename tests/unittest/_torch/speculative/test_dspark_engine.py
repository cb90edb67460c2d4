"""DSpark in the engine: lossless greedy, oracle-draft acceptance paths, stats, YAML switch."""
from __future__ import annotations

import json
import random

import pytest
import torch

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.models.checkpoint import read_config
from tensorrt_llm._torch.models.modeling_dspark import DSparkForCausalLMBase
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig
from tensorrt_llm._torch.speculative.dspark_worker import DSparkWorker
from tests.unittest._torch.speculative.chi2 import critical, two_sample_chi2

PROMPTS = ["the quick brown fox", "hello world, what is the capital of france?",
           "a paged kv cache holds keys and values in fixed size blocks and the target verifies them",
           "once upon a time", "speculative decoding drafts", "0123456789", "paris is", "a tiny model"]


def _drafter_dir(tmp_path_factory, target_dir, kind: str, **overrides):
    tc = LlamaConfig.from_dict(read_config(target_dir), "target")
    d = DSparkForCausalLMBase.random_init(kind, tc, seed=3, markov_rank=4, **overrides)
    out = tmp_path_factory.mktemp(f"drafter_{kind}")
    d.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def drafters(tmp_path_factory, tiny_llama_dir):
    return {k: _drafter_dir(tmp_path_factory, tiny_llama_dir, k) for k in ("gqa", "mla")}


def _run(target, prompts, params, **kw):
    kw.setdefault("kv_cache_config", {"max_tokens": 4096, "tokens_per_block": 16})
    with LLM(str(target), device="cpu", **kw) as llm:
        outs = llm.generate(prompts, params)
        return [o.outputs[0].token_ids for o in outs], llm.get_stats()


@pytest.fixture(scope="module")
def baseline(tiny_llama_dir):
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    toks, _ = _run(tiny_llama_dir, PROMPTS, params)
    return toks


def _spec(drafter, **kw):
    return {"decoding_type": "DSpark", "speculative_model": str(drafter), **kw}


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("chunked", [True, False])
def test_random_drafter_is_lossless(tiny_llama_dir, drafters, baseline, kind, batch, chunked):
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = PROMPTS[:batch]
    toks, stats = _run(tiny_llama_dir, prompts, params, speculative_config=_spec(drafters[kind]),
                       max_num_tokens=8 if chunked else 256, enable_chunked_prefill=chunked,
                       max_batch_size=batch)
    assert toks == baseline[:batch]
    assert stats["speculative"]["request_steps"] > 0


def _eager_drafts(monkeypatch):
    """Oracles here replace the eager draft step's output: turn the device draft step off."""
    monkeypatch.setattr(DSparkWorker, "enable_device_drafts", lambda self, *a, **k: None)


def _oracle_patch(monkeypatch, truth: dict[tuple, list[int]], seed: int):
    """Replace drafts with the baseline's true future tokens, corrupted after a random prefix (on the
    eager draft path: the device draft step is turned off)."""
    rng = random.Random(seed)
    _eager_drafts(monkeypatch)
    orig = DSparkWorker._draft_group

    def patched(self, reqs, s):
        orig(self, reqs, s)
        for req in reqs:
            k = len(req.draft_tokens)
            fut = truth[tuple(req.prompt_token_ids)][len(req.output_token_ids):][:k]
            keep = rng.randint(0, k)
            drafts = list(fut[:keep]) + [(t + 1) % 512 for t in fut[keep:]]
            drafts += [7] * (k - len(drafts))
            req.draft_tokens = drafts[:k]
    monkeypatch.setattr(DSparkWorker, "_draft_group", patched)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_oracle_drafts_exercise_acceptance_and_stay_lossless(tiny_llama_dir, drafters, baseline,
                                                             monkeypatch, kind):
    from tensorrt_llm.llmapi.tokenizer import TokenizerWrapper
    tk = TokenizerWrapper(tiny_llama_dir)
    truth = {tuple(tk.encode(p)): t for p, t in zip(PROMPTS, baseline)}
    _oracle_patch(monkeypatch, truth, seed=11)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    toks, stats = _run(tiny_llama_dir, PROMPTS, params, speculative_config=_spec(drafters[kind]),
                       max_num_tokens=12)
    assert toks == baseline
    sp = stats["speculative"]
    hist = sp["accept_histogram"]
    assert sum(hist[1:]) > 0 and hist[-1] > 0, hist      # multi-token acceptance happened
    assert sp["acceptance_length"] > 1.5
    # far fewer verify steps than tokens: speculation really advanced several tokens per step
    assert sp["request_steps"] < sum(len(t) for t in baseline)


@pytest.mark.parametrize("rows", ["own", "rotated"])
def test_device_resident_drafts_reach_verification(tiny_llama_dir, drafters, baseline, monkeypatch, rows):
    """Drafts left on the device as `TokenRow`s (what the draft graph leaves) go through segment
    building, the forward and acceptance like host lists: the oracle's AL is unchanged. Rows
    rotated between requests (another request's drafts) lower it; output is lossless either way."""
    from tensorrt_llm._torch.runtime.token_rows import TokenRow, PendingTokens
    from tensorrt_llm.llmapi.tokenizer import TokenizerWrapper
    tk = TokenizerWrapper(tiny_llama_dir)
    truth = {tuple(tk.encode(p)): t for p, t in zip(PROMPTS, baseline)}
    orig = DSparkWorker._draft_group
    seen = {"rows": 0}

    def patched(self, reqs, s):
        orig(self, reqs, s)
        drafts = []
        for req in reqs:
            k = len(req.draft_tokens)
            fut = truth[tuple(req.prompt_token_ids)][len(req.output_token_ids):][:k]
            drafts.append((list(fut) + [7] * k)[:k])
        pend = PendingTokens(torch.tensor(drafts, dtype=torch.long).view(len(reqs), -1))
        shift = 1 if rows == "rotated" else 0
        for j, req in enumerate(reqs):
            req.draft_tokens = pend.row((j + shift) % len(reqs))
            seen["rows"] += isinstance(req.draft_tokens, TokenRow)
    monkeypatch.setattr(DSparkWorker, "_draft_group", patched)
    _eager_drafts(monkeypatch)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    toks, stats = _run(tiny_llama_dir, PROMPTS, params, speculative_config=_spec(drafters["gqa"]),
                       max_batch_size=8)
    assert toks == baseline and seen["rows"] > 0
    al = stats["speculative"]["acceptance_length"]
    if rows == "own":
        assert al > 4.0, al              # the oracle's drafts arrive intact
    else:
        assert al < 2.0, al              # negative control: other requests' drafts


def test_oracle_stop_inside_accepted_run(tiny_llama_dir, drafters, baseline, monkeypatch):
    """max_tokens lands in the middle of an accepted run: output is cut exactly there."""
    from tensorrt_llm.llmapi.tokenizer import TokenizerWrapper
    tk = TokenizerWrapper(tiny_llama_dir)
    truth = {tuple(tk.encode(p)): t for p, t in zip(PROMPTS, baseline)}
    _oracle_patch(monkeypatch, truth, seed=5)
    for n in (1, 3, 7):
        toks, _ = _run(tiny_llama_dir, PROMPTS[:2], SamplingParams(max_tokens=n, ignore_eos=True),
                       speculative_config=_spec(drafters["mla"]))
        assert toks == [b[:n] for b in baseline[:2]]


def test_sampling_with_drafter_runs_and_is_seeded(tiny_llama_dir, drafters):
    params = SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=123, ignore_eos=True)
    a, _ = _run(tiny_llama_dir, PROMPTS[:3], params, speculative_config=_spec(drafters["gqa"]))
    b, _ = _run(tiny_llama_dir, PROMPTS[:3], params, speculative_config=_spec(drafters["gqa"]))
    assert a == b and all(len(t) == 16 for t in a)


def test_accept_stats_json_written(tiny_llama_dir, drafters, tmp_path):
    spec = _spec(drafters["mla"], accept_stats_dir=str(tmp_path / "stats"))
    toks, stats = _run(tiny_llama_dir, PROMPTS[:2], SamplingParams(max_tokens=8, ignore_eos=True),
                       speculative_config=spec)
    data = json.loads((tmp_path / "stats" / "dspark_accept_stats_rank0.json").read_text())
    assert data["request_steps"] == sum(data["accept_histogram"]) > 0
    assert data["accept_histogram"] == stats["speculative"]["accept_histogram"]


def test_yaml_one_line_switch(tiny_llama_dir, drafters, tmp_path):
    reports = {}
    for kind in ("gqa", "mla"):
        y = tmp_path / f"{kind}.yaml"
        y.write_text(f"model: {tiny_llama_dir}\ndevice: cpu\nkv_cache_config:\n  max_tokens: 1024\n"
                     f"speculative_config:\n  decoding_type: DSpark\n  speculative_model: {drafters[kind]}\n")
        with LLM(str(y)) as llm:
            reports[kind] = llm.capacity_report
            out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True))
            assert len(out.outputs[0].token_ids) == 4
    assert reports["gqa"]["pools"]["draft"]["kind"] == "gqa"
    assert reports["mla"]["pools"]["draft"]["kind"] == "mla"
    assert reports["mla"]["pools"]["draft"]["layer_shape"][1:3] == [1, 1]


def test_max_draft_len_above_block_rejected(tiny_llama_dir, drafters):
    with pytest.raises(ValueError, match="max_draft_len"):
        LLM(str(tiny_llama_dir), device="cpu", kv_cache_config={"max_tokens": 512},
            speculative_config=_spec(drafters["gqa"], max_draft_len=99))


def test_bad_target_layer_override_rejected(tiny_llama_dir, drafters):
    with pytest.raises(ValueError, match="target_layer_ids"):
        LLM(str(tiny_llama_dir), device="cpu", kv_cache_config={"max_tokens": 512},
            speculative_config=_spec(drafters["gqa"], target_layer_ids=[0, 1, 40]))


def test_unknown_drafter_backend_rejected(tiny_llama_dir, drafters):
    with pytest.raises(ValueError):
        LLM(str(tiny_llama_dir), device="cpu", kv_cache_config={"max_tokens": 512},
            speculative_config=_spec(drafters["mla"], attention_backend="FLASHINFER"))


def _truncating_stats(max_tokens: list[int], k: int) -> tuple[list[int], int]:
    """(accept histogram, drafted tokens) of an all-accepting oracle when drafts are truncated to
    the ones whose acceptance can be committed: a step may emit cap = m - out tokens, the last of
    them the target's own, so at most cap - 1 drafts count (#19 defect 10: counting cap drafts
    recorded a step as cap + 1 tokens when max_tokens cut it)."""
    hist, drafted = [0] * (k + 1), 0
    for m in max_tokens:
        out = 1                                   # the prefill's token
        while out < m:
            d = min(k, m - out - 1)
            hist[d] += 1
            drafted += d
            out += d + 1
    return hist, drafted


def test_full_drafts_near_max_tokens_commit_capped(tiny_llama_dir, drafters, baseline, monkeypatch):
    """Greedy requests keep all K drafts near max_tokens (their verify segment keeps the graph's
    shape); accept caps the commit: exact lengths, tokens == no-spec greedy, and acceptance stats
    equal those of truncated drafts. Negative control: the uncapped drafts' counts differ."""
    from tensorrt_llm.llmapi.tokenizer import TokenizerWrapper
    tk = TokenizerWrapper(tiny_llama_dir)
    truth = {tuple(tk.encode(p)): t for p, t in zip(PROMPTS, baseline)}
    orig_group, orig_accept = DSparkWorker._draft_group, DSparkWorker.accept
    lengths, uncapped = [], {"hist": None, "drafted": 0}

    def oracle(self, reqs, s):                # drafts = the true future: all accepted
        orig_group(self, reqs, s)
        for req in reqs:
            k = len(req.draft_tokens)
            lengths.append(k)
            req.draft_tokens = truth[tuple(req.prompt_token_ids)][len(req.output_token_ids):][:k]

    def counting_accept(self, req, verified, num_drafts):
        if uncapped["hist"] is None:
            uncapped["hist"] = [0] * (self.max_draft_len + 1)
        uncapped["hist"][len(verified) - 1] += 1          # every verified draft, past the cap too
        uncapped["drafted"] += num_drafts
        return orig_accept(self, req, verified, num_drafts)

    monkeypatch.setattr(DSparkWorker, "_draft_group", oracle)
    monkeypatch.setattr(DSparkWorker, "accept", counting_accept)
    _eager_drafts(monkeypatch)
    max_tokens = [13, 11, 7, 16, 13, 2, 9, 18]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    toks, stats = _run(tiny_llama_dir, PROMPTS, params, speculative_config=_spec(drafters["gqa"]),
                       max_batch_size=3)          # staggered: requests arrive as others finish
    assert [len(t) for t in toks] == max_tokens
    assert toks == [b[:m] for b, m in zip(baseline, max_tokens)]
    k = max(lengths)
    assert set(lengths) == {k} and k > 1          # never truncated near max_tokens
    sp = stats["speculative"]
    hist, drafted = _truncating_stats(max_tokens, k)
    assert sp["accept_histogram"] == hist and sp["draft_tokens"] == drafted
    assert sp["acceptance_length"] == pytest.approx(1 + sum(i * h for i, h in enumerate(hist)) / sum(hist))
    # AL counts committed tokens: the verify steps' tokens are every output token but the prefill's
    assert sum((i + 1) * h for i, h in enumerate(sp["accept_histogram"])) == sum(m - 1 for m in max_tokens)
    # negative control: counting every drafted token (uncapped) gives other statistics
    assert sum(uncapped["hist"]) == sum(hist)
    assert uncapped["hist"] != hist and uncapped["drafted"] > drafted


def _first_two_tokens(target, drafter, n: int, seed0: int):
    spec = {"speculative_config": _spec(drafter)} if drafter else {}
    params = [SamplingParams(max_tokens=2, temperature=1.0, top_k=3, seed=seed0 + i, ignore_eos=True)
              for i in range(n)]
    toks, stats = _run(target, [PROMPTS[0]] * n, params, max_batch_size=64, **spec)
    return [tuple(t) for t in toks], stats


def test_sampled_spec_output_has_the_no_spec_distribution(tiny_llama_dir, drafters, monkeypatch):
    """End to end at T > 0: the (first, second) token pairs of DSpark (batched drafting, the
    RejectionSampler's verification) and of plain sampling are samples of one distribution
    (two-sample chi2); a verifier that accepts every draft, the control, is far from it."""
    import tensorrt_llm._torch.speculative.rejection_sampler as rs
    n = 1200
    plain, _ = _first_two_tokens(tiny_llama_dir, None, n, seed0=0)
    spec, stats = _first_two_tokens(tiny_llama_dir, drafters["gqa"], n, seed0=n)
    assert stats["speculative"]["request_steps"] >= n                  # the second token went through verify
    chi2, dof = two_sample_chi2(plain, spec)
    crit = critical(dof)                          # seen: 8.5 at dof 8
    assert chi2 < crit, (chi2, dof)

    def accept_all_batched(draft_ids, num_drafts, draft_probs, target_probs, *keys):
        rows = torch.arange(len(num_drafts))
        return num_drafts, torch.multinomial(target_probs[rows, num_drafts], 1).squeeze(-1)
    monkeypatch.setattr(rs, "batched_rejection_accept", accept_all_batched)
    biased, _ = _first_two_tokens(tiny_llama_dir, drafters["gqa"], n, seed0=n)
    chi2_bad, dof_bad = two_sample_chi2(plain, biased)
    assert chi2_bad > 3 * crit, (chi2_bad, dof_bad)


def test_acceptance_window_resets(tiny_llama_dir, drafters):
    """#19 defect 10: get_stats() AL was cumulative over the LLM's life; reset_speculative_stats()
    starts a new window that counts only later verify steps."""
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    with LLM(str(tiny_llama_dir), device="cpu", kv_cache_config={"max_tokens": 1024},
             speculative_config=_spec(drafters["gqa"])) as llm:
        llm.generate(PROMPTS[:3], params)
        first = llm.get_stats()["speculative"]["request_steps"]
        llm.generate(PROMPTS[:1], params)
        cumulative = llm.get_stats()["speculative"]["request_steps"]
        llm.reset_speculative_stats()
        assert llm.get_stats()["speculative"]["request_steps"] == 0
        llm.generate(PROMPTS[:1], params)
        window = llm.get_stats()["speculative"]["request_steps"]
    assert first > 0 and window == cumulative - first      # the same request alone, counted again


@pytest.fixture(scope="module")
def mla_unfolded(tiny_llama_dir, drafters):
    """Greedy tokens and stats of the MLA drafter without folds (the folds' reference)."""
    return _run(tiny_llama_dir, PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True),
                speculative_config=_spec(drafters["mla"]))


def _folded_run_equals(tiny_llama_dir, drafters, baseline, mla_unfolded, **folds) -> list:
    """Serve PROMPTS with the MLA drafter folded as `folds` say: greedy output equals no-spec's and the
    unfolded drafter's, and so do its accept statistics; the first fold option on a GQA drafter is
    refused at load. Returns the folded drafter's layers."""
    plain, s_plain = mla_unfolded
    with LLM(str(tiny_llama_dir), device="cpu", kv_cache_config={"max_tokens": 4096, "tokens_per_block": 16},
             speculative_config=_spec(drafters["mla"], **folds)) as llm:
        layers = list(llm._executor.drafter.drafter.layers)
        toks = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True))]
        stats = llm.get_stats()
    assert toks == baseline == plain
    assert stats["speculative"]["accept_histogram"] == s_plain["speculative"]["accept_histogram"]
    option = next(iter(folds))
    with pytest.raises(ValueError, match=f"{option} folds an MLA drafter"):
        LLM(str(tiny_llama_dir), device="cpu", kv_cache_config={"max_tokens": 512},
            speculative_config=_spec(drafters["gqa"], **{option: True}))
    return layers


def test_mla_fold_output_is_lossless_and_refused_for_gqa(tiny_llama_dir, drafters, baseline, mla_unfolded):
    """`mla_fold_output`: every layer of the MLA drafter takes its latent attention output through the
    folded [hidden, H * R] weight; greedy output equals no-spec's and the unfolded drafter's accept
    statistics (float32 on the CPU: the same drafts). A GQA drafter with it is refused at load."""
    layers = _folded_run_equals(tiny_llama_dir, drafters, baseline, mla_unfolded, mla_fold_output=True)
    r = layers[0].self_attn
    assert all(layer.self_attn.w_o_abs is not None for layer in layers)
    assert r.output_weight().shape == (r.o_proj.weight.shape[0], r.num_heads * r.kv_lora_rank)


@pytest.mark.parametrize("both", [False, True], ids=["query", "query+output"])
def test_mla_fold_query_is_lossless_and_refused_for_gqa(tiny_llama_dir, drafters, baseline, mla_unfolded, both):
    """`mla_fold_query` (alone, and with `mla_fold_output`): every layer of the MLA drafter gets its
    absorbed q [q_nope W_UK | q_pe] from the one folded [H (R + rope), hidden] GEMM; greedy output equals
    no-spec's and the unfolded drafter's accept statistics (float32 on the CPU: the same drafts). A GQA
    drafter with it is refused at load."""
    layers = _folded_run_equals(tiny_llama_dir, drafters, baseline, mla_unfolded, mla_fold_query=True,
                                mla_fold_output=both)
    attns = [layer.self_attn for layer in layers]
    r = attns[0]
    assert all(a.q_weights()[3] is None and (a.w_o_abs is not None) == both for a in attns)
    assert r.q_weights()[2].shape == (r.num_heads * r.latent_dim, r.q_proj.weight.shape[1])
