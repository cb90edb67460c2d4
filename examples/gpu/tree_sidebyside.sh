#!/usr/bin/env bash
# An old tree vs this checkout on one H200, processes alternating per arm (supersedes sidebyside.sh and
# spec_sidebyside.sh). Arms: fi (no-spec FLASHINFER + graphs), gqa / mla (DSpark, the staged drafters);
# MT-Bench first turns, 256 tokens, C = 1 16 64, per tree and arm; plus a greedy-token hash per tree (the two
# must agree) and, with TESTS=1, this checkout's GPU tests. Runs after device_setup.sh (sourced, same call).
# The old tree: `git archive` of its tensorrt_llm/ into an ignored folder that travels as a carry path:
#   rm -rf carry/old_tree && mkdir -p carry/old_tree && git archive OLD_REV tensorrt_llm | tar -x -C carry/old_tree
#   run(command=". examples/gpu/device_setup.sh && ARMS='fi gqa mla' bash examples/gpu/tree_sidebyside.sh carry/old_tree",
#       carry=["carry/old_tree"])                      # ~1.5 MiB + the tree without drafter weights
#   run(command=". examples/gpu/device_setup.sh && TESTS=1 BENCH=0 bash examples/gpu/tree_sidebyside.sh", carry=[])
# ORDER="old new" (default) sets the order within each arm; results: $OUT/bench_<arm>_<tree>.json.
set -uo pipefail
: "${M:?source examples/gpu/device_setup.sh first (same call)}"
NEW=$PWD OLD=${1:-} T0=$(date +%s)
mkdir -p /tmp/yaml && printf "attn_backend: FLASHINFER\nuse_cuda_graph: true\nkv_cache_config: {max_tokens: 262144}\n" > /tmp/yaml/fi.yaml
for d in gqa mla; do
  cp /tmp/yaml/fi.yaml /tmp/yaml/$d.yaml
  printf "speculative_config: {decoding_type: DSpark, speculative_model: /tmp/carry/drafters/smollm2-135m-dspark-$d}\n" >> /tmp/yaml/$d.yaml
done
if [[ -n $OLD ]]; then rm -rf /tmp/old_tree && cp -r "$OLD" /tmp/old_tree; fi
tree_dir() { [[ $1 == old ]] && echo /tmp/old_tree || echo "$NEW"; }
if [[ "${TESTS:-0}" == 1 ]]; then
  timeout "${TEST_S:-400}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/unittest 2>&1 | tail -15 | tee "$OUT/pytest_gpu.log"
  echo "[tests +$(( $(date +%s) - T0 ))s]"
fi
[[ "${BENCH:-1}" == 1 ]] || exit 0
for v in ${ORDER:-old new}; do
  [[ $v == old && -z $OLD ]] && continue
  PYTHONPATH=/tmp/site:$(tree_dir $v) timeout 60 python3 -c "
from tensorrt_llm import LLM, SamplingParams
import hashlib
llm = LLM('$M', attn_backend='FLASHINFER', use_cuda_graph=True)
outs = llm.generate([[1, 9690, 198, 28120, 359, 253, 4219, 2], [1, 4093, 198, 19161, 2]] * 4, SamplingParams(max_tokens=64))
print('$v tokens', hashlib.sha256(str([o.outputs[0].token_ids for o in outs]).encode()).hexdigest()[:16])
llm.shutdown()" 2>&1 | grep tokens
done
for arm in ${ARMS:-fi gqa mla}; do for v in ${ORDER:-old new}; do
  [[ $v == old && -z $OLD ]] && continue
  (cd "$(tree_dir $v)" && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m tensorrt_llm.bench.benchmark --model "$M" --dataset mtbench \
    --ignore-eos --dataset-cache-dir /tmp/carry/ds --num-requests 80 --extra-llm-api-options /tmp/yaml/$arm.yaml \
    --concurrency 1 16 64 --waves 2 --max-tokens 256 --json "$OUT/bench_${arm}_$v.json" 2>&1 | grep "^|" | tail -3 | sed "s/^/$v /")
  echo "[$arm $v +$(( $(date +%s) - T0 ))s]"
done; done
