#!/usr/bin/env bash
# guidellm, the load tool benchmarks/load_openai.py drives against the worker's OpenAI-compatible API, in a
# virtualenv of its own under ~/.cache/modeld/tools, keyed by its version (it pulls in transformers and datasets,
# which the project does not need). torch is pinned to the project's lock, so uv links it from its cache.
# Prints the guidellm executable's path.
set -o errexit -o nounset -o pipefail
cd "$(dirname "$0")/.."
CACHE=${MODELD_CACHE:-$HOME/.cache/modeld}
VERSION=0.8.1
venv=$CACHE/tools/guidellm-$VERSION
if [[ ! -f $venv/.complete ]]; then
  rm -rf "$venv"
  "${PYTHON:-python3}" -m venv "$venv"
  torch=$(grep -E '^torch==' hack/requirements.lock)
  .venv/bin/uv pip install --python "$venv/bin/python" --quiet "guidellm==$VERSION" "$torch"
  touch "$venv/.complete"    # only a finished install counts
fi
echo "$venv/bin/guidellm"
