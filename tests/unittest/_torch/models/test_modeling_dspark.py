"""DSpark drafters: paged block attention vs a dense reference, sliding windows, strict
checkpoint loading, save/load round trip, and the left-to-right Markov head."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tensorrt_llm._torch.attention_backend.interface import BAD_PAGE_INDEX, AttentionMetadata
from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttention
from tensorrt_llm._torch.models.dspark_loader import DRAFTER_REGISTRY, load_drafter
from tensorrt_llm._torch.models.modeling_dspark import (DSparkForCausalLMBase, GQADSparkForCausalLM,
                                                         MLADSparkForCausalLM)
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig, LlamaForCausalLM
from tensorrt_llm._torch.models.dspark_config import DSparkModelConfig
from tensorrt_llm._torch.speculative.dspark_worker import draft_kv_cache_spec

HIDDEN, VOCAB, P, NUM_PAGES = 64, 128, 4, 40
CPU, F32 = torch.device("cpu"), torch.float32


def kv_spec(drafter, dtype=torch.float32):
    """The draft pool spec built from the drafter's kv_cache_layout() (as the engine builds it)."""
    return draft_kv_cache_spec(drafter, dtype)


def target_config(hidden: int = HIDDEN, vocab: int = VOCAB) -> LlamaConfig:
    return LlamaConfig("LlamaForCausalLM", vocab, hidden, 2 * hidden, 4, 4, 2, hidden // 4, 1e-6, 10000.0,
                       None, 256, True, False, None, None)


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(target_config()).eval()


def drafter(kind: str, target: LlamaForCausalLM, seed: int = 0, **ov) -> DSparkForCausalLMBase:
    d = DSparkForCausalLMBase.random_init(kind, target.config, seed=seed, **ov)
    d.bind_target(target.model.embed_tokens, target.lm_head)
    return d


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


