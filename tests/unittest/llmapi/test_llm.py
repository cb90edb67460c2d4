"""`LLM` end to end on CPU: greedy parity with transformers, bad input, streaming, async."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from pydantic import ValidationError

from tensorrt_llm import LLM, SamplingParams

GREEDY_64 = SamplingParams(max_tokens=64, ignore_eos=True)


# ---- greedy parity with transformers ------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_greedy_matches_hf_generate(arch, tiny_llama_dir, tiny_qwen2_dir, make_llm, hf_reference,
                                         tiny_prompts):
    folder = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    llm = make_llm(folder, max_num_tokens=24)   # < longest prompt: chunked prefill + mixed steps
    outs = llm.generate(tiny_prompts, GREEDY_64)
    hf = hf_reference.load(folder)
    for prompt, out in zip(tiny_prompts, outs):
        ids = llm.tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_reference.greedy(hf, ids, 64), prompt
        assert out.outputs[0].finish_reason == "length" and out.finished
        assert len(set(out.outputs[0].token_ids)) > 8   # a varied continuation, not one repeated id


def test_real_model_greedy_matches_hf_generate(real_model, make_llm, hf_reference):
    llm = make_llm(real_model, kv_cache_config={"max_tokens": 1024, "tokens_per_block": 16})
    prompts = ["The capital of France is",
               llm.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}])]
    outs = llm.generate(prompts, GREEDY_64)
    hf = hf_reference.load(real_model)
    for prompt, out in zip(prompts, outs):
        ref = hf_reference.greedy(hf, llm.tokenizer.encode(prompt), 64)
        assert out.outputs[0].token_ids == ref, prompt
    assert "Paris" in outs[0].outputs[0].text


@pytest.mark.gpu
def test_cuda_fp32_greedy_matches_hf_and_seeded_sampling_repeats(tiny_llama_dir, make_llm, hf_reference,
                                                                 tiny_prompts):
    llm = make_llm(tiny_llama_dir, device="cuda", dtype="float32", attn_backend="VANILLA", max_num_tokens=24)
    assert llm.capacity_report["device"].startswith("cuda")
    outs = llm.generate(tiny_prompts, GREEDY_64)
    hf = hf_reference.load(tiny_llama_dir)
    for prompt, out in zip(tiny_prompts, outs):
        assert out.outputs[0].token_ids == hf_reference.greedy(hf, llm.tokenizer.encode(prompt), 64), prompt
    p = dict(max_tokens=16, temperature=1.5, ignore_eos=True)
    a = llm.generate(tiny_prompts[0], SamplingParams(seed=1, **p)).outputs[0].token_ids
    assert a == llm.generate(tiny_prompts[0], SamplingParams(seed=1, **p)).outputs[0].token_ids
    assert a != llm.generate(tiny_prompts[0], SamplingParams(seed=2, **p)).outputs[0].token_ids


def test_single_prompt_returns_one_output_and_list_returns_list(tiny_llama_dir, make_llm):
    llm = make_llm(tiny_llama_dir)
    one = llm.generate("the quick brown fox", SamplingParams(max_tokens=5))
    assert not isinstance(one, list) and len(one.outputs[0].token_ids) == 5
    ids = llm.tokenizer.encode("the quick brown fox")
    by_ids = llm.generate(ids, SamplingParams(max_tokens=5))
    assert by_ids.outputs[0].token_ids == one.outputs[0].token_ids and by_ids.prompt is None
    many = llm.generate(["once upon a time", ids], [SamplingParams(max_tokens=3), SamplingParams(max_tokens=4)])
    assert [len(o.outputs[0].token_ids) for o in many] == [3, 4]
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate(["a", "b"], [SamplingParams()])


def test_generate_admits_a_list_as_one_group_and_a_bad_prompt_submits_nothing(tiny_llama_dir, make_llm):
    """All prompts of one generate() call reach the scheduler before the same step (so its batches
    do not depend on how fast they were tokenized); a bad prompt in the list raises naming its
    index, and none of the list runs."""
    llm = make_llm(tiny_llama_dir)
    ex = llm._executor
    admitted: list[tuple[int, int]] = []           # (request id, executor iteration at admission)
    add = ex.scheduler.add
    ex.scheduler.add = lambda req: (admitted.append((req.request_id, ex.iterations)), add(req))[1]
    prompts = ["the quick brown fox", "once upon a time", "paris is", "hello world", "a b c d e f"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [6] * 5
    assert len(admitted) == 5 and len({it for _, it in admitted}) == 1
    # control: a request submitted after the first finished is admitted at a later iteration
    first = llm.generate_async("hello", SamplingParams(max_tokens=3))
    first.result()
    llm.generate_async("world", SamplingParams(max_tokens=3)).result()
    assert admitted[-1][1] > admitted[-2][1]
    # a bad prompt at index 2: clear error, nothing of the list is admitted, the engine keeps serving
    admitted.clear()
    vocab = llm._bundle.model.config.vocab_size
    with pytest.raises(ValueError, match=r"prompt 2: prompt token ids out of range"):
        llm.generate(["the quick brown fox", "paris is", [1, vocab + 5]], SamplingParams(max_tokens=4))
    good = llm.generate("the quick brown fox", SamplingParams(max_tokens=4))
    assert len(good.outputs[0].token_ids) == 4
    assert len(admitted) == 1                         # only the good request; the list's never ran


# ---- bad input: each rejected with a clear error, and the engine keeps serving ------------
def test_bad_requests_are_rejected_and_engine_keeps_serving(tiny_llama_dir, make_llm):
    llm = make_llm(tiny_llama_dir, max_seq_len=64, kv_cache_config={"max_tokens": 256, "tokens_per_block": 16})
    good_prompt = "the quick brown fox"
    expected = llm.generate(good_prompt, SamplingParams(max_tokens=8)).outputs[0].token_ids
    bad = [
        (list(range(3, 3 + 64)), SamplingParams(max_tokens=1), "max_seq_len"),      # prompt too long
        (list(range(3, 3 + 40)), SamplingParams(max_tokens=30), "max_seq_len"),     # prompt + output
        ("", SamplingParams(max_tokens=4), "empty"),
        ((), SamplingParams(max_tokens=4), "empty"),   # () not []: generate([]) means zero prompts
        ([5, 6, 512], SamplingParams(max_tokens=4), r"out of range.*512"),          # vocab is 512
        ([5, -1], SamplingParams(max_tokens=4), "out of range"),
        ([5, 6.0], SamplingParams(max_tokens=4), r"token id 1 of the prompt is 6\.0 \(float\)"),
    ]
    for prompt, params, msg in bad:
        with pytest.raises(ValueError, match=msg):
            llm.generate_async(prompt, params)
        # the very next good request is served and unaffected
        assert llm.generate(good_prompt, SamplingParams(max_tokens=8)).outputs[0].token_ids == expected
    assert llm._executor.fatal_error is None
    # the boundary itself is legal: 63 prompt tokens + 1 output token == max_seq_len
    edge = llm.generate(list(range(3, 3 + 63)), SamplingParams(max_tokens=1))
    assert len(edge.outputs[0].token_ids) == 1 and edge.outputs[0].finish_reason == "length"


def test_request_larger_than_kv_pool_is_rejected(tiny_llama_dir, make_llm):
    llm = make_llm(tiny_llama_dir, kv_cache_config={"max_tokens": 64, "tokens_per_block": 16})
    with pytest.raises(ValueError, match="KV"):
        llm.generate(list(range(3, 43)), SamplingParams(max_tokens=40))
    assert len(llm.generate(list(range(3, 23)), SamplingParams(max_tokens=20)).outputs[0].token_ids) == 20


def test_unchunked_prefill_rejects_prompt_over_token_budget(tiny_llama_dir, make_llm):
    llm = make_llm(tiny_llama_dir, enable_chunked_prefill=False, max_num_tokens=16, max_batch_size=4)
    with pytest.raises(ValueError, match="chunked prefill"):
        llm.generate(list(range(3, 20)), SamplingParams(max_tokens=2))
    ok = llm.generate([list(range(3, 19)), list(range(5, 12))], SamplingParams(max_tokens=3, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in ok] == [3, 3]


def test_max_tokens_below_one_raises():
    for n in (0, -3):
        with pytest.raises(ValidationError, match="max_tokens"):
            SamplingParams(max_tokens=n)


def test_max_seq_len_beyond_model_raises(tiny_llama_dir):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(str(tiny_llama_dir), device="cpu", max_seq_len=4096)


# ---- streaming and asyncio ----------------------------------------------------------------
def _check_stream(chunks, final_ids):
    assert chunks, "no streamed outputs"
    assert chunks[-1].finished and all(not c.finished for c in chunks[:-1])
    assert all(c.outputs[0].finish_reason is None for c in chunks[:-1])
    lens = [len(c.outputs[0].token_ids) for c in chunks]
    assert lens == sorted(lens) and len(set(lens)) >= len(final_ids) // 2   # incremental, not one blob
    for a, b in zip(chunks, chunks[1:]):                                     # each extends the last
        assert b.outputs[0].token_ids[:len(a.outputs[0].token_ids)] == a.outputs[0].token_ids
    assert chunks[-1].outputs[0].token_ids == final_ids


def test_streaming_yields_incremental_outputs_equal_to_blocking(tiny_llama_dir, make_llm, bounded):
    llm = make_llm(tiny_llama_dir)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = llm.generate("once upon a time", params)
    chunks = bounded(lambda: list(llm.generate_async("once upon a time", params, streaming=True)))
    _check_stream(chunks, ref.outputs[0].token_ids)
    assert chunks[-1].outputs[0].text == ref.outputs[0].text
    assert chunks[-1].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("interval", [3, 100])
def test_stream_interval_makes_a_snapshot_every_n_steps(tiny_llama_dir, make_llm, bounded, interval):
    """stream_interval N (TensorRT-LLM's): a streamed snapshot at the first token, then every N steps
    with tokens (one token per step here), and the last one when the request finishes; the streamed
    tokens and text equal the blocking call's. Control: interval 1 streams every step."""
    params = SamplingParams(max_tokens=11, ignore_eos=True)
    every = make_llm(tiny_llama_dir)
    ref = every.generate("once upon a time", params)
    per_step = bounded(lambda: list(every.generate_async("once upon a time", params, streaming=True)))
    assert [len(c.outputs[0].token_ids) for c in per_step] == list(range(1, 12))
    llm = make_llm(tiny_llama_dir, stream_interval=interval)
    chunks = bounded(lambda: list(llm.generate_async("once upon a time", params, streaming=True)))
    assert [len(c.outputs[0].token_ids) for c in chunks] == [*range(1, 11, interval), 11]
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert chunks[-1].outputs[0].token_ids == ref.outputs[0].token_ids
    assert chunks[-1].outputs[0].text == ref.outputs[0].text
    for a, b in zip(chunks, chunks[1:]):
        assert b.outputs[0].token_ids[:len(a.outputs[0].token_ids)] == a.outputs[0].token_ids
    assert llm.generate("once upon a time", params).outputs[0].token_ids == ref.outputs[0].token_ids
    with pytest.raises(ValueError, match="stream_interval"):
        make_llm(tiny_llama_dir, stream_interval=0)


def test_async_iteration_under_asyncio_run(tiny_llama_dir, make_llm, bounded):
    llm = make_llm(tiny_llama_dir)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    ref = llm.generate(["once upon a time", "the quick brown fox"], params)

    async def main():
        async def stream(prompt):
            return [c async for c in llm.generate_async(prompt, params, streaming=True)]

        streamed = await asyncio.gather(stream("once upon a time"), stream("the quick brown fox"))
        awaited = await llm.generate_async("once upon a time", params).aresult()
        non_streaming_iter = [c async for c in llm.generate_async("the quick brown fox", params)]
        return streamed, awaited, non_streaming_iter

    streamed, awaited, plain = bounded(lambda: asyncio.run(main()))
    for chunks, r in zip(streamed, ref):
        _check_stream(chunks, r.outputs[0].token_ids)
    assert awaited.finished and awaited.outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert len(plain) == 1 and plain[0].outputs[0].token_ids == ref[1].outputs[0].token_ids


def test_result_metrics_and_chat_template(tiny_llama_dir, make_llm):
    llm = make_llm(tiny_llama_dir)
    text = llm.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    out = llm.generate(text, SamplingParams(max_tokens=3, ignore_eos=True))
    assert out.metrics["ttft_s"] >= 0 and out.metrics["e2e_s"] >= out.metrics["ttft_s"]
    assert llm.get_stats()["iterations"] >= 3


# ---- input validation (issue #19 item 11) ---------------------------------------------------
def test_numpy_ids_are_ints_and_float_ids_name_the_bad_element(tiny_llama_dir, make_llm):
    """numpy integer ids used to fail with a misleading `TypeError: ... not iterable` (a numpy
    array is not a Sequence, and an int64 is not an int); they are ids like any int. Float ids are
    refused with a ValueError naming the element."""
    llm = make_llm(tiny_llama_dir)
    p = SamplingParams(max_tokens=4, ignore_eos=True)
    ref = llm.generate([5, 6, 7], p).outputs[0].token_ids
    for prompt in (np.array([5, 6, 7]), [np.int64(5), np.int32(6), 7], (5, np.uint16(6), 7)):
        out = llm.generate(prompt, p)
        assert not isinstance(out, list) and out.outputs[0].token_ids == ref
        assert out.prompt_token_ids == [5, 6, 7] and all(type(t) is int for t in out.prompt_token_ids)
    assert [o.outputs[0].token_ids for o in llm.generate([np.array([5, 6, 7])] * 2, p)] == [ref, ref]
    for prompt, bad in (([5, 6.0, 7], r"token id 1 of the prompt is 6\.0 \(float\)"),
                        (np.array([5.0, 6.0]), r"token id 0 of the prompt is .*5\.0.* \(float64\)"),
                        ([5, True], r"token id 1 of the prompt is True \(bool\)"),
                        ([[5, 6], [7, "x"]], r"prompt 1: token id 1 of the prompt is 'x' \(str\)"),
                        (["hello", None], r"prompt 1: a prompt is a string or a sequence of token ids, got NoneType")):
        with pytest.raises(ValueError, match=bad):
            llm.generate(prompt, p)


def test_end_id_and_stop_token_ids_out_of_vocab_are_rejected(tiny_llama_dir, make_llm):
    """end_id / stop_token_ids outside the vocabulary used to be accepted (a stop that can never
    happen); they are refused at submission, naming the value. Negative control: the last id of
    the vocabulary is accepted."""
    llm = make_llm(tiny_llama_dir)                       # vocab 512
    for params, msg in ((SamplingParams(end_id=512), r"end_id \[512\] out of the vocabulary \[0, 512\)"),
                        (SamplingParams(end_id=-1), r"end_id \[-1\]"),
                        (SamplingParams(stop_token_ids=[7, 100000]), r"stop_token_ids \[100000\]")):
        with pytest.raises(ValueError, match=msg):
            llm.generate("once upon a time", params)
    ok = llm.generate("once upon a time", SamplingParams(max_tokens=3, end_id=511, stop_token_ids=[0, 511]))
    assert ok.finished


# ---- lifecycle: shutdown, exit, abort (issue #19 items 3, 4, 9) ---------------------------
LONG = SamplingParams(max_tokens=400, ignore_eos=True)


def test_generate_after_shutdown_raises_at_once(tiny_llama_dir, make_llm, bounded):
    """generate() after shutdown() used to wait forever; it raises RuntimeError at once."""
    llm = make_llm(tiny_llama_dir)
    assert llm.generate("once upon a time", SamplingParams(max_tokens=2)).finished
    llm.shutdown()
    llm.shutdown()                                       # idempotent
    for call in (lambda: llm.generate("once upon a time"), lambda: llm.generate_async("hello world"),
                 lambda: llm.generate(["a b", "c d"])):
        with pytest.raises(RuntimeError, match="shut down"):
            bounded(call, timeout=10)


def _wait_running(llm, n: int = 1, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while len(llm._bundle.kv.seqs) < n or llm._executor.iterations < 3:
        assert time.monotonic() < end, "requests never started"
        time.sleep(0.01)


def test_shutdown_fails_requests_waiting_in_other_threads(tiny_llama_dir, make_llm):
    """shutdown() while other threads wait in generate() used to leave them blocked forever; their
    requests (running and still queued) finish with an error naming the shutdown, the threads
    return promptly, and the pages are freed."""
    llm = make_llm(tiny_llama_dir, max_batch_size=1)     # the second request stays queued
    outs: dict[int, object] = {}
    threads = [threading.Thread(target=lambda i=i: outs.__setitem__(i, llm.generate(f"prompt {i}", LONG)),
                                daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    _wait_running(llm)
    llm.shutdown()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "a generate() caller is still blocked after shutdown()"
    for out in outs.values():
        c = out.outputs[0]
        assert out.finished and c.finish_reason == "error" and "shut down" in c.error
        assert len(c.token_ids) < LONG.max_tokens
    assert llm._bundle.kv.seqs == {}


EXIT_SCRIPT = """
import sys
from tensorrt_llm import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", kv_cache_config={"max_tokens": 1024, "tokens_per_block": 16})
print(llm.generate("the quick brown fox", SamplingParams(max_tokens=8)).outputs[0].token_ids)
"""


def test_exit_without_shutdown_is_clean(tiny_llama_dir):
    """A program that generates and exits without shutdown() used to abort at interpreter
    teardown ('terminate called without an active exception', SIGABRT / exit 134: the executor
    thread was still alive), in about half of the runs when run one after another; an atexit hook
    now stops the executor first. Six sequential runs all exit 0."""
    for _ in range(6):
        r = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tiny_llama_dir)], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-500:]}"
        assert r.stdout.strip().startswith("[")


