"""Builds a PyExecutor from validated `TorchLlmArgs`: model, backends, KV pools, drafter."""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...llmapi.llm_args import TorchLlmArgs
from ...llmapi.tokenizer import TokenizerWrapper
from ..attention_backend.interface import FP8_KV_DTYPES
from ..attention_backend.resolver import create_backend
from ..models import load_target_model
from ..modules.compiled_regions import LayerRegions
from .kv_cache.kv_cache_spec import KVCacheSpec, kv_dtype_from_name, split_budget
from ..runtime.device import is_device_fault, resolve_device, resolve_dtype
from .model_engine import ModelEngine
from .py_executor import PyExecutor
from .kv_cache.resource_manager import KVCacheManager
from ..runtime.sampler import Sampler
from .scheduler import Scheduler

logger = logging.getLogger("tensorrt_llm")

@dataclass
class ExecutorBundle:
    executor: PyExecutor
    kv: KVCacheManager
    model: torch.nn.Module
    max_seq_len: int
    device: torch.device
    dtype: torch.dtype
    report: dict[str, Any]


def _budget_bytes(args: TorchLlmArgs, device: torch.device) -> int:
    kvc = args.kv_cache_config
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * kvc.free_gpu_memory_fraction)
    return kvc.cpu_kv_budget_bytes


