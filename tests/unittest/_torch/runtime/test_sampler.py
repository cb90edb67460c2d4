"""Sampler: seeding, greedy equivalences, the sampled distribution, and stop criteria."""
from __future__ import annotations

import pytest
import torch

from tensorrt_llm import SamplingParams
from tensorrt_llm._torch.runtime import sampler as sampler_module
from tensorrt_llm._torch.runtime.sampler import Sampler, draw_key, mix32, processed_probs, race_noise

CPU = torch.device("cpu")
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


# ---- unit ---------------------------------------------------------------------------------
def test_processed_probs_greedy_top_k_top_p():
    x = LOGITS[None]
    assert torch.equal(processed_probs(x, SamplingParams(temperature=0.0)), torch.eye(8)[:1])
    assert torch.equal(processed_probs(x, SamplingParams(temperature=1.0, top_k=1)), torch.eye(8)[:1])
    p = processed_probs(x, SamplingParams(temperature=0.5, top_k=3))[0]
    expect = torch.zeros(8)
    expect[:3] = torch.softmax(LOGITS[:3] / 0.5, -1)
    torch.testing.assert_close(p, expect)
    full = torch.softmax(LOGITS, -1)
    p = processed_probs(x, SamplingParams(temperature=1.0, top_p=0.7))[0]
    k = int((full.cumsum(-1) < 0.7).sum()) + 1            # smallest prefix reaching 0.7
    expect = torch.zeros(8)
    expect[:k] = full[:k] / full[:k].sum()
    torch.testing.assert_close(p, expect)
    tiny = processed_probs(x, SamplingParams(temperature=1.0, top_p=1e-6))[0]
    assert torch.equal(tiny, torch.eye(8)[0])



def _one(sampler, logits, request_id, params) -> int:
    """One request's draw from logits [V] through the batched path (syncs)."""
    return int(sampler.sample_rows(logits[None], [request_id], [params])[0])

def _draws(params, n, seed=0, rid=0):
    s = Sampler(default_seed=seed, device=CPU)
    return torch.tensor([int(s.sample_rows(LOGITS[None], [rid], [params])[0]) for _ in range(n)])


def _chi2(draws, probs):
    counts = torch.bincount(draws, minlength=probs.numel()).double()
    expected = probs.double() * draws.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "drew a token of probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, seed=11),
                                    SamplingParams(temperature=1.3, top_k=5, seed=12),
                                    SamplingParams(temperature=1.0, top_p=0.8, seed=13)],
                         ids=["temp0.7", "topk5", "topp0.8"])
def test_sampled_distribution_matches_processed_softmax(params):
    n = 8000
    draws = _draws(params, n)
    probs = processed_probs(LOGITS[None], params)[0]
    chi2, dof = _chi2(draws, probs)
    crit = {7: 24.32, 4: 18.47, 3: 16.27, 2: 13.82, 1: 10.83}[dof]   # p = 0.001
    assert chi2 < crit, f"chi2 {chi2:.1f} >= {crit} (dof {dof})"
    # negative control: the same draws are far from the *untempered, unfiltered* softmax
    wrong = torch.softmax(LOGITS / (1.0 if params.temperature != 1.0 else 2.0), -1)
    assert _chi2_loose(draws, wrong) > 10 * crit


def _chi2_loose(draws, probs):
    counts = torch.bincount(draws, minlength=probs.numel()).double()
    expected = probs.double() * draws.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_seeds_per_request():
    p = SamplingParams(temperature=1.0, seed=5)
    a, b = _draws(p, 50), _draws(p, 50, seed=99, rid=3)   # explicit seed wins over default/rid
    assert torch.equal(a, b)
    assert not torch.equal(a, _draws(SamplingParams(temperature=1.0, seed=6), 50))
    # no explicit seed: default seed and request id decide
    q = SamplingParams(temperature=1.0)
    assert torch.equal(_draws(q, 50, seed=1, rid=2), _draws(q, 50, seed=1, rid=2))
    assert not torch.equal(_draws(q, 50, seed=1, rid=2), _draws(q, 50, seed=1, rid=3))


def test_interleaved_requests_do_not_share_rng():
    p = SamplingParams(temperature=1.0)
    s = Sampler(0, CPU)
    alone = [_one(s, LOGITS, 1, p) for _ in range(30)]
    s.release(1)
    mixed = []
    for _ in range(30):
        mixed.append(_one(s, LOGITS, 1, p))
        _one(s, LOGITS, 2, p)
    assert mixed == alone


