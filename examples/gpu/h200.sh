#!/usr/bin/env bash
# H200 runs of this repo, one stage per device call (the device keeps /tmp between back-to-back
# calls; training runs detached between them).
# Current layout (examples/gpu/prepare_carry.sh builds carry/p1..pN here and prints the call plan; the
# tracked drafter weights must be parked first, the tree alone is over a call's 64 MiB):
#   setup      : one carry part per call, back to back: run(command="bash examples/gpu/h200.sh setup", carry=["carry/pK"])
#                (= `. examples/gpu/device_setup.sh`: wheels -> /tmp/site, target -> /tmp/models, drafters,
#                MT-Bench prompts -> /tmp/carry); every later stage sources it again (idempotent), so M is
#                /tmp/models/smollm2-135m-instruct once the target is fetched
#   sidebyside : HF / no-spec / DSpark-GQA / DSpark-MLA in one process, 3 rotated rounds, C = 1 16 64
#                (examples/gpu/sidebyside.py; SBS="--rounds 0 --anchor" for the warm-up call, then no SBS)
# Older stages, older carried inputs (git-ignored; nothing builds these any more, kept for the training runs):
#   .whl_gpu             flashinfer + pydantic wheels, prebuilt flashinfer kernels (aot/*.so)
#   .device_carry/model_a  first part of the SmolLM2 GGUF
#   .device_carry/model_b  second GGUF part, gguf wheel, eval prompts, ShareGPT prompts (.json.gz),
#                          MT-Bench wheel
# Stages:
#   model_a : first GGUF part -> /tmp/persist
#   drafter : B=gqa|mla: .device_carry/drafter_$B (a drafter folder; the tracked weights make the tree
#             too big to carry, so move them there first) -> /tmp/persist/drafters/smollm2-135m-dspark-$B
#   install : wheels -> /tmp/site (+ prebuilt kernels from .whl_gpu/aot/*.so if present)
#   train   : GGUF -> HF folder; starts examples/dspark/train_on_h200.sh detached (regeneration on
#             both GPUs, probe, GQA + MLA training side by side); returns at once. INIT=1 continues
#             from the drafters of the `drafter` stage (train.init_from), INIT=DIR from an earlier
#             run's output (e.g. INIT=/tmp/runs RUNS=/tmp/runs2); TRAIN_MIN sets the box;
#             SKIP=N skips the first N prompts (fresh ones for a continued run); STEPS=N fixes the
#             step count (no probe); GEN_BATCH=N requests in flight per regeneration shard;
#             GEN_PROCS=N regeneration processes per GPU; SETS="k=v ..." more config overrides (e.g. "train.kd_weight=0.5 data.temperature=0.7")
#   wait    : progress of the detached training after up to W seconds (keeps the machine warm;
#             returns early once training is done); TESTS=1 also runs the
#             GPU tests meanwhile (they JIT-compile the flashinfer kernels into /tmp/fiws)
#   eval    : waits for training; AL tables (T=0 all sets, T=0.7 first 40) on GPU 0 while the HF
#             transformers arm runs on GPU 1; returns the MLA drafter. AL_REJ=torch verifies T=0.7
#             without flashinfer's sampling kernel (its first-use JIT took > 170 s on one H200)
#   compare : waits for training; paired AL of the `drafter` stage's drafters (arms gqa0/mla0) and the
#             new ones (gqa/mla): T=0 on GPU 0, T=0.7 (first 40, AL_REJ rejection sampler, default
#             torch; batched also avoids flashinfer's JIT) on GPU 1; tables
#   fetch   : B=gqa|mla: returns that trained drafter (tar parts)
#   bench   : throughput table (no-spec FLASHINFER+graphs, DSpark MLA / GQA, VANILLA); T>0
#             verification per step (torch vs batched rejection sampler); extras;
#             EXTRA_YAML="key: value\n..." is appended to the three FLASHINFER arms' args; returns the
#             GQA drafter
set -uo pipefail
STAGE=$1
[[ -f examples/gpu/device_setup.sh ]] && . examples/gpu/device_setup.sh   # no-op where /tmp already has it all
export PYTHONPATH=/tmp/site:$PWD CUDA_HOME=/usr/local/cuda MAX_JOBS=16 FLASHINFER_WORKSPACE_BASE=/tmp/fiws
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
[[ -f ${M:-}/config.json ]] || M=$HOME/.cache/tensorrt_llm/models/smollm2-135m-instruct; RUNS=${RUNS:-/tmp/runs} T0=$(date +%s)
stamp() { echo "[h200 $STAGE +$(( $(date +%s) - T0 ))s] $*"; }
split_out() {  # split_out FILE PREFIX : parts < 16 MB into $OUT
  split -b 15000000 -d "$1" "$OUT/$2"; ls -la "$OUT" | grep "$2"; }
