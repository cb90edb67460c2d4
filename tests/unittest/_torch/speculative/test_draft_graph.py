"""CUDA-graph draft step launched from the device-side verify output (context write + block +
greedy drafts, TRITON attention) vs the eager draft step after the host update.

GPU: a tiny Llama with head_dim 64 and random GQA (2 KV heads x 64) / MLA (512 + 64 latent)
drafters at block 8 (9 verify rows per request), through the LLM API with FLASHINFER + use_cuda_graph. Every
launch is shadowed by the eager draft step of the same commits after the update: the draft ids must agree (bf16:
>= 90% of ids) and the draft KV both wrote at the committed positions must match (first and last
drafter layer, relative error < 2e-2), while the same KV compared one committed row off must not
(negative control, > 0.3; a wrong-anchor control was too weak in bf16: 75% of ids agreed on the
H200), and greedy output must equal the no-spec graph engine's, token for token. With staggered
arrivals and different max_tokens (piecewise target steps, launched drafts next to eager
ones) the output still equals the no-spec engine's.
At T > 0 (graphs, overlap) DSpark samples the no-spec distribution (two-sample chi2, with an
accept-every-draft control).
CPU: the eager path is what CPU runs; enabling graphs without CUDA raises.
"""
from __future__ import annotations

import pytest
import torch

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.models.checkpoint import read_config
from tensorrt_llm._torch.models.modeling_dspark import DSparkForCausalLMBase
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig
from tensorrt_llm._torch.pyexecutor.spec_step_graph import SpecStepGraph
from tensorrt_llm._torch.speculative.draft_graph_runner import DraftGraphRunner
from tensorrt_llm._torch.speculative.dspark_worker import DSparkWorker
from tests.unittest._torch.speculative.chi2 import critical, two_sample_chi2

PROMPTS = ["the quick brown fox", "hello world, what is the capital of france?", "once upon a time",
           "a paged kv cache holds keys and values", "0123456789", "paris is"]


def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


def _drafter(tmp_path_factory, target_dir, kind: str):
    tc = LlamaConfig.from_dict(read_config(target_dir), "target")
    arch = (dict(num_key_value_heads=2, head_dim=64) if kind == "gqa" else
            dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64))
    d = DSparkForCausalLMBase.random_init(kind, tc, seed=5, markov_rank=4, block_size=8, **arch)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        # A plain random drafter is an identity map (tied embeddings: the residual stream is its
        # input embedding, so it drafts [anchor, MASK, MASK, ...] whatever the context; seen on
        # the H200). Target-like scale, q/k x4 (peaky attention) and o/down x8 (the layers, i.e.
        # the context, dominate the residual) make drafts depend on context and anchor.
        for name, p in d.named_parameters():
            if p.dim() == 2:
                kind = name.split(".")[-2]
                scale = {"q_proj": 4.0, "k_proj": 4.0, "kv_a_proj_with_mqa": 4.0, "o_proj": 8.0,
                         "down_proj": 8.0}.get(kind, 1.0)
                std = 0.5 if name.startswith("markov_head") else scale * p.shape[-1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=g) * std)
    out = tmp_path_factory.mktemp(f"graph_drafter_{kind}")
    d.save_pretrained(out)
    return out


