"""Shared fixtures of the DSpark drafter model tests (`test_modeling_dspark.py`, `test_dspark_loader.py`):
a tiny Llama target config, random drafters bound to a target, and paged context + block inputs."""
from __future__ import annotations

import math

import torch

from tensorrt_llm._torch.attention_backend.interface import BAD_PAGE_INDEX, AttentionMetadata
from tensorrt_llm._torch.attention_backend.vanilla import VanillaAttention
from tensorrt_llm._torch.models.modeling_dspark import DSparkForCausalLMBase
from tensorrt_llm._torch.models.modeling_llama import LlamaConfig, LlamaForCausalLM
from tensorrt_llm._torch.speculative.dspark_worker import draft_kv_cache_spec

HIDDEN, VOCAB, P, NUM_PAGES = 64, 128, 4, 40
CPU, F32 = torch.device("cpu"), torch.float32


def kv_spec(drafter, dtype=torch.float32):
    """The draft pool spec built from the drafter's kv_cache_layout() (as the engine builds it)."""
    return draft_kv_cache_spec(drafter, dtype)


def target_config(hidden: int = HIDDEN, vocab: int = VOCAB) -> LlamaConfig:
    return LlamaConfig("LlamaForCausalLM", vocab, hidden, 2 * hidden, 4, 4, 2, hidden // 4, 1e-6, 10000.0,
                       None, 256, True, False, None, None)


def drafter(kind: str, target: LlamaForCausalLM, seed: int = 0, **ov) -> DSparkForCausalLMBase:
    d = DSparkForCausalLMBase.random_init(kind, target.config, seed=seed, **ov)
    d.bind_target(target.model.embed_tokens, target.lm_head)
    return d


class Paged:
    """R requests with random pages: ctx_lens[b] context tokens, then a block of `blk`."""

    def __init__(self, ctx_lens: list[int], blk: int, g: torch.Generator):
        self.ctx_lens, self.blk = ctx_lens, blk
        perm = torch.randperm(NUM_PAGES, generator=g).tolist()
        self.table = torch.full((len(ctx_lens), math.ceil((max(ctx_lens) + blk) / P)), BAD_PAGE_INDEX,
                                dtype=torch.int32)
        for b, c in enumerate(ctx_lens):
            for j in range(math.ceil((c + blk) / P)):
                self.table[b, j] = perm.pop()
        self.ctx_pos = torch.cat([torch.arange(c) for c in ctx_lens])
        self.ctx_slots = torch.cat([self.slots(b, 0, c) for b, c in enumerate(ctx_lens)])
        self.blk_pos = torch.cat([torch.arange(c, c + blk) for c in ctx_lens])
        self.blk_slots = torch.cat([self.slots(b, c, c + blk) for b, c in enumerate(ctx_lens)])

    def slots(self, b: int, lo: int, hi: int) -> torch.Tensor:
        pos = torch.arange(lo, hi)
        return self.table[b, pos // P].long() * P + pos % P

    def md(self) -> AttentionMetadata:
        return AttentionMetadata(seq_lens=[self.blk] * len(self.ctx_lens), num_cached=list(self.ctx_lens),
                                 block_tables=self.table, slot_mapping=self.blk_slots,
                                 tokens_per_block=P, causal=False)


def make_inputs(d: DSparkForCausalLMBase, paged: Paged, g: torch.Generator):
    th = [torch.randn(c, d.config.fc_in_features, generator=g) for c in paged.ctx_lens]
    anchors = torch.randint(0, VOCAB - 1, (len(paged.ctx_lens),), generator=g)
    blocks = torch.full((len(paged.ctx_lens), paged.blk), d.config.mask_token_id)
    blocks[:, 0] = anchors
    return th, blocks, anchors


@torch.no_grad()
def run_paged(d: DSparkForCausalLMBase, paged: Paged, th: list[torch.Tensor], blocks: torch.Tensor,
              causal: bool = False) -> torch.Tensor:
    spec = kv_spec(d)
    caches = [torch.zeros(spec.layer_shape(NUM_PAGES, P)) for _ in range(spec.num_layers)]
    backend = VanillaAttention()
    d.write_context(d.context_features(torch.cat(th)), paged.ctx_pos, paged.ctx_slots, caches, backend)
    md = paged.md()
    md.causal = causal
    return d.forward_block(blocks.flatten(), paged.blk_pos, md, caches, backend)
