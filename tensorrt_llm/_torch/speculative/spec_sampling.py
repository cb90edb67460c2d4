"""Lossless rejection sampling on the GPU through flashinfer's `chain_speculative_sampling`.

Three implementations of the same rule (`verification.rejection_accept` describes it):

    torch      : `rejection_accept`, a host loop per request (any device; the reference)
    flashinfer : one fused kernel launch for B requests (CUDA; flashinfer 0.7.2.post1)
    batched    : `batched_rejection.batched_rejection_accept`, every sampling request of a step in one
                 pass of torch ops on hash noise (any device; seed-stable; chosen only explicitly
                 until it has been measured on the GPU)

`resolve_rejection_sampler` picks one once per worker: flashinfer when the device is CUDA and
`flashinfer.sampling` imports, torch otherwise (with the reason). flashinfer is imported only
inside functions, so CPU-only installs never need it.

Randomness and determinism. The kernel draws Philox uniforms from (seed, offset, row index).
`flashinfer_rejection_accept` takes (seed, offset) from the given CUDA `torch.Generator` and
advances it past the K+1 uniforms a row uses, so later torch ops on that generator never reuse
them (flashinfer's own `generator=` path hands the kernel the *advanced* offset, which the next
torch op on the same generator would start from: correlated draws). With one request per call
(what `DSparkWorker.accept` does) the outcome depends only on that request's seeded generator,
never on batch composition; in a batched call row b's stream also depends on its index b.
The torch and flashinfer paths consume randomness differently: same distribution, not the same
samples for a given seed.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal, Optional, get_args

import torch

from .verification import rejection_accept

RejectionSamplerName = Literal["torch", "flashinfer", "batched"]
KNOWN_REJECTION_SAMPLERS: tuple[str, ...] = get_args(RejectionSamplerName)


@dataclass(frozen=True)
class RejectionSamplerResolution:
    """The rejection-sampling implementation a worker uses, and why."""

    name: RejectionSamplerName
    reason: str


def flashinfer_sampling_error() -> str:
    """Empty string when `flashinfer.sampling.chain_speculative_sampling` imports; else why not."""
    try:
        mod = importlib.import_module("flashinfer.sampling")
    except Exception as e:  # ImportError or a broken install (missing CUDA libs, ABI mismatch)
        return f"{type(e).__name__}: {e}"
    if not hasattr(mod, "chain_speculative_sampling"):
        return "flashinfer.sampling has no chain_speculative_sampling"
    return ""


def resolve_rejection_sampler(device: torch.device, requested: Optional[str] = None,
                              import_error: Optional[str] = None) -> RejectionSamplerResolution:
    """Pick the rejection-sampling implementation for `device`.

    requested: None picks automatically (flashinfer on CUDA when it imports, else torch);
    "torch" / "flashinfer" is an explicit choice; an explicit flashinfer that cannot run and
    an unknown name raise ValueError. import_error: the result of `flashinfer_sampling_error()`
    (probed here when None; tests pass it in).
    """
    if requested is not None and requested not in KNOWN_REJECTION_SAMPLERS:
        raise ValueError(f"unknown rejection sampler {requested!r}; known: "
                         f"{', '.join(KNOWN_REJECTION_SAMPLERS)} (or None for automatic)")
    if requested in ("torch", "batched"):
        return RejectionSamplerResolution(requested, "requested explicitly")
    if device.type != "cuda":
        why = f"flashinfer rejection sampling needs a CUDA device (device is {device.type})"
    else:
        err = flashinfer_sampling_error() if import_error is None else import_error
        if not err:
            return RejectionSamplerResolution(
                "flashinfer", "requested explicitly" if requested else "CUDA device and flashinfer imports")
        why = (f"flashinfer is not importable ({err}); "
               "install the 'gpu' extra: pip install 'tensorrt_llm[gpu]'")
    if requested == "flashinfer":
        raise ValueError(f"rejection sampler 'flashinfer' cannot run: {why}")
    return RejectionSamplerResolution("torch", why)


def take_philox_seed_offset(generator: torch.Generator, uniforms_per_row: int) -> tuple[int, int]:
    """Reserve `uniforms_per_row` Philox draws of a CUDA generator -> (seed, offset) to use.

    The returned offset is the generator's current one (as torch's own CUDA kernels use it);
    the generator is advanced past the reservation, rounded up to 4 like torch does.
    """
    state = generator.get_state()
    if state.numel() != 16:
        raise ValueError(f"flashinfer sampling needs a CUDA torch.Generator whose state is (seed, offset) "
                         f"int64; got a {generator.device} generator with a {state.numel()}-byte state")
    seed, offset = state.view(torch.int64).tolist()
    new_offset = offset + (uniforms_per_row + 3) // 4 * 4
    generator.set_state(torch.tensor([seed, new_offset], dtype=torch.int64).view(torch.uint8))
    return seed, offset


def unsupported_last_tokens(out_ids: torch.Tensor, emitted: torch.Tensor, draft_probs: torch.Tensor,
                            target_probs: torch.Tensor) -> torch.Tensor:
    """[B] bool: rows whose last emitted token has no mass where it was drawn from.

    out_ids [B, K+1] int (-1 padded), emitted [B] int (accepted drafts), draft_probs [B, K, V],
    target_probs [B, K+1, V]. The last token of row b sits at position n = emitted[b] and was
    drawn from max(p_n - q_n, 0) (q_K = 0 for the bonus). When that residual has no mass in
    fp32 (p_n == q_n up to rounding) the kernel returns uninitialised shared memory instead of
    a token; such a row is flagged so that the caller redraws it from p_n, as the torch path does.
    """
    b, k1, v = target_probs.shape
    rows = torch.arange(b, device=out_ids.device)
    pos = emitted.long().clamp(0, k1 - 1)
    tok = out_ids[rows, pos].long()
    in_range = (tok >= 0) & (tok < v)
    safe = tok.clamp(0, v - 1)
    p = target_probs[rows, pos, safe].float()
    q_pad = torch.cat([draft_probs.float(), draft_probs.new_zeros(b, 1, v, dtype=torch.float32)], 1)
    q = q_pad[rows, pos, safe]
    return ~in_range | ((p - q).clamp(min=0) <= 0)


def committed_from_padded(out_ids: list[list[int]], emitted: list[int],
                          draft_ids: list[list[int]]) -> list[list[int]]:
    """Kernel output rows (host lists) -> committed tokens per request.

    out_ids B x [K+1]: n = emitted[b] accepted drafts, then the token drawn at position n, then
    -1 padding. A row whose layout disagrees with its counter (a counter that was not zeroed
    before the launch, a wrong K) raises ValueError instead of committing wrong tokens.
    """
    if not len(out_ids) == len(emitted) == len(draft_ids):
        raise ValueError(f"batch mismatch: {len(out_ids)} output rows, {len(emitted)} counters, "
                         f"{len(draft_ids)} draft rows")
    out: list[list[int]] = []
    for b, (row, n, drafts) in enumerate(zip(out_ids, emitted, draft_ids)):
        k = len(drafts)
        if len(row) != k + 1 or not 0 <= n <= k:
            raise ValueError(f"row {b}: {len(row)} outputs and emitted={n} for K={k} drafts "
                             f"(expected K+1 outputs and 0 <= emitted <= K; counters must start at 0)")
        if row[:n] != drafts[:n] or any(t != -1 for t in row[n + 1:]):
            raise ValueError(f"row {b}: output {row} does not match emitted={n} and drafts {drafts} "
                             f"(accepted drafts, one drawn token, then -1 padding)")
        out.append(row[:n + 1])
    return out


def flashinfer_rejection_accept(draft_ids: torch.Tensor, draft_probs: torch.Tensor,
                                target_probs: torch.Tensor,
                                generator: Optional[torch.Generator]) -> list[list[int]]:
    """Lossless rejection sampling for B requests in one flashinfer launch -> committed tokens.

    draft_ids [B, K] int (any int dtype; sent as int32), draft_probs [B, K, V] and
    target_probs [B, K+1, V] (sent as contiguous float32) on one CUDA device; K >= 1.
    generator: a CUDA torch.Generator (None: the device's default one); see the module
    docstring for determinism.
    Returns B lists of 1..K+1 tokens: the accepted drafts plus one token from the target.
    """
    if draft_probs.dim() != 3 or draft_ids.shape != draft_probs.shape[:2]:
        raise ValueError(f"draft_ids {tuple(draft_ids.shape)} must be [B, K] and draft_probs "
                         f"{tuple(draft_probs.shape)} [B, K, V]")
    b, k, v = draft_probs.shape
    if k < 1:
        raise ValueError("flashinfer rejection sampling needs K >= 1 drafts (use rejection_accept for K=0)")
    if tuple(target_probs.shape) != (b, k + 1, v):
        raise ValueError(f"target_probs {tuple(target_probs.shape)} must be [B, K+1, V] = {(b, k + 1, v)}")
    dev = draft_probs.device
    if dev.type != "cuda" or target_probs.device != dev:
        raise ValueError(f"flashinfer rejection sampling needs draft_probs and target_probs on one CUDA "
                         f"device; got {dev} and {target_probs.device}")
    from flashinfer.sampling import chain_speculative_sampling

    if generator is None:
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        generator = torch.cuda.default_generators[index]
    seed, offset = take_philox_seed_offset(generator, k + 1)   # K accept draws + 1 residual draw
    qp = draft_probs.to(torch.float32).contiguous()
    tp = target_probs.to(torch.float32).contiguous()
    ids = draft_ids.to(device=dev, dtype=torch.int32).contiguous()
    # The kernel *adds* into these counters: they must start at zero (fresh buffers every call).
    accepted = torch.zeros(b, dtype=torch.int32, device=dev)
    emitted = torch.zeros(b, dtype=torch.int32, device=dev)
    out_ids, _, emitted = chain_speculative_sampling(
        qp, ids, tp, accepted, emitted, deterministic=True, generator=None,
        seed=torch.tensor([seed], dtype=torch.int64, device=dev),
        offset=torch.tensor([offset], dtype=torch.int64, device=dev))
    bad = unsupported_last_tokens(out_ids, emitted, qp, tp)
    host = torch.cat([out_ids.long(), emitted.long()[:, None], bad.long()[:, None]], 1).tolist()
    rows = committed_from_padded([r[:k + 1] for r in host], [r[k + 1] for r in host], ids.tolist())
    for i, r in enumerate(host):
        if r[k + 2]:   # rare: redraw as `rejection_accept` does (residual, or p_n when it has no mass)
            n = len(rows[i]) - 1
            resid = (tp[i, n] - qp[i, n]).clamp(min=0) if n < k else tp[i, n]
            s = float(resid.sum())
            dist = resid / s if s > 0 else tp[i, n]
            rows[i][n] = int(torch.multinomial(dist, 1, generator=generator).item())
    return rows


def run_rejection_accept(sampler: RejectionSamplerName, draft_ids: list[int], draft_probs: torch.Tensor,
                         target_probs: torch.Tensor, generator: Optional[torch.Generator]) -> list[int]:
    """One request: draft_probs [K, V], target_probs [K+1, V] -> committed tokens via `sampler`.

    flashinfer with K = 0 has nothing to verify and uses the torch path (one draw from p_0).
    """
    if sampler == "batched":
        raise ValueError("the 'batched' rejection sampler verifies a whole step at once "
                         "(DSparkWorker.verify_batch); it has no per-request entry")
    if sampler == "torch" or (sampler == "flashinfer" and not draft_ids):
        return rejection_accept(draft_ids, draft_probs, target_probs, generator)
    if sampler == "flashinfer":
        ids = torch.tensor([draft_ids], dtype=torch.int32, device=target_probs.device)
        return flashinfer_rejection_accept(ids, draft_probs[None], target_probs[None], generator)[0]
    raise ValueError(f"unknown rejection sampler {sampler!r}; known: {', '.join(KNOWN_REJECTION_SAMPLERS)}")
