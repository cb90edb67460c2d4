#!/usr/bin/env bash
# old vs new no-spec FLASHINFER+graphs, same machine, back to back (+ a greedy-token check).
#   bash examples/gpu/sidebyside.sh DIR   (DIR/snap_old, DIR/snap_new: `git archive` of the two trees)
# needs /tmp/site (flashinfer), the converted model and the MT-Bench wheel in /tmp/persist/ds/wheels.
export PYTHONPATH=/tmp/site CUDA_HOME=/usr/local/cuda MAX_JOBS=16 FLASHINFER_WORKSPACE_BASE=/tmp/fiws PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
M=$HOME/.cache/tensorrt_llm/models/smollm2-135m-instruct
mkdir -p /tmp/yaml && printf "attn_backend: FLASHINFER\nuse_cuda_graph: true\nkv_cache_config: {max_tokens: 262144}\n" > /tmp/yaml/fi.yaml
ROOT=$(cd "${1:?usage: sidebyside.sh DIR (holding snap_old and snap_new)}" && pwd)
for v in ${ORDER:-old new}; do
  cd $ROOT/snap_$v
  PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m tensorrt_llm.bench.benchmark --model $M --dataset mtbench --ignore-eos --dataset-cache-dir /tmp/persist/ds \
    --num-requests 64 --extra-llm-api-options /tmp/yaml/fi.yaml --waves 1 --max-tokens 256 --concurrency 1 16 64 --json $OUT/bench_fi_$v.json 2>&1 | grep "^|" | tail -3 | sed "s/^/$v /"
  PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -c "
from tensorrt_llm import LLM, SamplingParams
import hashlib
llm = LLM('$M', attn_backend='FLASHINFER', use_cuda_graph=True)
outs = llm.generate([[1, 9690, 198, 28120, 359, 253, 4219, 2], [1, 4093, 198, 19161, 2]] * 4, SamplingParams(max_tokens=64))
print('$v tokens', hashlib.sha256(str([o.outputs[0].token_ids for o in outs]).encode()).hexdigest()[:16], outs[0].outputs[0].token_ids[:12])
llm.shutdown()" 2>&1 | grep tokens
done
