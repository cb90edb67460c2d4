"""DSpark speculative step: verify acceptance, draft-context writes and block drafting.

Per generation step and request (ctx = committed tokens with target KV)::

    target verify : [anchor, d1..dK] at ctx..ctx+K          -> accept a drafts + 1 target token
    draft context : captured target hidden of [anchor, d1..da] -> draft pool at ctx..ctx+a
    draft block   : [next anchor, MASK x (S-1)] at ctx'..ctx'+S-1 (ctx' = ctx+a+1), non-causal,
                    written transiently into the draft pages, attending to all stored context

Every draft-pool write is clamped to the pages the request owns this iteration: a write
beyond them is skipped and that request drafts less (logged once per request); it can never
land in a neighbour's page or page 0.
"""
from __future__ import annotations

import hashlib
import logging
from collections import defaultdict
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from ...llmapi.llm_args import DSparkDecodingConfig
from ..attention_backend.interface import AttentionBackend, AttentionMetadata, host_ints
from ..attention_backend.resolver import Resolution, create_backend
from ..models.dspark_config import DraftKVLayout
from ..pyexecutor.kv_cache.kv_cache_spec import KVCacheSpec
from ..pyexecutor.kv_cache.resource_manager import KVCacheManager
from ..runtime.device import is_device_fault
from ..runtime.llm_request import LlmRequest, RequestState
from ..runtime.sampler import Sampler, processed_rows
from ..runtime.step import DraftsAhead, StepCommit, VerifiedSegment
from ..runtime.token_rows import PendingTokens, TokenRow, VerifyTokens, gather_into, group_by_pending
from .accept_stats import AcceptStats
from .interface import Drafter
from .rejection_sampler import RejectionSampler, SpecDecodeMetadata, stack_verify_rows

logger = logging.getLogger("tensorrt_llm")


def draft_kv_cache_spec(drafter: torch.nn.Module, dtype: torch.dtype) -> KVCacheSpec:
    """The draft pool ("draft") of a DSpark drafter at allocation dtype `dtype`."""
    lay: DraftKVLayout = drafter.kv_cache_layout()
    return KVCacheSpec(name="draft", kind=lay.kind, num_layers=lay.num_layers, planes=lay.planes,
                       heads=lay.heads, head_dim=lay.head_dim, dtype=dtype)


