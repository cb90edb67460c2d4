"""Where a DSpark training step spends its time, per variant (GPU benchmark; prints JSON lines).

    python examples/gpu/train_profile.py --out $OUT/train_profile.jsonl

Random SmolLM2-135M-shaped target and synthetic sequences (prompt 30..256, answer 100..384
tokens, like the regenerated ShareGPT data): step time does not depend on the weights. Each
variant: 3 warm-up steps, then `--steps` timed steps end to end, then one step with a sync
after each phase (capture / forward+loss / backward / optimizer).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from tensorrt_llm._torch.models.modeling_llama import LlamaConfig, LlamaForCausalLM
from tensorrt_llm.tools.dspark_capture import TargetCapture
from tensorrt_llm.tools.dspark_train_config import DSparkTrainConfig
from tensorrt_llm.tools.dspark_train_forward import sample_anchors
from tensorrt_llm.tools.train_dspark import build_drafter, make_batch, run_blocks

SMOLLM2 = dict(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               rms_norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None, max_position_embeddings=8192,
               tie_word_embeddings=True, attention_bias=False, bos_token_id=1, eos_token_id=2)


def synthetic_rows(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        p, o = int(torch.randint(30, 257, (1,), generator=g)), int(torch.randint(100, 385, (1,), generator=g))
        ids = torch.randint(17, 49152, (p + o,), generator=g).tolist()
        rows.append({"prompt_ids": ids[:p], "output_ids": ids[p:]})
    return rows


def sync() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def run_variant(target, backbone: str, capture_mode: str, batch: int, anchors: int, steps: int,
                compile_fwd: bool, kd_weight: float = 0.0) -> dict:
    cfg = DSparkTrainConfig(target="(random)", backbone=backbone, output_dir="/tmp/train_profile")
    drafter = build_drafter(cfg, target.config).to(target.lm_head.weight.device)
    drafter.bind_target(target.model.embed_tokens, target.lm_head)
    capture = TargetCapture(target, drafter.config.target_layer_ids, capture_mode)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4, betas=(0.9, 0.95))
    rows = synthetic_rows(batch * (steps + 4), seed=1)
    gen = torch.Generator().manual_seed(0)
    step_fn = run_blocks
    if compile_fwd:
        step_fn = torch.compile(run_blocks, dynamic=True)

    def one(i: int, phases: dict | None):
        picked = rows[i * batch:(i + 1) * batch]
        anc = [sample_anchors(len(r["prompt_ids"]), len(r["prompt_ids"]) + len(r["output_ids"]), anchors, gen)
               for r in picked]
        t0 = sync() if phases is not None else 0.0
        b = make_batch(picked, capture, anc, final=kd_weight > 0)
        t1 = sync() if phases is not None else 0.0
        with torch.autocast(drafter.fc.weight.device.type, dtype=torch.bfloat16):
            loss, *_ = step_fn(drafter, b, 4.0, kd_weight)
        t2 = sync() if phases is not None else 0.0
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t3 = sync() if phases is not None else 0.0
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        float(loss.detach())
        if phases is not None:
            t4 = sync()
            for k, v in (("capture", t1 - t0), ("fwd_loss", t2 - t1), ("backward", t3 - t2), ("opt", t4 - t3)):
                phases[k] = round(1e3 * v, 2)

    c0 = time.perf_counter()
    for i in range(3):
        one(i, None)
    warm_s = time.perf_counter() - c0
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = sync()
    for i in range(3, 3 + steps):
        one(i, None)
    step_ms = 1e3 * (sync() - t0) / steps
    phases: dict = {}
    one(3 + steps, phases)
    blocks = batch * anchors
    return {"backbone": backbone, "capture": capture_mode, "batch": batch, "anchors": anchors,
            "compile": compile_fwd, "kd_weight": kd_weight, "step_ms": round(step_ms, 2), "blocks_per_s": round(blocks / step_ms * 1e3),
            "seqs_per_s": round(batch / step_ms * 1e3, 1), "warmup_s": round(warm_s, 1),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2 ** 30, 1) if torch.cuda.is_available() else None, "phases_ms": phases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variants", default="gqa:paged:32:64,gqa:dense:32:64,gqa:dense:32:128,gqa:dense:32:256,"
                    "gqa:dense:64:128,mla:dense:32:64,mla:dense:32:256,gqa:dense:32:128:compile,"
                    "mla:dense:32:128:compile",
                    help="backbone:capture:batch:anchors[:compile][:kd<weight>], comma-separated "
                    "(e.g. mla:dense:32:64:kd0.5 distils with train.kd_weight 0.5)")
    args = ap.parse_args()
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to(args.device, torch.bfloat16).eval().requires_grad_(False)
    target.fuse_projections()
    with open(args.out, "w") as f:
        for spec in args.variants.split(","):
            parts = spec.split(":")
            kd = [float(p[2:]) for p in parts[4:] if p.startswith("kd")]
            try:
                rec = run_variant(target, parts[0], parts[1], int(parts[2]), int(parts[3]), args.steps,
                                  "compile" in parts[4:], kd[0] if kd else 0.0)
            except Exception as e:                                  # a failed variant must not end the run
                rec = {"variant": spec, "error": f"{type(e).__name__}: {e}"[:500]}
            print(json.dumps(rec), flush=True)
            f.write(json.dumps(rec) + "\n")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