def _rows(cache: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """Rows [len(slots), X*H*D] float32 of a paged layer cache [pages, X, H, page, D] at flat slots."""
    p, x, h, page, d = cache.shape
    flat = cache.permute(0, 3, 1, 2, 4).reshape(p * page, x * h * d)
    return flat[torch.tensor(slots, device=cache.device)].float()


def _llm(target, **kw):
    return LLM(str(target), device="cuda", attn_backend="FLASHINFER", max_batch_size=8,
               kv_cache_config={"max_tokens": 8192, "tokens_per_block": 16}, **kw)


def test_draft_graphs_need_cuda(tiny_llama_dir, tmp_path_factory, make_llm):
    drafter = _drafter(tmp_path_factory, tiny_llama_dir, "mla")
    with pytest.raises(ValueError, match="CUDA"):
        make_llm(tiny_llama_dir, use_cuda_graph=True,
                 speculative_config={"decoding_type": "DSpark", "speculative_model": str(drafter)})


@gpu
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_draft_graph_matches_eager_and_is_lossless(llama64_dir, tmp_path_factory, monkeypatch, kind):
    pytest.importorskip("flashinfer")
    drafter = _drafter(tmp_path_factory, llama64_dir, kind)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    with _llm(llama64_dir, use_cuda_graph=True) as llm:
        baseline = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]

    seen = {"same": 0, "total": 0, "replays": 0, "inner": 0, "kv_err": [], "kv_off": []}
    orig_draft = DSparkWorker.draft
    # A one-graph step hands the drafter no captured rows (the graph drafted from them): keep the
    # captured buffer each graph's draft step reads (held here, it stays a fixed buffer of the graph's
    # pool, rewritten by every replay) and hand it to the shadow below with the step's launch.
    kept, last_block = {}, {}
    orig_rows, orig_prep, orig_run = DraftGraphRunner.draft_rows, DraftGraphRunner.prepare_block, SpecStepGraph.run

    def keep_rows(self, captured, verified, start, md):
        kept[id(md)] = captured
        return orig_rows(self, captured, verified, start, md)

    def note_block(self, md, *args):
        last_block["md"] = id(md)
        return orig_prep(self, md, *args)

    def run_keeping_rows(self, reqs, segments):
        launch = orig_run(self, reqs, segments)
        if launch is not None:
            launch.out.captured = kept[last_block["md"]][:len(segments) * launch.verify_width].clone()
        return launch

    def shadowed(self, commits, captured, ahead=None):
        before = self.graph_runner.num_launches if self.graph_runner is not None else 0
        orig_draft(self, commits, captured, ahead)      # attaches the launched drafts
        # an arriving prompt drafts through the draft graph inside draft() (`_launch_from_last`)
        seen["inner"] += (self.graph_runner.num_launches if self.graph_runner is not None else 0) - before
        if ahead is None:
            return
        seen["replays"] += 1
        live = [c for c in commits if c.req.request_id in ahead.rows and not c.req.is_finished]
        if not live:
            return
        # the host values (waits for the draft step's copy), read before the eager replay
        graph = {c.req.request_id: ahead.drafts(c.req.request_id).tolist() for c in live}
        slots = [s for c in live for s in self.kv.slots(c.req.request_id, c.start, c.count)]
        layers = (self.kv_caches[0], self.kv_caches[-1])
        graph_kv = [_rows(c, slots) for c in layers]
        # the same step eagerly (rewrites the KV and the drafts): without the graph runner, which
        # `_eager_draft` would otherwise take for generating requests (`_launch_from_last`)
        runner, self.graph_runner = self.graph_runner, None
        try:
            with torch.inference_mode():
                self._eager_draft(live, captured)
        finally:
            self.graph_runner = runner
        for g, c in zip(graph_kv, layers):
            e = _rows(c, slots)
            seen["kv_err"].append(float((g - e).norm() / e.norm()))
            if len(slots) > 1:    # negative control: each row against the next committed row
                seen["kv_off"].append(float((g - e.roll(1, 0)).norm() / e.norm()))
        for c in live:
            e = c.req.draft_tokens
            seen["total"] += len(e)
            seen["same"] += sum(a == b for a, b in zip(graph[c.req.request_id], e))

    monkeypatch.setattr(DSparkWorker, "draft", shadowed)
    monkeypatch.setattr(DraftGraphRunner, "draft_rows", keep_rows)
    monkeypatch.setattr(DraftGraphRunner, "prepare_block", note_block)
    monkeypatch.setattr(SpecStepGraph, "run", run_keeping_rows)
    spec = {"decoding_type": "DSpark", "speculative_model": str(drafter)}
    with _llm(llama64_dir, use_cuda_graph=True, speculative_config=spec) as llm:
        worker: DSparkWorker = llm._executor.drafter
        toks = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        runner, one_graph = worker.graph_runner, llm._executor.engine.spec_step
        assert runner.graphs.num_captures + one_graph.graphs.num_captures >= 1
        # every launch is either shadowed below (a step's drafts handed to draft()) or an arrival's
        assert runner.num_launches + one_graph.num_launches == seen["replays"] + seen["inner"]
        assert seen["replays"] > 0
    assert toks == baseline
    assert seen["total"] > 100
    assert seen["same"] / seen["total"] >= 0.9, seen
    assert max(seen["kv_err"]) < 2e-2, max(seen["kv_err"])
    assert seen["kv_off"] and min(seen["kv_off"]) > 0.3, min(seen["kv_off"] or [0.0])


