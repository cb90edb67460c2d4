"""PromptStream: the prompt part of a step beside a one-graph DSpark step on a second CUDA stream.

GPU: work inside `beside` starts after the main-stream work queued before `mark` and the main
stream's later work sees its writes, with a long kernel on the other stream each time; controls: a
plain side stream without those waits reads / leaves the stale value. CPU: no stream, the body runs
in place.
"""
from __future__ import annotations

import pytest
import torch

from tensorrt_llm._torch.pyexecutor.prompt_stream import PromptStream

SPIN = 200_000_000    # torch.cuda._sleep cycles: ~0.1 s on an H200, far longer than the copies below


def test_cpu_runs_the_prompt_part_in_place():
    ps = PromptStream(torch.device("cpu"), enabled=True)
    assert not ps.enabled
    x = torch.zeros(3)
    ps.mark()
    with ps.beside(True):
        x.add_(1)
    assert x.tolist() == [1.0, 1.0, 1.0]


def test_a_failing_prompt_part_still_raises_on_cpu():
    ps = PromptStream(torch.device("cpu"), enabled=True)
    ps.mark()
    with pytest.raises(ValueError, match="bad chunk"), ps.beside(True):
        raise ValueError("bad chunk")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_side_stream_is_ordered_after_the_mark_and_before_later_main_work():
    dev = torch.device("cuda")
    ps = PromptStream(dev, enabled=True)
    assert ps.enabled and ps.stream != torch.cuda.current_stream(dev)
    src = torch.zeros(1 << 20, device=dev)
    dst = torch.zeros_like(src)
    torch.cuda.synchronize()
    # 1. work queued before the mark (a long kernel, then a write) is seen by the side stream
    torch.cuda._sleep(SPIN)
    src.fill_(1.0)
    ps.mark()
    with ps.beside(True):
        assert torch.cuda.current_stream(dev) == ps.stream
        dst.copy_(src)
        torch.cuda._sleep(SPIN)
        dst.add_(1.0)
    # 2. main-stream work queued after the prompt part sees its writes
    seen = dst.clone()
    torch.cuda.synchronize()
    assert torch.all(seen == 2.0)
    # controls: a side stream that does not wait for the mark copies the stale value, and a main
    # stream that does not wait for the side stream reads before the side stream's write lands
    side = torch.cuda.Stream(dev)
    src.zero_()
    dst.zero_()
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN)
    src.fill_(1.0)
    with torch.cuda.stream(side):
        dst.copy_(src)
    torch.cuda.synchronize()
    assert torch.all(dst == 0.0)
    with torch.cuda.stream(side):
        torch.cuda._sleep(SPIN)
        dst.fill_(5.0)
    early = dst.clone()
    torch.cuda.synchronize()
    assert torch.all(early == 0.0)
