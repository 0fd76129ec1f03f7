#!/usr/bin/env bash
# Download the wheels the engine step of hack/gpu-bench.sh needs on the device image (which has torch and triton
# but not pydantic) into .whl/ (git-ignored through .git/info/exclude): CPython 3.12, manylinux x86_64, the versions
# of this checkout's environment. gpu-bench.sh installs them with pip --no-index before its engine step.
#   hack/gpu-wheels.sh && <device run carrying .whl>: hack/gpu-bench.sh
set -o errexit -o nounset -o pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-.venv/bin/python}
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
# nvidia-ml-py (the labeler's NVML binding) is not in the checkout's environment: its version is pinned here
for pkg in pydantic pydantic_core annotated_types typing_extensions typing_inspection nvidia_ml_py; do
  ver=$("$PY" -c "import importlib.metadata as m; print(m.version('${pkg//_/-}'))" 2>/dev/null || echo 13.615.71)
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${pkg//_/-}==$ver"
done
ls -l .whl
