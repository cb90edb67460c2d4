"""TRITON as the target's attention backend (Triton's interpreter on the CPU, float32): prefill with
prompts of different lengths (ragged queries), decode and verify steps (uniform) and a mixed step
give the VANILLA engine's logits within 1e-4; negative control: another row's logits are far
off. Lengths missing from the metadata are computed in `prepare` (with -1 slots noted); a
captured graph's metadata keeps one persistent lengths tensor."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata  # noqa: E402
from tensorrt_llm._torch.attention_backend.triton_backend import TritonAttention  # noqa: E402
from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttention  # noqa: E402
from tensorrt_llm._torch.runtime.step import ForwardSegment  # noqa: E402


def _engine(model, backend):
    from tensorrt_llm._torch.pyexecutor.kv_cache.kv_cache_spec import KVCacheSpec
    from tensorrt_llm._torch.pyexecutor.kv_cache.resource_manager import KVCacheManager
    from tensorrt_llm._torch.pyexecutor.model_engine import ModelEngine
    layers, kv_heads, head_dim = model.kv_cache_layout()
    kv = KVCacheManager([KVCacheSpec("target", "gqa", layers, 2, kv_heads, head_dim, torch.float32)],
                        num_pages=40, tokens_per_block=16, max_seq_len=160, device=torch.device("cpu"))
    return ModelEngine(model, kv, backend, torch.device("cpu"))


def rel(a, b):
    return float((a - b).norm() / b.norm())


def test_triton_engine_steps_match_vanilla(tiny_llama_dir):
    from tensorrt_llm._torch.models import load_target_model
    model = load_target_model(tiny_llama_dir, torch.float32, torch.device("cpu"), max_positions=256)
    tri, van = _engine(model, TritonAttention()), _engine(model, VanillaAttention())
    fused = []      # the loaded model runs layer regions: TRITON rotates q and k in its KV append
    forward_rope = tri.backend.forward_rope
    tri.backend.forward_rope = lambda *a: fused.append(1) or forward_rope(*a)
    g = torch.Generator().manual_seed(0)
    prompts = {0: 5, 1: 23, 2: 1, 3: 17}
    toks = {r: torch.randint(3, 400, (n,), generator=g).tolist() for r, n in prompts.items()}
    for e in (tri, van):
        for r, n in prompts.items():
            e.kv.add_sequence(r, toks[r], n + 40)
            e.kv.ensure_capacity(r, n + 20)
    t = lambda n: torch.randint(3, 400, (n,), generator=g).tolist()   # noqa: E731
    steps = [[ForwardSegment(r, toks[r], 0, 1) for r in prompts]]                  # ragged prefill
    pos = dict(prompts)
    steps.append([ForwardSegment(r, t(1), pos[r], 1) for r in prompts])            # decode
    pos = {r: p + 1 for r, p in pos.items()}
    steps.append([ForwardSegment(r, t(4), pos[r], 4) for r in prompts])            # verify
    pos = {r: p + 4 for r, p in pos.items()}
    steps.append([ForwardSegment(0, t(3), pos[0], 3), ForwardSegment(1, t(2), pos[1], 2),
                  ForwardSegment(3, t(9), pos[3], 1)])                             # ragged again
    with torch.inference_mode():
        for segs in steps:
            a, b = tri.forward(segs), van.forward(segs)
            assert a.logits.shape == b.logits.shape and rel(a.logits, b.logits) < 1e-4
            if a.logits.shape[0] > 1:
                assert rel(a.logits.roll(1, 0), b.logits) > 0.1
    assert tri.paths.eager == len(steps)
    assert len(fused) == len(steps) * model.config.num_hidden_layers


def test_rope_is_fused_only_where_the_backend_declares_it(tiny_llama_dir):
    """VANILLA (no `fused_rope_append`) gets rotated q and k; its forward_rope refuses by name; a
    model without layer regions keeps the rotation in the model on TRITON too."""
    from tensorrt_llm._torch.models import load_target_model
    assert TritonAttention.capabilities.fused_rope_append and not VanillaAttention.capabilities.fused_rope_append
    with pytest.raises(ValueError, match="VANILLA does not fuse RoPE"):
        VanillaAttention().forward_rope(*[None] * 8)
    model = load_target_model(tiny_llama_dir, torch.float32, torch.device("cpu"), max_positions=256)
    for layer in model.decoder_layers:
        layer.regions = None
    with pytest.raises(ValueError, match="unrotated q and k need the layer regions"):
        model.decoder_layers[0].attention_inputs(torch.zeros(1, model.config.hidden_size), torch.zeros(1).long(),
                                                 model.rotary.cos_sin(torch.zeros(1).long()), rotate=False)
    tri = _engine(model, TritonAttention())
    tri.backend.forward_rope = lambda *a: pytest.fail("a model without regions rotates q and k itself")
    tri.kv.add_sequence(0, [5, 6, 7], 10)
    tri.kv.ensure_capacity(0, 3)
    with torch.inference_mode():
        tri.forward([ForwardSegment(0, [5, 6, 7], 0, 1)])


def test_prepare_fills_lengths_and_keeps_a_graphs_tensor():
    be = TritonAttention()
    md = AttentionMetadata(seq_lens=[3, 1], num_cached=[5, 9], block_tables=torch.zeros(2, 2, dtype=torch.int32),
                           slot_mapping=torch.tensor([1, 2, 3, -1]), tokens_per_block=16)
    be.prepare(md)
    assert md.extras["triton_kv_lens"].tolist() == [8, 10] and md.extras["triton_qo_indptr"].tolist() == [0, 3, 4]
    assert md.extras["triton_slots_valid"] is False
    g = AttentionMetadata(seq_lens=[2, 2], num_cached=[5, 9], block_tables=torch.zeros(2, 2, dtype=torch.int32),
                          slot_mapping=torch.zeros(4, dtype=torch.long), tokens_per_block=16, graph_shape=(2, 2, 2))
    be.prepare(g)
    kept = g.extras["triton_kv_lens"]
    g.num_cached = [7, 1]
    be.prepare(g)
    assert g.extras["triton_kv_lens"] is kept and kept.tolist() == [9, 3]       # updated in place
    assert "triton_qo_indptr" not in g.extras and g.extras["triton_slots_valid"] is True
    with pytest.raises(ValueError, match="sliding windows"):
        be.prepare(AttentionMetadata(seq_lens=[1], num_cached=[0], block_tables=torch.zeros(1, 1, dtype=torch.int32),
                                     slot_mapping=torch.zeros(1, dtype=torch.long), tokens_per_block=16,
                                     sliding_window=4))


def test_q_views_of_the_qkv_buffer_are_not_copied(monkeypatch):
    """TRITON hands the kernel q as given when its last dim is contiguous (the view of a layer's
    q|k|v buffer: no copy kernel), and the K/V halves of that buffer as one write; a q whose dims
    are strided (the control) is made contiguous first."""
    from tensorrt_llm._torch.attention_backend import triton_paged_kernel
    seen = []
    real = triton_paged_kernel.paged_attention

    def spy(q, *args, **kwargs):
        seen.append((q.data_ptr(), q.stride()))
        return real(q, *args, **kwargs)
    monkeypatch.setattr(triton_paged_kernel, "paged_attention", spy)
    hq, hkv, d, p = 4, 2, 16, 16
    g = torch.Generator().manual_seed(3)
    buf = torch.randn(4, hq + 2 * hkv, d, generator=g)
    q, k, v = buf.split((hq, hkv, hkv), dim=1)
    md = AttentionMetadata(seq_lens=[2, 2], num_cached=[3, 0], block_tables=torch.tensor([[0], [1]], dtype=torch.int32),
                           slot_mapping=torch.tensor([3, 4, 16, 17]), tokens_per_block=p)
    cache = torch.zeros(2, 2, hkv, p, d)
    out = TritonAttention().forward(q, k, v, cache, md, 0.25)
    assert seen[-1] == (q.data_ptr(), q.stride())
    assert torch.equal(cache[1, 0, :, 1], k[3]) and torch.equal(cache[1, 1, :, 1], v[3])
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)        # same values, last dim strided
    md.extras.clear()
    assert torch.equal(TritonAttention().forward(strided, k, v, cache, md, 0.25), out)
    assert seen[-1][1][-1] == 1 and seen[-1][0] != strided.data_ptr()
