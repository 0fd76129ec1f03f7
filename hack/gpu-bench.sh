#!/usr/bin/env bash
# The GPU figures in one command, on a bare CUDA box that has only torch + triton (pytest optional).
#   hack/gpu-bench.sh              # on the GPU; results in ./_out (OUT=... to change, PYTHON=... for the interpreter)
#   hack/gpu-bench.sh --dry-run    # the same steps on the CPU under the Triton interpreter at tiny shapes (CI runs it)
# Each step has its own time cap and writes its own file, so one failure loses nothing else. The caps add up to
# 560 s (20 + 20 + 180 + 220 + 120), inside one device call's 600 s, and the steps run most valuable first, so a
# call cut short keeps what came before. Steps, in order:
#   1. env.json           torch, triton, the device's properties
#   2. nvml.json          the node labeler's NVML reader (modeld_operator/labeler.py) on this machine's GPUs and the
#                         labels it would write (needs nvidia-ml-py: the device image has it, and hack/gpu-wheels.sh
#                         carries it in .whl too); in a dry run there is no NVML and the step says so
#   3. engine.json        benchmarks/engine_gpu.py: the worker's engine, triton vs torch backend on the device, on a
#                         synthetic model with SmolLM2-135M's shapes (the real GGUF is 93 MB, over a call's 64 MiB):
#                         a warm-up (JIT compiles), then first output and decode ms/token at 8k and 32k, greedy
#                         agreement. It needs pydantic: carry the wheels hack/gpu-wheels.sh puts in .whl/ (installed
#                         here with pip --no-index)
#   4. kernels.json       benchmarks/kernels.py: paged decode bandwidth vs HBM peak at 32k/128k, fused int8/fp8/int4
#                         decode vs bf16, block-sparse vs dense (SDPA flash, 4-D) prefill at 32k/64k/128k, merge;
#                         each row is also printed as it is measured, so a cut-short run keeps its rows in the log
#   5. kernels-tests.txt  tests/kernels on the device (the interpreter-only cases skip themselves on CUDA)
#   6. steps.json         each step's exit status and seconds
set -o errexit -o nounset -o pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"  # the device image's torch is python3's
OUT="${OUT:-./_out}"
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
if [[ $# -gt 0 ]]; then echo "usage: hack/gpu-bench.sh [--dry-run]" >&2; exit 2; fi
mkdir -p "$OUT"
export PYTHONPATH="$PWD/cellimage:$PWD/api${PYTHONPATH:+:$PYTHONPATH}"
if [[ $DRY == 1 ]]; then export TRITON_INTERPRET=1; fi

steps=()
run_step() {  # name cap_s command...: runs the command under its cap, records status and seconds
  local name=$1 cap=$2 rc=0 t0 t1
  shift 2
  t0=$(date +%s)
  timeout "$cap" bash -o errexit -o nounset -o pipefail -c "$*" || rc=$?
  t1=$(date +%s)
  steps+=("\"$name\": {\"rc\": $rc, \"seconds\": $((t1 - t0)), \"cap_s\": $cap}")
  echo "== step $name: exit $rc in $((t1 - t0)) s (cap $cap s)" >&2
  return 0
}

env_step() {
  DRY=$DRY "$PYTHON" - "$OUT/env.json" <<'PY'
import json, os, sys
import torch, triton
dry = os.environ["DRY"] == "1"
if not dry and not torch.cuda.is_available():
    sys.exit("hack/gpu-bench.sh needs a CUDA device (or --dry-run)")
env = {"torch": torch.__version__, "triton": triton.__version__, "dry_run": dry,
       "interpreter": os.environ.get("TRITON_INTERPRET")}
if torch.cuda.is_available() and not dry:
    p = torch.cuda.get_device_properties(0)
    env["device"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
                     "memory_bytes": p.total_memory, "cuda": torch.version.cuda}
else:
    env["device"] = {"name": "cpu (Triton interpreter)"}
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(json.dumps(env))
PY
}

tests_step() {
  if ! "$PYTHON" -c 'import pytest' 2>/dev/null; then
    echo "pytest is not installed: tests/kernels SKIPPED; benchmarks/kernels.py still checks each triton kernel" \
      "against its torch reference before timing it" | tee "$OUT/kernels-tests.txt"
    return 0
  fi
  local sel=()
  if [[ $DRY == 1 ]]; then sel=(-k "paged_prefill and triton"); fi   # a small real subset: the script must not rot
  # pyproject's timeout/asyncio options only warn when those plugins are missing.
  "$PYTHON" -m pytest tests/kernels -q -p no:cacheprovider -m kernels -rs "${sel[@]}" 2>&1 | tee "$OUT/kernels-tests.txt"
}

bench_step() {
  if [[ $DRY == 1 ]]; then
    "$PYTHON" benchmarks/kernels.py --out "$OUT/kernels.json" --interpret --sparse-lengths 256 --sparse-past "" \
      --cpu-reps 1 --cpu-budget-s 0.1
  else
    "$PYTHON" benchmarks/kernels.py --out "$OUT/kernels.json"
  fi
}

engine_step() {
  if [[ -d .whl ]] && ! "$PYTHON" -c 'import pydantic' 2>/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/modeld-site \
      .whl/*.whl
    export PYTHONPATH="/tmp/modeld-site:$PYTHONPATH"
  fi
  if ! "$PYTHON" -c 'import pydantic' 2>/dev/null; then
    echo '{"skipped": "pydantic is not installed: run hack/gpu-wheels.sh and carry .whl"}' | tee "$OUT/engine.json"
    return 3
  fi
  if [[ $DRY == 1 ]]; then
    "$PYTHON" benchmarks/engine_gpu.py --dry-run --out "$OUT/engine.json"
  else
    "$PYTHON" benchmarks/engine_gpu.py --out "$OUT/engine.json"
  fi
}

nvml_step() {
  if [[ $DRY == 1 ]]; then
    echo '{"skipped": "dry run: no NVIDIA driver, no NVML"}' | tee "$OUT/nvml.json"
    return 0
  fi
  if [[ -d .whl ]] && ! "$PYTHON" -c 'import pynvml, pydantic' 2>/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/modeld-site \
      .whl/*.whl
    export PYTHONPATH="/tmp/modeld-site:$PYTHONPATH"
  fi
  PYTHONPATH="$PWD/operator:$PYTHONPATH" "$PYTHON" - "$OUT/nvml.json" <<'PY'
import dataclasses, json, sys
from modeld_operator.labeler import label_patch, read_nvml
reading = read_nvml()
out = {"reading": dataclasses.asdict(reading), "labels": label_patch({}, reading)}
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(json.dumps(out["labels"]))
PY
}

export -f env_step tests_step bench_step engine_step nvml_step
export DRY OUT PYTHON
run_step env 20 env_step
run_step nvml 20 nvml_step
run_step engine 180 engine_step
run_step kernels 220 bench_step
run_step kernel-tests 120 tests_step
( IFS=,; echo "{${steps[*]}}" ) > "$OUT/steps.json"
cat "$OUT/steps.json"
if grep -q '"rc": [1-9]' "$OUT/steps.json"; then
  echo "a step failed; see $OUT/steps.json and each step's file" >&2
  exit 1
fi
