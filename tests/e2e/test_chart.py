"""The Helm chart: lint, render accepted by the real apiserver, installed, least-privilege RBAC, values schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from .conftest import RELEASE_NS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
CHART = str(Path(__file__).resolve().parents[2] / "charts" / "modeld")


def rendered(cluster, *args: str) -> list[dict]:
    out = cluster.run("helm", "template", "modeld", CHART, "-n", RELEASE_NS, "--kube-version", "1.34.4", *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_lint(cluster):
    res = cluster.run("helm", "lint", "--strict", CHART, "--kube-version", "1.34.4", check=False)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("values", [[], ["--set", "watchNamespace=agents"], ["--set", "metrics.enabled=false"],
                                    ["--set", "labeler.enabled=true"]],
                         ids=["default", "namespaced", "no-metrics", "labeler"])
def test_template_accepted_by_apiserver(cluster, chart, values):
    docs = rendered(cluster, *values)
    text = yaml.safe_dump_all(docs)
    if "--set" in values and "watchNamespace=agents" in values:
        cluster.kubectl("create", "namespace", "agents", check=False)
    res = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=text, check=False)
    assert res.returncode == 0, res.stderr


def test_rbac_is_least_privilege(cluster):
    for values in ([], ["--set", "watchNamespace=agents"], ["--set", "labeler.enabled=true"]):
        for doc in rendered(cluster, *values):
            if doc["kind"] in ("ClusterRole", "Role"):
                for rule in doc["rules"]:
                    for key in ("apiGroups", "resources", "verbs"):
                        assert "*" not in rule[key], (doc["metadata"]["name"], rule)
                    assert not {"delete", "deletecollection", "escalate", "bind", "impersonate"} & set(rule["verbs"]), rule
            if doc["kind"] in ("ClusterRoleBinding", "RoleBinding"):
                assert doc["roleRef"]["name"] not in ("cluster-admin", "admin", "edit")


def test_replicas_elect_a_leader_with_a_lease_in_the_release_namespace_only(cluster):
    docs = rendered(cluster, "--set", "replicaCount=2")
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    env = {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert dep["spec"]["replicas"] == 2 and env["MODELD_LEADER_ELECTION"]["value"] == "true"
    assert env["MODELD_LEASE_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    (role,) = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"].endswith("-leader")]
    assert role["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                              "verbs": ["get", "create", "update"]}]


def test_the_node_labeler_is_opt_in_and_may_only_read_and_label_nodes(cluster):
    assert not [d for d in rendered(cluster) if d["kind"] == "DaemonSet"]
    docs = rendered(cluster, "--set", "labeler.enabled=true", "--set", "labeler.runtimeClassName=nvidia")
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert container["command"] == ["modeld-labeler"] and pod["runtimeClassName"] == "nvidia"
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    (role,) = [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-labeler")]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    assert pod["serviceAccountName"] == role["metadata"]["name"]


def test_monitoring_renders_a_service_monitor_a_pod_monitor_and_the_dashboard(cluster):
    """Off by default; on, each object points at what the chart and the operator really serve. The monitors' kinds
    need the Prometheus Operator's CRDs, which the local cluster lacks: they are checked as rendered; the dashboard's
    ConfigMap is also accepted by the apiserver."""
    assert not [d for d in rendered(cluster) if d["kind"] in ("ServiceMonitor", "PodMonitor", "ConfigMap")]
    docs = rendered(cluster, "--set", "monitoring.serviceMonitor.enabled=true", "--set", "monitoring.podMonitor.enabled=true",
                    "--set", "monitoring.dashboards.enabled=true", "--set", "monitoring.podMonitor.labels.release=prom")
    kinds = {d["kind"]: d for d in docs}
    svc = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-metrics"))
    sm = kinds["ServiceMonitor"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert [e["port"] for e in sm["spec"]["endpoints"]] == [p["name"] for p in svc["spec"]["ports"]]
    pm = kinds["PodMonitor"]
    assert pm["metadata"]["labels"]["release"] == "prom" and pm["spec"]["namespaceSelector"] == {"any": True}
    # the cell pods' labels and every port a worker (or a data-parallel copy) serves on
    from modeld_api import CellSpec
    from modeld_operator import placement
    spec = CellSpec.model_validate({"runtime": {"backend": "torch", "parallelism": "data", "ranks": 16},
                                    "topology": {"gpus": 0, "interconnect": "none"},
                                    "model": {"family": "smollm2", "ref": "x"}, "contextTier": 1024})
    pod = placement.pod_template("c", "ns", spec)
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == [
        p["name"] for p in pod["spec"]["containers"][0]["ports"]]
    cm = kinds["ConfigMap"]
    dashboard = Path(CHART) / "dashboards" / "modeld.json"
    assert json.loads(cm["data"]["modeld.json"]) == json.loads(dashboard.read_text())
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    res = cluster.kubectl("apply", "--dry-run=server", "-n", RELEASE_NS, "-f", "-", input=yaml.safe_dump(cm), check=False)
    assert res.returncode == 0, res.stderr
    scoped = rendered(cluster, "--set", "monitoring.podMonitor.enabled=true", "--set", "watchNamespace=agents")
    assert next(d for d in scoped if d["kind"] == "PodMonitor")["spec"]["namespaceSelector"] == {"matchNames": ["agents"]}


def test_values_schema_rejects_bad_values(cluster):
    for bad, message in [
        (["--set", "replicaCount=9"], "replicaCount"),
        (["--set", "operator.logFormat=xml"], "logFormat"),
        (["--set", "image.pullPolicy=Sometimes"], "pullPolicy"),
        (["--set", "unknownKey=1"], "unknownKey"),
        (["--set", "labeler.intervalSeconds=1"], "intervalSeconds"),
        (["--set", "monitoring.podMonitor.interval=often"], "interval"),
    ]:
        res = cluster.run("helm", "template", "modeld", CHART, "--kube-version", "1.34.4", *bad, check=False)
        assert res.returncode != 0 and message in res.stderr, res.stderr


def test_installed_release(cluster, chart):
    status = cluster.run("helm", "status", chart, "-n", RELEASE_NS, "-o", "yaml").stdout
    assert yaml.safe_load(status)["info"]["status"] == "deployed"
    dep = cluster.get("deployment", "modeld", RELEASE_NS)
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "modeld"
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    for crd in ("cells.modeld.contenox.io", "sessions.modeld.contenox.io"):
        assert cluster.get("crd", crd) is not None
