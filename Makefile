# Everyday targets. `make help` lists them.
SHELL := /bin/bash
PY := .venv/bin/python

.PHONY: help setup test demo generate verify lint unit e2e cell kernels cluster-up cluster-down bench
help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'
setup:  ## all set-up: virtualenv, control-plane binaries, the CPU model (cached under ~/.cache/modeld)
	hack/setup.sh
test:  ## set-up, then every test tier (the command CI runs)
	hack/test.sh
demo:  ## set-up, then the main job: local cluster, chart, operator, a CPU cell serving a real session
	hack/demo.sh
generate:  ## regenerate CRDs and the worker's OpenAPI document from their typed sources
	$(PY) -m modeld_operator.crdgen --write
	$(PY) -m modeld_cell.openapi --write
verify:  ## fail if generated files drifted
	$(PY) -m modeld_operator.crdgen --check
	$(PY) -m modeld_cell.openapi --check
lint:  ## ruff everywhere, mypy on the operator
	.venv/bin/ruff check api operator cellimage tests hack benchmarks
	.venv/bin/mypy
	.venv/bin/mypy --ignore-missing-imports --follow-imports=silent cellimage/modeld_cell/server.py cellimage/modeld_cell/contract.py
unit:  ## fast tests, no cluster, no model
	$(PY) -m pytest -m unit
kernels:  ## Triton kernels against their references (interpreter on CPU)
	$(PY) -m pytest -m kernels
cell:  ## the worker on the real model
	$(PY) -m pytest -m cell
e2e:  ## against the real local control plane
	$(PY) -m pytest -m e2e
cluster-up:  ## start the local cluster (hack/cluster up)
	hack/cluster up
cluster-down:  ## stop it
	hack/cluster down
bench:  ## CPU benchmarks of the worker and kernels (figures go to docs/)
	$(PY) benchmarks/cell_cpu.py
	$(PY) benchmarks/kernels.py --out _out/kernels-cpu.json
