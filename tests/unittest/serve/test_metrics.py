"""The engine collector: exposed values are exactly get_stats(), the AL histogram's mean is the AL."""
from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tensorrt_llm.serve.metrics import ServerMetrics, accepted_per_position


def stats(hist: list[int]) -> dict:
    steps, accepted = sum(hist), sum(i * h for i, h in enumerate(hist))
    return {"iterations": 9, "kv_cache": {"num_pages": 20, "free_pages": 15, "tokens_per_block": 16,
                                          "active_sequences": 2},
            "prefix_cache": {"hit_rate": 0.25, "lookup_tokens": 40, "reused_tokens": 10},
            "speculative": {"accept_histogram": hist, "request_steps": steps, "draft_tokens": 3 * steps,
                            "accepted_tokens": accepted, "acceptance_length": 1 + accepted / steps,
                            "acceptance_rate": accepted / (3 * steps)}}


def scrape(s: dict) -> dict:
    text = generate_latest(ServerMetrics(lambda: s).registry).decode()
    return {(x.name, tuple(sorted(x.labels.items()))): x.value
            for f in text_string_to_metric_families(text) for x in f.samples}


def test_accepted_per_position():
    # 2 steps accepted 0, 1 step accepted 1, 4 steps accepted 3 drafts
    assert accepted_per_position([2, 1, 0, 4]) == [5, 4, 4]
    assert accepted_per_position([3, 0, 0, 0]) == [0, 0, 0]


def test_engine_values_and_al_histogram():
    hist = [2, 1, 0, 4]
    m = scrape(stats(hist))
    assert m[("trtllm_kv_cache_pages_used", ())] == 5 and m[("trtllm_kv_cache_pages_total", ())] == 20
    assert m[("trtllm_prefix_cache_hit_rate", ())] == 0.25
    assert m[("trtllm_spec_decode_num_drafts_total", ())] == 7
    assert m[("trtllm_spec_decode_num_accepted_tokens_total", ())] == 13
    assert [m[("trtllm_spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))]
            for i in range(3)] == [5, 4, 4]
    name = "trtllm_spec_decode_acceptance_length_per_step"
    assert [m[(name + "_bucket", (("le", le),))] for le in ("1.0", "2.0", "3.0", "4.0", "+Inf")] == [2, 3, 3, 7, 7]
    al = m[(name + "_sum", ())] / m[(name + "_count", ())]
    assert al == m[("trtllm_spec_decode_acceptance_length", ())] == 1 + 13 / 7
    # control: a different histogram gives a different AL
    m2 = scrape(stats([0, 0, 0, 7]))
    assert m2[(name + "_sum", ())] / m2[(name + "_count", ())] == 4.0 != al


def test_no_speculative_family_without_a_drafter():
    s = stats([1])
    del s["speculative"]
    assert not any(k[0].startswith("trtllm_spec_decode") for k in scrape(s))