class Paged:
    """R requests with random pages: ctx_lens[b] context tokens, then a block of `blk`."""

    def __init__(self, ctx_lens: list[int], blk: int, g: torch.Generator):
        self.ctx_lens, self.blk = ctx_lens, blk
        perm = torch.randperm(NUM_PAGES, generator=g).tolist()
        self.table = torch.full((len(ctx_lens), math.ceil((max(ctx_lens) + blk) / P)), BAD_PAGE_INDEX,
                                dtype=torch.int32)
        for b, c in enumerate(ctx_lens):
            for j in range(math.ceil((c + blk) / P)):
                self.table[b, j] = perm.pop()
        self.ctx_pos = torch.cat([torch.arange(c) for c in ctx_lens])
        self.ctx_slots = torch.cat([self.slots(b, 0, c) for b, c in enumerate(ctx_lens)])
        self.blk_pos = torch.cat([torch.arange(c, c + blk) for c in ctx_lens])
        self.blk_slots = torch.cat([self.slots(b, c, c + blk) for b, c in enumerate(ctx_lens)])

    def slots(self, b: int, lo: int, hi: int) -> torch.Tensor:
        pos = torch.arange(lo, hi)
        return self.table[b, pos // P].long() * P + pos % P

    def md(self) -> AttentionMetadata:
        return AttentionMetadata(seq_lens=[self.blk] * len(self.ctx_lens), num_cached=list(self.ctx_lens),
                                 block_tables=self.table, slot_mapping=self.blk_slots,
                                 tokens_per_block=P, causal=False)


def make_inputs(d: DSparkForCausalLMBase, paged: Paged, g: torch.Generator):
    th = [torch.randn(c, d.config.fc_in_features, generator=g) for c in paged.ctx_lens]
    anchors = torch.randint(0, VOCAB - 1, (len(paged.ctx_lens),), generator=g)
    blocks = torch.full((len(paged.ctx_lens), paged.blk), d.config.mask_token_id)
    blocks[:, 0] = anchors
    return th, blocks, anchors


@torch.no_grad()
def run_paged(d: DSparkForCausalLMBase, paged: Paged, th: list[torch.Tensor], blocks: torch.Tensor,
              causal: bool = False) -> torch.Tensor:
    spec = kv_spec(d)
    caches = [torch.zeros(spec.layer_shape(NUM_PAGES, P)) for _ in range(spec.num_layers)]
    backend = VanillaAttention()
    d.write_context(d.context_features(torch.cat(th)), paged.ctx_pos, paged.ctx_slots, caches, backend)
    md = paged.md()
    md.causal = causal
    return d.forward_block(blocks.flatten(), paged.blk_pos, md, caches, backend)


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


# ---- checkpoints ---------------------------------------------------------------------------

def save(kind: str, target, folder: Path, **ov) -> DSparkForCausalLMBase:
    d = drafter(kind, target, seed=6, **ov)
    d.save_pretrained(folder)
    return d


def edit_state(folder: Path, fn) -> None:
    state = load_file(str(folder / "model.safetensors"))
    fn(state)
    save_file(state, str(folder / "model.safetensors"))


def edit_config(folder: Path, fn) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    fn(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


def load(folder: Path, tcfg: LlamaConfig | None = None, **ov):
    return load_drafter(folder, tcfg or target_config(), F32, CPU, overrides=ov)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_round_trip_identical_outputs(kind, target, tmp_path):
    g = torch.Generator().manual_seed(7)
    d = save(kind, target, tmp_path, markov_rank=4)
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert keys == set(d.state_dict())
    assert not any("embed" in k or "lm_head" in k for k in keys)
    assert "markov_head.w1.weight" in keys
    d2 = load(tmp_path)
    assert type(d2) is DRAFTER_REGISTRY[d.config.architecture] and d2.config == d.config
    d2.bind_target(target.model.embed_tokens, target.lm_head)
    paged = Paged([6, 11], blk=4, g=g)
    th, blocks, anchors = make_inputs(d, paged, g)
    h1, h2 = run_paged(d, paged, th, blocks), run_paged(d2, paged, th, blocks)
    assert torch.equal(h1, h2)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(d.propose(h1, anchors, 4), d2.propose(h2, anchors, 4)))


def test_reject_missing_tensor(target, tmp_path):
    save("gqa", target, tmp_path)
    edit_state(tmp_path, lambda s: s.pop("layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: \['layers.1.mlp.up_proj.weight'\]"):
        load(tmp_path)


@pytest.mark.parametrize("kind,value", [("gqa", float("nan")), ("mla", float("-inf"))])
def test_reject_non_finite_weight(kind, value, target, tmp_path):
    """Issue #19 item 7: a drafter with a NaN/Inf weight used to load silently (and then accept no
    draft, AL 1.0 forever); it raises naming the file and the tensor. Negative control: the same
    checkpoint before the edit loads."""
    save(kind, target, tmp_path)
    load(tmp_path)
    edit_state(tmp_path, lambda s: s["layers.1.mlp.up_proj.weight"].__setitem__((2, 3), value))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'layers\.1\.mlp\.up_proj\.weight' "
                                         r"has 1 non-finite"):
        load(tmp_path)


def test_reject_unexpected_tensor(target, tmp_path):
    save("gqa", target, tmp_path)
    edit_state(tmp_path, lambda s: s.__setitem__("embed_tokens.weight", torch.zeros(VOCAB, HIDDEN)))
    with pytest.raises(ValueError, match=r"unexpected tensors: \['embed_tokens.weight'\]"):
        load(tmp_path)


def test_reject_shape_mismatch(target, tmp_path):
    save("mla", target, tmp_path)
    edit_state(tmp_path, lambda s: s.__setitem__("layers.0.self_attn.kv_b_proj.weight", torch.zeros(4, 32)))
    with pytest.raises(ValueError, match="shape mismatch for 'layers.0.self_attn.kv_b_proj.weight'"):
        load(tmp_path)


def test_reject_partial_markov_head(target, tmp_path):
    save("gqa", target, tmp_path, markov_rank=4)
    edit_state(tmp_path, lambda s: s.pop("markov_head.w2.weight"))
    with pytest.raises(ValueError, match=r"module 'markov_head' is partially present; "
                                         r"missing \['markov_head.w2.weight'\]"):
        load(tmp_path)


def test_reject_declared_head_absent(target, tmp_path):
    save("gqa", target, tmp_path, markov_rank=4)
    edit_state(tmp_path, lambda s: [s.pop(k) for k in ("markov_head.w1.weight", "markov_head.w2.weight")])
    with pytest.raises(ValueError, match="config declares markov_head but the checkpoint has none"):
        load(tmp_path)
    edit_config(tmp_path, lambda c: c["dspark_config"].update(markov_rank=0))
    load(tmp_path)                                       # consistent again


def test_retired_confidence_head_key(target, tmp_path):
    # Older checkpoints carry dspark_config.confidence_head: false loads (shipped drafters do),
    # true raises naming the file and key, and its tensors are not silently dropped.
    save("gqa", target, tmp_path)
    assert "confidence_head" not in json.loads((tmp_path / "config.json").read_text())["dspark_config"]
    edit_config(tmp_path, lambda c: c["dspark_config"].update(confidence_head=False))
    assert not hasattr(load(tmp_path), "confidence_head")
    edit_config(tmp_path, lambda c: c["dspark_config"].update(confidence_head=True))
    with pytest.raises(ValueError, match=r"config.json: dspark_config: key 'confidence_head' is true"):
        load(tmp_path)
    edit_config(tmp_path, lambda c: c["dspark_config"].update(confidence_head="no"))
    with pytest.raises(ValueError, match=r"dspark_config: key 'confidence_head' must be bool"):
        load(tmp_path)
    edit_config(tmp_path, lambda c: c["dspark_config"].update(confidence_head=False))
    edit_state(tmp_path, lambda s: s.update({"confidence_head.weight": torch.zeros(1, HIDDEN),
                                             "confidence_head.bias": torch.zeros(1)}))
    with pytest.raises(ValueError, match=r"unexpected tensors: \['confidence_head.bias', 'confidence_head.weight'\]"):
        load(tmp_path)


def test_reject_hidden_size_mismatch(target, tmp_path):
    save("gqa", target, tmp_path)
    with pytest.raises(ValueError, match="drafter hidden_size 64 does not match the target's hidden_size 96"):
        load(tmp_path, target_config(hidden=96))


def test_reject_num_target_hidden_mismatch(target, tmp_path):
    save("gqa", target, tmp_path)
    edit_config(tmp_path, lambda c: c["dspark_config"].update(num_target_hidden=32))
    with pytest.raises(ValueError, match="num_target_hidden 32 does not match the target's hidden_size 64"):
        load(tmp_path)


def test_reject_vocab_mismatch(target, tmp_path):
    save("gqa", target, tmp_path)
    with pytest.raises(ValueError, match="drafter vocab_size 128 does not match the target's vocab_size 256"):
        load(tmp_path, target_config(vocab=256))


def test_reject_unknown_architecture(target, tmp_path):
    save("gqa", target, tmp_path)
    edit_config(tmp_path, lambda c: c.update(architectures=["EagleForCausalLM"]))
    with pytest.raises(ValueError, match=r"config.json: unknown drafter architectures \['EagleForCausalLM'\]"):
        load(tmp_path)


def test_reject_missing_dspark_config_key(target, tmp_path):
    save("gqa", target, tmp_path)
    edit_config(tmp_path, lambda c: c["dspark_config"].pop("block_size"))
    with pytest.raises(ValueError, match="config.json: dspark_config: missing required key 'block_size'"):
        load(tmp_path)


def test_reject_bad_config_values(target, tmp_path):
    save("gqa", target, tmp_path)
    edit_config(tmp_path, lambda c: c.update(hidden_size="64"))
    with pytest.raises(ValueError, match="key 'hidden_size' must be int"):
        load(tmp_path)
    edit_config(tmp_path, lambda c: c.update(hidden_size=64, dspark_config={**c["dspark_config"], "markov": 2}))
    with pytest.raises(ValueError, match=r"dspark_config: unknown keys \['markov'\]"):
        load(tmp_path)
    edit_config(tmp_path, lambda c: (c["dspark_config"].pop("markov"), c.update(layer_types=["full_attention"])))
    with pytest.raises(ValueError, match="'layer_types' must list 2 entries"):
        load(tmp_path)
    edit_config(tmp_path, lambda c: (c.pop("layer_types"), c["dspark_config"].update(target_layer_ids=[0, 9])))
    with pytest.raises(ValueError, match=r"name layers \[9\] but the target has 4 layers"):
        load(tmp_path)


def test_load_overrides(target, tmp_path):
    save("gqa", target, tmp_path)
    d = load(tmp_path, mask_token_id=5, target_layer_ids=None)
    assert d.config.mask_token_id == 5
    with pytest.raises(ValueError, match="unknown drafter overrides"):
        load(tmp_path, block_sise=3)


def test_config_round_trip_and_num_drafts():
    d = DSparkForCausalLMBase.random_init("mla", target_config(), q_lora_rank=16, block_size=6,
                                          sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    c = d.config
    assert DSparkModelConfig.from_dict(c.to_dict(), "x") == c
    assert c.num_drafts == 6 and c.layer_sliding_window(0) == 8 and c.layer_sliding_window(1) is None
    assert hasattr(d.layers[0].self_attn, "q_a_proj") and not hasattr(d.layers[0].self_attn, "q_proj")
