"""AUTO attention-backend resolution from a fixed preference list.

CPU -> VANILLA. CUDA + MLA drafter -> FLASHINFER's absorbed-MLA paged decode, or TRITON's where
flashinfer cannot run the model's dtype (float32); it never degrades to VANILLA (a clear error
names what is missing). CUDA + GQA -> FLASHINFER -> VANILLA, degrading with a logged reason.
Every choice is checked against the backend's declared `capabilities` (device, dtype, fp8 KV).
TRITON (plan-free, lengths on the device) is otherwise an explicit choice here. A DSpark drafter under
AUTO with CUDA graphs then switches every draft step to its device draft step's backend
(`DSparkWorker.enable_device_drafts`): CUTEDSL (TRITON attention with the norm + RoPE prep and the
page-bounded append as one CuTe DSL launch per layer, `cute_rope_append`) where its support predicate
holds (CUDA sm90+, nvidia-cutlass-dsl and apache-tvm-ffi importable, the drafter's widths and layers
supported), else TRITON, the reason logged. An explicit choice that cannot run raises; an unknown name
raises (listing the known ones).
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from .cute_norm_rope import MIN_SM, dsl_import_error
from .interface import AttentionBackend

logger = logging.getLogger("tensorrt_llm")

KNOWN_BACKENDS = ("VANILLA", "FLASHINFER", "TRITON", "CUTEDSL")   # every one has a loader in _LOADERS


def _load_vanilla() -> type[AttentionBackend]:
    from .vanilla import VanillaAttention
    return VanillaAttention


def _load_flashinfer() -> type[AttentionBackend]:
    mod = importlib.import_module("tensorrt_llm._torch.attention_backend.flashinfer_backend")
    return mod.FlashInferAttention


def _load_triton() -> type[AttentionBackend]:
    from .triton_backend import TritonAttention
    return TritonAttention


def _load_cutedsl() -> type[AttentionBackend]:
    from .cute_dsl_backend import CuteDslAttention
    return CuteDslAttention


@dataclass(frozen=True)
class Probe:
    """Environment facts the resolver decides on (mockable in tests)."""

    device_type: str
    sm: int                      # compute capability major*10+minor (0 on CPU)
    flashinfer_importable: bool
    flashinfer_error: str = ""
    triton_importable: bool = False
    cute_dsl_importable: bool = False      # nvidia-cutlass-dsl (`cutlass.cute`); probed for CUTEDSL only
    cute_dsl_error: str = ""


def probe_environment(device: torch.device, cute_dsl: bool = False) -> Probe:
    """The facts for `device`; cute_dsl: also import the CuTe DSL (a CUDA device's CUTEDSL request)."""
    sm = 0
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        sm = major * 10 + minor
    try:
        importlib.import_module("flashinfer")
        ok, err = True, ""
    except Exception as e:  # ImportError or a broken install
        ok, err = False, f"{type(e).__name__}: {e}"
    cute_err = dsl_import_error() if cute_dsl and device.type == "cuda" else "not probed"
    return Probe(device.type, sm, ok, err, importlib.util.find_spec("triton") is not None, not cute_err, cute_err)


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
    if name in ("TRITON", "CUTEDSL") and not probe.triton_importable:
        return "triton is not importable (it ships with torch's CUDA wheels)"
    if name == "CUTEDSL":
        if probe.sm < MIN_SM:
            return f"the CuTe DSL norm + RoPE kernel needs sm{MIN_SM}+ (Hopper), device is sm{probe.sm}"
        if not probe.cute_dsl_importable:
            return f"nvidia-cutlass-dsl is not importable ({probe.cute_dsl_error or 'not installed'}); install " \
                   "the 'cutedsl' extra: pip install 'tensorrt_llm[cutedsl]'"
    try:
        dtypes = _LOADERS[name]().capabilities.dtypes
    except (ImportError, AttributeError):
        return ""      # create_backend names the load failure
    dname = str(dtype).removeprefix("torch.")
    if dname not in dtypes:
        return f"{name} runs {'/'.join(dtypes)} activations, the model runs {dname}"
    return ""


_LOADERS: dict[str, Callable[[], type[AttentionBackend]]] = {
    "VANILLA": _load_vanilla, "FLASHINFER": _load_flashinfer, "TRITON": _load_triton, "CUTEDSL": _load_cutedsl}


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
    res = resolve_name(requested, probe or probe_environment(device, cute_dsl=requested == "CUTEDSL"), mla, dtype,
                       fp8_kv)
    try:
        cls = _LOADERS[res.name]()
    except (ImportError, KeyError, AttributeError) as e:
        raise ValueError(f"attention backend {res.name} cannot be loaded: {e}") from e
    logger.info("attention backend %s (%s)", res.name, res.reason)
    return cls(), res
