#!/usr/bin/env bash
# Serving throughput with and without batch waiting (`batch_wait_timeout_iters`), one H200, after
# device_setup.sh in the same call (it stages the model, the drafters and the MT-Bench wheel cache):
#   run(command=". examples/gpu/device_setup.sh && ARMS='fi:0 fi:8 gqa:0 gqa:8' WAVES=4 bash examples/gpu/batch_wait_bench.sh", carry=[])
# ARM:N = the no-spec (fi) or DSpark (gqa / mla) FLASHINFER + graphs args, plus batch_wait_timeout_iters N
# (0: not set). MT-Bench first turns, --ignore-eos, 256 new tokens, C = 16 and 64, WAVES x C requests.
# (examples/gpu/sidebyside.py --extra-yaml 'batch_wait_timeout_iters: 8' runs all arms so, in one process.)
set -uo pipefail
: "${M:?source examples/gpu/device_setup.sh first (same call)}"
T0=$(date +%s)
mkdir -p /tmp/yaml; printf "attn_backend: FLASHINFER\nuse_cuda_graph: true\nkv_cache_config: {max_tokens: 262144}\n" > /tmp/yaml/fi.yaml
for d in gqa mla; do cp /tmp/yaml/fi.yaml /tmp/yaml/$d.yaml; printf "speculative_config: {decoding_type: DSpark, speculative_model: /tmp/carry/drafters/smollm2-135m-dspark-$d}\n" >> /tmp/yaml/$d.yaml; done
B="python3 -m tensorrt_llm.bench.benchmark --model $M --dataset mtbench --ignore-eos --dataset-cache-dir /tmp/carry/ds --num-requests 80"
for cfg in ${ARMS:-fi:0 fi:8 gqa:0 gqa:8 mla:0 mla:8}; do set -- ${cfg/:/ }; cp /tmp/yaml/$1.yaml /tmp/yaml/x.yaml; [[ $2 != 0 ]] && echo "batch_wait_timeout_iters: $2" >> /tmp/yaml/x.yaml
  timeout 200 $B --extra-llm-api-options /tmp/yaml/x.yaml --concurrency 16 64 --waves ${WAVES:-4} --max-tokens 256 --json $OUT/bw_$1_$2.json > /tmp/bw_$1_$2.log 2>&1; grep "^|" /tmp/bw_$1_$2.log | tail -2 | tee -a $OUT/bw_summary.log; echo "[$1 wait $2 +$(( $(date +%s)-T0 ))s]"; done
