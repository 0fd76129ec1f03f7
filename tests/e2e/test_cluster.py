"""The local control plane is real: stamped versions, kwok GPU nodes from the inventory, loopback pod IPs, and the
pod runner serving a pod's command on its pod IP."""

from __future__ import annotations

import ipaddress
import json
import urllib.request

import pytest

from .conftest import ENV, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def test_versions_are_stamped(cluster):
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == "v1.34.4"
    assert version["clientVersion"]["gitVersion"] == "v1.34.4"


def test_fake_gpu_nodes_are_ready_with_real_labels(cluster):
    nodes = cluster.get("nodes", selector="type=kwok")["items"]
    by_link: dict[str, list[dict]] = {}
    for node in nodes:
        conditions = {c["type"]: c["status"] for c in node["status"]["conditions"]}
        assert conditions["Ready"] == "True", node["metadata"]["name"]
        by_link.setdefault(node["metadata"]["labels"]["modeld.contenox.io/interconnect"], []).append(node)
    assert set(by_link) == {"none", "pcie", "nvlink", "nvswitch"}
    for node in by_link["nvswitch"]:
        labels = node["metadata"]["labels"]
        assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
        assert labels["nvidia.com/gpu.count"] == "8" and node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    for node in by_link["none"]:
        assert "nvidia.com/gpu" not in node["status"]["allocatable"]


def test_pod_runner_serves_on_loopback_pod_ip(cluster, namespace):
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web", "labels": {"modeld.contenox.io/local-run": "true"}},
        "spec": {
            "nodeSelector": {"modeld.contenox.io/interconnect": "none"},
            "containers": [
                {
                    "name": "web",
                    "image": "python:3.11-slim",
                    "command": ["python", "-m", "http.server", "--bind", "$(POD_IP)", "18080"],
                    "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                }
            ],
        },
    }
    cluster.apply(pod, namespace)
    ip = wait_until("pod IP", lambda: (cluster.get("pod", "web", namespace) or {}).get("status", {}).get("podIP"))
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(ENV["MODELD_POD_CIDR"])
    assert ipaddress.ip_address(ip).is_loopback

    def answers():
        try:
            with urllib.request.urlopen(f"http://{ip}:18080/", timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False

    wait_until("the pod's process to answer on its pod IP", answers, timeout=30)
    cluster.kubectl("delete", "pod", "web", "-n", namespace, "--timeout=60s")
    wait_until("the process to stop with its pod", lambda: not answers(), timeout=30)
