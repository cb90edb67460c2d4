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

import torch
from torch.nn.utils.rnn import pad_sequence

from ...llmapi.llm_args import DSparkDecodingConfig
from ..attention_backend.interface import AttentionMetadata
from ..attention_backend.resolver import create_backend
from ..pyexecutor.llm_request import LlmRequest, RequestState
from ..pyexecutor.model_engine import build_metadata
from ..pyexecutor.sampler import Sampler, host_ints, processed_probs, processed_rows
from .accept_stats import AcceptStats
from .batched_rejection import batched_rejection_accept
from .spec_sampling import RejectionSamplerName, resolve_rejection_sampler, run_rejection_accept
from .verification import greedy_accept, greedy_accept_ids

logger = logging.getLogger("tensorrt_llm")


class DSparkWorker:
    def __init__(self, cfg: DSparkDecodingConfig, drafter: torch.nn.Module, backend, resolution,
                 device: torch.device, dtype: torch.dtype, identity: str, *,
                 rejection_sampler: Optional[RejectionSamplerName] = None):
        """rejection_sampler: "torch" / "flashinfer" / "batched" for T>0 verification; None picks flashinfer
        on CUDA when it imports, else torch (see `spec_sampling.resolve_rejection_sampler`)."""
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
        self.rejection = resolve_rejection_sampler(device, rejection_sampler)
        logger.info("DSpark rejection sampling: %s (%s)", self.rejection.name, self.rejection.reason)
        self.block_size = dc.block_size
        self.max_draft_len = cfg.max_draft_len or dc.num_drafts
        self.mask_token_id = dc.mask_token_id
        self.capture_layer_ids = list(dc.target_layer_ids)
        self.kv_cache_spec = drafter.kv_cache_spec(dtype)
        self.lookahead_tokens = self.block_size   # block slots beyond the committed tokens
        self.stats_ = AcceptStats(self.max_draft_len)
        self._warned: set[int] = set()
        self.kv = None
        self.sampler: Optional[Sampler] = None
        self.kv_caches: list[torch.Tensor] = []
        self.graph_runner = None

    def bind(self, kv, sampler: Sampler) -> None:
        self.kv, self.sampler = kv, sampler
        self.kv_caches = kv.layer_caches("draft")

    def enable_cuda_graphs(self, max_batch_size: int) -> None:
        """Capture the draft step of generation-only greedy steps per batch bucket (after `bind`)."""
        from .draft_graph_runner import DraftGraphRunner
        if self.kv is None:
            raise ValueError("bind() the worker to its KV manager before enabling CUDA graphs")
        self.graph_runner = DraftGraphRunner(self.drafter, self.kv, self.backend, self.kv_caches, self.device,
                                             max_batch_size, verify_tokens=1 + self.max_draft_len,
                                             num_drafts=self.max_draft_len)

    def describe(self) -> dict:
        dc = self.drafter.config
        return {"architecture": dc.architecture, "block_size": dc.block_size,
                "max_draft_len": self.max_draft_len, "target_layer_ids": list(dc.target_layer_ids),
                "kv_bytes_per_token": self.kv_cache_spec.bytes_per_token,
                "rejection_sampler": {"name": self.rejection.name, "reason": self.rejection.reason},
                "attention_backend": {"name": self.resolution.name, "reason": self.resolution.reason}}

    # ---- verification ------------------------------------------------------------------
    @property
    def verifies_in_batch(self) -> bool:
        """True when sampling requests are verified per step (`verify_batch`), not per request."""
        return self.rejection.name == "batched"

    def _batched_verify(self, req: LlmRequest) -> bool:
        return (self.verifies_in_batch and not req.sampling_params.greedy
                and self.cfg.use_rejection_sampling and req.draft_probs is not None)

    def verify_batch(self, items: Sequence[tuple[LlmRequest, torch.Tensor]]) -> dict[int, list[int]]:
        """The "batched" rejection sampler over a step: items (request, rows [K_b+1, V] target
        logits) -> {request id: committed tokens, before accept()'s max_tokens cap} for the
        sampling requests among them (empty with another sampler). One device-to-host copy."""
        items = [(r, x) for r, x in items if self._batched_verify(r)]
        if not items:
            return {}
        reqs = [r for r, _ in items]
        params = [r.sampling_params for r in reqs]
        counts = [len(r.draft_tokens) for r in reqs]
        for r, x in items:
            if x.shape[0] != len(r.draft_tokens) + 1:
                raise ValueError(f"request {r.request_id}: {x.shape[0]} target rows for "
                                 f"{len(r.draft_tokens)} drafts (want drafts + 1)")
        k, dev = max(counts), items[0][1].device
        # drafts padded to k, sent from pinned memory (no wait on the device queue)
        ids = host_ints([t for r in reqs for t in list(r.draft_tokens) + [0] * (k - len(r.draft_tokens))],
                        dev).view(len(reqs), k)
        tp_flat = processed_rows(torch.cat([x for _, x in items]),
                                 [p for p, n in zip(params, counts) for _ in range(n + 1)])
        # [B, k+1, V] and [B, k, V], zero-padded past each request's own drafts
        tp = pad_sequence(list(tp_flat.split([n + 1 for n in counts])), batch_first=True)
        qp = pad_sequence([r.draft_probs[:n].to(tp.dtype) for r, n in zip(reqs, counts)], batch_first=True)
        rids = [r.request_id for r in reqs]
        accept_keys = self.sampler.stream_keys(rids, params, "verify", dev)
        residual_keys = self.sampler.stream_keys(rids, params, "verify", dev)
        accepted, token = batched_rejection_accept(ids, host_ints(counts, dev), qp, tp, accept_keys, residual_keys)
        host = torch.stack([accepted, token], 1).tolist()
        return {r.request_id: list(r.draft_tokens[:n]) + [t] for r, (n, t) in zip(reqs, host)}

    def accept(self, req: LlmRequest, rows: torch.Tensor, greedy_ids: Optional[list[int]] = None,
               verified: Optional[list[int]] = None) -> list[int]:
        """rows [K+1, V] target logits for [anchor, d1..dK] -> committed tokens (at most the
        max_tokens - len(output) the request may still emit, at least 1).

        greedy_ids: the rows' argmax already on the host (saves a device sync per request).
        verified: this request's entry of `verify_batch` for the step (else a sampling request
        under the "batched" sampler is verified here, alone, with the same result).
        """
        drafts = list(req.draft_tokens)
        p = req.sampling_params
        if p.greedy:
            out = greedy_accept_ids(drafts, greedy_ids) if greedy_ids is not None else greedy_accept(drafts, rows)
        elif verified is not None or self._batched_verify(req):
            out = verified if verified is not None else self.verify_batch([(req, rows)])[req.request_id]
        else:
            tp = processed_probs(rows, p)
            gen = self.sampler.generator(req.request_id, p)
            if self.cfg.use_rejection_sampling and req.draft_probs is not None:
                out = run_rejection_accept(self.rejection.name, drafts, req.draft_probs, tp, gen)
            else:  # sample the target at each position; accept while it equals the draft
                out = []
                for i in range(len(drafts) + 1):
                    tok = int(torch.multinomial(tp[i], 1, generator=gen).item())
                    out.append(tok)
                    if i == len(drafts) or tok != drafts[i]:
                        break
        # A greedy request keeps all K drafts near max_tokens (so its verify segment keeps the
        # graph's shape): commit at most what it may still emit, and count only the drafts it
        # could have used, which is what truncating them to `cap` would have recorded.
        cap = max(1, p.max_tokens - len(req.output_token_ids))
        usable = min(len(drafts), cap)
        accepted = min(len(out) - 1, usable)
        self.stats_.record(accepted, usable)
        req.num_verify_steps += 1
        req.num_accepted_drafts += accepted
        req.draft_tokens, req.draft_probs = [], None
        return out[:cap]

    # ---- drafting ----------------------------------------------------------------------
    @torch.inference_mode()
    def draft_step(self, committed: Sequence[tuple[LlmRequest, int, int, int]],
                   captured: Optional[torch.Tensor], kv) -> None:
        """Write draft context for newly committed tokens, then draft for generating requests.

        committed: (request, first captured row, absolute start position, count).
        captured: [T, n*H] target hidden states of this step's packed tokens.
        """
        if captured is None or not committed:
            return
        rest = self._graph_draft_step(committed, captured, kv) if self.graph_runner is not None else committed
        if rest:
            self.eager_draft_step(rest, captured, kv)

    def _graph_draft_step(self, committed: Sequence[tuple[LlmRequest, int, int, int]],
                          captured: torch.Tensor, kv) -> list[tuple[LlmRequest, int, int, int]]:
        """Replay the draft graph for the eligible entries; returns the entries left for eager."""
        try:
            idx, drafts = self.graph_runner.draft(committed, captured)
        except RuntimeError as e:   # a capture the runtime refuses: serve eagerly from now on
            logger.error("draft CUDA graph failed (%s); drafting eagerly from now on", e)
            self.graph_runner = None
            return list(committed)
        if not idx:
            return list(committed)
        group = [committed[i] for i in idx]
        self._after_context_write(group, kv)      # host bookkeeping while the GPU drafts
        for j, (req, *_) in enumerate(group):
            if req.state == RequestState.GENERATION and not req.is_finished:
                # all K drafts, also near max_tokens: the verify segment keeps the graph's
                # shape and `accept` caps what is committed; they stay on the device until
                # the next verify step reads them there (`pending_drafts`)
                req.draft_tokens, req.draft_probs = drafts.row(j), None
        taken = set(idx)
        return [c for i, c in enumerate(committed) if i not in taken]

    def eager_draft_step(self, committed: Sequence[tuple[LlmRequest, int, int, int]],
                         captured: torch.Tensor, kv) -> None:
        """`draft_step` without CUDA graphs: any mix of context chunks, clamps and sampling."""
        rows, pos, slots = [], [], []
        for req, row0, start, n in committed:
            s = kv.slots(req.request_id, start, n)
            if -1 in s:
                self._warn(req, f"draft context write beyond owned pages at {start}..{start + n - 1}")
                self.stats_.skipped_writes += s.count(-1)
            rows.extend(range(row0, row0 + n))
            pos.extend(range(start, start + n))
            slots.extend(s)
        feats = self.drafter.context_features(captured[torch.tensor(rows, device=captured.device)])
        self.drafter.write_context(feats, torch.tensor(pos, device=self.device),
                                   torch.tensor(slots, dtype=torch.long, device=self.device),
                                   self.kv_caches, self.backend)
        self._after_context_write(committed, kv)
        gen = [req for req, *_ in committed
               if req.state == RequestState.GENERATION and not req.is_finished]
        if gen:
            self._draft(gen, kv)

    @staticmethod
    def _after_context_write(committed: Sequence[tuple[LlmRequest, int, int, int]], kv) -> None:
        """Mark the committed positions' draft KV written; publish blocks that became complete."""
        for req, _, start, n in committed:
            owned = kv.owned_tokens(req.request_id)
            kv.mark_draft_written(req.request_id, min(start + n, owned))
            if kv.wants_commit(req.request_id, req.num_computed):
                kv.commit(req.request_id, req.all_token_ids, req.num_computed)

    def _draft(self, reqs: list[LlmRequest], kv) -> None:
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
            self._draft_group(group, s, kv)

    def _draft_group(self, reqs: list[LlmRequest], s: int, kv) -> None:
        ids, pos, starts = [], [], []
        for req in reqs:
            ctx = req.num_computed
            ids.extend([req.token_at(ctx)] + [self.mask_token_id] * (s - 1))
            pos.extend(range(ctx, ctx + s))
            starts.append(ctx)
        rids = [r.request_id for r in reqs]
        md: AttentionMetadata = build_metadata(kv, rids, starts, [s] * len(reqs), False, self.device)
        md.validate(kv.num_pages)
        self.backend.prepare(md)
        hidden = self.drafter.forward_block(torch.tensor(ids, device=self.device),
                                            torch.tensor(pos, device=self.device), md,
                                            self.kv_caches, self.backend)
        if s < self.block_size:   # clamped block: pad rows that no draft slot reads
            h = hidden.view(len(reqs), s, -1)
            hidden = torch.cat([h, h.new_zeros(len(reqs), self.block_size - s, h.shape[-1])], 1)
            hidden = hidden.reshape(len(reqs) * self.block_size, -1)
        anchors = torch.tensor([ids[i * s] for i in range(len(reqs))], device=self.device)
        n_slots = s if self.drafter.config.shift_label else s - 1
        k_max = min(self.max_draft_len, n_slots)
        # Sampling requests draw every slot in one batched pass (their own "draft" noise stream).
        sampled = [i for i, r in enumerate(reqs) if not r.sampling_params.greedy]
        at = host_ints(sampled, self.device) if sampled else None
        s_ids = [reqs[i].request_id for i in sampled]
        s_params = [reqs[i].sampling_params for i in sampled]
        slot_probs: list[torch.Tensor] = []        # per slot [len(sampled), V]

        def pick(logits: torch.Tensor) -> torch.Tensor:
            out = logits.argmax(-1)
            if sampled:
                q = processed_rows(logits[at], s_params)
                slot_probs.append(q)
                out[at] = self.sampler.draw(q, s_ids, s_params, stream="draft")
            return out

        draft_ids, _ = self.drafter.propose(hidden, anchors, k_max, pick)
        draft_ids = draft_ids.tolist()
        q_all = torch.stack(slot_probs, 1) if slot_probs else None   # [len(sampled), k_max, V]
        row_of = {i: j for j, i in enumerate(sampled)}
        for i, req in enumerate(reqs):
            k = min(k_max, self._draft_limit(req))
            req.draft_tokens = draft_ids[i][:k]
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
    def stats(self) -> dict:
        d = self.stats_.as_dict()
        d["attention_backend"] = self.resolution.name
        g = self.graph_runner
        if g is not None:
            d["draft_cuda_graph"] = {"captures": g.num_captures, "replays": g.num_replays,
                                     "eager_steps": g.num_eager_fallbacks, "split_steps": g.num_split_steps}
        return d

    def write_stats(self, folder: Path, rank: int = 0) -> Path:
        return self.stats_.write(folder, rank)