class DSparkWorker(Drafter):
    def __init__(self, cfg: DSparkDecodingConfig, drafter: torch.nn.Module, backend: AttentionBackend,
                 resolution: Resolution, device: torch.device, dtype: torch.dtype, identity: str):
        dc = drafter.config
        if cfg.max_draft_len is not None and cfg.max_draft_len > dc.num_drafts:
            raise ValueError(f"max_draft_len {cfg.max_draft_len} exceeds the drafter's trained "
                             f"drafts per block ({dc.num_drafts}, block_size {dc.block_size})")
        self.cfg = cfg
        self.drafter = drafter
        self.backend = backend
        self.resolution = resolution
        self.device = device
        self.identity = identity
        self.block_size = dc.block_size
        self._max_draft_len = cfg.max_draft_len or dc.num_drafts
        sched = cfg.draft_len_schedule or {}
        too_long = {b: n for b, n in sched.items() if n > self._max_draft_len}
        if too_long:
            raise ValueError(f"draft_len_schedule {too_long} exceeds max_draft_len {self._max_draft_len}")
        self._schedule = sorted(sched.items())
        self.mask_token_id = dc.mask_token_id
        self._capture_layer_ids = list(dc.target_layer_ids)
        self._kv_cache_spec = draft_kv_cache_spec(drafter, dtype)
        self.stats_ = AcceptStats(self._max_draft_len)
        self._warned: set[int] = set()
        self.kv: Optional[KVCacheManager] = None
        self.sampler: Optional[Sampler] = None
        self.rejection: Optional[RejectionSampler] = None
        self.kv_caches: list[torch.Tensor] = []
        self.graph_runner = None
        self.graph_backend: Optional[str] = None    # the device draft step's attention backend, or why it is off

    # ---- Drafter properties --------------------------------------------------------------
    @property
    def max_draft_len(self) -> int:
        return self._max_draft_len

    @property
    def lookahead_tokens(self) -> int:
        return self.block_size      # block slots beyond the committed tokens

    @property
    def capture_layer_ids(self) -> Sequence[int]:
        return self._capture_layer_ids

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return self._kv_cache_spec

    def bind(self, kv: KVCacheManager, sampler: Sampler) -> None:
        self.kv, self.sampler = kv, sampler
        self.rejection = RejectionSampler(sampler)
        self.kv_caches = kv.layer_caches("draft")

    def enable_device_drafts(self, max_batch_size: int, cuda_graphs: bool) -> None:
        """Launch the draft step of greedy verified requests from the device-side verify output
        (`draft_ahead`; after `bind`). With cuda_graphs it is captured per batch bucket with a backend
        that reads KV lengths on the device: an explicit TRITON / CUTEDSL its own; otherwise TRITON, and
        under `attention_backend: AUTO` CUTEDSL where its support predicate holds (`_auto_graph_backend`),
        which then takes the eager draft steps as well. Without cuda_graphs the same step runs directly
        with the worker's own backend. Without such a backend drafting stays eager."""
        from ..attention_backend.triton_backend import TritonAttention
        from .draft_graph_runner import DraftGraphRunner
        if self.kv is None:
            raise ValueError("bind() the worker to its KV manager before enabling device drafts")
        auto = cuda_graphs and self.cfg.attention_backend == "AUTO"
        backend: Optional[AttentionBackend] = None
        if cuda_graphs:
            if auto:
                backend, note = self._auto_graph_backend()
            else:      # CUTEDSL captures its prep kernel; every other choice captures TRITON
                backend = self.backend if self.backend.capabilities.cute_norm_rope else TritonAttention()
            ok, why = type(backend).availability(self.device)
            if ok:
                why = type(backend).shape_support(*self._widths(), self.kv.tokens_per_block)
            backend = backend if ok and not why else None
        elif self.backend.capabilities.device_lengths:
            backend, why = self.backend, ""
        else:
            why = f"{self.backend.name} plans on the host"
        if backend is not None:
            try:      # the runner refuses shapes it cannot pad into one page (its ValueError says why)
                self.graph_runner = DraftGraphRunner(self.drafter, self.kv, backend, self.kv_caches, self.device,
                                                     max_batch_size, verify_widths=sorted({1, *self.verify_widths}),
                                                     num_drafts=self.max_draft_len, capture=cuda_graphs)
            except ValueError as e:
                why = str(e)
        if self.graph_runner is None:
            logger.warning("device draft step disabled: %s (the draft step runs after the host update)", why)
            self.graph_backend = why
            return
        self.graph_backend = backend.name
        if auto:
            # AUTO: the draft steps outside the graph (a step with an arriving prompt) use the graph's
            # backend too, so no draft step plans on the host or waits for the GPU
            self.backend = backend
            self.resolution = Resolution(backend.name, f"AUTO with CUDA graphs: the device draft step's backend "
                                         f"for every draft step (KV lengths read on the device: no host plan, no "
                                         f"sync); {note}")
            logger.info("draft attention backend %s (%s)", backend.name, self.resolution.reason)

    def _widths(self) -> tuple[int, int]:
        """(v_dim, rope_dim) of the drafter's attention for `shape_support`."""
        dc = self.drafter.config
        return (dc.kv_lora_rank, dc.qk_rope_head_dim) if dc.is_mla else (dc.head_dim, 0)

    def _auto_graph_backend(self) -> tuple[AttentionBackend, str]:
        """AUTO's device draft backend and why: CUTEDSL (TRITON attention, the prep and append as the CuTe DSL
        kernel) where its support predicate holds (CUDA sm90+, nvidia-cutlass-dsl and apache-tvm-ffi
        importable, the widths supported, every drafter layer hands over unrotated rows), else TRITON."""
        from ..attention_backend.cute_dsl_backend import CuteDslAttention
        from ..attention_backend.triton_backend import TritonAttention
        ok, why = CuteDslAttention.availability(self.device)
        if ok:
            why = CuteDslAttention.shape_support(*self._widths(), self.kv.tokens_per_block)
        cute = CuteDslAttention()
        if ok and not why:
            unfused = [i for i, layer in enumerate(self.drafter.layers) if not layer.fuses_rope_append(cute)]
            why = f"layers {unfused} cannot hand over unrotated rows" if unfused else ""
        if ok and not why:
            return cute, "CUTEDSL: its support predicate holds"
        return TritonAttention(), f"TRITON (CUTEDSL: {why})"

    @property
    def drafts_on_device(self) -> bool:
        return self.graph_runner is not None

    def describe(self) -> dict:
        dc = self.drafter.config
        return {"architecture": dc.architecture, "block_size": dc.block_size,
                "max_draft_len": self.max_draft_len, "target_layer_ids": list(dc.target_layer_ids),
                "kv_bytes_per_token": self.kv_cache_spec.bytes_per_token,
                "attention_backend": {"name": self.resolution.name, "reason": self.resolution.reason},
                "device_draft_backend": self.graph_backend}

    # ---- verification ------------------------------------------------------------------
    def draft_len(self, batch_size: int) -> int:
        if not self._schedule:
            return self.max_draft_len
        return next((n for b, n in self._schedule if batch_size <= b), 0)

    @property
    def verify_widths(self) -> Sequence[int]:
        # with a schedule, batches above its largest key verify no draft: width 1
        return sorted({1 + self.max_draft_len} | {1 + n for _, n in self._schedule} | ({1} if self._schedule else set()))

    def verify_tokens(self, req: LlmRequest, num_drafts: int) -> Sequence[int]:
        anchor = req.token_at(req.num_computed)
        drafts = req.draft_tokens
        n = min(num_drafts, len(drafts))
        if isinstance(drafts, TokenRow):   # still on the device: the graph gathers them there
            return VerifyTokens(anchor, TokenRow(drafts.pending, drafts.index, n, drafts.offset)) if n else [anchor]
        return [anchor, *list(drafts)[:n]]

    def verify(self, reqs: Sequence[LlmRequest], drafts: Sequence[Sequence[int]], logits: torch.Tensor,
               offsets: Sequence[int], counts: Sequence[int]) -> torch.Tensor:
        for r, d, c in zip(reqs, drafts, counts):
            if c != len(d) + 1:
                raise ValueError(f"request {r.request_id}: {c} target rows for {len(d)} drafts (want drafts + 1)")
        rows = stack_verify_rows(logits, offsets, counts)              # [B, K+1, V]
        meta = SpecDecodeMetadata(
            request_ids=[r.request_id for r in reqs], params=[r.sampling_params for r in reqs],
            draft_token_ids=self._draft_ids(drafts, rows.shape[1] - 1, logits.device),
            num_draft_tokens=host_ints([c - 1 for c in counts], logits.device), target_logits=rows,
            draft_probs=([None if r.draft_probs is None else r.draft_probs[:len(d)] for r, d in zip(reqs, drafts)]
                         if any(r.draft_probs is not None for r in reqs) else None))
        return self.rejection.forward(meta)

    @staticmethod
    def _draft_ids(drafts: Sequence[Sequence[int]], k: int, device: torch.device) -> torch.Tensor:
        """[B, k] int64 draft ids on `device` (entries past a request's own drafts are don't-cares):
        rows still on the device (`TokenRow`s of one or more draft steps) are gathered there, never
        waited for; host lists are sent in one pinned copy."""
        if k and all(isinstance(d, TokenRow) and d.pending is drafts[0].pending and len(d) == k
                     and d.offset == drafts[0].offset for d in drafts):
            pend, cols = drafts[0].pending, drafts[0].columns
            idx = [d.index for d in drafts]
            if idx == list(range(idx[0], idx[0] + len(idx))):
                return pend.device[idx[0]:idx[0] + len(idx), cols]
            return pend.device.index_select(0, host_ints(idx, device))[:, cols]
        flat: list[int] = []
        for d in drafts:
            flat.extend([0] * k if isinstance(d, TokenRow) else list(d) + [0] * (k - len(d)))
        out = host_ints(flat, device).view(len(drafts), k)
        dev = [(j, d) for j, d in enumerate(drafts) if isinstance(d, TokenRow)]
        for pend, rows, toks in group_by_pending([d for _, d in dev], [j for j, _ in dev]):
            gather_into(out[:, :min(k, pend.width - toks[0].offset)], toks, rows)   # one producer each
        return out

    def accept(self, req: LlmRequest, verified: Sequence[int], num_drafts: int) -> list[int]:
        # A greedy request keeps all K drafts near max_tokens (so its verify segment keeps the
        # graph's shape): commit at most what it may still emit, and count only the drafts whose
        # acceptance could have been committed (cap - 1: the last committed slot is the target's).
        # A step that verified no draft (draft_len 0 at its batch size) records nothing.
        cap = max(1, req.sampling_params.max_tokens - len(req.output_token_ids))
        if num_drafts:
            usable = min(num_drafts, cap - 1)
            accepted = min(len(verified) - 1, usable)
            self.stats_.record(accepted, usable)
            req.num_verify_steps += 1
            req.num_accepted_drafts += accepted
        req.draft_tokens, req.draft_probs = [], None
        return list(verified[:cap])

    # ---- drafting ----------------------------------------------------------------------
    def draft_ahead(self, segments: Sequence[VerifiedSegment], verified: torch.Tensor,
                    captured: torch.Tensor) -> Optional[DraftsAhead]:
        if self.graph_runner is None or not segments:
            return None
        try:
            return self.graph_runner.launch(segments, [s.num_tokens for s in segments], verified, captured)
        except RuntimeError as e:   # a capture the runtime refuses: serve eagerly from now on
            if is_device_fault(e):
                raise
            logger.error("draft CUDA graph failed (%s); drafting eagerly from now on", e)
            self.graph_runner = None
            self.graph_backend = f"off after an error: {e}"
            return None

    @torch.inference_mode()
    def draft(self, commits: Sequence[StepCommit], captured: Optional[torch.Tensor],
              ahead: Optional[DraftsAhead] = None) -> None:
        """Attach the drafts launched by `draft_ahead`, then write draft context for the other
        committed tokens and draft for their generating requests (eagerly).

        captured: [T, n*H] target hidden states of this step's packed tokens, or None (a one-graph
        step: every request of it is in `ahead`); the other requests draft only from it.
        """
        if not commits:
            return
        rest = commits
        if ahead is not None:
            rest, rows, kv, generating = [], ahead.rows, self.kv, RequestState.GENERATION
            for c in commits:
                req = c.req
                if req.request_id not in rows:
                    rest.append(c)
                    continue
                kv.mark_draft_written(req.request_id, c.start + c.count)   # the launch wrote their context
                # running => its host count equals the device count (a cap or a stop finishes it);
                # all K drafts, also near max_tokens: `accept` caps what is committed
                if req.state is generating:
                    req.draft_tokens, req.draft_probs = ahead.drafts(req.request_id), None
        if rest and captured is not None:
            self._eager_draft(rest, captured)

    @torch.inference_mode()
    def draft_arrivals(self, commits: Sequence[StepCommit], anchors: torch.Tensor,
                       captured: torch.Tensor) -> Optional[DraftsAhead]:
        if self.graph_runner is None or not commits:
            return None
        self._write_arrivals_context(commits, captured)
        return self._launch_last_rows(commits, anchors, captured)

    @torch.inference_mode()
    def anchor_arrivals(self, commits: Sequence[StepCommit], anchors: torch.Tensor,
                        captured: torch.Tensor) -> Optional[DraftsAhead]:
        """Rows [committed 1 | anchor | mask_token_id x K] (the draft launch's layout), after writing
        the draft context the target forward did not."""
        if self.graph_runner is None or not commits:
            return None
        self._write_arrivals_context(commits, captured)
        rows = anchors.new_full((len(commits), 2 + self.max_draft_len), self.mask_token_id)
        rows[:, 0] = 1
        rows[:, 1] = anchors.view(-1)
        return DraftsAhead({c.req.request_id: j for j, c in enumerate(commits)}, PendingTokens(rows))

    @property
    def writes_forward_context(self) -> bool:
        return True

    def write_forward_context(self, captured: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        feats = self.drafter.context_features(captured)
        self.drafter.write_context(feats, positions, slots, self.kv_caches, self.backend, slots_valid=True)

    def _eager_draft(self, commits: Sequence[StepCommit], captured: torch.Tensor) -> None:
        """The draft step without CUDA graphs: any mix of context chunks, clamps and sampling."""
        self._write_context(self._unwritten(commits), captured)
        self._mark_written(commits)
        gen = [c for c in commits if c.req.state is RequestState.GENERATION and c.count]
        if gen:
            rest = self._launch_from_last(gen, captured)
            if rest:
                self._draft(rest)

    def _write_arrivals_context(self, commits: Sequence[StepCommit], captured: torch.Tensor) -> None:
        """The arrivals' prompt-row draft context the target forward did not write, then all of it
        marked written (an arrival a launch leaves out does not write it again)."""
        self._write_context(self._unwritten(commits), captured)
        self._mark_written(commits)

    def _unwritten(self, commits: Sequence[StepCommit]) -> list[StepCommit]:
        """The commits whose draft context is not written yet (the packed prompt graph writes its
        prompts', an arrivals' launch writes those it then leaves out)."""
        kv = self.kv
        return [c for c in commits if kv.draft_written_tokens(c.req.request_id) < c.start + c.count]

    def _write_context(self, commits: Sequence[StepCommit], captured: torch.Tensor) -> None:
        """The draft context (K/V from the captured target rows) of the committed positions."""
        kv = self.kv
        rows, pos, slots = [], [], []
        for c in commits:
            s = kv.slots(c.req.request_id, c.start, c.count)
            if -1 in s:
                self._warn(c.req, f"draft context write beyond owned pages at {c.start}..{c.start + c.count - 1}")
                self.stats_.skipped_writes += s.count(-1)
            rows.extend(range(c.row0, c.row0 + c.count))
            pos.extend(range(c.start, c.start + c.count))
            slots.extend(s)
        if rows:
            # one pinned copy of rows | positions | slots, whose validity is known here: no device sync.
            # Outside any graph, with a token count new each call: the eager regions (`_regions`)
            idx = host_ints(np.array([rows, pos, slots], dtype=np.int64), self.device)
            feats = self.drafter.context_features(captured[idx[0]], compiled=False)
            self.drafter.write_context(feats, idx[1], idx[2], self.kv_caches, self.backend,
                                       slots_valid=-1 not in slots, compiled=False)

    def _launch_from_last(self, commits: Sequence[StepCommit], captured: torch.Tensor) -> list[LlmRequest]:
        """Draft the greedy requests among `commits` with the device draft step, as a one-row verify
        segment: the last committed token's captured row at its position, the next token (the anchor,
        known on the host) as its only committed token. An arriving prompt drafts this way instead of
        through an eager draft block. Returns the requests left to draft eagerly."""
        if self.graph_runner is None:       # its widths hold 1 (`enable_device_drafts`)
            return [c.req for c in commits]
        anchors = host_ints([c.req.token_at(c.req.num_computed) for c in commits], captured.device)
        ahead = self._launch_last_rows(commits, anchors, captured)
        rows = ahead.rows if ahead is not None else {}
        for c in commits:
            if c.req.request_id in rows:
                c.req.draft_tokens, c.req.draft_probs = ahead.drafts(c.req.request_id), None
        return [c.req for c in commits if c.req.request_id not in rows]

    def _launch_last_rows(self, commits: Sequence[StepCommit], anchors: torch.Tensor,
                          captured: torch.Tensor) -> Optional[DraftsAhead]:
        """The device draft step from each commit's last row as a one-row verify segment whose only
        verified token is its anchor (anchors [len(commits)] int64 on the device)."""
        items = [VerifiedSegment(c.req, c.row0 + c.count - 1, c.start + c.count - 1, 1, j)
                 for j, c in enumerate(commits)]
        return self.draft_ahead(items, anchors.view(-1, 1), captured)

    def _mark_written(self, commits: Sequence[StepCommit]) -> None:
        """The committed positions' draft KV is written (the manager publishes what waited for it)."""
        kv = self.kv
        for c in commits:
            kv.mark_draft_written(c.req.request_id, c.start + c.count)

    def _draft(self, reqs: list[LlmRequest]) -> None:
        kv = self.kv
        groups: dict[int, list[LlmRequest]] = defaultdict(list)
        for req in reqs:
            ctx = req.num_computed
            s = min(self.block_size, kv.owned_tokens(req.request_id) - ctx)
            if s < self.block_size:
                self._warn(req, f"draft block clamped to {max(s, 0)} slots by the page bound")
            k = min(self.max_draft_len, self._draft_limit(req), s if self.drafter.config.shift_label else s - 1)
            if k <= 0 or s <= 0:
                req.draft_tokens = []
                continue
            groups[s].append(req)
        for s, group in groups.items():
            self._draft_group(group, s)

    def _draft_group(self, reqs: list[LlmRequest], s: int) -> None:
        kv = self.kv
        ids, pos, starts = [], [], []
        for req in reqs:
            ctx = req.num_computed
            ids.extend([req.token_at(ctx)] + [self.mask_token_id] * (s - 1))
            pos.extend(range(ctx, ctx + s))
            starts.append(ctx)
        rids = [r.request_id for r in reqs]
        # built from the manager's own tables (their invariants: test_resource_manager); no device check here
        md: AttentionMetadata = kv.attention_metadata(rids, starts, [s] * len(reqs), False)
        self.backend.prepare(md)
        hidden = self.drafter.forward_block(host_ints(ids, self.device), host_ints(pos, self.device), md,
                                            self.kv_caches, self.backend)
        if s < self.block_size:   # clamped block: pad rows that no draft slot reads
            h = hidden.view(len(reqs), s, -1)
            hidden = torch.cat([h, h.new_zeros(len(reqs), self.block_size - s, h.shape[-1])], 1)
            hidden = hidden.reshape(len(reqs) * self.block_size, -1)
        anchors = host_ints([ids[i * s] for i in range(len(reqs))], self.device)
        n_slots = s if self.drafter.config.shift_label else s - 1
        k_max = min(self.max_draft_len, n_slots)
        # Sampling requests draw every slot in one batched pass (their own "draft" noise stream).
        sampled = [i for i, r in enumerate(reqs) if not r.sampling_params.greedy]
        at = host_ints(sampled, self.device) if sampled else None
        s_ids = [reqs[i].request_id for i in sampled]
        s_params = [reqs[i].sampling_params for i in sampled]
        slot_probs: list[torch.Tensor] = []        # per slot [len(sampled), V]

        def pick(logits: torch.Tensor) -> torch.Tensor:      # greedy rows argmax, sampled rows draw
            out = logits.argmax(-1)
            q = processed_rows(logits[at], s_params)
            slot_probs.append(q)
            out[at] = self.sampler.draw(q, s_ids, s_params, stream="draft")
            return out

        draft_ids = (self.drafter.propose(hidden, anchors, k_max, pick)[0] if sampled
                     else self.drafter.propose_greedy(hidden, anchors, k_max))
        # the drafts stay on the device (no wait here); their host copy is under way
        pending = PendingTokens(draft_ids)
        q_all = torch.stack(slot_probs, 1) if slot_probs else None   # [len(sampled), k_max, V]
        row_of = {i: j for j, i in enumerate(sampled)}
        for i, req in enumerate(reqs):
            k = min(k_max, self._draft_limit(req))
            req.draft_tokens = pending.row(i, k)
            req.draft_probs = q_all[row_of[i], :k] if i in row_of else None

    def _draft_limit(self, req: LlmRequest) -> int:
        """Most drafts worth proposing: all of them for a greedy request (`accept` caps what is
        committed, and full-length verify segments stay on the target graph); a sampled request
        drafts at most the tokens it may still emit (its draft probs feed rejection sampling)."""
        if req.sampling_params.greedy:
            return self.max_draft_len
        return req.sampling_params.max_tokens - len(req.output_token_ids)

    def _warn(self, req: LlmRequest, msg: str) -> None:
        if req.request_id not in self._warned:
            self._warned.add(req.request_id)
            logger.warning("request %d: %s (it drafts less)", req.request_id, msg)

    def release(self, req: LlmRequest) -> None:
        self._warned.discard(req.request_id)

    # ---- stats -------------------------------------------------------------------------
    def reset_stats(self) -> None:
        self.stats_ = AcceptStats(self.max_draft_len)

    def stats(self) -> dict:
        d = self.stats_.as_dict()
        d["attention_backend"] = self.resolution.name
        g = self.graph_runner
        if g is not None:
            d["device_drafts"] = {"cuda_graph": g.graphs.capture, "captures": g.graphs.num_captures,
                                  "replays": g.graphs.num_replays, "drafted_requests": g.num_drafted}
        return d

    def write_stats(self, folder: Path, rank: int = 0) -> Path:
        return self.stats_.write(folder, rank)


def create_dspark_worker(cfg: DSparkDecodingConfig, target: torch.nn.Module, dtype: torch.dtype,
                         device: torch.device) -> DSparkWorker:
    """Load the drafter (validated against the target), resolve its backend, build the worker."""
    from ..models.dspark_loader import load_drafter
    overrides = {}
    if cfg.mask_token_id is not None:
        overrides["mask_token_id"] = cfg.mask_token_id
    if cfg.target_layer_ids is not None:
        overrides["target_layer_ids"] = list(cfg.target_layer_ids)
    # the draft block looks past the last committed token: rope positions as far as the target's
    drafter = load_drafter(cfg.speculative_model, target.config, dtype, device, overrides,
                           max_positions=target.rotary.max_positions)
    if cfg.mla_fold_output:
        drafter.fold_mla_output()
    if cfg.mla_fold_query:
        drafter.fold_mla_query()
    n_layers = target.config.num_hidden_layers
    bad = [i for i in drafter.config.target_layer_ids if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"{cfg.speculative_model}: target_layer_ids {bad} outside the target's "
                         f"{n_layers} layers")
    drafter.bind_target(target.model.embed_tokens, target.lm_head)
    backend, res = create_backend(cfg.attention_backend, device, dtype, mla=drafter.config.is_mla)
    if backend.capabilities.cute_norm_rope:      # its prep kernel must run on every layer: no unfused path
        unfused = [i for i, layer in enumerate(drafter.layers) if not layer.fuses_rope_append(backend)]
        if unfused:
            raise ValueError(f"attention backend {res.name} norms and rotates the drafter's q / k (latents) in its "
                             f"CuTe DSL kernel, but layers {unfused} of {cfg.speculative_model} cannot hand them "
                             "over unrotated (that needs layer regions, i.e. no quant_config, half-rotation RoPE, "
                             "GQA q / k norms over the whole head or absorbed MLA with power-of-two widths)")
    h = hashlib.sha256(str(Path(cfg.speculative_model).resolve()).encode())
    for f in sorted(Path(cfg.speculative_model).glob("*.safetensors")):
        h.update(str(f.stat().st_size).encode() + str(f.stat().st_mtime_ns).encode())
    return DSparkWorker(cfg, drafter, backend, res, device, dtype, h.hexdigest()[:16])