def test_batch_sample_mixes_greedy_and_random_rows():
    s = Sampler(0, CPU)
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    out = s.choose(logits, [1], [1], [SamplingParams(temperature=1.0, top_k=1)])
    assert out.tolist() == [0, 7]
    hot = torch.stack([LOGITS, torch.tensor([0.0] * 7 + [50.0])])
    assert s.choose(hot, [], [], []).tolist() == [0, 7]            # no sampled rows: plain argmax
    flat = torch.zeros(2, 8)
    draws = {tuple(s.choose(flat, [0, 1], [5, 6], [SamplingParams(temperature=1.0)] * 2).tolist()) for _ in range(20)}
    assert len(draws) > 5                                           # rows really sampled (control: argmax is (0, 0))


def test_batched_rows_equal_each_request_alone():
    """A request's draws depend on its seed and draw count only, not on the other rows of the step."""
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
              SamplingParams(temperature=1.0, top_p=0.8, seed=3)]
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS * 0.3])
    batched = Sampler(0, CPU)
    rows = [batched.sample_rows(logits, [10, 11, 12], params).tolist() for _ in range(40)]
    for j, p in enumerate(params):
        alone = Sampler(0, CPU)
        assert [r[j] for r in rows] == [_one(alone, logits[j], 10 + j, p) for _ in range(40)]
    # negative control: another request id (another default seed) draws another sequence
    other = Sampler(0, CPU)
    assert [r[0] for r in rows] != [_one(other, logits[0], 99, params[0]) for _ in range(40)]


def test_race_noise_is_uniform_and_independent_across_draws_and_rows():
    """Flat logits over 16 tokens: draws are uniform, consecutive draws of one request and the
    same draw of neighbouring requests are independent (chi2 on 16 and 16 x 16 cells)."""
    flat = torch.zeros(200, 16)
    s = Sampler(0, CPU)
    draws = torch.stack([s.sample_rows(flat, list(range(200)), [SamplingParams(temperature=1.0)] * 200)
                         for _ in range(60)])                                    # [60 draws, 200 requests]
    uniform = torch.full((16,), 1 / 16)
    assert _chi2(draws.flatten(), uniform)[0] < 37.7                             # dof 15, p = 0.001
    pairs_t = (draws[:-1] * 16 + draws[1:]).flatten()                            # draw k, k+1 of a request
    pairs_r = (draws[:, :-1] * 16 + draws[:, 1:]).flatten()                      # requests r, r+1
    crit = 330.5                                                                 # dof 255, p = 0.001
    assert _chi2(pairs_t, torch.full((256,), 1 / 256))[0] < crit
    assert _chi2(pairs_r, torch.full((256,), 1 / 256))[0] < crit
    # negative control: pairs of a draw with itself fill only the diagonal
    same = (draws * 16 + draws).flatten()
    assert _chi2_loose(same, torch.full((256,), 1 / 256)) > 10 * crit


def test_draft_stream_is_separate_from_the_token_stream():
    """Draft draws (DSpark proposals) neither shift a request's token draws nor repeat them, and
    follow the given distribution (chi2, with a negative control)."""
    p = SamplingParams(temperature=1.0, seed=21)
    probs = torch.softmax(LOGITS, -1)
    plain = Sampler(0, CPU)
    tokens = [int(plain.draw(probs[None], [1], [p])[0]) for _ in range(40)]
    mixed, drafts = Sampler(0, CPU), []
    for _ in range(40):
        drafts.append(int(mixed.draw(probs[None], [1], [p], stream="draft")[0]))
        assert int(mixed.draw(probs[None], [1], [p])[0]) == tokens[len(drafts) - 1]
    assert drafts != tokens
    s = Sampler(0, CPU)
    unseeded = [SamplingParams(temperature=1.0)] * 400                       # seeds from request ids
    many = torch.cat([s.draw(probs.expand(400, -1), list(range(400)), unseeded, stream="draft")
                      for _ in range(10)])                                    # 4000 draws
    assert _chi2(many, probs)[0] < 24.32                                       # dof 7, p = 0.001
    assert _chi2_loose(many, torch.full((8,), 1 / 8)) > 243


# ---- zero-probability tokens never win (issue #19 item 5) -----------------------------------
def _old_race_noise(keys, vocab_hash):
    """The pre-fix noise: 24-bit uniforms whose largest value rounds to 1.0 in float32 (E = 0)."""
    h = mix32(keys[:, None] ^ vocab_hash[None, :])
    return -torch.log(((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24)))


def _mix32_inverse(y: int) -> int:
    """x with mix32(x) == y (each xorshift-16 is its own inverse on 32 bits; the multiply is odd)."""
    inv = pow(0x45D9F3B, -1, 1 << 32)
    y ^= y >> 16
    y = y * inv & 0xFFFFFFFF
    y ^= y >> 16
    y = y * inv & 0xFFFFFFFF
    return y ^ (y >> 16)


