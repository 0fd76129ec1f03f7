#!/usr/bin/env bash
# A separate virtualenv for the CPU peers that benchmarks/peers_cpu.py compares modeld with (benchmark-only: never
# installed into the project's .venv):
#   * llama-cpp-python, built from source without AMX: the prebuilt/default build dies with SIGILL in ggml's AMX
#     matrix code on these machines (`tilezero`; ggml-org/llama.cpp#26954), so it is built with
#     -mno-amx-tile -mno-amx-int8 -mno-amx-bf16;
#   * transformers + torch (the same torch as the project's lock, run on the CPU), gguf, numpy.
# Idempotent: the venv is keyed by the versions and the build flags below; the llama-cpp-python wheel is built once
# (a long compile on 2 cores) and kept under ~/.cache/modeld/peers-wheels/KEY, so a rerun does almost nothing.
#
#   hack/peers-setup.sh            # prints the venv's python on stdout when done
#   PEERS_VENV=/some/dir hack/peers-setup.sh
set -o errexit -o nounset -o pipefail
cd "$(dirname "$0")/.."
CACHE=${MODELD_CACHE:-$HOME/.cache/modeld}
venv=${PEERS_VENV:-$CACHE/peers-venv}
PYTHON=${PYTHON:-python3}
if [[ -x .venv/bin/uv ]]; then UV=${UV:-$PWD/.venv/bin/uv}; else UV=${UV:-uv}; fi
t0=$SECONDS

LLAMA_CPP_PYTHON_VERSION=0.3.36
TRANSFORMERS_SPEC=${TRANSFORMERS_SPEC:-transformers}   # newest on the index; the benchmark records the version
TORCH_VERSION=2.15.0     # as hack/requirements.lock: the same torch build that modeld's CPU cell runs on
NUMPY_VERSION=2.4.6
GGUF_VERSION=0.19.0
EXTRA="accelerate"       # transformers refuses to load a GGUF without it
NO_AMX='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'
LLAMA_CMAKE_ARGS="-DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'"

pyver=$("$PYTHON" -c 'import sys; print(sys.version)')
wheel_key=$( (echo "$LLAMA_CPP_PYTHON_VERSION"; echo "$LLAMA_CMAKE_ARGS"; echo "$pyver") | sha256sum | cut -c1-12)
key=$( (echo "$wheel_key $TRANSFORMERS_SPEC $TORCH_VERSION $NUMPY_VERSION $GGUF_VERSION $EXTRA") | sha256sum | cut -c1-12)
wheels=$CACHE/peers-wheels/$wheel_key

if [[ ! -f $venv/.complete-$key ]]; then
  echo "peers-setup: creating $venv" >&2
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"

  # 1. llama-cpp-python from its sdist with AMX off. Built with pip into our own folder (not uv's cache, whose built
  #    wheels are not keyed by CMAKE_ARGS: a wheel built once without these flags would be reused and crash).
  if ! ls "$wheels"/llama_cpp_python-"$LLAMA_CPP_PYTHON_VERSION"-*.whl >/dev/null 2>&1; then
    echo "peers-setup: building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION (AMX off; log: $wheels.log)" >&2
    mkdir -p "$wheels"
    CMAKE_ARGS=$LLAMA_CMAKE_ARGS CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
      "$venv/bin/python" -m pip wheel --verbose --no-deps --no-cache-dir --no-binary llama-cpp-python \
      -w "$wheels.tmp" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" >"$wheels.log" 2>&1 \
      || { echo "peers-setup: llama-cpp-python build failed; last lines of $wheels.log:" >&2
           tail -n 40 "$wheels.log" >&2; exit 1; }
    mv "$wheels.tmp"/llama_cpp_python-*.whl "$wheels"/
    rm -rf "$wheels.tmp"
  fi

  # 2. Everything else from the index (uv's cache already holds the project's torch/numpy/gguf wheels).
  VIRTUAL_ENV=$venv "$UV" pip install --quiet "$wheels"/llama_cpp_python-"$LLAMA_CPP_PYTHON_VERSION"-*.whl \
    "torch==$TORCH_VERSION" "numpy==$NUMPY_VERSION" "gguf==$GGUF_VERSION" "$TRANSFORMERS_SPEC" $EXTRA

  # 3. Imports work (an AMX build only crashes at the first evaluated token: peers_cpu.py shows that).
  "$venv/bin/python" - <<'EOF'
import llama_cpp, torch, transformers, gguf, numpy, accelerate
print("peers-setup: llama-cpp-python", llama_cpp.__version__, "transformers", transformers.__version__,
      "torch", torch.__version__, "numpy", numpy.__version__, file=__import__("sys").stderr)
EOF
  touch "$venv/.complete-$key"   # only a finished install counts; an interrupted one is redone
fi
echo "peers-setup: done in $((SECONDS - t0)) s" >&2
echo "$venv/bin/python"