def create_dspark_worker(cfg: DSparkDecodingConfig, target: torch.nn.Module, dtype: torch.dtype,
                         device: torch.device, max_seq_len: int) -> DSparkWorker:
    """Load the drafter (validated against the target), resolve its backend, build the worker."""
    from ..models.modeling_dspark import load_drafter
    overrides = {}
    if cfg.mask_token_id is not None:
        overrides["mask_token_id"] = cfg.mask_token_id
    if cfg.target_layer_ids is not None:
        overrides["target_layer_ids"] = list(cfg.target_layer_ids)
    drafter = load_drafter(cfg.speculative_model, target.config, dtype, device, overrides)
    n_layers = target.config.num_hidden_layers
    bad = [i for i in drafter.config.target_layer_ids if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"{cfg.speculative_model}: target_layer_ids {bad} outside the target's "
                         f"{n_layers} layers")
    drafter.bind_target(target.model.embed_tokens, target.lm_head)
    backend, res = create_backend(cfg.attention_backend, device, mla=drafter.config.is_mla)
    h = hashlib.sha256(str(Path(cfg.speculative_model).resolve()).encode())
    for f in sorted(Path(cfg.speculative_model).glob("*.safetensors")):
        h.update(str(f.stat().st_size).encode() + str(f.stat().st_mtime_ns).encode())
    rejection = None if cfg.rejection_sampler == "auto" else cfg.rejection_sampler
    return DSparkWorker(cfg, drafter, backend, res, device, dtype, h.hexdigest()[:16], rejection_sampler=rejection)
