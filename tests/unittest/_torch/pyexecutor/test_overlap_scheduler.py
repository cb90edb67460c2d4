"""The overlap scheduler: a step's tokens stay on the device as the next step's inputs and are read
one step later; outputs (tokens, finish reasons, stop criteria applied one step late) equal the
non-overlapped loop's, and pages return to the pool."""
from __future__ import annotations

import random

import pytest
import torch

from tensorrt_llm import SamplingParams
from tensorrt_llm._torch.pyexecutor.cuda_graph_runner import gather_rows
from tensorrt_llm._torch.runtime.token_rows import PendingTokens


def _cases(rng: random.Random, eos_free: list[int]) -> list[tuple[list[int], SamplingParams]]:
    out = []
    for i in range(14):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(2, 40))]
        kind = i % 5
        if kind == 0:
            p = SamplingParams(max_tokens=rng.randrange(1, 20), ignore_eos=True)
        elif kind == 1:      # a stop id the model emits: stops one step late in the overlapped loop
            p = SamplingParams(max_tokens=30, stop_token_ids=eos_free[:3])
        elif kind == 2:
            p = SamplingParams(max_tokens=25, temperature=0.9, seed=i, ignore_eos=True)
        elif kind == 3:
            p = SamplingParams(max_tokens=25, top_k=5, temperature=1.0, seed=i, stop_token_ids=eos_free[3:6])
        else:
            p = SamplingParams(max_tokens=20)
        out.append((prompt, p))
    return out


def _run(make_llm, path, cases, overlap: bool, **kw):
    llm = make_llm(path, disable_overlap_scheduler=not overlap, **kw)
    outs = llm.generate([c[0] for c in cases], [c[1] for c in cases])
    kv = llm.get_stats()["kv_cache"]
    assert kv["free_pages"] == llm._bundle.kv.num_pages, "pages leaked"
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs], llm._executor.iterations


@pytest.mark.parametrize("options", [{}, {"max_num_tokens": 16, "max_batch_size": 4},
                                     {"kv_cache_config": {"max_tokens": 4096, "tokens_per_block": 16,
                                                          "enable_block_reuse": True}}])
def test_overlap_equals_the_plain_loop(tiny_llama_dir, make_llm, options):
    rng = random.Random(1)
    # tokens the model really emits, to use as stop ids
    probe = make_llm(tiny_llama_dir, disable_overlap_scheduler=True).generate(
        [5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True)).outputs[0].token_ids
    cases = _cases(rng, list(dict.fromkeys(probe)) * 2)
    plain, n_plain = _run(make_llm, tiny_llama_dir, cases, False, **options)
    over, n_over = _run(make_llm, tiny_llama_dir, cases, True, **options)
    assert over == plain
    assert any(r == "stop" for _, r in plain) and any(r == "length" for _, r in plain)
    # a stop seen one step late may cost the overlapped loop at most one extra step per request
    assert n_plain <= n_over <= n_plain + len(cases)
    # control: the comparison sees a changed output
    assert over != [(t + [1], r) for t, r in plain]


def test_tokens_are_read_one_step_late(tiny_llama_dir, make_llm):
    """After a launched decode step the request's newest token is still device-resident (its output
    lags by one) and the next step consumes it there; the plain loop reads it at once."""
    for overlap in (True, False):
        llm = make_llm(tiny_llama_dir, disable_overlap_scheduler=not overlap)
        ex = llm._executor
        ex.shutdown()                                   # drive by hand
        h = llm.generate_async([5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True))
        ex._drain_incoming()
        req = ex.scheduler.running[0] if ex.scheduler.running else ex.scheduler.waiting[0]
        ex.step()                                       # prefill: the first token chosen
        ex.step()                                       # first decode step
        if overlap:
            assert req.next_input is not None and len(req.output_token_ids) == 1
        else:
            assert req.next_input is None and len(req.output_token_ids) == 2
        ex.run_until_idle()
        assert len(h.result(timeout=0).outputs[0].token_ids) == 6 and req.next_input is None


def test_gather_rows_places_device_tokens_in_graph_inputs():
    pend = PendingTokens(torch.tensor([[10], [11], [12], [13]]))
    dst = torch.zeros(6, 1, dtype=torch.long)
    gather_rows(dst, [pend.row(1, 1), pend.row(2, 1)], [0, 1])          # consecutive: one copy
    gather_rows(dst, [pend.row(3, 1), pend.row(0, 1)], [4, 2])          # any order: a gather
    assert dst.view(-1).tolist() == [11, 12, 10, 0, 13, 0]
    with pytest.raises(ValueError, match="segment of 1 device tokens in a graph of 2"):
        gather_rows(torch.zeros(2, 2, dtype=torch.long), [pend.row(0, 1)], [0])


@pytest.mark.gpu
def test_steady_decode_steps_never_block_on_the_gpu(llama64_dir, no_device_syncs):
    """20 steady-state no-spec decode steps with graphs and the overlap scheduler under
    torch.cuda.set_sync_debug_mode("error"): no torch op in a step blocks on the device (the only
    wait is on the previous step's token copy, an event). Outputs equal the plain loop's."""
    pytest.importorskip("flashinfer")
    from tensorrt_llm import LLM
    prompts = [[5 + i, 6, 7, 8, 9 + i] for i in range(4)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    outs = {}
    for overlap in (True, False):
        with LLM(str(llama64_dir), attn_backend="FLASHINFER", use_cuda_graph=True, max_batch_size=4,
                 kv_cache_config={"max_tokens": 4096}, disable_overlap_scheduler=not overlap) as llm:
            ex = llm._executor
            ex.shutdown()                               # drive by hand
            handles = [llm.generate_async(p, params) for p in prompts]
            ex._drain_incoming()
            for _ in range(6):                          # prefill, warm-up and capture
                ex.step()
            if overlap:
                with no_device_syncs():
                    for _ in range(20):
                        ex.step()
            ex.run_until_idle()
            outs[overlap] = [h.result(timeout=0).outputs[0].token_ids for h in handles]
            assert ex.engine.graph_runner.graphs.num_replays >= 20
    assert outs[True] == outs[False]
    # control: the debug mode does see a blocking read of a device value
    with no_device_syncs(), pytest.raises(RuntimeError):
        torch.ones(1, device="cuda").item()
