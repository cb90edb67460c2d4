"""Per-request page bound: draft writes never leave the pages a request owns (canary pages)."""
from __future__ import annotations

import pytest
import torch

from tensorrt_llm._torch.runtime.step import StepCommit
from tensorrt_llm import DSparkDecodingConfig, SamplingParams
from tensorrt_llm._torch.attention_backend.interface import BAD_PAGE_INDEX, write_slots
from tensorrt_llm._torch.attention_backend.resolver import Resolution
from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttention
from tensorrt_llm._torch.models.checkpoint import read_config
from tensorrt_llm._torch.models.modeling_dspark import DSparkForCausalLMBase
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig
from tensorrt_llm._torch.pyexecutor.kv_cache.kv_cache_spec import KVCacheSpec
from tensorrt_llm._torch.runtime.llm_request import LlmRequest, RequestState
from tensorrt_llm._torch.pyexecutor.kv_cache.resource_manager import KVCacheManager
from tensorrt_llm._torch.runtime.sampler import Sampler
from tensorrt_llm._torch.speculative.dspark_worker import DSparkWorker

P = 4
CANARY = 7.0


def _setup(tiny_llama_dir, kind):
    tc = LlamaConfig.from_dict(read_config(tiny_llama_dir), "t")
    drafter = DSparkForCausalLMBase.random_init(kind, tc, block_size=4)
    target_spec = KVCacheSpec("target", "gqa", tc.num_hidden_layers, 2, tc.num_key_value_heads,
                              tc.head_dim, torch.float32)
    embed = torch.nn.Embedding(tc.vocab_size, tc.hidden_size)
    head = torch.nn.Linear(tc.hidden_size, tc.vocab_size, bias=False)
    drafter.bind_target(embed, head)
    cfg = DSparkDecodingConfig(speculative_model="unused")
    worker = DSparkWorker(cfg, drafter, VanillaAttention(), Resolution("VANILLA", "test"),
                          torch.device("cpu"), torch.float32, "test")
    kv = KVCacheManager([target_spec, worker.kv_cache_spec], 12, P, 64, torch.device("cpu"))
    worker.bind(kv, Sampler(0, torch.device("cpu")))
    n_feat = len(drafter.config.target_layer_ids) * tc.hidden_size
    return worker, kv, n_feat


def _request(rid, n_prompt, ctx):
    req = LlmRequest(rid, list(range(3, 3 + n_prompt)), SamplingParams(max_tokens=16, ignore_eos=True))
    req.output_token_ids = [5]
    req.num_computed = ctx
    req.state = RequestState.GENERATION
    return req


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_draft_writes_stay_inside_owned_pages(tiny_llama_dir, kind):
    worker, kv, n_feat = _setup(tiny_llama_dir, kind)
    kv.add_sequence(100, [1] * 4, 4)          # neighbour owning page 0
    kv.ensure_capacity(100, 4)
    kv.add_sequence(1, [1] * 6, 8)            # request under test: 2 pages
    kv.ensure_capacity(1, 8)
    kv.add_sequence(2, [1] * 6, 8)            # neighbour after it
    kv.ensure_capacity(2, 8)
    pool = kv.pools["draft"]
    pool.fill_(CANARY)
    before = pool.clone()
    own = kv.seqs[1].pages
    assert 0 not in own and BAD_PAGE_INDEX not in own
    req = _request(1, n_prompt=6, ctx=6)
    # commit 6 context tokens, then ask for a 4-slot block at 6..9: only 6..7 are owned
    captured = torch.randn(6, n_feat)
    worker.draft([StepCommit(req, 0, 0, 6)], captured)
    others = [p for p in range(kv.num_pages) if p not in own]
    assert torch.equal(pool[:, others], before[:, others]), "a neighbour's page changed"
    assert not torch.equal(pool[:, own], before[:, own]), "own pages were not written"
    assert len(req.draft_tokens) <= 2                      # block clamped to 2 slots -> drafts less
    # commit beyond the owned pages: skipped and counted, neighbours still intact
    req.num_computed = 8
    worker.draft([StepCommit(req, 0, 4, 6)], torch.randn(6, n_feat))
    assert torch.equal(pool[:, others], before[:, others])
    assert worker.stats()["page_bound_skipped_writes"] >= 2
    assert kv.seqs[1].num_draft_valid_tokens <= 8


def test_unclamped_mapping_would_hit_a_neighbour(tiny_llama_dir):
    """Negative control: slots computed straight from a sentinel-padded table wrap onto
    another page (BAD_PAGE_INDEX * P + off is a negative index)."""
    _, kv, _ = _setup(tiny_llama_dir, "gqa")
    kv.add_sequence(1, [1] * 6, 8)
    kv.ensure_capacity(1, 8)
    kv.add_sequence(2, [1] * 40, 40)
    kv.ensure_capacity(2, 40)
    plane = kv.pools["draft"][0, :, 0]
    plane.fill_(CANARY)
    before = plane.clone()
    table = torch.full((4,), BAD_PAGE_INDEX, dtype=torch.long)
    table[:2] = torch.tensor(kv.seqs[1].pages)
    pos = torch.arange(6, 10)
    naive = table[pos // P] * P + pos % P
    plane[naive // P, :, naive % P] = 0.0      # an unclamped scatter (no bound, no sentinel check)
    own = kv.seqs[1].pages
    others = [p for p in range(kv.num_pages) if p not in own]
    assert not torch.equal(plane[others], before[others])
    # the clamped mapping of the same positions leaves them intact
    plane.copy_(before)
    write_slots(plane, torch.zeros(4, plane.shape[1], plane.shape[-1]),
                torch.tensor(kv.slots(1, 6, 4)))
    assert torch.equal(plane[others], before[others])
