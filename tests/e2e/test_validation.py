"""Malformed Cells and Sessions are rejected by the real apiserver (OpenAPI schema + CEL), each with a message a
person understands and that names the field."""

from __future__ import annotations

import copy

import pytest
import yaml

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

CELL = {
    "apiVersion": "modeld.contenox.io/v1alpha1",
    "kind": "Cell",
    "metadata": {"name": "bad"},
    "spec": {
        "runtime": {"backend": "triton"},
        "topology": {"gpus": 8, "interconnect": "nvlink"},
        "model": {"family": "llama3", "ref": "/models/llama3-8b"},
        "contextTier": 32768,
    },
}
SESSION = {
    "apiVersion": "modeld.contenox.io/v1alpha1",
    "kind": "Session",
    "metadata": {"name": "bad"},
    "spec": {"modelFamily": "smollm2", "requiredContext": 4096},
}


def edit(base: dict, path: str, value) -> dict:
    obj = copy.deepcopy(base)
    keys = path.split(".")
    node = obj
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    if value is DELETE:
        node.pop(keys[-1])
    else:
        node[keys[-1]] = value
    return obj


DELETE = object()

MALFORMED = [
    ("no-runtime", edit(CELL, "spec.runtime", DELETE), "spec.runtime: Required value"),
    ("unknown-backend", edit(CELL, "spec.runtime.backend", "cuda"), 'spec.runtime.backend: Unsupported value: "cuda"'),
    ("too-many-gpus", edit(CELL, "spec.topology.gpus", 17), "spec.topology.gpus in body should be less than or equal to 16"),
    ("negative-gpus", edit(CELL, "spec.topology.gpus", -1), "spec.topology.gpus in body should be greater than or equal to 0"),
    ("unknown-interconnect", edit(CELL, "spec.topology.interconnect", "infiniband"), 'Unsupported value: "infiniband"'),
    (
        "sharded-kv-one-gpu",
        edit(edit(CELL, "spec.runtime.parallelism", "sharded-kv"), "spec.topology", {"gpus": 1, "interconnect": "none"}),
        "topology.gpus must be at least 2",
    ),
    (
        "sharded-kv-cpu-without-ranks",
        edit(edit(CELL, "spec.runtime", {"backend": "torch", "parallelism": "sharded-kv"}), "spec.topology",
             {"gpus": 0, "interconnect": "none"}),
        "or a CPU cell (topology.gpus 0) states runtime.ranks of at least 2",
    ),
    ("single-with-ranks", edit(CELL, "spec.runtime", {"backend": "triton", "ranks": 2}), "runtime.ranks must be 1 or omitted"),
    (
        "ranks-not-gpus",
        edit(CELL, "spec.runtime", {"backend": "triton", "parallelism": "sharded-kv", "ranks": 4}),
        "runtime.ranks must equal topology.gpus",
    ),
    (
        "data-copies-past-the-last-port",
        edit(edit(edit(CELL, "spec.runtime", {"backend": "torch", "parallelism": "data", "ranks": 4}), "spec.topology",
                  {"gpus": 0, "interconnect": "none"}), "spec.port", 65533),
        "spec.port plus its copies must stay within 65535",
    ),
    (
        "cpu-cell-with-link",
        edit(edit(CELL, "spec.runtime.backend", "torch"), "spec.topology", {"gpus": 0, "interconnect": "pcie"}),
        "a CPU cell (topology.gpus: 0) has no GPU interconnect",
    ),
    ("multi-gpu-no-link", edit(CELL, "spec.topology.interconnect", "none"), "must state how its GPUs are joined"),
    (
        "nvswitch-pair",
        edit(CELL, "spec.topology", {"gpus": 2, "interconnect": "nvswitch"}),
        "an NVSwitch fabric joins 4 or more GPUs",
    ),
    (
        "tensor-over-4-pcie",
        edit(edit(CELL, "spec.runtime.parallelism", "tensor"), "spec.topology", {"gpus": 4, "interconnect": "pcie"}),
        "not certified across more than 2 PCIe GPUs",
    ),
    (
        "triton-on-cpu",
        edit(CELL, "spec.topology", {"gpus": 0, "interconnect": "none"}),
        "the triton backend runs on GPUs",
    ),
    ("tiny-context", edit(CELL, "spec.contextTier", 100), "spec.contextTier in body should be greater than or equal to 512"),
    ("bad-digest", edit(CELL, "spec.model.digest", "md5:abc"), "spec.model.digest in body should match"),
    ("bad-family", edit(CELL, "spec.model.family", "Llama 3!"), "spec.model.family in body should match"),
    ("own-baseline", edit(CELL, "spec.baseline", "bad"), "a cell is measured against a different cell"),
    (
        "sparse-short-context",
        edit(edit(CELL, "spec.profile", {"attention": "block-sparse"}), "spec.contextTier", 4096),
        "a block-sparse cell needs contextTier of at least 8192",
    ),
    (
        "products-on-cpu",
        edit(edit(CELL, "spec.runtime.backend", "torch"), "spec.topology", {"gpus": 0, "interconnect": "none", "products": ["NVIDIA-L40S"]}),
        "topology.products names GPU products, but this is a CPU cell",
    ),
    ("unknown-kv", edit(CELL, "spec.profile", {"kv": "int3"}), 'spec.profile.kv: Unsupported value: "int3"'),
    ("store-names-nothing", edit(CELL, "spec.sessionStore", {}), "sessionStore names exactly one of claimName"),
    ("store-names-both", edit(CELL, "spec.sessionStore", {"claimName": "s", "hostPath": "/x"}),
     "sessionStore names exactly one of claimName"),
    ("store-relative-path", edit(CELL, "spec.sessionStore", {"hostPath": "x/y"}),
     "spec.sessionStore.hostPath in body should match"),
    ("rope-factor-one", edit(CELL, "spec.model.ropeScaling", {"factor": 1}),
     "spec.model.ropeScaling.factor in body should be greater than 1"),
    ("too-many-replicas", edit(CELL, "spec.replicas", 100), "spec.replicas in body should be less than or equal to 64"),
    ("bad-memory", edit(CELL, "spec.resources", {"requests": {"memory": "lots"}}), "spec.resources.requests.memory in body should match"),
    ("no-spec", {k: v for k, v in CELL.items() if k != "spec"}, "spec: Required value"),
    ("session-no-family", edit(SESSION, "spec.modelFamily", DELETE), "spec.modelFamily: Required value"),
    ("session-zero-context", edit(SESSION, "spec.requiredContext", 0), "spec.requiredContext in body should be greater than or equal to 1"),
    (
        "session-negative-budget",
        edit(SESSION, "spec.latencyBudget", {"firstOutputMs": -5}),
        "spec.latencyBudget.firstOutputMs in body should be greater than or equal to 1",
    ),
    # names the operator derives other names from (a label value, cell-<name>, <namespace>.<name>)
    ("cell-name-too-long", edit(CELL, "metadata.name", "c" * 59), "at most 58 lowercase letters"),
    ("cell-name-with-dots", edit(CELL, "metadata.name", "smollm2.cpu"), "(no dots)"),
    ("session-name-too-long", edit(SESSION, "metadata.name", "s" * 65), "the name may have at most 64"),
]


