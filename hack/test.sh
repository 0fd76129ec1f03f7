#!/usr/bin/env bash
# The test command (README, CI): set-up, static checks, then every tier — unit, kernels (Triton interpreter on CPU),
# cell (the worker on the real model) and e2e (the real local control plane).
set -o errexit -o nounset -o pipefail
cd "$(dirname "$0")/.."
hack/setup.sh
.venv/bin/ruff check api operator cellimage tests hack benchmarks
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
