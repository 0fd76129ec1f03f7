#!/usr/bin/env bash
# The test command (README, CI): set-up, static checks, then every tier — unit, kernels (Triton interpreter on CPU),
# cell (the worker on the real model) and e2e (the real local control plane).
set -o errexit -o nounset -o pipefail
cd "$(dirname "$0")/.."
hack/setup.sh
.venv/bin/ruff check api operator cellimage tests hack benchmarks
.venv/bin/mypy
# the worker's typed seam: the HTTP server against the engine Protocol (contract.SessionEngine)
.venv/bin/mypy --ignore-missing-imports --follow-imports=silent cellimage/modeld_cell/server.py cellimage/modeld_cell/contract.py
exec .venv/bin/python -m pytest "$@"
