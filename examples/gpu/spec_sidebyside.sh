#!/usr/bin/env bash
# DSpark, old tree vs this checkout, one H200, back to back. After the h200.sh stages model_a, install,
# drafter B=gqa, drafter B=mla; carry .device_carry/model_b (+ the old tree, a `git archive` of its
# tensorrt_llm/ in .device_carry/model_b/old_tree):
#   TESTS=1 BENCH=0 bash examples/gpu/spec_sidebyside.sh   # GPU tests of this checkout (graphs, drafts)
#   ARMS="gqa mla" ORDER="old new" bash examples/gpu/spec_sidebyside.sh   # MT-Bench bench per arm and tree
export PYTHONPATH=/tmp/site CUDA_HOME=/usr/local/cuda MAX_JOBS=16 FLASHINFER_WORKSPACE_BASE=/tmp/fiws PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
M=$HOME/.cache/tensorrt_llm/models/smollm2-135m-instruct; T0=$(date +%s); NEW=$PWD
if [[ ! -f $M/config.json ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device_carry/model_b/gguf-*.whl 2>/dev/null
  cat /tmp/persist/gguf_part_00 .device_carry/model_b/gguf_part_01 > /tmp/model.gguf
  PYTHONPATH=/tmp/site:$NEW python3 -m tensorrt_llm.tools.convert_gguf /tmp/model.gguf $M 2>&1 | tail -1
  mkdir -p /tmp/persist/ds/wheels && cp .device_carry/model_b/*.whl /tmp/persist/ds/wheels/
fi
[[ -d .device_carry/model_b/old_tree ]] && rm -rf /tmp/old_tree && cp -r .device_carry/model_b/old_tree /tmp/old_tree
mkdir -p /tmp/yaml; printf "attn_backend: FLASHINFER\nuse_cuda_graph: true\nkv_cache_config: {max_tokens: 262144}\n" > /tmp/yaml/fi.yaml
for d in gqa mla; do cp /tmp/yaml/fi.yaml /tmp/yaml/$d.yaml; printf "speculative_config: {decoding_type: DSpark, speculative_model: /tmp/persist/drafters/smollm2-135m-dspark-$d}\n" >> /tmp/yaml/$d.yaml; done
if [[ "${TESTS:-0}" == 1 ]]; then
  PYTHONPATH=/tmp/site:$NEW timeout ${TEST_S:-400} python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
    tests/unittest/_torch/speculative tests/unittest/_torch/pyexecutor 2>&1 | tail -15 | tee $OUT/pytest_gpu.log
  echo "[tests +$(( $(date +%s)-T0 ))s]"
fi
[[ "${BENCH:-1}" == 1 ]] || exit 0
for arm in ${ARMS:-gqa mla}; do for v in ${ORDER:-old new}; do
  [[ $v == old ]] && cd /tmp/old_tree || cd $NEW
  PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m tensorrt_llm.bench.benchmark --model $M --dataset mtbench --ignore-eos \
    --dataset-cache-dir /tmp/persist/ds --num-requests 80 --extra-llm-api-options /tmp/yaml/$arm.yaml --concurrency 1 16 64 \
    --waves 2 --max-tokens 256 --json $OUT/bench_${arm}_$v.json 2>&1 | grep "^|" | tail -3 | sed "s/^/$v /"
  echo "[$arm $v +$(( $(date +%s)-T0 ))s]"
done; done