return_drafter() {  # return_drafter gqa|mla : the trained drafter folder as tar parts in $OUT
  (cd $RUNS/$1/drafter && tar cf /tmp/$1.tar .) && split_out /tmp/$1.tar $1_tar_; }
progress() {
  tail -n 4 /tmp/train_all.log 2>/dev/null
  for f in $RUNS/data/data*.log; do [[ -f $f ]] && tail -n 1 "$f"; done
  for b in gqa mla; do [[ -f $RUNS/$b/train.log ]] && tail -c 300 $RUNS/$b/train.log | tr '\r' '\n' | tail -n 2; done
  nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader; }
case "$STAGE" in
setup) ;;   # device_setup.sh ran above
sidebyside)
  timeout 590 python3 examples/gpu/sidebyside.py --out $OUT ${SBS:-} ;;
install)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_gpu/*.whl || exit 1
  for so in .whl_gpu/aot/*.so; do n=$(basename "$so" .so); mkdir -p /tmp/site/flashinfer/data/aot/$n; cp "$so" /tmp/site/flashinfer/data/aot/$n/; done
  python3 -c "import torch, pydantic, flashinfer; print(torch.__version__, pydantic.__version__, flashinfer.__version__, torch.cuda.device_count(), torch.cuda.get_device_name())" ;;
model_a)
  mkdir -p /tmp/persist && cp .device_carry/model_a/gguf_part_00 /tmp/persist/ && ls -la /tmp/persist ;;
drafter)
  D=/tmp/persist/drafters/smollm2-135m-dspark-${B:?B=gqa or mla}
  mkdir -p $D && cp .device_carry/drafter_$B/* $D/ && ls -la $D ;;
train)  # carries .device_carry/model_b on the first run of a machine; later runs reuse what it left
  if [[ ! -f $M/config.json ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device_carry/model_b/gguf-*.whl || exit 1
    cat /tmp/persist/gguf_part_00 .device_carry/model_b/gguf_part_01 > /tmp/model.gguf
    sha256sum /tmp/model.gguf
    python3 -m tensorrt_llm.tools.convert_gguf /tmp/model.gguf $M 2>&1 | tail -2
    mkdir -p /tmp/persist/ds/wheels && cp .device_carry/model_b/eval_prompts.json .device_carry/model_b/prompts.json.gz /tmp/persist/
    cp .device_carry/model_b/*.whl /tmp/persist/ds/wheels/
  fi
  INIT_SRC=${INIT:-}; [[ "$INIT_SRC" == 1 ]] && INIT_SRC=/tmp/persist/drafters/smollm2-135m-dspark-
  rm -rf /tmp/repo && mkdir -p /tmp/repo && cp -r tensorrt_llm examples /tmp/repo/   # frozen copy for the detached run
  cd /tmp/repo && PYTHONPATH=/tmp/site:/tmp/repo setsid nohup bash examples/dspark/train_on_h200.sh --model $M \
    --prompts /tmp/persist/prompts.json.gz --out $RUNS --minutes ${TRAIN_MIN:-8} --gen-minutes ${GEN_MIN:-3} \
    --num-prompts ${NUM_PROMPTS:-40000} --skip-prompts ${SKIP:-0} ${INIT:+--init-from $INIT_SRC} ${STEPS:+--steps $STEPS} ${GEN_PROCS:+--procs-per-gpu $GEN_PROCS} \
    -- --set data.attn_backend=FLASHINFER --set data.use_cuda_graph=true ${GEN_BATCH:+--set data.gen_batch=$GEN_BATCH} \
    $(for kv in ${SETS:-}; do printf -- '--set %s ' "$kv"; done) \
    > /tmp/train_all.log 2>&1 < /dev/null &
  sleep 20; progress ;;
wait)
  if [[ "${TESTS:-0}" == 1 ]]; then
    timeout ${TEST_S:-400} python3 -m pytest -q -m gpu -p no:cacheprovider tests/unittest -rs 2>&1 | tail -30 | tee $OUT/pytest_gpu.log
    stamp "tests"
  fi
  for i in $(seq 1 ${W:-1}); do [[ -f $RUNS/DONE ]] && break; sleep 1; done   # returns as soon as training ends
  progress ;;
bench)
  B="python3 -m tensorrt_llm.bench.benchmark --model $M --dataset mtbench --ignore-eos --dataset-cache-dir /tmp/persist/ds --num-requests 80"
  mkdir -p /tmp/yaml
  printf "attn_backend: VANILLA\nkv_cache_config: {max_tokens: 65536}\n" > /tmp/yaml/vanilla.yaml
  printf "attn_backend: FLASHINFER\nuse_cuda_graph: true\nkv_cache_config: {max_tokens: 262144}\n" > /tmp/yaml/fi.yaml
  for d in gqa mla; do printf "attn_backend: FLASHINFER\nuse_cuda_graph: true\nkv_cache_config: {max_tokens: 262144}\nspeculative_config: {decoding_type: DSpark, speculative_model: $RUNS/$d/drafter}\n" > /tmp/yaml/$d.yaml; done
  for arm in fi mla gqa; do printf "%b" "${EXTRA_YAML:-}" >> /tmp/yaml/$arm.yaml; done   # e.g. "batch_wait_timeout_iters: 4\n"
  for arm in fi mla gqa; do
    timeout 110 $B --extra-llm-api-options /tmp/yaml/$arm.yaml --concurrency 1 16 64 --waves 2 --max-tokens 256 --json $OUT/bench_$arm.json 2>&1 | grep "^|" | tail -4
    stamp "$arm"
  done
  timeout 60 $B --extra-llm-api-options /tmp/yaml/vanilla.yaml --waves 1 --max-tokens 128 --concurrency 1 64 --json $OUT/bench_vanilla.json 2>&1 | grep "^|" | tail -3
  stamp "vanilla"
  timeout 90 python3 -m tensorrt_llm.bench.verify_bench --samplers torch batched --iters 20 --json $OUT/verify_bench.json 2>&1 | tail -8
  stamp "verify_bench"
  timeout 100 python3 examples/gpu/h200_extras.py --model $M --gqa $RUNS/gqa/drafter --mla $RUNS/mla/drafter --json $OUT/extras.json 2>&1 | tail -50
  stamp "extras"
  return_drafter gqa
  stamp "bench done" ;;
eval)
  for i in $(seq 1 ${WAIT_S:-600}); do [[ -f $RUNS/DONE ]] && break; sleep 1; done
  progress; cat /tmp/train_all.log | grep -v "^\[" | tail -8 | tee $OUT/train_summary.log
  for b in gqa mla; do cp $RUNS/$b/training_log.json $OUT/${b}_training_log.json; done
  cp $RUNS/steps.txt $RUNS/data/regen.shard0.meta.json $OUT/ 2>/dev/null
  mkdir -p /tmp/yaml && printf "attn_backend: FLASHINFER\nuse_cuda_graph: true\nkv_cache_config: {max_tokens: 262144}\n" > /tmp/yaml/fi.yaml
  # HF transformers arm on GPU 1 (static cache + its torch.compile) while GPU 0 measures AL; HF_S=0 skips it
  [[ ${HF_S:-420} -gt 0 ]] && CUDA_VISIBLE_DEVICES=1 timeout ${HF_S:-420} python3 -m tensorrt_llm.bench.benchmark --model $M --dataset mtbench --ignore-eos \
    --dataset-cache-dir /tmp/persist/ds --num-requests 64 --extra-llm-api-options /tmp/yaml/fi.yaml --waves 1 --max-tokens 256 \
    --concurrency 1 16 64 --hf-baseline --hf-static-cache --json $OUT/bench_hf.json > /tmp/hf.log 2>&1 &
  HF=$!
  AL="python3 -m tensorrt_llm.bench.eval_acceptance --model $M --drafter gqa=$RUNS/gqa/drafter --drafter mla=$RUNS/mla/drafter
    --prompts-file /tmp/persist/eval_prompts.json --concurrency 64 --cuda-graph --attn-backend FLASHINFER --kv-max-tokens 262144
"
  CUDA_VISIBLE_DEVICES=0 timeout ${AL_S:-300} $AL --temperature 0 --max-tokens 256 --json $OUT/eval_al_t0.json 2>&1 | grep -v "^\[" | tail -14
  stamp "AL T=0 done"
  [[ ${AL7_S:-150} -gt 0 ]] && CUDA_VISIBLE_DEVICES=0 timeout ${AL7_S:-150} $AL --temperature 0.7 --limit 40 --max-tokens 128 --json $OUT/eval_al_t07.json 2>&1 | grep -v "^\[" | tail -14
  stamp "AL T=0.7 done"
  wait $HF; grep "^|" /tmp/hf.log 2>/dev/null | tail -8; tail -n 3 /tmp/hf.log 2>/dev/null
  stamp "hf"
  return_drafter mla
  stamp "eval done" ;;
compare)  # waits for training; AL of the `drafter` stage's drafters (gqa0/mla0) against the new ones
  # (gqa/mla), paired: T=0 on GPU 0 while T=0.7 (first 40, torch rejection sampler) runs on GPU 1
  for i in $(seq 1 ${WAIT_S:-600}); do [[ -f $RUNS/DONE ]] && break; sleep 1; done
  progress; grep -v "^\[" /tmp/train_all.log | tail -8 | tee $OUT/train_summary.log
  for b in gqa mla; do cp $RUNS/$b/training_log.json $OUT/${b}_training_log.json; done
  cat $RUNS/data/regen.shard*.meta.json > $OUT/regen_meta.json 2>/dev/null
  P=/tmp/persist/drafters/smollm2-135m-dspark-
  AL="python3 -m tensorrt_llm.bench.eval_acceptance --model $M --drafter gqa0=${BASE_GQA:-${P}gqa} --drafter mla0=${BASE_MLA:-${P}mla}
    --drafter gqa=$RUNS/gqa/drafter --drafter mla=$RUNS/mla/drafter --prompts-file /tmp/persist/eval_prompts.json
    --concurrency 64 --cuda-graph --attn-backend FLASHINFER --kv-max-tokens 262144 --rejection-sampler ${AL_REJ:-torch}"
  CUDA_VISIBLE_DEVICES=1 timeout ${AL7_S:-300} $AL --temperature 0.7 --limit 40 --max-tokens 128 --json $OUT/eval_al_t07.json > /tmp/al7.log 2>&1 &
  A7=$!
  CUDA_VISIBLE_DEVICES=0 timeout ${AL_S:-300} $AL --temperature 0 --max-tokens 256 --json $OUT/eval_al_t0.json 2>&1 | grep -v "^\[" | tail -3
  stamp "AL T=0 done"
  wait $A7; grep -v "^\[" /tmp/al7.log | tail -3
  stamp "AL T=0.7 done"
  for t in t0 t07; do
    [[ -f $OUT/eval_al_$t.json ]] && python3 -m tensorrt_llm.bench.eval_acceptance --report $OUT/eval_al_$t.json \
      --pair mla-gqa --pair gqa-gqa0 --pair mla-mla0 2>&1 | grep -v "^\[" | tee $OUT/eval_al_$t.md
  done
  [[ -f $OUT/eval_al_t0.json ]] && python3 -m tensorrt_llm.bench.eval_acceptance --report $OUT/eval_al_t0.json \
    --by-category --pair mla-gqa --pair gqa-gqa0 2>&1 | grep -v "^\[" > $OUT/eval_al_t0_by_category.md
  stamp "compare done" ;;
fetch)  # B=gqa|mla: the trained drafter folder as tar parts in $OUT
  return_drafter ${B:?B=gqa or mla} ;;
*) echo "unknown stage $STAGE"; exit 2 ;;
esac
stamp "end"
