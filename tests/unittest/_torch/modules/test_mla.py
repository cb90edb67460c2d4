"""MLAAttention: absorbed vs un-absorbed over pages, a dense reference, softmax scale, RoPE layout, the W_UV
and W_UK folds."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from tensorrt_llm._torch.attention_backend.interface import BAD_PAGE_INDEX, AttentionMetadata
from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttention
from tensorrt_llm._torch.modules.fp8_block import FP8BlockLinear, FP8BlockQuantConfig
from tensorrt_llm._torch.modules.mla import MLAAttention, mla_softmax_scale
from tensorrt_llm._torch.modules.rotary_embedding import RotaryEmbedding

HIDDEN, HEADS, R, ROPE, NOPE, VDIM = 64, 4, 32, 8, 16, 16
P, NUM_PAGES, MAXPOS = 4, 24, 256
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}
YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def make_mla(seed: int, rope_scaling=None, q_lora_rank=None, interleaved=False, absorb=True) -> MLAAttention:
    rot = RotaryEmbedding(ROPE, 10000.0, MAXPOS, rope_scaling, interleaved=interleaved)
    m = MLAAttention(HIDDEN, HEADS, R, NOPE, ROPE, VDIM, rot, q_lora_rank=q_lora_rank,
                     rope_scaling=rope_scaling, absorb=absorb)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return m.eval()


class Paged:
    """Random page assignment for R requests, each `ctx` cached tokens + a block of `blk`."""

    def __init__(self, ctx_lens: list[int], blk: int, causal: bool, g: torch.Generator):
        self.ctx_lens, self.blk = ctx_lens, blk
        perm = torch.randperm(NUM_PAGES, generator=g).tolist()
        width = math.ceil((max(ctx_lens) + blk) / P)
        self.table = torch.full((len(ctx_lens), width), BAD_PAGE_INDEX, dtype=torch.int32)
        for b, c in enumerate(ctx_lens):
            for j in range(math.ceil((c + blk) / P)):
                self.table[b, j] = perm.pop()
        self.ctx_slots = torch.cat([self.slots(b, 0, c) for b, c in enumerate(ctx_lens)])
        self.ctx_pos = torch.cat([torch.arange(c) for c in ctx_lens])
        self.blk_pos = torch.cat([torch.arange(c, c + blk) for c in ctx_lens])
        self.md = AttentionMetadata(seq_lens=[blk] * len(ctx_lens), num_cached=list(ctx_lens),
                                    block_tables=self.table,
                                    slot_mapping=torch.cat([self.slots(b, c, c + blk)
                                                            for b, c in enumerate(ctx_lens)]),
                                    tokens_per_block=P, causal=causal)

    def slots(self, b: int, lo: int, hi: int) -> torch.Tensor:
        pos = torch.arange(lo, hi)
        return self.table[b, pos // P].long() * P + pos % P


def run_paged(m: MLAAttention, paged: Paged, x_ctx: torch.Tensor, x_blk: torch.Tensor) -> torch.Tensor:
    """The context latents written into a fresh pool, then the block through m (inputs and pool in m's dtype)."""
    dtype = m.kv_b_proj.weight.dtype
    cache = torch.zeros(NUM_PAGES, 1, 1, P, R + ROPE, dtype=dtype)
    lat = m.project_latent(x_ctx.to(dtype), paged.ctx_pos)
    cache[paged.ctx_slots // P, 0, 0, paged.ctx_slots % P] = lat
    with torch.no_grad():
        return m(x_blk.to(dtype), paged.blk_pos, cache, paged.md, VanillaAttention())


def dense_mla(m: MLAAttention, x_ctx: list[torch.Tensor], x_blk: torch.Tensor, blk: int,
              scale: float, causal: bool) -> torch.Tensor:
    """DeepSeek-V2 MLA written out per request from the weights (no pool, no absorption)."""
    outs = []
    for b, xc in enumerate(x_ctx):
        xb = x_blk[b * blk:(b + 1) * blk]
        x = torch.cat((xc, xb))
        pos = torch.arange(x.shape[0])
        kv_a = x @ m.kv_a_proj_with_mqa.weight.T
        c, k_pe = kv_a[:, :R], kv_a[:, R:]
        c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6) * m.kv_a_layernorm.weight
        k_pe = m.rotary(k_pe[:, None], pos)                                     # [L, 1, rope]
        kv = (c @ m.kv_b_proj.weight.T).view(-1, HEADS, NOPE + VDIM)
        k = torch.cat((kv[..., :NOPE], k_pe.expand(-1, HEADS, -1)), -1)
        v = kv[..., NOPE:]
        if m.q_lora_rank is None:
            q = xb @ m.q_proj.weight.T
        else:
            qa = xb @ m.q_a_proj.weight.T
            qa = qa * torch.rsqrt(qa.pow(2).mean(-1, keepdim=True) + 1e-6) * m.q_a_layernorm.weight
            q = qa @ m.q_b_proj.weight.T
        q = q.view(blk, HEADS, NOPE + ROPE)
        q = torch.cat((q[..., :NOPE], m.rotary(q[..., NOPE:], pos[-blk:])), -1)
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        if causal:
            s = s.masked_fill(pos[None, -blk:, None] < pos[None, None, :], float("-inf"))
        o = torch.einsum("hqk,khv->qhv", s.softmax(-1), v).reshape(blk, HEADS * VDIM)
        outs.append(o @ m.o_proj.weight.T)
    return torch.cat(outs)


def inputs(paged: Paged, g: torch.Generator) -> tuple[list[torch.Tensor], torch.Tensor]:
    x_ctx = [torch.randn(c, HIDDEN, generator=g) for c in paged.ctx_lens]
    return x_ctx, torch.randn(len(paged.ctx_lens) * paged.blk, HIDDEN, generator=g)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_absorbed_equals_unabsorbed_paged(causal, q_lora_rank):
    g = torch.Generator().manual_seed(100 + int(causal) + (q_lora_rank or 0))
    paged = Paged([5, 13, 0], blk=4, causal=causal, g=g)
    m = make_mla(1, YARN, q_lora_rank=q_lora_rank, absorb=True)
    ref = copy.deepcopy(m)
    ref.absorb = False
    x_ctx, x_blk = inputs(paged, g)
    out = run_paged(m, paged, torch.cat(x_ctx), x_blk)
    want = run_paged(ref, paged, torch.cat(x_ctx), x_blk)
    assert rel_err(out, want) < 1e-5
    # control: K and V halves of each head's kv_b_proj rows swapped (W_UK <-> W_UV) in the absorbed path
    swapped = copy.deepcopy(m)
    w = swapped.kv_b_proj.weight.data.view(HEADS, NOPE + VDIM, R)
    w.copy_(torch.cat((w[:, NOPE:], w[:, :NOPE]), dim=1))
    assert rel_err(run_paged(swapped, paged, torch.cat(x_ctx), x_blk), want) > 1e-2


@pytest.mark.parametrize("absorb", [True, False])
def test_paged_matches_dense_reference(absorb):
    g = torch.Generator().manual_seed(7)
    paged = Paged([9, 3, 17], blk=5, causal=False, g=g)
    m = make_mla(2, YARN, absorb=absorb)
    x_ctx, x_blk = inputs(paged, g)
    out = run_paged(m, paged, torch.cat(x_ctx), x_blk)
    scale = (1 + 0.1 * 0.707 * math.log(40.0)) ** 2 / math.sqrt(NOPE + ROPE)
    with torch.no_grad():
        want = dense_mla(m, x_ctx, x_blk, 5, scale, causal=False)
        assert rel_err(out, want) < 1e-5
        # controls: the latent-width scale, and a causal block mask, are both far off
        assert rel_err(out, dense_mla(m, x_ctx, x_blk, 5, (R + ROPE) ** -0.5, causal=False)) > 1e-2
        assert rel_err(out, dense_mla(m, x_ctx, x_blk, 5, scale, causal=True)) > 1e-2


def test_softmax_scale_formula():
    got = mla_softmax_scale(NOPE, ROPE, YARN)
    mscale = 0.1 * 0.707 * math.log(40.0) + 1.0
    assert got == pytest.approx(mscale * mscale / math.sqrt(NOPE + ROPE), rel=1e-12)
    assert make_mla(0, YARN).scale == got
    assert mla_softmax_scale(NOPE, ROPE, None) == pytest.approx((NOPE + ROPE) ** -0.5, rel=1e-12)
    no_all_dim = {k: v for k, v in YARN.items() if k != "mscale_all_dim"}
    assert mla_softmax_scale(NOPE, ROPE, no_all_dim) == pytest.approx((NOPE + ROPE) ** -0.5, rel=1e-12)
    # control: 1/sqrt(kv_lora_rank + rope) (the absorbed head width) is not the MLA scale
    assert abs(got - (R + ROPE) ** -0.5) / got > 1e-2
    # DeepSeek-V2 sizes: 1/sqrt(576) vs mscale^2/sqrt(192)
    assert abs(mla_softmax_scale(128, 64, YARN) - 576 ** -0.5) > 1e-2


def test_rope_interleave_equals_half_under_weight_permutation():
    g = torch.Generator().manual_seed(3)
    paged = Paged([6, 10], blk=4, causal=False, g=g)
    half = make_mla(4, YARN, interleaved=False)
    inter = make_mla(4, YARN, interleaved=True)
    perm = torch.stack((torch.arange(ROPE // 2), torch.arange(ROPE // 2) + ROPE // 2), 1).flatten()
    with torch.no_grad():
        wq = inter.q_proj.weight.view(HEADS, NOPE + ROPE, HIDDEN)
        wq[:, NOPE:] = wq[:, NOPE:][:, perm]
        wa = inter.kv_a_proj_with_mqa.weight
        wa[R:] = wa[R:][perm]
    x_ctx, x_blk = inputs(paged, g)
    want = run_paged(half, paged, torch.cat(x_ctx), x_blk)
    assert rel_err(run_paged(inter, paged, torch.cat(x_ctx), x_blk), want) < 1e-5
    # control: interleaved rotary with the half-layout weights
    wrong = make_mla(4, YARN, interleaved=True)
    assert rel_err(run_paged(wrong, paged, torch.cat(x_ctx), x_blk), want) > 1e-2


def test_unabsorbed_rejects_missing_page():
    g = torch.Generator().manual_seed(9)
    paged = Paged([5], blk=4, causal=False, g=g)
    m = make_mla(5, absorb=False)
    paged.md.block_tables[0, 1] = BAD_PAGE_INDEX
    x_ctx, x_blk = inputs(paged, g)
    with pytest.raises(ValueError, match="no page"):
        m(x_blk, paged.blk_pos, torch.zeros(NUM_PAGES, 1, 1, P, R + ROPE), paged.md, VanillaAttention())


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_folded_output_equals_w_uv_then_o_proj(q_lora_rank):
    """`fold_output`: the absorbed attention's latent output through the one folded weight equals W_UV
    per head then o_proj (float32); the module's output weight is then [hidden, H * R]. Control: a fold
    from W_UV with its heads rolled lands far off. The un-absorbed path refuses to fold."""
    g = torch.Generator().manual_seed(21)
    paged = Paged([6, 11], blk=4, causal=True, g=g)
    m = make_mla(3, q_lora_rank=q_lora_rank)
    m.post_load_weights()
    x_ctx, x_blk = inputs(paged, g)
    want = run_paged(m, paged, torch.cat(x_ctx), x_blk)
    folded = copy.deepcopy(m)
    folded.fold_output()
    assert folded.output_weight().shape == (HIDDEN, HEADS * R)
    assert rel_err(run_paged(folded, paged, torch.cat(x_ctx), x_blk), want) < 1e-5
    rolled = copy.deepcopy(m)
    rolled.w_uv = rolled.w_uv.roll(1, dims=0)
    rolled.fold_output()
    assert rel_err(run_paged(rolled, paged, torch.cat(x_ctx), x_blk), want) > 1e-2
    with pytest.raises(ValueError, match="un-absorbed"):
        make_mla(3, absorb=False).fold_output()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_folded_query_equals_q_then_w_uk(q_lora_rank, dtype):
    """`fold_query`: each head's [q_nope W_UK | q_pe] out of the one folded [H (R + rope), q input] GEMM
    (`q_weights`: W_UK None) gives the unfolded attention's output: within 1e-5 in float32 (measured
    3e-7), within 2e-2 in bf16 (measured 4e-3; the unfolded bf16 path is itself 6e-3 - 8e-3 off float32,
    and the folded one no further than 1.5x that: measured 1.0 - 1.1x); with fold_output too. Control: a
    fold from another layer's W_UK lands beyond 0.5 (measured 0.8). FP8 q projections and the
    un-absorbed path refuse to fold."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    g = torch.Generator().manual_seed(22)
    paged = Paged([6, 11], blk=4, causal=True, g=g)
    m = make_mla(3, q_lora_rank=q_lora_rank)
    m.post_load_weights()
    x_ctx, x_blk = inputs(paged, g)
    ref = run_paged(m, paged, torch.cat(x_ctx), x_blk)                 # float32
    m = m.to(dtype)
    want = run_paged(m, paged, torch.cat(x_ctx), x_blk)
    folded = copy.deepcopy(m)
    folded.fold_query()
    *_, w_q, w_uk = folded.q_weights()
    assert w_uk is None and w_q.dtype == dtype
    assert w_q.shape == (HEADS * (R + ROPE), HIDDEN if q_lora_rank is None else q_lora_rank)
    got = run_paged(folded, paged, torch.cat(x_ctx), x_blk)
    assert rel_err(got.float(), want.float()) < tol
    if dtype == torch.bfloat16:
        assert rel_err(got.float(), ref) < 1.5 * rel_err(want.float(), ref)
    both = copy.deepcopy(folded)
    both.fold_output()
    assert rel_err(run_paged(both, paged, torch.cat(x_ctx), x_blk).float(), want.float()) < tol
    alien = copy.deepcopy(m)
    alien.w_uk = make_mla(4, q_lora_rank=q_lora_rank).to(dtype).w_uk_uv()[0].contiguous()
    alien.fold_query()
    assert rel_err(run_paged(alien, paged, torch.cat(x_ctx), x_blk).float(), want.float()) > 0.5
    with pytest.raises(ValueError, match="un-absorbed"):
        make_mla(3, absorb=False).fold_query()
    fp8, qc = make_mla(3, q_lora_rank=q_lora_rank), FP8BlockQuantConfig.from_dict(QUANT, "test")
    name = "q_proj" if q_lora_rank is None else "q_b_proj"
    setattr(fp8, name, FP8BlockLinear.from_linear(getattr(fp8, name), qc))
    with pytest.raises(ValueError, match="plain nn.Linear q projection, got FP8BlockLinear"):
        fp8.fold_query()


@pytest.mark.parametrize("fold", [False, True])
def test_fused_q_and_latent_projection(fold):
    """`fuse_projections` (no q_lora): the q projection and kv_a_proj_with_mqa become views of one [H (first
    + rope) + R + rope, hidden] weight (`projection_weights`: (None, None, fused, None)); the module's
    output is bitwise unchanged; `fold_query` afterwards fuses the folded q rows (q_first_dim R) and
    after `fold_query` the same. With q_lora nothing fuses. Control: another kv_a weight moves the
    output beyond 0.1 (the fused GEMM's latent rows are what the cache gets)."""
    g = torch.Generator().manual_seed(31)
    paged = Paged([6, 11], blk=4, causal=True, g=g)
    x_ctx, x_blk = inputs(paged, g)
    m = make_mla(3)
    m.post_load_weights()
    if fold:
        m.fold_query()
    want = run_paged(m, paged, torch.cat(x_ctx), x_blk)
    m.fuse_projections()
    q_a, q_a_norm, w, kv_a = m.projection_weights()
    first = R if fold else NOPE
    assert (q_a, q_a_norm, kv_a) == (None, None, None) and m.q_first_dim == first
    assert w.shape == (HEADS * (first + ROPE) + R + ROPE, HIDDEN)
    q_rows = m.w_q_abs if fold else m.q_proj.weight
    assert q_rows.data_ptr() == w.data_ptr()
    assert m.kv_a_proj_with_mqa.weight.data_ptr() == w[HEADS * (first + ROPE):].data_ptr()
    assert torch.equal(run_paged(m, paged, torch.cat(x_ctx), x_blk), want)
    if not fold:                              # folding after the fusion re-fuses with the folded rows
        m.fold_query()
        assert m.projection_weights()[2][:HEADS * (R + ROPE)].data_ptr() == m.w_q_abs.data_ptr()
        assert m.q_first_dim == R
    swapped = make_mla(3)
    swapped.post_load_weights()
    with torch.no_grad():
        swapped.kv_a_proj_with_mqa.weight.copy_(swapped.q_proj.weight[:R + ROPE])
    assert rel_err(run_paged(swapped, paged, torch.cat(x_ctx), x_blk), want) > 0.1
    lora = make_mla(3, q_lora_rank=24)
    lora.fuse_projections()
    assert lora.projection_weights()[3] is lora.kv_a_proj_with_mqa.weight
