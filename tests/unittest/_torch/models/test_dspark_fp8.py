"""A drafter whose config.json carries `quant_config` (FP8 e4m3, UE8M0 128 x 128 blocks) loads with
FP8 block-scaled projections (`post_load_weights`), drafts close to its full-precision twin, and
speculation with it stays lossless; MLA keeps W_UK / W_UV contiguous after loading, and refuses the W_UK /
W_UV folds with FP8 projections.
"""
from __future__ import annotations

import json

import pytest
import torch

from tensorrt_llm import SamplingParams
from tensorrt_llm._torch.models.checkpoint import read_config
from tensorrt_llm._torch.models.dspark_config import DSparkModelConfig
from tensorrt_llm._torch.models.dspark_loader import load_drafter
from tensorrt_llm._torch.models.modeling_dspark import DSparkForCausalLMBase
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig
from tensorrt_llm._torch.modules.fp8_block import FP8BlockLinear

QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}


def _save(tmp_path_factory, target_dir, kind, quant):
    tc = LlamaConfig.from_dict(read_config(target_dir), "target")
    folder = tmp_path_factory.mktemp(f"fp8_{kind}_{bool(quant)}")
    DSparkForCausalLMBase.random_init(kind, tc, seed=4, markov_rank=4).save_pretrained(folder)
    if quant:
        cfg = json.loads((folder / "config.json").read_text())
        cfg["quant_config"] = QUANT
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder, tc


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_quant_config_makes_projections_fp8_and_drafts_close(tmp_path_factory, tiny_llama_dir, kind):
    plain_dir, tc = _save(tmp_path_factory, tiny_llama_dir, kind, quant=False)
    fp8_dir, _ = _save(tmp_path_factory, tiny_llama_dir, kind, quant=True)
    plain = load_drafter(plain_dir, tc, torch.float32, torch.device("cpu"))
    fp8 = load_drafter(fp8_dir, tc, torch.float32, torch.device("cpu"))
    assert fp8.config.quant_config is not None and plain.config.quant_config is None
    assert DSparkModelConfig.from_dict(fp8.config.to_dict(), "rt") == fp8.config       # round trip
    linears = [n for n, m in fp8.named_modules() if isinstance(m, FP8BlockLinear)]
    assert "fc" in linears and any("mlp.down_proj" in n for n in linears)
    assert not any(isinstance(m, FP8BlockLinear) for m in plain.modules())
    if kind == "mla":
        assert all(not isinstance(l.self_attn.kv_b_proj, FP8BlockLinear) for l in fp8.layers)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(12, tc.hidden_size * len(fp8.config.target_layer_ids), generator=g)
    a, b = plain.context_features(feats), fp8.context_features(feats)
    assert ((a - b).norm() / a.norm()).item() < 0.05
    # negative control: the same features through a drafter of other weights
    other = DSparkForCausalLMBase.random_init(kind, tc, seed=9, markov_rank=4)
    assert ((other.context_features(feats) - a).norm() / a.norm()).item() > 0.5


def test_mla_post_load_keeps_w_uk_uv_contiguous(tmp_path_factory, tiny_llama_dir):
    folder, tc = _save(tmp_path_factory, tiny_llama_dir, "mla", quant=False)
    d = load_drafter(folder, tc, torch.float32, torch.device("cpu"))
    raw = load_drafter(folder, tc, torch.float32, torch.device("cpu"), for_inference=False)
    for a, b in zip(d.layers, raw.layers):
        uk, uv = a.self_attn.w_uk_uv()
        ruk, ruv = b.self_attn.w_uk_uv()
        assert uk.is_contiguous() and uv.is_contiguous() and not ruk.is_contiguous()
        assert torch.equal(uk, ruk) and torch.equal(uv, ruv)
    assert set(d.state_dict()) == set(raw.state_dict())          # derived buffers are not saved


def test_mla_folds_refuse_an_fp8_drafter(tmp_path_factory, tiny_llama_dir):
    """`mla_fold_query` / `mla_fold_output` need the drafter's plain projections: an FP8 drafter is refused
    by option name, and its layers are left unfolded; its full-precision twin folds (control)."""
    fp8_dir, tc = _save(tmp_path_factory, tiny_llama_dir, "mla", quant=True)
    plain_dir, _ = _save(tmp_path_factory, tiny_llama_dir, "mla", quant=False)
    fp8 = load_drafter(fp8_dir, tc, torch.float32, torch.device("cpu"))
    for fold, option in ((fp8.fold_mla_query, "mla_fold_query"), (fp8.fold_mla_output, "mla_fold_output")):
        with pytest.raises(ValueError, match=f"{option} needs a drafter without quant_config"):
            fold()
    assert all(l.self_attn.w_q_abs is None and l.self_attn.w_o_abs is None for l in fp8.layers)
    plain = load_drafter(plain_dir, tc, torch.float32, torch.device("cpu"))
    plain.fold_mla_query()
    assert all(l.self_attn.q_weights()[3] is None for l in plain.layers)


def test_speculation_with_fp8_drafter_is_lossless(tmp_path_factory, tiny_llama_dir, make_llm):
    fp8_dir, _ = _save(tmp_path_factory, tiny_llama_dir, "gqa", quant=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    base = make_llm(tiny_llama_dir)
    want = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    spec = make_llm(tiny_llama_dir, speculative_config={"decoding_type": "DSpark", "speculative_model": str(fp8_dir)})
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert got == want
    assert spec.get_stats()["speculative"]["draft_tokens"] > 0
