"""Decoder-layer regions (`compiled_regions`): the eager functions are the layers' own path, and the
inductor-compiled ones agree with them.

CPU (float32, tiny Llama, paged VANILLA forward): the eager regions (what a loaded target runs) give
bitwise the module path's logits; the inductor regions agree within 1e-4 relative while a model with one perturbed weight
(negative control) lands far outside; `LLM(torch_compile_config=...)` decodes the same greedy
tokens and reports its regions; layers without fused projections are refused.
GPU (bf16, FLASHINFER + CUDA graphs): compiled vs eager regions' prompt logits within 2e-2
relative with the same negative control, and greedy decoding with graphs agrees with the eager
regions' up to near ties (a divergence only where fp32 logits of the two choices are within
3% of a std; >= 75% of tokens before the first divergence).
"""
from __future__ import annotations

import pytest
import torch

from tensorrt_llm import SamplingParams
from tensorrt_llm._torch.attention_backend.interface import joint_kv
from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttention
from tensorrt_llm._torch.models import load_target_model
from tensorrt_llm._torch.modules.compiled_regions import LayerRegions
from tensorrt_llm._torch.pyexecutor.kv_cache.kv_cache_spec import KVCacheSpec
from tensorrt_llm._torch.pyexecutor.kv_cache.resource_manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.model_engine import ModelEngine
from tensorrt_llm._torch.runtime.step import ForwardSegment

IDS = [5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 1, 2, 3]


def _logits(model, device, chunks=(9, 1, 3)) -> torch.Tensor:
    """[len(IDS), V] logits of a paged forward: a 9-token chunk, one decode-shaped step, a 3-token one."""
    layers, kv_heads, head_dim = model.kv_cache_layout()
    spec = KVCacheSpec("target", "gqa", layers, 2, kv_heads, head_dim, model.lm_head.weight.dtype)
    kv = KVCacheManager([spec], 4, 16, len(IDS) + 1, device)
    engine = ModelEngine(model, kv, VanillaAttention(), device)
    kv.add_sequence(1, IDS, len(IDS))
    out, start = [], 0
    for n in chunks:
        kv.ensure_capacity(1, start + n)
        out.append(engine.forward([ForwardSegment(1, IDS[start:start + n], start, n)]).logits.float().cpu())
        start += n
    return torch.cat(out)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _perturbed(model) -> None:
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.5)


def _regions_vs_modules(folder, dtype, device, regions: LayerRegions, tol: float, control: float) -> None:
    """The model's logits with `regions` are within `tol` (relative; 0: bitwise) of its module path,
    and with one weight perturbed beyond `control` (the regions read the weights passed in)."""
    model = load_target_model(folder, dtype, device)
    for layer in model.model.layers:      # the module path
        layer.regions = None
    want = _logits(model, device)
    model.use_regions(regions)
    got = _logits(model, device)
    assert torch.equal(got, want) if tol == 0 else _rel(got, want) < tol
    _perturbed(model)
    assert _rel(_logits(model, device), want) > control


def test_eager_regions_are_the_module_path(tiny_llama_dir):
    _regions_vs_modules(tiny_llama_dir, torch.float32, torch.device("cpu"), LayerRegions.eager(), 0, 1e-2)


def test_inductor_regions_match_eager_on_cpu(tiny_llama_dir, make_llm):
    _regions_vs_modules(tiny_llama_dir, torch.float32, torch.device("cpu"), LayerRegions.inductor(), 1e-4, 1e-2)

    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7], [40, 41, 42, 43, 44]]
    ref = [o.outputs[0].token_ids for o in make_llm(tiny_llama_dir).generate(prompts, sp)]
    llm = make_llm(tiny_llama_dir, torch_compile_config={})
    assert llm.capacity_report["layer_regions"] == "inductor"
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == ref


def test_regions_need_fused_projections(tiny_llama_dir):
    model = load_target_model(tiny_llama_dir, torch.float32, torch.device("cpu"))
    assert all(layer.regions == LayerRegions.eager() for layer in model.model.layers)   # set by fusing
    model.model.layers[1].mlp._gate_up = None
    with pytest.raises(ValueError, match="layer 1: compiled regions need fused"):
        model.use_regions(LayerRegions.inductor())
    assert all(layer.regions == LayerRegions.eager() for layer in model.model.layers)   # nothing half-applied


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inductor_regions_on_gpu(llama64_dir, make_llm, hf_reference):
    _regions_vs_modules(llama64_dir, torch.bfloat16, torch.device("cuda"), LayerRegions.inductor(), 2e-2, 5e-2)

    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7], [40, 41, 42, 43, 44], list(range(100, 140))]
    common = dict(device="cuda", attn_backend="FLASHINFER", use_cuda_graph=True)
    ref = [o.outputs[0].token_ids for o in make_llm(llama64_dir, **common).generate(prompts, sp)]
    llm = make_llm(llama64_dir, torch_compile_config={}, **common)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert llm._bundle.executor.engine.graph_runner.graphs.num_replays > 0
    hf, agreed = hf_reference.load(llama64_dir), 0
    for pr, a, b in zip(prompts, got, ref):
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        agreed += i
        if i < len(a):
            logits = hf_reference.logits(hf, pr + a[:i])[-1]
            gap = float((logits[a[i]] - logits[b[i]]).abs())
            assert gap < 0.03 * float(logits.std()), f"diverged at {i}: fp32 gap {gap:.3f}"
    assert agreed >= 0.75 * sum(len(a) for a in got)


