"""`LLM` end to end on CPU: greedy parity with transformers, bad input, streaming, async."""
from __future__ import annotations

import asyncio

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
        ([5, 6.0], SamplingParams(max_tokens=4), "list of ints"),
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