@pytest.mark.parametrize("manifest, message", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_apiserver_rejects(cluster, chart, manifest, message):
    res = cluster.kubectl("create", "--dry-run=server", "-n", "default", "-f", "-", input=yaml.safe_dump(manifest), check=False)
    assert res.returncode != 0, f"accepted: {manifest}"
    assert "is invalid" in res.stderr and message in res.stderr, res.stderr


def test_valid_manifests_are_accepted_with_defaults(cluster, chart):
    res = cluster.kubectl("create", "--dry-run=server", "-n", "default", "-o", "json", "-f", "-", input=yaml.safe_dump(CELL))
    created = yaml.safe_load(res.stdout)
    # Nested defaults are applied by the apiserver, so `kubectl get` shows them.
    assert created["spec"]["profile"] == {"attention": "dense", "kv": "bf16", "prefixReuse": True, "weights": "bf16"}
    assert created["spec"]["runtime"]["parallelism"] == "single"
    assert created["spec"]["replicas"] == 1


def test_a_cpu_cell_with_cpu_ranks_is_accepted(cluster, chart):
    cpu_ranks = edit(edit(CELL, "spec.runtime", {"backend": "torch", "parallelism": "sharded-kv", "ranks": 2}),
                     "spec.topology", {"gpus": 0, "interconnect": "none"})
    res = cluster.kubectl("create", "--dry-run=server", "-n", "default", "-o", "json", "-f", "-",
                          input=yaml.safe_dump(cpu_ranks))
    assert yaml.safe_load(res.stdout)["spec"]["runtime"]["ranks"] == 2


def test_session_pinned_cell_is_immutable(cluster, chart, namespace):
    pinned = edit(edit(SESSION, "spec.cell", "one"), "metadata.name", "pinned")
    cluster.apply(pinned, namespace)
    res = cluster.apply(edit(pinned, "spec.cell", "two"), namespace, check=False)
    assert res.returncode != 0
    assert "spec.cell is immutable" in res.stderr, res.stderr
