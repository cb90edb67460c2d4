"""DSpark drafters: paged block attention vs a dense reference, sliding windows, the KV cache
spec, and the left-to-right Markov head (checkpoint loading: `test_dspark_loader.py`)."""
from __future__ import annotations

import pytest
import torch

from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttention
from tensorrt_llm._torch.models.modeling_dspark import (DSparkForCausalLMBase, GQADSparkForCausalLM,
                                                         MLADSparkForCausalLM)
from tensorrt_llm._torch.models.modeling_llama import LlamaForCausalLM
from tensorrt_llm._torch.models.dspark_config import DSparkModelConfig
from tests.unittest._torch.models.dspark_fixtures import (F32, HIDDEN, P, VOCAB, Paged, drafter, kv_spec,
                                                          make_inputs, run_paged, target_config)


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(target_config()).eval()


def sharpen(d: DSparkForCausalLMBase, seed: int) -> DSparkForCausalLMBase:
    """Re-draw weights at std 1/sqrt(fan_in) so attention is far from uniform (sensitive controls)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return d


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@torch.no_grad()
def dense_gqa(d: GQADSparkForCausalLM, th: list[torch.Tensor], blocks: torch.Tensor,
              causal: bool = False) -> torch.Tensor:
    """Per request: keys/values = [context features ; block] through each layer, no pool."""
    cfg, outs = d.config, []
    embed, _ = d._target()
    for b, t in enumerate(th):
        c, blk = t.shape[0], blocks.shape[1]
        feats = d.hidden_norm(d.fc(t))
        pos_c, pos_b = torch.arange(c), torch.arange(c, c + blk)
        h = embed(blocks[b])
        for i, layer in enumerate(d.layers):
            a = layer.self_attn
            x = layer.input_layernorm(h)

            def heads(proj, inp, n):
                return proj(inp).view(inp.shape[0], n, cfg.head_dim)
            q = a.rotary(a.q_norm(heads(a.q_proj, x, cfg.num_attention_heads)), pos_b)
            k = torch.cat((a.rotary(a.k_norm(heads(a.k_proj, feats, cfg.num_key_value_heads)), pos_c),
                           a.rotary(a.k_norm(heads(a.k_proj, x, cfg.num_key_value_heads)), pos_b)))
            v = torch.cat((heads(a.v_proj, feats, cfg.num_key_value_heads),
                           heads(a.v_proj, x, cfg.num_key_value_heads)))
            rep = cfg.num_attention_heads // cfg.num_key_value_heads
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            s = torch.einsum("qhd,khd->hqk", q, k) * cfg.head_dim ** -0.5
            kpos = torch.arange(c + blk)[None, :]
            valid = torch.ones(blk, c + blk, dtype=torch.bool)
            if causal:
                valid &= kpos <= pos_b[:, None]
            w = cfg.layer_sliding_window(i)
            if w is not None:
                valid &= kpos > pos_b[:, None] - w
            o = torch.einsum("hqk,khd->qhd", s.masked_fill(~valid, float("-inf")).softmax(-1), v)
            h = h + a.o_proj(o.reshape(blk, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        outs.append(d.norm(h))
    return torch.cat(outs)


# ---- numerics ------------------------------------------------------------------------------

def test_gqa_paged_block_matches_dense_reference(target):
    g = torch.Generator().manual_seed(1)
    d = sharpen(drafter("gqa", target, seed=1, num_hidden_layers=3), seed=1)
    paged = Paged([7, 12, 1], blk=4, g=g)
    th, blocks, _ = make_inputs(d, paged, g)
    out = run_paged(d, paged, th, blocks)
    assert rel_err(out, dense_gqa(d, th, blocks)) < 1e-5
    # control: a causal block (what a normal decode step would do) is far off
    assert rel_err(out, dense_gqa(d, th, blocks, causal=True)) > 1e-2


def test_mla_drafter_absorbed_matches_unabsorbed(target):
    g = torch.Generator().manual_seed(2)
    fast = sharpen(drafter("mla", target, seed=2), seed=2)
    ref = MLADSparkForCausalLM(fast.config, absorb=False)
    ref.load_state_dict(fast.state_dict())
    ref.bind_target(target.model.embed_tokens, target.lm_head)
    paged = Paged([9, 4, 15], blk=4, g=g)
    th, blocks, _ = make_inputs(fast, paged, g)
    out = run_paged(fast, paged, th, blocks)
    assert rel_err(out, run_paged(ref, paged, th, blocks)) < 1e-5
    assert rel_err(out, run_paged(ref, paged, th, blocks, causal=True)) > 1e-2


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_sliding_window(kind, target):
    g = torch.Generator().manual_seed(3)
    paged = Paged([10, 14], blk=4, g=g)

    def make(**ov):                              # same sharpened weights for every window choice
        return sharpen(drafter(kind, target, seed=3, **ov), seed=3)
    full = make()
    th, blocks, _ = make_inputs(full, paged, g)
    want = run_paged(full, paged, th, blocks)
    wide = make(sliding_window=max(paged.ctx_lens) + paged.blk)
    assert rel_err(run_paged(wide, paged, th, blocks), want) < 1e-6
    small = make(sliding_window=3)
    out_small = run_paged(small, paged, th, blocks)
    assert rel_err(out_small, want) > 1e-2
    if kind == "gqa":
        assert rel_err(out_small, dense_gqa(small, th, blocks)) < 1e-5
        mixed = make(sliding_window=3, layer_types=["full_attention", "sliding_attention"])
        out_mixed = run_paged(mixed, paged, th, blocks)
        assert rel_err(out_mixed, dense_gqa(mixed, th, blocks)) < 1e-5
        assert rel_err(out_mixed, out_small) > 1e-2 and rel_err(out_mixed, want) > 1e-2


def test_write_context_skips_negative_slots(target):
    d = drafter("gqa", target)
    spec = kv_spec(d)
    caches = [torch.zeros(spec.layer_shape(4, P)) for _ in range(spec.num_layers)]
    feats = d.context_features(torch.randn(3, d.config.fc_in_features))
    d.write_context(feats, torch.arange(3), torch.tensor([5, -1, 6]), caches, VanillaAttention())
    written = (caches[0].abs().sum(dim=(1, 2, 4)) != 0).flatten().nonzero().flatten().tolist()
    assert written == [5, 6]


def test_kv_cache_spec(target):
    g = kv_spec(drafter("gqa", target), torch.bfloat16)
    assert (g.name, g.kind, g.num_layers, g.planes, g.heads, g.head_dim, g.dtype) == \
        ("draft", "gqa", 2, 2, 2, 16, torch.bfloat16)
    m = kv_spec(drafter("mla", target))
    assert (m.name, m.kind, m.planes, m.heads, m.head_dim) == ("draft", "mla", 1, 1, 32 + 8)


def test_bind_target_is_not_registered(target):
    d = drafter("gqa", target, markov_rank=4)
    n_params = sum(p.numel() for p in d.parameters())
    unbound = DSparkForCausalLMBase.random_init("gqa", target.config, markov_rank=4)
    assert n_params == sum(p.numel() for p in unbound.parameters())
    assert not any("embed" in k or "lm_head" in k for k in d.state_dict())
    d.to(torch.float64)
    assert target.lm_head.weight.dtype == F32
    with pytest.raises(ValueError, match="bind_target"):
        unbound.draft_logits(torch.zeros(1, HIDDEN))


# ---- Markov head / propose -----------------------------------------------------------------

def markov_drafter(target, rank: int):
    d = drafter("gqa", target, seed=4, markov_rank=rank)
    if rank:
        with torch.no_grad():          # make the bias large enough to move the argmax
            d.markov_head.w1.weight.mul_(100.0)
            d.markov_head.w2.weight.mul_(100.0)
    return d


def test_markov_bias_left_to_right(target):
    g = torch.Generator().manual_seed(5)
    d = markov_drafter(target, rank=4)
    hidden = torch.randn(2 * 4, HIDDEN, generator=g)
    anchors = torch.tensor([3, 77])
    with torch.no_grad():
        ids, logits = d.propose(hidden, anchors, 4)
        base = d.draft_logits(hidden).view(2, 4, VOCAB)
        prevs = torch.cat((anchors[:, None], ids[:, :-1]), dim=1)
        for j in range(4):
            want = base[:, j] + d.markov_head(prevs[:, j])
            assert float((logits[:, j] - want).abs().max()) < 1e-5
            assert torch.equal(ids[:, j], want.argmax(-1))

        # a different slot-0 choice changes slot-1 logits by exactly the bias difference
        forced = (ids[:, 0] + 1) % VOCAB
        calls = []

        def pick(lg):
            calls.append(lg)
            return forced if len(calls) == 1 else lg.argmax(-1)
        ids2, logits2 = d.propose(hidden, anchors, 4, pick=pick)
        assert torch.equal(ids2[:, 0], forced) and torch.equal(logits2[:, 0], logits[:, 0])
        delta = logits2[:, 1] - logits[:, 1]
        want_delta = d.markov_head(forced) - d.markov_head(ids[:, 0])
        assert float((delta - want_delta).abs().max()) < 1e-4
        assert float(delta.abs().max()) > 1e-2
        # control: without a Markov head slot 1 ignores the slot-0 choice
        plain = markov_drafter(target, rank=0)
        calls.clear()
        _, p1 = plain.propose(hidden, anchors, 4)
        _, p2 = plain.propose(hidden, anchors, 4, pick=pick)
        assert torch.equal(p1, p2)


def test_propose_slots_without_shift_label(target):
    d = drafter("gqa", target, shift_label=False, block_size=4)
    assert d.config.num_drafts == 3
    hidden = torch.randn(4, HIDDEN)
    with torch.no_grad():
        ids, logits = d.propose(hidden, torch.tensor([1]), 3)
        assert torch.equal(logits[0], d.draft_logits(hidden[1:4]))
    with pytest.raises(ValueError, match="num_drafts 4"):
        d.propose(hidden, torch.tensor([1]), 4)


def test_config_round_trip_and_num_drafts():
    d = DSparkForCausalLMBase.random_init("mla", target_config(), q_lora_rank=16, block_size=6,
                                          sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    c = d.config
    assert DSparkModelConfig.from_dict(c.to_dict(), "x") == c
    assert c.num_drafts == 6 and c.layer_sliding_window(0) == 8 and c.layer_sliding_window(1) is None
    assert hasattr(d.layers[0].self_attn, "q_a_proj") and not hasattr(d.layers[0].self_attn, "q_proj")