def seed_hitting(token: int, vocab: int) -> int:
    """A request seed whose first "token" draw hashes to 0xFFFFFFFF (the largest uniform) at
    `token`: before the fix that cell's noise was E = 0, so a zero-probability token scored NaN."""
    vocab_hash = int(Sampler(0, CPU).vocab_hash(vocab, CPU)[token])
    key = _mix32_inverse(0xFFFFFFFF) ^ vocab_hash
    base = _mix32_inverse(key)                               # draw 0: key = mix32(base)
    seed = _mix32_inverse(_mix32_inverse(base) ^ mix32(0x632BE5AB))   # seed < 2**32
    assert draw_key(seed, 0) == key
    return seed


def test_race_noise_is_positive_at_the_largest_hash():
    """Issue #19 item 5: the hash 0xFFFFFFFF (the largest uniform) must still give E > 0, so a
    zero-probability token scores 0, not 0 / 0 = NaN. Negative control: the pre-fix noise is 0
    there and the zero-probability token wins argmax."""
    key = torch.tensor([_mix32_inverse(0xFFFFFFFF)])
    vocab_hash = torch.tensor([0, 0x12345])                  # token 0 gets the largest hash
    assert int(mix32(key ^ vocab_hash[0])) == 0xFFFFFFFF
    probs = torch.tensor([[0.0, 1.0]])                       # token 0 has probability 0
    noise = race_noise(key, vocab_hash)
    assert bool((noise > 0).all()) and bool(noise.isfinite().all())
    assert int((probs / noise).argmax(-1)) == 1
    old = _old_race_noise(key, vocab_hash)
    assert float(old[0, 0]) == 0.0 and int((probs / old).argmax(-1)) == 0


def test_top_k_50_never_samples_outside_the_top_50_over_5000_draws(monkeypatch):
    """Issue #19 item 5: with top_k=50 every sampled token is among the 50 largest logits of its
    row, over 5,000 draws (random logits, 4k vocab), 8 of them seeded so that the largest hash
    falls on the row's smallest logit. Negative control: the pre-fix noise samples those 8 outside
    the top 50."""
    n, vocab, crafted = 5000, 4096, 8
    logits = 3.0 * torch.randn(n, vocab, generator=torch.Generator().manual_seed(0))
    worst = logits.argmin(-1)
    params = [SamplingParams(temperature=1.0, top_k=50, seed=seed_hitting(int(worst[i]), vocab) if i < crafted
                             else None) for i in range(n)]
    top50 = logits.topk(50, dim=-1).indices

    def draws():
        s = Sampler(0, CPU)
        return torch.cat([s.sample_rows(logits[lo:lo + 250], list(range(lo, lo + 250)), params[lo:lo + 250])
                          for lo in range(0, n, 250)])

    new = draws()
    inside = (top50 == new[:, None]).any(-1)
    assert bool(inside.all()), f"{int((~inside).sum())} draws outside the top 50"
    assert len(set(new.tolist())) > 1000                     # really sampled, not the argmax
    monkeypatch.setattr(sampler_module, "race_noise", _old_race_noise)
    old = draws()
    assert torch.equal(old[:crafted], worst[:crafted])


# ---- end to end ---------------------------------------------------------------------------
@pytest.fixture
def llm(tiny_llama_dir, make_llm):
    return make_llm(tiny_llama_dir)


PROMPT = "once upon a time"


def _ids(llm, params, prompt=PROMPT):
    return llm.generate(prompt, params).outputs[0].token_ids


def test_seeded_sampling_end_to_end(llm):
    p = dict(max_tokens=16, temperature=1.5, ignore_eos=True)
    a = _ids(llm, SamplingParams(seed=1, **p))
    assert a == _ids(llm, SamplingParams(seed=1, **p))
    assert a != _ids(llm, SamplingParams(seed=2, **p))
    assert a != _ids(llm, SamplingParams(max_tokens=16, ignore_eos=True))   # really sampled, not greedy
    # a seeded request gives the same tokens inside a batch of other sampling requests
    outs = llm.generate(["the quick brown fox", PROMPT, "hello world"],
                        [SamplingParams(seed=7, **p), SamplingParams(seed=1, **p), SamplingParams(seed=8, **p)])
    assert outs[1].outputs[0].token_ids == a