def test_abort_returns_the_tokens_so_far_and_frees_pages(tiny_llama_dir, make_llm, bounded):
    """There was no way to cancel a request. GenerationResult.abort() (TensorRT-LLM's
    RequestOutput.abort()) and LLM.abort(request_id) finish it at the next step: result() returns
    the tokens so far, a prefix of the full output, with finish_reason "aborted" (no exception);
    a queued request aborts with no tokens; pages are freed and the engine keeps serving."""
    llm = make_llm(tiny_llama_dir, max_batch_size=1)
    full = llm.generate("once upon a time", LONG).outputs[0].token_ids
    running = llm.generate_async("once upon a time", LONG, streaming=True)
    queued = llm.generate_async("the quick brown fox", LONG)
    seen = 0
    for snap in running:                                 # abort once a few tokens have streamed
        seen = len(snap.outputs[0].token_ids)
        if seen >= 3:
            running.abort()
            break
    llm.abort(queued.request_id)
    a, q = bounded(lambda: (running.result(timeout=30), queued.result(timeout=30)))
    assert a.finished and a.outputs[0].finish_reason == "aborted" and a.outputs[0].error is None
    assert seen <= len(a.outputs[0].token_ids) < len(full) and a.outputs[0].token_ids == full[:len(a.outputs[0].token_ids)]
    assert q.outputs[0].finish_reason == "aborted" and q.outputs[0].token_ids == []
    assert llm._bundle.kv.seqs == {} and llm._executor.fatal_error is None
    running.abort()                                      # finished: no effect
    llm.abort(12345)                                     # unknown id: no effect
    again = llm.generate("once upon a time", SamplingParams(max_tokens=8, ignore_eos=True))
    assert again.outputs[0].token_ids == full[:8] and again.outputs[0].finish_reason == "length"

