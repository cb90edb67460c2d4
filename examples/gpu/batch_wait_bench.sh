#!/usr/bin/env bash
# Serving throughput with and without batch waiting (`batch_wait_timeout_iters`), one H200, after the
# h200.sh stages model_a, install, drafter B=gqa, drafter B=mla (carry .device_carry/model_b here):
#   ARMS="fi:0 fi:8 gqa:0 gqa:8 mla:0 mla:8" WAVES=4 bash examples/gpu/batch_wait_bench.sh
# ARM:N = the no-spec (fi) or DSpark (gqa / mla) FLASHINFER + graphs args, plus batch_wait_timeout_iters N
# (0: not set). MT-Bench first turns, --ignore-eos, 256 new tokens, C = 16 and 64, WAVES x C requests.
export PYTHONPATH=/tmp/site:$PWD CUDA_HOME=/usr/local/cuda MAX_JOBS=16 FLASHINFER_WORKSPACE_BASE=/tmp/fiws PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
M=$HOME/.cache/tensorrt_llm/models/smollm2-135m-instruct; T0=$(date +%s)
[[ -f $M/config.json ]] || { python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device_carry/model_b/gguf-*.whl 2>/dev/null
cat /tmp/persist/gguf_part_00 .device_carry/model_b/gguf_part_01 > /tmp/model.gguf
python3 -m tensorrt_llm.tools.convert_gguf /tmp/model.gguf $M 2>&1 | tail -1; }
mkdir -p /tmp/persist/ds/wheels && cp .device_carry/model_b/eval_prompts.json /tmp/persist/ && cp .device_carry/model_b/*.whl /tmp/persist/ds/wheels/
mkdir -p /tmp/yaml; printf "attn_backend: FLASHINFER\nuse_cuda_graph: true\nkv_cache_config: {max_tokens: 262144}\n" > /tmp/yaml/fi.yaml
for d in gqa mla; do cp /tmp/yaml/fi.yaml /tmp/yaml/$d.yaml; printf "speculative_config: {decoding_type: DSpark, speculative_model: /tmp/persist/drafters/smollm2-135m-dspark-$d}\n" >> /tmp/yaml/$d.yaml; done
B="python3 -m tensorrt_llm.bench.benchmark --model $M --dataset mtbench --ignore-eos --dataset-cache-dir /tmp/persist/ds --num-requests 80"
for cfg in ${ARMS:-fi:0 fi:8 gqa:0 gqa:8 mla:0 mla:8}; do set -- ${cfg/:/ }; cp /tmp/yaml/$1.yaml /tmp/yaml/x.yaml; [[ $2 != 0 ]] && echo "batch_wait_timeout_iters: $2" >> /tmp/yaml/x.yaml
  timeout 200 $B --extra-llm-api-options /tmp/yaml/x.yaml --concurrency 16 64 --waves ${WAVES:-4} --max-tokens 256 --json $OUT/bw_$1_$2.json > /tmp/bw_$1_$2.log 2>&1; grep "^|" /tmp/bw_$1_$2.log | tail -2 | tee -a $OUT/bw_summary.log; echo "[$1 wait $2 +$(( $(date +%s)-T0 ))s]"; done