def create_py_executor(args: TorchLlmArgs, tokenizer: TokenizerWrapper) -> ExecutorBundle:
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    from ..models.checkpoint import read_config
    model_max = int(read_config(args.model).get("max_position_embeddings", 2048))
    max_seq_len = args.max_seq_len or model_max
    if max_seq_len > model_max:
        raise ValueError(f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings {model_max}")
    model = load_target_model(args.model, dtype, device, max_positions=max_seq_len + 64)
    tcc = args.torch_compile_config
    if tcc is not None and tcc.enable_inductor:
        model.use_regions(LayerRegions.inductor())
    cfg = model.config
    kvc = args.kv_cache_config
    kv_dtype = kv_dtype_from_name(kvc.dtype, dtype)
    backend, res = create_backend(args.attn_backend, device, dtype, mla=False,
                                  fp8_kv=kv_dtype in FP8_KV_DTYPES)
    n_layers, n_kv, head_dim = model.kv_cache_layout()
    specs = [KVCacheSpec("target", "gqa", n_layers, 2, n_kv, head_dim, kv_dtype)]
    drafter, drafter_report = None, None
    salt = f"target:{Path(args.model).resolve()}"
    if args.speculative_config is not None:
        from ..speculative.dspark_worker import create_dspark_worker
        drafter = create_dspark_worker(args.speculative_config, model, dtype, device)
        from ..models.dspark_regions import DrafterRegions
        # on CUDA the greedy Markov chain and the GQA draft context write in Triton
        # (`dspark_markov_kernel`, `dspark_context_kernel`)
        cuda = device.type == "cuda"
        if tcc is not None and tcc.enable_inductor:
            drafter.drafter.use_regions(DrafterRegions.inductor(triton_chain=cuda, triton_context=cuda))
        elif cuda and drafter.drafter.regions is not None:
            drafter.drafter.use_regions(DrafterRegions.eager(triton_chain=True, triton_context=True))
        specs.append(drafter.kv_cache_spec)
        salt += f"|draft:{drafter.identity}"
    p = kvc.tokens_per_block
    if kvc.max_tokens is not None:
        num_pages = -(-kvc.max_tokens // p)
    else:
        num_pages = split_budget(_budget_bytes(args, device), specs, p)
    lookahead = drafter.lookahead_tokens if drafter else 0
    tokens_per_gen = 1 + (drafter.max_draft_len if drafter else 0)
    spec_slack = lookahead + tokens_per_gen if drafter else 0
    kv = KVCacheManager(specs, num_pages, p, max_seq_len, device,
                        enable_block_reuse=kvc.enable_block_reuse,
                        cache_salt=hashlib.sha256(salt.encode()).hexdigest()[:16], seq_slack_tokens=spec_slack)
    capture = drafter.capture_layer_ids if drafter else ()
    engine = ModelEngine(model, kv, backend, device, capture, use_cuda_graph=args.use_cuda_graph,
                         max_batch_size=args.max_batch_size, tokens_per_gen=tokens_per_gen,
                         max_num_tokens=args.max_num_tokens, verify_widths=drafter.verify_widths if drafter else ())
    sched = Scheduler(kv, args.max_batch_size, max(args.max_num_tokens, tokens_per_gen),
                      args.enable_chunked_prefill, tokens_per_gen, spec_slack=spec_slack,
                      batch_wait_timeout_iters=args.batch_wait_timeout_iters,
                      batch_wait_max_tokens_ratio=args.batch_wait_max_tokens_ratio,
                      batch_admit_min_slots=args.batch_admit_min_slots)
    sampler = Sampler(args.seed, device)
    if drafter is not None:
        drafter.bind(kv, sampler)
        drafter.enable_device_drafts(args.max_batch_size, cuda_graphs=args.use_cuda_graph)
        if engine.packed is not None and drafter.writes_forward_context:
            engine.packed.context = drafter     # prompt steps' draft context inside the packed graph
        one_graph = _enable_spec_step(engine, drafter, args.max_batch_size, args.max_num_tokens,
                                      overlap=not args.disable_overlap_scheduler)
        drafter_report = drafter.describe()
    executor = PyExecutor(engine, sched, sampler, kv, tokenizer.decode, drafter,
                          overlap=not args.disable_overlap_scheduler, step_timeout_s=args.step_timeout_s)
    report = kv.report()
    report["overlap_scheduler"] = _overlap_report(args, executor, backend, drafter)
    if args.use_cuda_graph:
        report["cuda_graphs"] = _capture_graphs(engine, drafter, executor.spec_overlap, dtype)
    if drafter is not None:
        if one_graph["enabled"] and engine.spec_step is None:
            one_graph = {"enabled": False, "reason": "its capture failed at startup (logged)"}
        report["one_graph_step"] = one_graph
        report["drafter_regions"] = drafter.drafter.regions_summary()
    report.update({
        "device": str(device), "dtype": str(dtype).replace("torch.", ""), "max_seq_len": max_seq_len,
        "layer_regions": "inductor" if tcc is not None and tcc.enable_inductor else "eager",
        "attention_backend": {"target": {"name": res.name, "reason": res.reason}},
        "model": {"architecture": cfg.architecture, "layers": cfg.num_hidden_layers,
                  "hidden": cfg.hidden_size, "vocab": cfg.vocab_size},
    })
    if drafter_report:
        report["attention_backend"]["draft"] = drafter_report.pop("attention_backend")
        report["drafter"] = drafter_report
    _log_capacity(report)
    return ExecutorBundle(executor, kv, model, max_seq_len, device, dtype, report)


def _enable_spec_step(engine: ModelEngine, drafter, max_batch_size: int, max_num_tokens: int,
                      overlap: bool) -> dict[str, Any]:
    """With a device draft step, steady-state DSpark steps run verify -> accept -> draft as one
    graph (`SpecStepGraph`), composed with the target's graph runner, and so do such steps with
    arriving prompts (`MixedSpecGraph`) where the target backend takes ragged queries on the device
    and steps overlap (overlap: the overlap scheduler is on; only an overlapped step continues
    running requests beside arriving prompts, so without it those graphs are not built); on the CPU
    (no CUDA graphs) the same steps run directly, the reference path. Returns the capacity report's
    entry."""
    from .cuda_graph_runner import CUDAGraphRunner
    from .mixed_step_graph import MixedSpecGraph
    from .spec_step_graph import SpecStepGraph
    if drafter.graph_runner is None:
        return {"enabled": False, "reason": f"the device draft step is off ({drafter.graph_backend})"}
    target = engine.graph_runner
    if target is None and engine.device.type == "cuda":
        return {"enabled": False, "reason": "use_cuda_graph is off (on CUDA the step is one captured graph)"}
    if target is None:
        target = CUDAGraphRunner(engine.model, engine.kv, engine.backend, engine.kv_caches, engine.device,
                                 max_batch_size, token_counts=drafter.verify_widths,
                                 capture_layer_ids=engine.capture_layer_ids, capture=False)
    engine.spec_step = SpecStepGraph(target, drafter.graph_runner)
    how = "one CUDA graph" if target.graphs.capture else "one step run directly (the CPU reference path)"
    prompts = "arriving prompts run beside it (the drafter does not write context in the target forward)"
    if not overlap:
        prompts = "arriving prompts run in steps of their own (the overlap scheduler is off)"
    elif drafter.writes_forward_context:
        try:
            engine.mixed_step = MixedSpecGraph(engine.spec_step, drafter, max_num_tokens)
            prompts = "arriving greedy prompts ride in its forward"
        except ValueError as e:
            prompts = f"arriving prompts run beside it ({e})"
    return {"enabled": True, "reason": f"greedy generation steps: verify, acceptance and draft step as {how}",
            "prompts": prompts}


def _capture_graphs(engine: ModelEngine, drafter, continued: bool, dtype: torch.dtype) -> dict[str, Any]:
    """Capture every CUDA graph a step may replay before the first request (a capture takes tens of
    milliseconds, and a new batch size or token bucket would otherwise stall every running request
    for it); continued: the entries of overlapped DSpark steps too. The capacity report's entry.
    A capture the runtime refuses here is logged and reported; the graphs not captured yet are then
    captured at their first step, as without a startup capture (a device fault is raised)."""
    t0, n, error = time.perf_counter(), 0, None
    try:
        if drafter is not None and drafter.graph_runner is not None:
            n += drafter.graph_runner.capture_all(dtype)
        n += engine.capture_graphs(continued)
    except (RuntimeError, ValueError) as e:
        if is_device_fault(e):
            raise
        error = f"{type(e).__name__}: {e}"
        logger.error("capturing CUDA graphs at startup failed after %d (%s); the rest are captured at their "
                     "first step", n, error)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    out: dict[str, Any] = {"captured_at_startup": n, "seconds": round(time.perf_counter() - t0, 2)}
    if error is not None:
        out["error"] = error
    return out


def _overlap_report(args: TorchLlmArgs, executor: PyExecutor, backend, drafter) -> dict[str, Any]:
    """Whether steps overlap (the next step launched before this one is read), and why not."""
    if args.disable_overlap_scheduler:
        return {"enabled": False, "reason": "disable_overlap_scheduler: true"}
    if drafter is None:
        return {"enabled": executor.overlap, "reason": "non-speculative steps"}
    if executor.spec_overlap:
        return {"enabled": True, "reason": "verify steps continue from the device rows of the step in flight"}
    if not drafter.drafts_on_device:
        why = f"the device draft step is off ({drafter.describe().get('device_draft_backend')})"
    else:
        why = (f"target attention backend {backend.name} plans on the host; TRITON (GPU) or VANILLA read "
               "KV lengths on the device")
    logger.warning("DSpark steps do not overlap: %s", why)
    return {"enabled": False, "reason": why}


def _log_capacity(report: dict[str, Any]) -> None:
    lines = [f"KV capacity: {report['max_tokens']} tokens/pool, {report['num_pages']} pages x "
             f"{report['tokens_per_block']} tokens, {report['bytes_per_token_total']} B/token total"]
    for name, pool in report["pools"].items():
        lines.append(f"  {name}: {pool['shape_str']}  {pool['bytes_per_token']} B/token")
    for role, b in report["attention_backend"].items():
        lines.append(f"  attention[{role}]: {b['name']} ({b['reason']})")
    ov = report["overlap_scheduler"]
    lines.append(f"  overlap scheduler: {'on' if ov['enabled'] else 'off'} ({ov['reason']})")
    logger.info("\n".join(lines))