@gpu
def test_split_steps_with_staggered_arrivals_are_lossless(llama64_dir, tmp_path_factory):
    """More requests than the batch and different max_tokens: requests finish at different steps
    and new prompts arrive next to verify segments (piecewise target steps; the prompt-finishing
    requests draft eagerly next to the launched draft graph). Output == the no-spec graph engine's, token for token; graphs dominate.
    Every graph was captured at startup: none is captured while the requests run."""
    pytest.importorskip("flashinfer")
    drafter = _drafter(tmp_path_factory, llama64_dir, "gqa")
    prompts = PROMPTS + [p[::-1] for p in PROMPTS]
    max_tokens = [40, 17, 29, 8, 33, 21, 12, 40, 25, 9, 31, 3]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    common = dict(device="cuda", attn_backend="FLASHINFER", max_batch_size=4, use_cuda_graph=True,
                  kv_cache_config={"max_tokens": 8192, "tokens_per_block": 16})
    def captures(llm) -> list[int]:
        ex = llm._executor
        caches = [ex.engine.graph_runner.graphs, ex.engine.piecewise.graphs]
        if ex.drafter is not None:
            caches += [ex.engine.spec_step.graphs, ex.drafter.graph_runner.graphs]
        return [c.num_captures for c in caches]

    with LLM(str(llama64_dir), **common) as llm:
        at_start = captures(llm)
        baseline = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert captures(llm) == at_start and llm.capacity_report["cuda_graphs"]["captured_at_startup"] == sum(at_start)
    spec = {"decoding_type": "DSpark", "speculative_model": str(drafter)}
    with LLM(str(llama64_dir), speculative_config=spec, **common) as llm:
        at_start = captures(llm)
        toks = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert captures(llm) == at_start and min(at_start) > 0, (at_start, captures(llm))
        assert llm.capacity_report["cuda_graphs"]["captured_at_startup"] == sum(at_start)
        llm_engine = llm._executor.engine
        target = llm_engine.graph_runner
        draft = llm._executor.drafter.graph_runner
        stats = llm._executor.drafter.stats()["device_drafts"]
    assert [len(t) for t in toks] == max_tokens
    assert toks == baseline
    # steady steps replay the one-graph step; the others the target's whole-step or piecewise graphs
    assert target.num_declined > 0 and llm_engine.spec_step.graphs.num_replays > 0
    assert llm_engine.piecewise.num_steps == target.num_declined and llm_engine.paths.eager == 0
    assert draft is not None and draft.num_launches > 0 and stats["drafted_requests"] == draft.num_drafted > 0


@gpu
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_auto_drafter_takes_the_graph_backend_and_arrivals_stay_lossless(llama64_dir, tmp_path_factory, kind):
    """Drafter on AUTO with CUDA graphs: every draft step runs the device draft step's backend, CUTEDSL
    where its support predicate holds (here: nvidia-cutlass-dsl carried to the H200), else TRITON (a step
    with an arriving prompt drafts eagerly on it, with no host plan); staggered arrivals on a
    TRITON target give the no-spec graph engine's output token for token, prompt-only steps among
    them read one step late (`draft_arrivals`), arrivals inside a one-graph step among them
    (`MixedSpecGraph`), and, with that form off, beside it (`anchor_arrivals`). Control: an explicit
    FLASHINFER choice is kept."""
    from tensorrt_llm._torch.attention_backend.cute_dsl_backend import CuteDslAttention
    from tensorrt_llm._torch.attention_backend.triton_backend import TritonAttention
    drafter = _drafter(tmp_path_factory, llama64_dir, kind)
    expected = "CUTEDSL" if CuteDslAttention.availability(torch.device("cuda"))[0] else "TRITON"
    prompts = PROMPTS + [p[::-1] for p in PROMPTS]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (40, 17, 29, 8, 33, 21, 12, 40, 25, 9, 31, 3)]
    common = dict(device="cuda", attn_backend="TRITON", max_batch_size=4, use_cuda_graph=True,
                  kv_cache_config={"max_tokens": 8192, "tokens_per_block": 16})
    with LLM(str(llama64_dir), **common) as llm:
        baseline = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    spec = {"decoding_type": "DSpark", "speculative_model": str(drafter)}
    with LLM(str(llama64_dir), speculative_config=spec, **common) as llm:
        chosen = llm.capacity_report["attention_backend"]["draft"]
        worker: DSparkWorker = llm._executor.drafter
        assert chosen["name"] == expected and chosen["reason"].startswith("AUTO with CUDA graphs"), chosen
        assert isinstance(worker.backend, TritonAttention) and worker.backend is worker.graph_runner.backend
        toks = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        steps = llm.get_stats()["steps"]
        llm._executor.engine.mixed_step = None
        beside = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        steps_beside = llm.get_stats()["steps"]
    assert toks == baseline and beside == baseline
    assert steps["prompts_read_late"] > 0      # prompt-only steps drafted their arrivals from the device ids
    assert steps["one_graph_with_prompts"] > 0     # arrivals inside a one-graph step (placeholder drafts)
    assert steps_beside["prompts_beside_one_graph"] > 0   # arrivals beside it
    pytest.importorskip("flashinfer")
    with LLM(str(llama64_dir), speculative_config={**spec, "attention_backend": "FLASHINFER"}, **common) as llm:
        assert llm.capacity_report["attention_backend"]["draft"]["name"] == "FLASHINFER"


