"""The node labeler: reads a GPU node's NVML and labels how its GPUs are joined, which placement depends on.

GPU Feature Discovery labels product, count and memory (``nvidia.com/gpu.*``) but nothing says whether a node's GPUs
talk over NVSwitch, direct NVLink or only PCIe. This program, run by the chart's opt-in DaemonSet on GPU nodes, reads
NVML through the maintained binding nvidia-ml-py (``import pynvml``) and writes:

- ``modeld.contenox.io/interconnect``: ``nvswitch`` when every GPU has active NVLinks to an NVSwitch (HGX boards),
  ``nvlink`` when every pair of GPUs is joined by a direct NVLink (a bridged pair), ``pcie`` otherwise (also for four
  GPUs in two bridged pairs: a cell on all four would talk over PCIe), ``none`` for a single GPU;
- ``modeld.contenox.io/nvlink-domain``: the NVLink domain (NVML's fabric cluster UUID and clique) where every GPU
  reports itself registered in the same one (multi-node NVLink, e.g. GB200 NVL72);
- GFD's ``nvidia.com/gpu.product`` / ``.count`` / ``.memory`` only where GFD has not written them: never overwritten.

The mapping from a reading to labels is a pure function (``label_patch``), unit-tested on readings of real topologies
(tests/unit/test_labeler.py); ``read_nvml`` is the thin NVML reader. Least privilege: get and patch on nodes.

    NODE_NAME=gpu-0 python -m modeld_operator.labeler [--once] [--interval 300]
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import modeld_api as api

log = logging.getLogger("modeld_operator.labeler")
LABEL_NVLINK_DOMAIN = f"{api.GROUP}/nvlink-domain"
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
# nvmlDeviceGetNvLinkRemoteDeviceType: NVML_NVLINK_DEVICE_TYPE_GPU, _IBMNPU, _SWITCH, _UNKNOWN
REMOTE_GPU, REMOTE_SWITCH = 0, 2
FABRIC_COMPLETED = 3            # NVML_GPU_FABRIC_STATE_COMPLETED: registered with the fabric manager


@dataclass(frozen=True)
class Link:
    """One active NVLink of a GPU: the PCI bus id at its far end and what is there (REMOTE_GPU, REMOTE_SWITCH...)."""

    remote_bus_id: str
    remote_type: int


@dataclass(frozen=True)
class GPU:
    bus_id: str                                  # PCI bus id, as NVML writes it ("00000000:18:00.0")
    product: str                                 # nvmlDeviceGetName: "NVIDIA H100 80GB HBM3"
    memory_mib: int
    links: tuple[Link, ...] = ()                 # active NVLinks only
    fabric: str | None = None                    # "<clusterUuid>.<cliqueId>" once registered in an NVLink domain


@dataclass(frozen=True)
class Reading:
    gpus: tuple[GPU, ...] = field(default_factory=tuple)


def _bus(bus_id: str) -> str:
    """NVML writes bus ids with 8 or 4 domain digits and in either case; compare them as domain:bus:device.fn."""
    parts = bus_id.strip().lower().split(":")
    if len(parts) == 3:
        parts[0] = parts[0][-4:].rjust(4, "0")
    return ":".join(parts)


def interconnect(reading: Reading) -> str:
    gpus = reading.gpus
    if len(gpus) <= 1:
        return "none"
    if all(any(link.remote_type == REMOTE_SWITCH for link in g.links) for g in gpus):
        return "nvswitch"
    peers = {_bus(g.bus_id): {_bus(link.remote_bus_id) for link in g.links if link.remote_type == REMOTE_GPU}
             for g in gpus}
    buses = list(peers)
    if all(b in peers[a] or a in peers[b] for i, a in enumerate(buses) for b in buses[i + 1:]):
        return "nvlink"
    return "pcie"


def nvlink_domain(reading: Reading) -> str | None:
    domains = {g.fabric for g in reading.gpus}
    if len(domains) != 1 or None in domains:
        return None
    (domain,) = domains
    assert domain is not None
    return _as_label_value(domain) or None


def gfd_product(name: str) -> str:
    """NVML's device name as GPU Feature Discovery writes it in nvidia.com/gpu.product ("NVIDIA-H100-80GB-HBM3")."""
    return _as_label_value(name)


