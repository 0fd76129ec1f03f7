"""Prints the Node objects of hack/inventory.yaml as a YAML stream: python hack/nodes.py [inventory]."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

INTERCONNECTS = {"none", "pcie", "nvlink", "nvswitch"}


def nodes(inventory: dict) -> list[dict]:
    out = []
    for group in inventory["nodes"]:
        gpus = int(group.get("gpus", 0))
        link = group.get("interconnect", "none")
        if link not in INTERCONNECTS:
            raise SystemExit(f"inventory: node group {group['name']!r}: interconnect {link!r} is not one of {sorted(INTERCONNECTS)}")
        if gpus == 0 and link != "none":
            raise SystemExit(f"inventory: node group {group['name']!r} has no GPUs but interconnect {link!r}")
        for i in range(int(group.get("count", 1))):
            name = f"{group['name']}-{i}"
            labels = {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                "modeld.contenox.io/interconnect": link,
            }
            capacity = {"cpu": str(group.get("cpu", "8")), "memory": str(group.get("memory", "32Gi")), "pods": "110"}
            taints = []
            if gpus:
                labels.update(
                    {
                        "nvidia.com/gpu.present": "true",
                        "nvidia.com/gpu.count": str(gpus),
                        "nvidia.com/gpu.product": group["product"],
                        "nvidia.com/gpu.memory": str(group["memoryMiB"]),
                        "nvidia.com/gpu.family": group.get("family", "unknown"),
                    }
                )
                capacity["nvidia.com/gpu"] = str(gpus)
                # As the NVIDIA GPU operator taints GPU nodes: only pods that tolerate it land there.
                taints.append({"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"})
            node = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": labels, "annotations": {"kwok.x-k8s.io/node": "fake"}},
                "spec": {"taints": taints} if taints else {},
                "status": {"capacity": capacity, "allocatable": dict(capacity)},
            }
            out.append(node)
    return out


def main() -> None:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).with_name("inventory.yaml"))
    print(yaml.safe_dump_all(nodes(yaml.safe_load(path.read_text())), sort_keys=False))


if __name__ == "__main__":
    main()