@gpu
def test_dspark_steps_never_block_on_the_gpu(llama64_dir, tmp_path_factory, no_device_syncs):
    """20 steady-state DSpark steps with graphs under torch.cuda.set_sync_debug_mode("error"): every
    step is one graph (verify, acceptance and the draft step: `SpecStepGraph`, one replay per
    step) and no torch op blocks on the device; the host waits only on the verify rows' pinned
    copy. Control: the mode does see a blocking read."""
    pytest.importorskip("flashinfer")
    drafter = _drafter(tmp_path_factory, llama64_dir, "gqa")
    spec = {"decoding_type": "DSpark", "speculative_model": str(drafter)}
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    with _llm(llama64_dir, use_cuda_graph=True, speculative_config=spec) as llm:
        ex = llm._executor
        ex.shutdown()                                   # drive by hand
        handles = [llm.generate_async([5 + i, 6, 7, 8, 9 + i], params) for i in range(4)]
        ex._drain_incoming()
        for _ in range(4):                              # prefill, warm-up and capture
            ex.step()
        one_graph = ex.engine.spec_step
        launches, replays = one_graph.num_launches, one_graph.graphs.num_replays
        with no_device_syncs():
            for _ in range(20):
                ex.step()
        assert one_graph.num_launches - launches == 20 == one_graph.graphs.num_replays - replays
        ex.run_until_idle()
        assert all(len(h.result(timeout=0).outputs[0].token_ids) == 200 for h in handles)
    with no_device_syncs(), pytest.raises(RuntimeError, match="synchroniz"):   # control
        torch.ones(1, device="cuda").item()


@gpu
@pytest.mark.parametrize("kind,schedule", [("gqa", None), ("mla", None), ("gqa", {2: 8, 4: 3})])
def test_overlapped_dspark_steps_are_lossless_and_never_block(llama64_dir, tmp_path_factory, no_device_syncs, kind,
                                                              schedule):
    """The overlap scheduler with DSpark on the GPU (TRITON target: KV lengths read on the device;
    graphs): 20 steady-state steps, each one graph (`SpecStepGraph`: continued verify segments
    with starts shifted on the device, acceptance, the draft step) launched before the step in
    flight is read, no blocking torch op (`set_sync_debug_mode("error")`); output == the no-spec engine's with the
    same backend, token for token, and == the DSpark loop without overlap. Also with a draft-length
    schedule (a narrower verify width than the drafted block)."""
    drafter = _drafter(tmp_path_factory, llama64_dir, kind)
    spec = {"decoding_type": "DSpark", "speculative_model": str(drafter)}
    if schedule:     # 4 requests: 3 drafts verified per step (graphs for widths 1, 4 and 9)
        spec["draft_len_schedule"] = schedule
    common = dict(device="cuda", attn_backend="TRITON", max_batch_size=4, use_cuda_graph=True,
                  kv_cache_config={"max_tokens": 8192, "tokens_per_block": 16})
    params = SamplingParams(max_tokens=160, ignore_eos=True)
    prompts = [[5 + i, 6, 7, 8, 9 + i] for i in range(4)]
    with LLM(str(llama64_dir), **common) as llm:
        baseline = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with LLM(str(llama64_dir), speculative_config=spec, disable_overlap_scheduler=True, **common) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with LLM(str(llama64_dir), speculative_config=spec, **common) as llm:
        ex = llm._executor
        assert ex.spec_overlap
        ex.shutdown()                                   # drive by hand
        handles = [llm.generate_async(p, params) for p in prompts]
        ex._drain_incoming()
        for _ in range(6):                              # prefill, warm-up and captures
            ex.step()
        engine = ex.engine
        one_graph = engine.spec_step
        launches, continued, replays = one_graph.num_launches, engine.num_continued_steps, one_graph.graphs.num_replays
        with no_device_syncs():
            for _ in range(20):
                ex.step()
        assert one_graph.num_launches - launches == 20 == one_graph.graphs.num_replays - replays
        assert engine.num_continued_steps - continued == 20 and engine.paths.eager == 0
        ex.run_until_idle()
        got = [h.result(timeout=0).outputs[0].token_ids for h in handles]
    assert got == plain == baseline