def _as_label_value(text: str) -> str:
    """Characters a label value cannot hold become "-"; at most 63, starting and ending alphanumeric."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", text.strip())[:63].strip("-_.")


def label_patch(current: Mapping[str, str], reading: Reading) -> dict[str, str | None]:
    """The labels to write on a node now labelled ``current`` (a merge patch of metadata.labels; empty when nothing
    changes). modeld's labels follow the reading; GFD's are written only where absent."""
    if not reading.gpus:
        return {}                  # NVML sees no GPU: leave the node as it is (the DaemonSet runs on GPU nodes)
    want: dict[str, str | None] = {api.LABEL_INTERCONNECT: interconnect(reading),
                                   LABEL_NVLINK_DOMAIN: nvlink_domain(reading)}
    gfd = {api.LABEL_GPU_PRODUCT: gfd_product(reading.gpus[0].product), api.LABEL_GPU_COUNT: str(len(reading.gpus)),
           api.LABEL_GPU_MEMORY: str(min(g.memory_mib for g in reading.gpus))}
    want.update({k: v for k, v in gfd.items() if k not in current})
    for key, value in want.items():
        if value is not None and not _LABEL_VALUE.fullmatch(value):
            raise ValueError(f"label {key}={value!r} is not a valid label value")
    return {k: v for k, v in want.items() if current.get(k) != v and not (v is None and k not in current)}


def read_nvml() -> Reading:
    """The node's GPUs as NVML reports them (nvidia-ml-py). Runs where the NVIDIA driver is: the DaemonSet's pod."""
    import pynvml

    pynvml.nvmlInit()
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            bus = pynvml.nvmlDeviceGetPciInfo(h).busId
            links = []
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(h, link) != pynvml.NVML_FEATURE_ENABLED:
                        continue
                    remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo_v2(h, link).busId
                    kind = pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(h, link)
                except pynvml.NVMLError:
                    continue           # no such link on this GPU, or NVLink not supported (a PCIe card)
                links.append(Link(_text(remote), int(kind)))
            gpus.append(GPU(_text(bus), _text(name), int(pynvml.nvmlDeviceGetMemoryInfo(h).total) >> 20,
                            tuple(links), _fabric(pynvml, h)))
        return Reading(tuple(gpus))
    finally:
        pynvml.nvmlShutdown()


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _fabric(pynvml: Any, handle: Any) -> str | None:
    """The GPU's NVLink domain as "<cluster uuid hex>.<clique id>", or None outside one. nvidia-ml-py's
    nvmlDeviceGetGpuFabricInfo fills a caller's c_nvmlGpuFabricInfo_t (passed by reference) and returns a status,
    like the C call; it does not return the struct (seen on an H200 with nvidia-ml-py 13.615)."""
    try:
        info = pynvml.c_nvmlGpuFabricInfo_t()
        pynvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))
    except (AttributeError, pynvml.NVMLError):
        return None                # older drivers or bindings, or a GPU outside any NVLink domain
    if int(info.state) != FABRIC_COMPLETED or not any(info.clusterUuid):
        return None
    uuid = bytes(info.clusterUuid).hex()
    return f"{uuid}.{int(info.cliqueId)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--node", default=os.environ.get("NODE_NAME", ""), help="this node's name (downward API)")
    ap.add_argument("--interval", type=float, default=float(os.environ.get("MODELD_LABELER_INTERVAL", "300")))
    ap.add_argument("--once", action="store_true", help="label once and exit")
    args = ap.parse_args()
    if not args.node:
        raise SystemExit("modeld-labeler: the node name is required (--node or NODE_NAME)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from kubernetes import client, config

    config.load_incluster_config() if os.environ.get("KUBERNETES_SERVICE_HOST") else config.load_kube_config()
    core = client.CoreV1Api()
    while True:
        reading = read_nvml()
        meta = core.read_node(args.node).metadata
        labels = (meta.labels if meta is not None else None) or {}
        patch = label_patch(labels, reading)
        if patch:
            core.patch_node(args.node, {"metadata": {"labels": patch}})
            log.info("node %s: %d GPU(s); labelled %s", args.node, len(reading.gpus), patch)
        if args.once:
            return
        time.sleep(args.interval)


if __name__ == "__main__":
    main()
