#!/usr/bin/env bash
# Re-measure the figures docs/ quotes from runs whose JSON was not kept, each into docs/bench/<today>/<name>.json
# with the command that made it (every benchmark writes its command into its JSON). One step per benchmark, each
# capped; a failing step is reported and the rest still run. On this 2-core machine (2026-12-01) the steps up to
# sparse-long took about 16 minutes and the int4 steps about 20 more: run it on an idle machine, then update the doc
# tables from the JSON. The peer comparison is not a step (it needs hack/peers-setup.sh: docs/cell-benchmarks.md).
#
#   hack/doc-figures.sh                  # every step
#   hack/doc-figures.sh kernels agent    # the steps named (see STEPS below)
set -o errexit -o nounset -o pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=.venv/bin/python
OUT="docs/bench/$(date -u +%F)"
mkdir -p "$OUT"
export PYTHONPATH=cellimage:api

# name | cap (s) | the command its doc section names (docs/<file>)
STEPS=(
  "kernels|900|benchmarks/kernels.py --out $OUT/kernels_cpu.json"                                   # kernels.md, CPU
  "kernels-sparse-past|300|benchmarks/kernels.py --out $OUT/kernels_sparse_past_cpu.json --only sparse --sparse-lengths 2048,4096,8192,16384 --sparse-past 6144:2048;14336:2048"
  "kernels-sparse-long|1800|benchmarks/kernels.py --out $OUT/kernels_sparse_long_cpu.json --only sparse --sparse-lengths 8192,16384,32768,65536,131072 --sparse-past 24576:8192"
  "cell|900|benchmarks/cell_cpu.py --weights bf16 --repeats 2 --out $OUT/cell_cpu_bf16.json"        # cell-benchmarks.md
  "weights|1200|benchmarks/weights_cpu.py --out $OUT/weights_cpu.json"                              # cell-benchmarks.md
  "decode-attention|300|benchmarks/decode_attention.py --out $OUT/decode_attention.json"            # cell-benchmarks.md, reuse.md
  "agent|1200|benchmarks/agent_replay.py --out $OUT/agent_replay.json"                              # reuse.md
  "reuse-floor|900|benchmarks/reuse_floor.py --out $OUT/reuse_floor.json"                           # reuse.md
  "profiles|900|benchmarks/profiles_cpu.py --out $OUT/profiles_cpu.json"                            # kernels.md, worker.md
  "int4|900|benchmarks/profiles_cpu.py --sections quality --kv int4 --out $OUT/int4.json"           # kernels.md
  "sparse-long|2400|benchmarks/sparse_long.py --contexts 8000,16384,32768 --out $OUT/sparse_long.json"
  "int4-diag|900|benchmarks/int4_diag.py --variant base --seeds 4,2 --modes kv,k,v,kv-sink --out $OUT/int4_diag.jsonl"   # kernels.md
  "int4-variants|2400|benchmarks/int4_variants.py --variants uni15-clip,uni16-signed-clip,asym64-clip,lloyd-signed-clip,nf4-clip,base --seeds 1,2,3,4 --out $OUT/int4_variants.jsonl"
)

want=" $* "
failed=0
for step in "${STEPS[@]}"; do
  IFS='|' read -r name cap cmd <<<"$step"
  if [[ $# -gt 0 && "$want" != *" $name "* ]]; then continue; fi
  echo "== $name (cap ${cap}s): $cmd" >&2
  # shellcheck disable=SC2086  # the command's words split on purpose; ';' inside --sparse-past is one argument
  if ! timeout "$cap" $PY $cmd; then
    echo "== $name FAILED" >&2
    failed=1
  fi
done
echo "JSON in $OUT" >&2
exit "$failed"