def _one_qkv_buffer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """q, k, v [T, H*, D] are the views of one [T, Hq + 2 Hkv, D] buffer, in that order (`split_qkv`)."""
    hq, d = q.shape[1], q.shape[2]
    row = (hq + 2 * k.shape[1]) * d
    return (joint_kv(k, v) is not None and q.stride() == k.stride() == (row, d, 1)
            and k.data_ptr() == q.data_ptr() + hq * d * q.element_size())


@pytest.mark.parametrize("t", [1, 7])
def test_compiled_regions_keep_q_k_and_v_in_one_buffer(t):
    """The inductor regions return q, k and v as the views of one buffer (one pointwise kernel writes
    them; k and v its halves, `joint_kv`: one cache write per layer), from `attention_inputs` and
    from `output_then_inputs`, and equal the eager regions'. Control: copies are not one buffer."""
    g = torch.Generator().manual_seed(t)
    hq, hkv, d, hidden, inter = 4, 2, 8, 16, 32
    w = {n: torch.randn(*s, generator=g) * 0.2 for n, s in
         (("qkv", ((hq + 2 * hkv) * d, hidden)), ("o", (hidden, hq * d)), ("gu", (2 * inter, hidden)),
          ("down", (hidden, inter)))}
    h, o = torch.randn(t, hidden, generator=g), torch.randn(t, hq * d, generator=g)
    ang = torch.randn(t, 1, d // 2, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    ones = torch.ones(hidden)
    args = (h, o, w["o"], ones, 1e-6, w["gu"], w["down"], ones, 1e-6, w["qkv"], None, cos, sin, hq, hkv, d)
    with torch.inference_mode():
        got = LayerRegions.inductor().output_then_inputs(*args)
        want = LayerRegions.eager().output_then_inputs(*args)
        q, k, v = LayerRegions.inductor().attention_inputs(h, ones, 1e-6, w["qkv"], None, cos, sin, hq, hkv, d)
    assert _one_qkv_buffer(*got[1:]) and _one_qkv_buffer(q, k, v) and _one_qkv_buffer(*want[1:])
    for a, b in zip(got, want):
        assert _rel(a, b) < 1e-4
    assert joint_kv(k.clone(), v.clone()) is None and not _one_qkv_buffer(q.clone(), k, v)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_attention_inputs_are_one_pointwise_kernel_on_gpu():
    """Compiled on the GPU (bf16, 9 tokens: the dynamic trace of a verify step), the work after the
    q|k|v GEMM, RoPE of q and k with v beside them in one buffer, is one Triton pointwise kernel
    (were three: the RoPE, the k|v cat, q's copy). Control: asking for a contiguous q adds its copy."""
    import re

    from torch._inductor.utils import run_and_get_code

    from tensorrt_llm._torch.modules.compiled_regions import attention_inputs
    dev, t, hq, hkv, d, hidden = torch.device("cuda"), 9, 8, 2, 64, 256
    g = torch.Generator().manual_seed(0)
    qkv_w = (torch.randn((hq + 2 * hkv) * d, hidden, generator=g) * 0.05).to(dev, torch.bfloat16)
    ang = torch.randn(t, 1, d // 2, generator=g)
    cos, sin = (torch.cat([f(ang)] * 2, -1).to(dev, torch.bfloat16) for f in (torch.cos, torch.sin))
    args = (torch.randn(t, hidden, generator=g).to(dev, torch.bfloat16), torch.ones(hidden, device=dev,
            dtype=torch.bfloat16), 1e-6, qkv_w, None, cos, sin, hq, hkv, d)

    def pointwise_kernels(fn) -> int:
        torch._dynamo.reset()
        with torch.inference_mode():
            _, code = run_and_get_code(torch.compile(fn, dynamic=True), *args)
        return len(set(re.findall(r"(triton_poi_\w+) = async_compile", "\n".join(code))))

    assert pointwise_kernels(attention_inputs) == 1
    assert pointwise_kernels(lambda *a: attention_inputs(*a)[0].contiguous()) == 2
    torch._dynamo.reset()
