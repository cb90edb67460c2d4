"""AUTO attention-backend resolution from a fixed preference list.

CPU -> VANILLA. CUDA + MLA drafter -> FLASHINFER's absorbed-MLA paged decode, or TRITON's where
flashinfer cannot run the model's dtype (float32); it never degrades to VANILLA (a clear error
names what is missing). CUDA + GQA -> FLASHINFER -> VANILLA, degrading with a logged reason.
Every choice is checked against the backend's declared `capabilities` (device, dtype, fp8 KV).
TRITON (plan-free, lengths on the device) is otherwise an explicit choice; a DSpark drafter under
AUTO with CUDA graphs then switches to its device draft step's TRITON backend for every draft step
(`DSparkWorker.enable_device_drafts`). An explicit choice that cannot run raises; an unknown name
raises (listing the known ones).
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from .interface import AttentionBackend

logger = logging.getLogger("tensorrt_llm")

KNOWN_BACKENDS = ("VANILLA", "FLASHINFER", "TRITON")   # every one has a loader in _LOADERS


def _load_vanilla() -> type[AttentionBackend]:
    from .vanilla import VanillaAttention
    return VanillaAttention


def _load_flashinfer() -> type[AttentionBackend]:
    mod = importlib.import_module("tensorrt_llm._torch.attention_backend.flashinfer_backend")
    return mod.FlashInferAttention


def _load_triton() -> type[AttentionBackend]:
    from .triton_backend import TritonAttention
    return TritonAttention


@dataclass(frozen=True)
class Probe:
    """Environment facts the resolver decides on (mockable in tests)."""

    device_type: str
    sm: int                      # compute capability major*10+minor (0 on CPU)
    flashinfer_importable: bool
    flashinfer_error: str = ""
    triton_importable: bool = False


def probe_environment(device: torch.device) -> Probe:
    sm = 0
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        sm = major * 10 + minor
    try:
        importlib.import_module("flashinfer")
        ok, err = True, ""
    except Exception as e:  # ImportError or a broken install
        ok, err = False, f"{type(e).__name__}: {e}"
    return Probe(device.type, sm, ok, err, importlib.util.find_spec("triton") is not None)


def _why_unavailable(name: str, probe: Probe, mla: bool, dtype: torch.dtype) -> str:
    """Empty string when `name` (a known backend) can run under `probe` with `dtype` activations;
    else the reason."""
    if name != "VANILLA" and probe.device_type != "cuda":
        return f"{name} needs a CUDA device (device is {probe.device_type})"
    if name == "FLASHINFER":
        if not probe.flashinfer_importable:
            return f"flashinfer is not importable ({probe.flashinfer_error or 'not installed'}); " \
                   "install the 'gpu' extra: pip install 'tensorrt_llm[gpu]'"
        if mla and probe.sm < 80:
            return f"flashinfer MLA paged decode needs sm80+, device is sm{probe.sm}"
    if name == "TRITON" and not probe.triton_importable:
        return "triton is not importable (it ships with torch's CUDA wheels)"
    try:
        dtypes = _LOADERS[name]().capabilities.dtypes
    except (ImportError, AttributeError):
        return ""      # create_backend names the load failure
    dname = str(dtype).removeprefix("torch.")
    if dname not in dtypes:
        return f"{name} runs {'/'.join(dtypes)} activations, the model runs {dname}"
    return ""


_LOADERS: dict[str, Callable[[], type[AttentionBackend]]] = {
    "VANILLA": _load_vanilla, "FLASHINFER": _load_flashinfer, "TRITON": _load_triton}


@dataclass(frozen=True)
class Resolution:
    name: str
    reason: str


def resolve_name(requested: str, probe: Probe, mla: bool, dtype: torch.dtype, fp8_kv: bool = False) -> Resolution:
    """Pick a backend name for `dtype` activations. Raises ValueError for unknown or unavailable
    explicit choices. fp8_kv: the KV pool is fp8, so AUTO skips backends that do not declare
    `capabilities.fp8_kv`."""
    if requested != "AUTO":
        if requested not in KNOWN_BACKENDS:
            raise ValueError(f"unknown attention backend {requested!r}; known: AUTO, {', '.join(KNOWN_BACKENDS)}")
        why = _why_unavailable(requested, probe, mla, dtype)
        if why:
            raise ValueError(f"attention backend {requested} cannot run: {why}")
        return Resolution(requested, "explicit choice")
    if probe.device_type != "cuda":
        return Resolution("VANILLA", f"AUTO on {probe.device_type}: VANILLA is the only CPU backend")
    if mla:
        why = _why_unavailable("FLASHINFER", probe, True, dtype)
        if not why:
            return Resolution("FLASHINFER", "AUTO: MLA drafter on CUDA -> flashinfer absorbed-MLA paged decode")
        why_triton = _why_unavailable("TRITON", probe, True, dtype)
        if not why_triton:
            return Resolution("TRITON", f"AUTO: MLA drafter on CUDA -> TRITON absorbed-MLA paged decode "
                                        f"(FLASHINFER: {why})")
        raise ValueError(f"AUTO for the MLA drafter on CUDA needs flashinfer's or TRITON's absorbed-MLA paged "
                         f"decode and never degrades: FLASHINFER: {why}; TRITON: {why_triton}")
    reasons = []
    for name in ("FLASHINFER", "VANILLA"):
        why = _why_unavailable(name, probe, False, dtype)
        if not why and fp8_kv and not _LOADERS[name]().capabilities.fp8_kv:
            why = "no fp8 KV (capabilities.fp8_kv is False)"
        if not why:
            note = "; ".join(reasons)
            return Resolution(name, f"AUTO on CUDA sm{probe.sm}: {name}" + (f" (skipped: {note})" if note else ""))
        reasons.append(f"{name}: {why}")
    raise AssertionError("unreachable: VANILLA always runs")


def create_backend(requested: str, device: torch.device, dtype: torch.dtype, mla: bool = False,
                   probe: Probe | None = None, fp8_kv: bool = False) -> tuple[AttentionBackend, Resolution]:
    """Resolve and instantiate for `dtype` activations; logs the choice and its reason."""
    res = resolve_name(requested, probe or probe_environment(device), mla, dtype, fp8_kv)
    try:
        cls = _LOADERS[res.name]()
    except (ImportError, KeyError, AttributeError) as e:
        raise ValueError(f"attention backend {res.name} cannot be loaded: {e}") from e
    logger.info("attention backend %s (%s)", res.name, res.reason)
    return cls(), res
