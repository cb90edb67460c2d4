# Copied verbatim from this project's ../shared/examples/compiled_step_anchor.py (so it travels with the tree).
# Anchor for one decode step of a SmolLM2-135M-shaped Llama on an H200, written the way gpt-fast writes it (own
# ~40-line model, static KV cache, torch.compile of the step, the compiled step captured in a CUDA graph).
# Random weights (timing only). Usage: python3 compiled_step_anchor.py 1x1 16x1 64x1 1x9 16x9 64x9  (BATCHxTOKENS)
import json, sys, time
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
V, D, NL, H, KVH, HD, FF, MAXL = 49152, 576, 30, 9, 3, 64, 1536, 1024

class Layer(nn.Module):
    def __init__(s, bs):
        super().__init__()
        s.wqkv = nn.Linear(D, (H + 2 * KVH) * HD, bias=False); s.wo = nn.Linear(H * HD, D, bias=False)
        s.w13 = nn.Linear(D, 2 * FF, bias=False); s.w2 = nn.Linear(FF, D, bias=False)
        s.n1 = nn.RMSNorm(D, eps=1e-5); s.n2 = nn.RMSNorm(D, eps=1e-5)
        s.register_buffer("k", torch.zeros(bs, KVH, MAXL, HD)); s.register_buffer("v", torch.zeros(bs, KVH, MAXL, HD))
    def forward(s, x, cos, sin, pos, mask):
        b, q, _ = x.shape
        qkv = s.wqkv(s.n1(x)).view(b, q, H + 2 * KVH, HD)
        qkv_r = torch.cat([qkv[..., :HD // 2], qkv[..., HD // 2:]], -1)
        x1, x2 = qkv[..., :HD // 2], qkv[..., HD // 2:]
        rot = torch.cat([-x2, x1], -1)
        qk = qkv[:, :, :H + KVH] * cos + rot[:, :, :H + KVH] * sin
        xq, xk, xv = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), qkv[:, :, H + KVH:].transpose(1, 2)
        s.k.index_copy_(2, pos, xk); s.v.index_copy_(2, pos, xv)
        o = F.scaled_dot_product_attention(xq, s.k, s.v, attn_mask=mask, enable_gqa=True)
        x = x + s.wo(o.transpose(1, 2).reshape(b, q, H * HD))
        g, u = s.w13(s.n2(x)).chunk(2, -1)
        return x + s.w2(F.silu(g) * u)

class Model(nn.Module):
    def __init__(s, bs):
        super().__init__()
        s.emb = nn.Embedding(V, D); s.layers = nn.ModuleList(Layer(bs) for _ in range(NL)); s.norm = nn.RMSNorm(D, eps=1e-5)
        inv = 1.0 / (100000.0 ** (torch.arange(0, HD, 2).float() / HD)); t = torch.arange(MAXL).float()[:, None] * inv
        s.register_buffer("cos", torch.cat([t.cos(), t.cos()], -1)); s.register_buffer("sin", torch.cat([t.sin(), t.sin()], -1))
        s.register_buffer("causal", torch.tril(torch.ones(MAXL, MAXL, dtype=torch.bool)))
    def forward(s, ids, pos):
        x = s.emb(ids); cos, sin = s.cos[pos][None, :, None], s.sin[pos][None, :, None]
        mask = s.causal[pos][None, None]
        for l in s.layers: x = l(x, cos, sin, pos, mask)
        return F.linear(s.norm(x), s.emb.weight)

def bench(fn, n):
    torch.cuda.synchronize(); e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n): fn()
    e1.record(); torch.cuda.synchronize(); return e0.elapsed_time(e1) / n

res = {}
shapes = [(int(b), int(q)) for b, q in (a.split("x") for a in sys.argv[1:])] or [(1, 1), (64, 1), (1, 9), (64, 9)]
with torch.no_grad():
    for bs, q in shapes:
        t0 = time.time()
        m = Model(bs).to(torch.bfloat16).cuda().eval()
        step_c = torch.compile(m, dynamic=False)
        ids = torch.randint(0, V, (bs, q), device="cuda"); pos = torch.arange(200, 200 + q, device="cuda")
        eager = bench(lambda: m(ids, pos), 10)
        for _ in range(3): step_c(ids, pos)
        comp = bench(lambda: step_c(ids, pos), 20)
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3): step_c(ids, pos)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g): out = step_c(ids, pos)
        for _ in range(5): g.replay()
        graph = bench(g.replay, 200)
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            g.replay(); torch.cuda.synchronize()
        kernels = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
        res[f"bs{bs}-q{q}"] = {"eager_ms": round(eager, 3), "compiled_ms": round(comp, 3), "compiled_graph_ms": round(graph, 3),
                               "kernels_per_step": kernels, "setup_s": round(time.time() - t0, 1)}
        print(f"bs={bs} q={q}: eager {eager:.3f} ms, compiled {comp:.3f} ms, compiled+graph {graph:.3f} ms, "
              f"{kernels} kernels/step ({kernels/NL:.1f}/layer), {time.time()-t0:.0f} s", flush=True)
        del m, step_c, g; torch.cuda.empty_cache()
print(f"weights {(V*D + NL*(D*(H+2*KVH)*HD + H*HD*D + 3*D*FF))*2/1e6:.0f} MB bf16")
print(json.dumps(res))