def test_top_k1_and_tiny_top_p_equal_greedy(llm):
    greedy = _ids(llm, SamplingParams(max_tokens=24, ignore_eos=True))
    assert _ids(llm, SamplingParams(max_tokens=24, ignore_eos=True, temperature=2.0, top_k=1, seed=3)) == greedy
    assert _ids(llm, SamplingParams(max_tokens=24, ignore_eos=True, temperature=2.0, top_p=1e-6, seed=3)) == greedy


def test_tiny_top_p_at_temperature_one_equals_greedy_over_3000_tokens(llm, monkeypatch):
    """Issue #19 item 5: top_p=1e-6 at temperature 1 keeps only the top token but still goes
    through the draw; 12 x 250 = 3,000 sampled tokens equal greedy. Four requests are seeded so
    that their first draw's largest hash falls on a zero-probability token. Negative control: the
    pre-fix noise (E = 0 there, 0 / 0 = NaN wins argmax) emits that token instead."""
    prompts = [PROMPT, "the quick brown fox", "hello world", "a paged kv cache"] * 3
    greedy = [o.outputs[0].token_ids for o in
              llm.generate(prompts, SamplingParams(max_tokens=250, ignore_eos=True))]
    vocab = llm._bundle.model.config.vocab_size
    traps = [(g[0] + 1) % vocab for g in greedy[:4]]
    params = [SamplingParams(max_tokens=250, ignore_eos=True, temperature=1.0, top_p=1e-6,
                             seed=seed_hitting(traps[i], vocab) if i < 4 else None) for i in range(len(prompts))]
    sampled = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert sum(map(len, sampled)) == 3000 and sampled == greedy
    monkeypatch.setattr(sampler_module, "race_noise", _old_race_noise)
    old = [o.outputs[0].token_ids[0] for o in llm.generate(prompts[:4], params[:4])]
    assert old == traps


def test_max_tokens_finishes_with_length(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=7, ignore_eos=True)).outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_end_id_and_stop_token_ids_stop(llm):
    greedy = _ids(llm, SamplingParams(max_tokens=24, ignore_eos=True))
    k = 5
    while greedy[k] in greedy[:k]:
        k += 1
    stop_tok = greedy[k]
    for params in (SamplingParams(max_tokens=24, end_id=stop_tok),
                   SamplingParams(max_tokens=24, stop_token_ids=[stop_tok])):
        out = llm.generate(PROMPT, params).outputs[0]
        assert out.token_ids == greedy[:k] and out.finish_reason == "stop"   # stop token not emitted
    out = llm.generate(PROMPT, SamplingParams(max_tokens=24, end_id=stop_tok, ignore_eos=True)).outputs[0]
    assert out.token_ids == greedy and out.finish_reason == "length"


def test_stop_token_ids_apply_even_with_ignore_eos(llm):
    greedy = _ids(llm, SamplingParams(max_tokens=24, ignore_eos=True))
    k = 5
    while greedy[k] in greedy[:k]:
        k += 1
    out = llm.generate(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True,
                                              stop_token_ids=[greedy[k]])).outputs[0]
    assert out.token_ids == greedy[:k] and out.finish_reason == "stop"


def test_tokenizer_eos_is_the_default_end_id(tiny_checkpoint_copy, make_llm):
    import json
    probe = make_llm(tiny_checkpoint_copy)
    greedy = _ids(probe, SamplingParams(max_tokens=24, ignore_eos=True))
    k = 4
    while greedy[k] in greedy[:k]:
        k += 1
    (tiny_checkpoint_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [99999, greedy[k]]}))
    llm = make_llm(tiny_checkpoint_copy)
    assert greedy[k] in llm.tokenizer.eos_token_ids
    out = llm.generate(PROMPT, SamplingParams(max_tokens=24)).outputs[0]
    assert out.token_ids == greedy[:k] and out.finish_reason == "stop"


def test_stop_strings_cut_text(llm):
    full = llm.generate(PROMPT, SamplingParams(max_tokens=32, ignore_eos=True)).outputs[0]
    text = full.text
    # a stop string taken from the middle of the greedy text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop and stop in text
    cut = text.find(stop)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=32, ignore_eos=True, stop=stop)).outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:cut]
    assert len(out.token_ids) < len(full.token_ids) and out.token_ids == full.token_ids[:len(out.token_ids)]
    kept = llm.generate(PROMPT, SamplingParams(max_tokens=32, ignore_eos=True, stop=[stop, "\x00never"],
                                               include_stop_str_in_output=True)).outputs[0]
    assert kept.text == text[:cut + len(stop)] and kept.finish_reason == "stop"
    never = llm.generate(PROMPT, SamplingParams(max_tokens=32, ignore_eos=True, stop="\x00never")).outputs[0]
    assert never.text == text and never.finish_reason == "length"