@gpu
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_arrivals_inside_the_one_graph_step_never_block(llama64_dir, tmp_path_factory, no_device_syncs, kind):
    """Prompts arriving beside running requests ride in their continued one-graph step's forward
    (`MixedSpecGraph`, captured at startup): such steps replay one graph each, launched before the
    step in flight is read, with no blocking torch op; output == the no-spec engine's, token for token."""
    drafter = _drafter(tmp_path_factory, llama64_dir, kind)
    spec = {"decoding_type": "DSpark", "speculative_model": str(drafter)}
    common = dict(device="cuda", attn_backend="TRITON", max_batch_size=8, use_cuda_graph=True,
                  kv_cache_config={"max_tokens": 8192, "tokens_per_block": 16})
    params = SamplingParams(max_tokens=120, ignore_eos=True)
    first = [[5 + i, 6, 7, 8, 9 + i] for i in range(4)]
    later = [[40 + i] * (3 + 7 * i) + [11, 12] for i in range(4)]
    with LLM(str(llama64_dir), **common) as llm:
        baseline = [o.outputs[0].token_ids for o in llm.generate(first + later, params)]
    with LLM(str(llama64_dir), speculative_config=spec, **common) as llm:
        ex, engine = llm._executor, llm._executor.engine
        assert ex.spec_overlap and engine.mixed_step is not None and engine.mixed_step.graphs.num_captures > 0
        ex.shutdown()                                   # drive by hand
        handles = [llm.generate_async(p, params) for p in first]
        ex._drain_incoming()
        for _ in range(6):
            ex.step()
        mixed = engine.mixed_step
        launches, replays, captures = mixed.num_launches, mixed.graphs.num_replays, mixed.graphs.num_captures
        for p in later:                                 # one arrival per step, beside the running requests
            handles.append(llm.generate_async(p, params))
            ex._drain_incoming()
            with no_device_syncs():
                ex.step()
        assert mixed.num_launches - launches == len(later) == mixed.graphs.num_replays - replays
        assert mixed.graphs.num_captures == captures    # every shape was captured at startup
        ex.run_until_idle()
        got = [h.result(timeout=0).outputs[0].token_ids for h in handles]
    assert got == baseline


def _first_two_sampled(target, n: int, seed0: int, **kw) -> tuple[list[tuple[int, ...]], dict]:
    # the test Llama's logits are peaky (a 4 x 64 random model with unit embeddings): at T = 1 its top
    # token holds nearly all mass; T = 30 spreads it over the top 3 (9 cells of pairs)
    params = [SamplingParams(max_tokens=2, temperature=30.0, top_k=3, seed=seed0 + i, ignore_eos=True)
              for i in range(n)]
    with LLM(str(target), device="cuda", attn_backend="TRITON", max_batch_size=64, use_cuda_graph=True,
             kv_cache_config={"max_tokens": 65536, "tokens_per_block": 16}, **kw) as llm:
        outs = llm.generate([[5, 6, 7, 8, 9]] * n, params)
        return [tuple(o.outputs[0].token_ids) for o in outs], llm.get_stats()


@gpu
def test_sampled_spec_output_has_the_no_spec_distribution_on_the_gpu(llama64_dir, tmp_path_factory, monkeypatch):
    """T > 0 on the GPU (TRITON, CUDA graphs, overlap on): the (first, second) token pairs of DSpark
    (the drafter's first block, the RejectionSampler's device verification) and of the no-spec engine
    are samples of one distribution (two-sample chi2 below the p = 0.001 bound); a verifier that
    accepts every draft, the control, lands far above it."""
    import tensorrt_llm._torch.speculative.rejection_sampler as rs
    n = 1200
    spec = {"speculative_config": {"decoding_type": "DSpark",
                                   "speculative_model": str(_drafter(tmp_path_factory, llama64_dir, "gqa"))}}
    plain, _ = _first_two_sampled(llama64_dir, n, seed0=0)
    drafted, stats = _first_two_sampled(llama64_dir, n, seed0=n, **spec)
    assert stats["speculative"]["request_steps"] >= n                  # the second token went through verify
    chi2, dof = two_sample_chi2(plain, drafted)
    assert dof >= 4 and chi2 < critical(dof), (chi2, dof)

    def accept_all_batched(draft_ids, num_drafts, draft_probs, target_probs, *keys):
        rows = torch.arange(len(num_drafts), device=num_drafts.device)
        return num_drafts, torch.multinomial(target_probs[rows, num_drafts], 1).squeeze(-1)
    monkeypatch.setattr(rs, "batched_rejection_accept", accept_all_batched)
    biased, _ = _first_two_sampled(llama64_dir, n, seed0=n, **spec)
    chi2_bad, dof_bad = two_sample_chi2(plain, biased)
    assert chi2_bad > 3 * critical(dof_bad), (chi2_bad, dof_bad)
