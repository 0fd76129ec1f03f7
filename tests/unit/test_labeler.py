"""The node labeler's mapping (labeler.label_patch) on NVML readings of real topologies: an HGX board on NVSwitch, a
bridged NVLink pair, two bridged pairs, a PCIe workstation, a single GPU, a multi-node NVLink domain; GPU Feature
Discovery's labels are never overwritten, and a node already labelled gets no patch."""

from __future__ import annotations

import ctypes

import pytest

import modeld_api as api
from modeld_operator.labeler import (
    GPU,
    LABEL_NVLINK_DOMAIN,
    REMOTE_GPU,
    REMOTE_SWITCH,
    Link,
    Reading,
    _fabric,
    label_patch,
)

pytestmark = pytest.mark.unit

H100 = ("NVIDIA H100 80GB HBM3", 81559)


def bus(i: int, domain_digits: int = 8) -> str:
    return f"{0:0{domain_digits}X}:{0x18 + 0x10 * i:02X}:00.0"


def hgx(n: int = 8, fabric: str | None = None) -> Reading:
    """Each GPU's 18 NVLinks go to the board's NVSwitches (their own PCI functions)."""
    switches = [f"00000000:{0xA0 + s:02X}:00.0" for s in range(4)]
    return Reading(tuple(GPU(bus(i), *H100, tuple(Link(switches[k % 4], REMOTE_SWITCH) for k in range(18)), fabric)
                         for i in range(n)))


def bridged(pairs: int, product: tuple[str, int] = ("NVIDIA A100-PCIE-40GB", 40960)) -> Reading:
    """Pairs of PCIe cards joined by an NVLink bridge (4 links per card to its partner)."""
    gpus = []
    for p in range(pairs):
        a, b = bus(2 * p), bus(2 * p + 1, domain_digits=4)        # NVML writes either width
        gpus += [GPU(a, *product, tuple(Link(b, REMOTE_GPU) for _ in range(4))),
                 GPU(b, *product, tuple(Link(a, REMOTE_GPU) for _ in range(4)))]
    return Reading(tuple(gpus))


@pytest.mark.parametrize(("reading", "link"), [
    (hgx(), "nvswitch"),
    (bridged(1), "nvlink"),
    (bridged(2), "pcie"),                          # a cell on all four would talk over PCIe between the pairs
    (Reading((GPU(bus(0), "NVIDIA GeForce RTX 4090", 24564), GPU(bus(1), "NVIDIA GeForce RTX 4090", 24564))), "pcie"),
    (Reading((GPU(bus(0), "NVIDIA H200", 143771),)), "none"),
    (Reading(tuple(GPU(bus(i), *H100, tuple(Link(bus(j), REMOTE_GPU) for j in range(4) if j != i))
                   for i in range(4))), "nvlink"),   # four GPUs, every pair joined directly
], ids=["hgx-8-nvswitch", "bridged-pair", "two-bridged-pairs", "pcie-workstation", "single-h200", "4-gpu-full-mesh"])
def test_interconnect_from_real_topologies(reading, link):
    patch = label_patch({}, reading)
    assert patch[api.LABEL_INTERCONNECT] == link
    assert LABEL_NVLINK_DOMAIN not in patch


def test_gfd_labels_are_written_only_where_absent():
    fresh = label_patch({}, hgx())
    assert fresh[api.LABEL_GPU_PRODUCT] == "NVIDIA-H100-80GB-HBM3"          # as GPU Feature Discovery writes it
    assert fresh[api.LABEL_GPU_COUNT] == "8" and fresh[api.LABEL_GPU_MEMORY] == "81559"
    gfd = {api.LABEL_GPU_PRODUCT: "NVIDIA-H100-80GB-HBM3-SXM", api.LABEL_GPU_COUNT: "8", api.LABEL_GPU_MEMORY: "81920"}
    assert label_patch(gfd, hgx()) == {api.LABEL_INTERCONNECT: "nvswitch"}   # GFD's own values stand


def test_a_labelled_node_gets_no_patch_and_a_changed_one_only_the_difference():
    reading = bridged(1)
    labels = dict(label_patch({}, reading))
    assert label_patch(labels, reading) == {}
    assert label_patch({**labels, api.LABEL_INTERCONNECT: "nvswitch"}, reading) == {api.LABEL_INTERCONNECT: "nvlink"}


def test_a_multi_node_nvlink_domain_is_labelled_and_removed_when_gone():
    domain = "5f1b0c3a9e2d4b6c8a7f1e0d2c3b4a59.7"
    patch = label_patch({}, hgx(4, fabric=domain))
    assert patch[api.LABEL_INTERCONNECT] == "nvswitch" and patch[LABEL_NVLINK_DOMAIN] == domain
    mixed = Reading(hgx(2, fabric=domain).gpus + hgx(1).gpus)              # one GPU not registered: no domain
    assert LABEL_NVLINK_DOMAIN not in label_patch({}, mixed)
    assert label_patch({LABEL_NVLINK_DOMAIN: domain, **{k: v for k, v in patch.items() if k != LABEL_NVLINK_DOMAIN
                                                        and v is not None}}, hgx(4)) == {LABEL_NVLINK_DOMAIN: None}


def test_a_node_where_nvml_sees_no_gpu_is_left_alone():
    assert label_patch({api.LABEL_INTERCONNECT: "nvswitch"}, Reading()) == {}


class _FabricBinding:
    """nvidia-ml-py's fabric call as its 13.x binding declares it (seen on an H200): the caller passes a
    c_nvmlGpuFabricInfo_t by reference, NVML fills it, and the call returns a status, not the struct."""

    class NVMLError(Exception):
        pass

    class c_nvmlGpuFabricInfo_t(ctypes.Structure):  # noqa: N801  (the binding's name)
        _fields_ = [("clusterUuid", ctypes.c_uint8 * 16), ("status", ctypes.c_uint), ("cliqueId", ctypes.c_uint32),
                    ("state", ctypes.c_uint8)]

    def __init__(self, uuid: bytes | None, clique: int = 0, state: int = 3) -> None:
        self.uuid, self.clique, self.state = uuid, clique, state

    def nvmlDeviceGetGpuFabricInfo(self, handle, info) -> int:  # noqa: N802, ANN001
        if self.uuid is None:
            raise self.NVMLError("Not Supported")
        s = info._obj                                     # ctypes.byref(x)._obj is x: NVML writes through it
        s.clusterUuid[:] = list(self.uuid)
        s.cliqueId, s.state = self.clique, self.state
        return 0


def test_the_fabric_reading_uses_nvml_bindings_out_parameter():
    uuid = bytes(range(1, 17))
    assert _fabric(_FabricBinding(uuid, clique=7), handle=None) == f"{uuid.hex()}.7"
    assert _fabric(_FabricBinding(uuid, state=1), handle=None) is None           # not yet registered with the fabric
    assert _fabric(_FabricBinding(bytes(16)), handle=None) is None               # no cluster: a GPU outside a domain
    assert _fabric(_FabricBinding(None), handle=None) is None                    # the driver says not supported
