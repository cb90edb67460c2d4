"""The one-graph DSpark step with arriving prompts inside it: one packed target forward over the
running requests' verify segments and the prompt chunks that end greedy prompts, then acceptance,
the draft step and the arrivals' first tokens, all in one CUDA graph.

Without it a step with arrivals runs the prompts' packed forward as a graph of its own beside the
one-graph step (`SpecSteps`): a second pass through every target layer, ~12 launches per layer
whose cost hardly depends on the few hundred prompt tokens, so each such step cost ~1 ms more on
the H200 at batch 64 (45% of DSpark's time at C = 64 went to these steps). Here the prompt tokens
ride in the verify step's own forward. Per (verify bucket Bv, verify width q, prompt token bucket
Pt) one graph over T = Bv * q + Pt token rows and R = Bv + MAX_PROMPTS request rows::

    token rows   : [ verify segments (b real, then Bv - b padding, q rows each) | prompt chunks | pad ]
    request rows : [ verify (Bv) | prompts (p <= MAX_PROMPTS) | padding requests ]
    padding      : verify requests b..Bv-1 in a scratch page of their own (`KVCacheManager.scratch_page(1)`);
                   token rows of no request and padding requests in the shared one
    io (int64)   : `packed_io_views` (ids, positions, slots, draft slots, shift index, shifts; kv_lens,
                   qo_indptr, block tables) | last_rows (MAX_PROMPTS): each prompt's last token row

    forward      : ragged attention over every row (query offsets and KV lengths on the device);
                   continued verify segments moved by their shifts (`shift_tokens`); the prompt
                   rows' draft context written from their captured rows (`write_forward_context`)
    verify       : rows 0..Bv*q-1 (a static slice) -> greedy acceptance -> draft step (`draft_rows`,
                   over the verify requests' block tables: request rows 0..Bv-1)
    arrivals     : argmax of each prompt's last row -> its first token, with placeholder drafts
                   (the `Drafter.anchor_arrivals` layout; the next step verifies them)
    output       : [Bv + MAX_PROMPTS, q + 2 + K] = verify rows [verified | committed, anchor,
                   drafts], then arrival rows [chosen, -1.. | 1, chosen, mask x K]

It takes a step whose prompt chunks all end greedy prompts (not context-only), at most
MAX_PROMPTS of them and `PROMPT_TOKEN_BUCKETS[-1]` tokens, beside a steady-state verify part the
one-graph step takes (`SpecStepGraph.eligible`, the target runner's plan); any other step runs
the prompts beside it. The graphs are captured at startup. Without CUDA graphs (`capture=False`:
the CPU) the same step runs directly on the batch as it is (no padding rows, host lengths for a
backend without ragged queries).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ..attention_backend.interface import BAD_PAGE_INDEX, AttentionMetadata
from ..runtime.cuda_graph import GraphCache, GraphEntry
from ..runtime.llm_request import LlmRequest
from ..runtime.step import DraftsAhead, ForwardOutput, ForwardSegment
from ..runtime.token_rows import PendingTokens, gather_shifts
from ..speculative.interface import Drafter
from .cuda_graph_runner import StepPlan
from .packed_graph_runner import packed_io_views, shift_tokens, shifted_token_rows
from .piecewise_graph_runner import pack_segments, segment_lengths
from .spec_step_graph import SpecLaunch, SpecStepGraph, greedy_verify

logger = logging.getLogger("tensorrt_llm")

PROMPT_TOKEN_BUCKETS = (128, 256, 512, 1024)   # prompt tokens a mixed step pads to
MAX_PROMPTS = 8                                 # arriving prompts per mixed step


@dataclass
class _MixedEntry(GraphEntry):
    """Persistent inputs of one (Bv, q, Pt) (views of `io`, layout in the module doc), their pinned host
    staging, the packed and the draft block's metadata, and the arrival rows' constant columns."""

    verify: int = 0                                # Bv
    q: int = 0
    tokens: int = 0                                # T
    requests: int = 0                              # R
    io: Optional[torch.Tensor] = None
    host: Optional[torch.Tensor] = None
    host_views: tuple[np.ndarray, ...] = ()        # `packed_io_views` of host, then last_rows
    md: Optional[AttentionMetadata] = None
    block_md: Optional[AttentionMetadata] = None
    last_rows: Optional[torch.Tensor] = None       # [MAX_PROMPTS] int64 view of io
    shifts: Optional[torch.Tensor] = None          # [R + 1] int64 view of io: continued segments' start shifts
    fill: Optional[torch.Tensor] = None            # [MAX_PROMPTS, q - 1] int64: -1
    mask: Optional[torch.Tensor] = None            # [MAX_PROMPTS, K] int64: the mask token
    copied: Optional[torch.cuda.Event] = None      # the last host -> io copy (staging buffer reuse)


class MixedSpecGraph:
    """Runs a one-graph DSpark step with arriving prompt chunks packed into its forward (module doc)."""

    def __init__(self, spec: SpecStepGraph, context: Drafter, max_num_tokens: int):
        """spec: the one-graph step whose target and draft runners this one composes; context: the
        drafter that writes the prompt rows' draft context inside the forward; max_num_tokens: the
        scheduler's token budget per step (prompt buckets above it are never captured)."""
        target = spec.target
        if not target.backend.capabilities.device_lengths:
            raise ValueError(f"a mixed one-graph step needs an attention backend that reads KV lengths on "
                             f"the device; {target.backend.name} plans on the host")
        if target.graphs.capture and not target.backend.capabilities.ragged_graphs:
            raise ValueError(f"a captured mixed one-graph step needs ragged queries on the device; "
                             f"{target.backend.name} has none")
        self.spec, self.target, self.draft, self.context = spec, target, spec.draft, context
        self.kv = target.kv
        self.capture = target.graphs.capture
        self.prompt_buckets = [b for b in PROMPT_TOKEN_BUCKETS if b <= max_num_tokens] or [PROMPT_TOKEN_BUCKETS[0]]
        # padding rows write here (a direct run has none, and holds no page): the token rows of no request
        # into the shared page (their attention output is never written: garbage, NaN at times, and so
        # are the K/V they write); the padding verify requests into their own, which only they write and
        # read (finite rows: their argmax feeds the draft step's embedding, which takes no NaN's index)
        self.scratch_page = self.kv.scratch_page() if self.capture else BAD_PAGE_INDEX
        self.verify_scratch = self.kv.scratch_page(1) if self.capture else BAD_PAGE_INDEX
        self.max_shift = max(target.token_counts)
        self.graphs: GraphCache[_MixedEntry] = GraphCache(target.device, self.capture)
        self.num_launches = 0

    # ---- eligibility ---------------------------------------------------------------------
    def _prompts_fit(self, reqs: Sequence[LlmRequest], segments: Sequence[ForwardSegment]) -> Optional[int]:
        """The prompt token bucket of the step's prompt chunks, or None when they are not all
        prompt ends of greedy, non-context-only requests that fit (`MAX_PROMPTS`, the largest bucket)."""
        if len(segments) > MAX_PROMPTS:
            return None
        n = 0
        for req, seg in zip(reqs, segments):
            if seg.num_logits != 1 or req.context_only or not req.sampling_params.greedy:
                return None
            n += len(seg.token_ids)
        if not self.capture:
            return n
        return next((b for b in self.prompt_buckets if b >= n), None)

    # ---- run -----------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, reqs: Sequence[LlmRequest], segments: Sequence[ForwardSegment], num_ctx: int
            ) -> Optional[SpecLaunch]:
        """Launch the step (no wait on the GPU): reqs / segments are the step's, its num_ctx prompt
        chunks first. None when it is not one this graph takes (the caller runs the prompts beside)."""
        vreqs, vsegs = reqs[num_ctx:], segments[num_ctx:]
        pt = self._prompts_fit(reqs[:num_ctx], segments[:num_ctx])
        if pt is None or not self.spec.eligible(vreqs, vsegs):
            return None
        plan = self.target.plan(vsegs, extra=self.draft.block_size)
        if plan is None:
            return None
        psegs = segments[:num_ctx]
        lens = segment_lengths(psegs)
        prows = self.kv.rows([s.request_id for s in psegs])
        pstarts = np.fromiter((s.start for s in psegs), dtype=np.int64, count=num_ctx)
        _, pslots = self.kv.packed_slots(prows, pstarts, lens)
        if (pslots < 0).any():
            return None
        if self.capture:
            e = self.graphs.entry((plan.bucket, plan.q, pt), lambda: self._new_entry(plan.bucket, plan.q, pt))
        else:   # the batch as it is: no padding rows
            e = self._new_entry(len(vsegs), plan.q, pt, num_ctx)
        offsets = self._load_inputs(e, vsegs, plan, psegs, lens, prows, pstarts, pslots)
        self.draft.prepare_block(e.block_md, e.verify, e.q, int(plan.starts.max()))
        rows = self.graphs.replay(e, self._forward)
        self.num_launches += 1
        b, q = len(vsegs), plan.q
        self.draft.num_drafted += b
        # the host's order: the prompts, then the verify segments (one row per request of the step)
        out_rows = torch.cat((rows[e.verify:e.verify + num_ctx], rows[:b]))
        ids = [s.request_id for s in psegs] + [s.request_id for s in vsegs]
        ahead = DraftsAhead({rid: j for j, rid in enumerate(ids)}, PendingTokens(out_rows), q)
        tokens = offsets + [j * q for j in range(b)]
        logits = list(range(num_ctx)) + [num_ctx + j * q for j in range(b)]
        out = ForwardOutput(self.spec.no_logits, logits, None, tokens, context_segments=num_ctx)
        return SpecLaunch(out, q, ahead)

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Capture every (Bv, q, Pt) entry now, on padding rows (the engine calls it once at startup).
        Returns how many were captured (0 without CUDA graphs)."""
        none = np.empty(0, dtype=np.int64)

        def stage(e: _MixedEntry) -> None:
            self._load_inputs(e, [], StepPlan.padding_only(e.verify, e.q, True), [], [], none, none, none)
            self.draft.prepare_block(e.block_md, e.verify, e.q, 0)
        keys = [(b, q, pt) for b in self.target.buckets
                for q in sorted(self.draft.widths & self.target.token_counts) for pt in self.prompt_buckets]
        return sum(self.graphs.capture_ahead(k, lambda: self._new_entry(*k), stage, self._forward) for k in keys)

    # ---- staging ---------------------------------------------------------------------------
    def _new_entry(self, bv: int, q: int, pt: int, prompts: int = MAX_PROMPTS) -> _MixedEntry:
        """Buffers of one (Bv, q, Pt); prompts: request rows for prompts (MAX_PROMPTS in a graph, the
        step's own count in a direct run)."""
        kv, dev = self.kv, self.target.device
        t, r, width = bv * q + pt, bv + prompts, kv.max_blocks_per_seq
        n32 = r + (r + 1) + r * width
        words = 5 * t + r + 1 + -(-n32 // 2) + prompts
        io = torch.zeros(words, dtype=torch.long, device=dev)
        host = torch.zeros(words, dtype=torch.long, pin_memory=dev.type == "cuda")
        dv = packed_io_views(io, t, r, width)
        md = AttentionMetadata(seq_lens=[0] * r, num_cached=[0] * r, block_tables=dv[8], slot_mapping=dv[2],
                               tokens_per_block=kv.tokens_per_block, causal=True, kv_lens_device=dv[6],
                               kv_len_bound=width * kv.tokens_per_block, slots_all_valid=True)
        if self.capture:       # ragged queries read on the device (a direct run plans from host lengths)
            md.qo_indptr_device, md.max_q_bound = dv[7], max(pt, q)
            self.target.backend.prepare(md)
        k = self.draft.k_max
        return _MixedEntry(verify=bv, q=q, tokens=t, requests=r, io=io, host=host,
                           host_views=tuple(v.numpy() for v in packed_io_views(host, t, r, width))
                           + (host[-prompts:].numpy(),),
                           md=md, block_md=self.draft.block_metadata(bv, dv[8][:bv]), last_rows=io[-prompts:],
                           shifts=dv[5],
                           fill=torch.full((prompts, q - 1), -1, dtype=torch.long, device=dev),
                           mask=torch.full((prompts, k), self.draft.mask_token_id, dtype=torch.long, device=dev))

    def _load_inputs(self, e: _MixedEntry, vsegs: Sequence[ForwardSegment], plan: StepPlan,
                     psegs: Sequence[ForwardSegment], lens: Sequence[int], prows: np.ndarray, pstarts: np.ndarray,
                     pslots: np.ndarray) -> list[int]:
        """Stage the step (layout: module doc) in one pinned copy; the verify segments' device-resident
        tokens and shifts are gathered on the device. Returns the prompt chunks' first token rows."""
        if e.copied is not None:
            e.copied.synchronize()     # the previous step of this entry has left the staging buffer
        kv, p = self.kv, self.kv.tokens_per_block
        b, q, bv, r, t = len(vsegs), e.q, e.verify, e.requests, e.tokens
        nv, np_ = bv * q, len(psegs)
        ids, pos, slot, dslot, shift_index, _, kv_lens, qo, table, last = e.host_views
        scratch = self.scratch_page * p + np.arange(t, dtype=np.int64) % p
        packed = pack_segments(vsegs, [q] * b, ids[:b * q], pos[:b * q])
        slot[:b * q] = plan.slots.reshape(-1)
        pos[b * q:nv] = np.tile(np.arange(q, dtype=np.int64), bv - b)      # padding verify requests
        ids[b * q:nv] = 0
        slot[b * q:nv] = self.verify_scratch * p + pos[b * q:nv]
        prompt_rows = pack_segments(psegs, lens, ids[nv:], pos[nv:]).token_offsets
        n = nv + int(sum(lens))
        slot[nv:n] = pslots
        slot[n:] = scratch[n:]
        dslot[nv:n] = pslots
        dslot[n:] = scratch[n:]
        shifted = np.fromiter((s.start_shift is not None for s in vsegs), dtype=bool, count=b)
        shift_index[:] = r
        shift_index[:b * q] = shifted_token_rows(shifted, [q] * b, r)
        ends = np.cumsum(np.asarray(lens, dtype=np.int64)) + nv
        kv_lens[:b] = plan.starts + q
        kv_lens[b:bv] = q
        kv_lens[bv:bv + np_] = pstarts + np.asarray(lens, dtype=np.int64)
        kv_lens[bv + np_:] = 0
        qo[:bv + 1] = np.arange(bv + 1, dtype=np.int64) * q
        qo[bv + 1:bv + np_ + 1] = ends
        qo[bv + np_ + 1:] = n
        table[:] = BAD_PAGE_INDEX
        table[:, 0] = self.scratch_page
        table[b:bv, 0] = self.verify_scratch
        np.take(kv.page_table, plan.rows, axis=0, out=table[:b])
        np.take(kv.page_table, prows, axis=0, out=table[bv:bv + np_])
        last[:] = 0
        last[:np_] = ends - 1
        e.io.copy_(e.host, non_blocking=True)
        if e.io.is_cuda:
            if e.copied is None:          # one event per entry, re-recorded by every copy
                e.copied = torch.cuda.Event()
            e.copied.record()
        packed.gather_device_tokens(e.io[:b * q])
        gather_shifts(e.shifts, [s.start_shift for s in vsegs])
        if not self.capture:      # host lengths for the backend (the shifts move the KV lengths on the device)
            md = e.md
            md.seq_lens = [q] * b + list(lens)
            md.num_cached = plan.starts.tolist() + pstarts.tolist()
            md.kv_len_bound = int(kv_lens.max(initial=0)) + self.max_shift
            self.target.backend.prepare(md)
        return [nv + o for o in prompt_rows]

    # ---- the graph -------------------------------------------------------------------------
    def _forward(self, e: _MixedEntry) -> torch.Tensor:
        t, bv, q = e.tokens, e.verify, e.q
        ids, pos, slot, dslot, shift_index, shifts, kv_lens, _, table = packed_io_views(
            e.io, t, e.requests, self.kv.max_blocks_per_seq)
        shift_tokens(pos, slot, kv_lens, shift_index, shifts, table, self.kv.tokens_per_block)
        model = self.target.model
        hidden, captured = model(ids, pos, self.target.kv_caches, e.md, self.target.backend,
                                 self.target.capture_layer_ids)
        cap = torch.cat(captured, dim=-1)
        nv = bv * q     # the prompt rows' draft context (padding rows after them: the scratch page)
        self.context.write_forward_context(cap[nv:], pos[nv:], dslot[nv:])
        start = pos[:nv].view(bv, q)[:, 0]        # moved by the shift: 0 only on padding rows
        logits = model.compute_logits(hidden[:nv], float32=False)
        verified = greedy_verify(ids[:nv].view(bv, q), logits.view(bv, q, -1), start > 0,
                                 self.spec.argmax, self.spec.accept)
        drafts = self.draft.draft_rows(cap[:nv], verified, start, e.block_md)
        chosen = self.spec.argmax(model.compute_logits(hidden[e.last_rows], float32=False))[:, None]
        arrivals = torch.cat((chosen, e.fill, torch.ones_like(chosen), chosen, e.mask), 1)
        return torch.cat((torch.cat((verified, drafts), 1), arrivals))
