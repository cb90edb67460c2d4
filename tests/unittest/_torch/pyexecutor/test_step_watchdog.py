"""StepWatchdog: a step that never returns ends the engine instead of leaving callers waiting forever.

Unit: a marked step running over the timeout gets one `on_stall` call and the log shows where the
loop thread waits; steps that end in time get none (control). Engine (CPU): a forward that blocks
forever (a stand-in for a GPU wait that never completes) fails the in-flight request with an error
naming the stall within about the timeout, later submissions raise, and the executor thread's stack
is logged; the same forward blocking briefly under a longer timeout serves normally (control).
"""
from __future__ import annotations

import logging
import threading
import time

import pydantic
import pytest

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.pyexecutor.step_watchdog import StepWatchdog
from tensorrt_llm.llmapi.llm_args import TorchLlmArgs


def _blocked_step(watchdog: StepWatchdog, gate: threading.Event) -> None:
    watchdog.begin()
    gate.wait(20)
    watchdog.end()


def test_a_step_over_the_timeout_is_reported_once_with_the_loop_stack(caplog):
    calls: list[str] = []
    dog = StepWatchdog(0.2, calls.append)
    gate = threading.Event()
    loop = threading.Thread(target=_blocked_step, args=(dog, gate), daemon=True)
    loop.start()
    dog.watch(loop)
    with caplog.at_level(logging.ERROR, logger="tensorrt_llm"):
        t0 = time.monotonic()
        while not calls and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        time.sleep(0.3)                              # no second call while the step stays stuck
    gate.set()
    loop.join(5)
    assert len(calls) == 1 and "executor step stalled" in calls[0] and "step_timeout_s=0.2" in calls[0]
    assert any("_blocked_step" in r.getMessage() for r in caplog.records)    # where the loop waits


def test_steps_that_end_in_time_are_not_reported():
    calls: list[str] = []
    dog = StepWatchdog(0.3, calls.append)

    def steps():
        for _ in range(20):
            dog.begin()
            time.sleep(0.02)
            dog.end()
            time.sleep(0.02)
    loop = threading.Thread(target=steps, daemon=True)
    loop.start()
    dog.watch(loop)
    loop.join(5)
    dog.stop()
    assert calls == []


def test_stop_returns_once_the_monitor_thread_has_ended():
    # the monitor holds on_stall (the executor's): a shut-down engine must not stay reachable from it
    dog = StepWatchdog(30.0, lambda reason: None)
    loop = threading.Thread(target=time.sleep, args=(2,), daemon=True)
    loop.start()
    dog.watch(loop)
    monitor = dog._thread
    assert monitor is not None and monitor.is_alive()
    dog.stop()
    assert not monitor.is_alive()
    loop.join(5)


def test_the_timeout_is_validated():
    with pytest.raises(ValueError, match="step_timeout_s must be > 0"):
        StepWatchdog(0.0, print)
    with pytest.raises(pydantic.ValidationError, match="step_timeout_s"):
        TorchLlmArgs(model="m", step_timeout_s=0)
    assert TorchLlmArgs(model="m", step_timeout_s=None).step_timeout_s is None
    assert TorchLlmArgs(model="m").step_timeout_s == 300.0


def _llm_with_slow_forward(target, timeout_s: float, block_s: float):
    llm = LLM(str(target), device="cpu", step_timeout_s=timeout_s,
              kv_cache_config={"max_tokens": 2048, "tokens_per_block": 16})
    engine = llm._executor.engine
    forward, gate = engine.forward, threading.Event()

    def slow_forward(*args, **kwargs):
        gate.wait(block_s)
        return forward(*args, **kwargs)
    engine.forward = slow_forward
    return llm, gate


def test_a_stuck_step_fails_the_request_and_stops_the_engine(tiny_llama_dir, caplog):
    llm, gate = _llm_with_slow_forward(tiny_llama_dir, 0.5, 60.0)
    try:
        with caplog.at_level(logging.ERROR, logger="tensorrt_llm"):
            t0 = time.monotonic()
            out = llm.generate_async([5, 6, 7, 8], SamplingParams(max_tokens=4)).result(timeout=15)
            waited = time.monotonic() - t0
        assert out.outputs[0].finish_reason == "error" and "executor step stalled" in out.outputs[0].error
        assert 0.4 < waited < 5.0
        with pytest.raises(RuntimeError, match="executor step stalled"):
            llm.generate_async([5, 6], SamplingParams(max_tokens=2))
        assert any("slow_forward" in r.getMessage() for r in caplog.records)
    finally:
        gate.set()                                   # the stuck step returns; its loop finds itself stopped
        llm.shutdown()


def test_a_slow_step_under_the_timeout_serves(tiny_llama_dir):
    llm, gate = _llm_with_slow_forward(tiny_llama_dir, 5.0, 0.3)
    try:
        out = llm.generate_async([5, 6, 7, 8], SamplingParams(max_tokens=2, ignore_eos=True)).result(timeout=30)
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 2
        assert llm._executor.fatal_error is None and llm._executor.watchdog.stalled is None
    finally:
        gate.set()
        llm.shutdown()
