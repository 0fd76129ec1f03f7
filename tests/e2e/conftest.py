"""A real local control plane (hack/cluster) for the whole run, the chart installed, and the operator running as
the chart's ServiceAccount, so every test also proves the chart's RBAC is enough."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
NAME = os.environ.get("MODELD_TEST_CLUSTER", "pytest")
ENV = {
    **os.environ,
    "MODELD_CLUSTER": NAME,
    "MODELD_PORT_BASE": os.environ.get("MODELD_TEST_PORT_BASE", "27440"),
    "MODELD_POD_CIDR": os.environ.get("MODELD_TEST_POD_CIDR", "127.30.0.0/16"),
    "MODELD_PYTHON": sys.executable,
}
RELEASE, RELEASE_NS = "modeld", "modeld-system"


def wait_until(what: str, check: Callable[[], Any], timeout: float = 60.0, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")


@dataclass
class Cluster:
    bin: Path
    kubeconfig: Path
    dir: Path

    def run(self, tool: str, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [str(self.bin / tool), f"--kubeconfig={self.kubeconfig}", *args]
        res = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=180)
        if check and res.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        return res

    def kubectl(self, *args: str, **kw: Any) -> subprocess.CompletedProcess:
        return self.run("kubectl", *args, **kw)

    def apply(self, manifest: dict | str, namespace: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        text = manifest if isinstance(manifest, str) else yaml.safe_dump(manifest)
        args = ["apply", "-f", "-"] + (["-n", namespace] if namespace else [])
        return self.kubectl(*args, input=text, check=check)

    def get(self, kind: str, name: str | None = None, namespace: str | None = None, selector: str | None = None) -> Any:
        args = ["get", kind] + ([name] if name else []) + ["-o", "json"]
        if namespace:
            args += ["-n", namespace]
        if selector:
            args += ["-l", selector]
        res = self.kubectl(*args, check=False)
        if res.returncode != 0:
            return None
        return json.loads(res.stdout)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    subprocess.run([str(ROOT / "hack" / "cluster"), "down"], env=ENV, check=False, capture_output=True)
    up = subprocess.run([str(ROOT / "hack" / "cluster"), "up"], env=ENV, capture_output=True, text=True, timeout=3600)
    if up.returncode != 0:
        pytest.fail(f"hack/cluster up failed:\n{up.stdout}\n{up.stderr}")
    bin_dir = Path(subprocess.run([str(ROOT / "hack" / "build-tools.sh")], capture_output=True, text=True, check=True).stdout.split()[-1])
    cl_dir = Path(os.path.expanduser(f"~/.cache/modeld/clusters/{NAME}"))
    c = Cluster(bin_dir, cl_dir / "kubeconfig", cl_dir)
    try:
        yield c
    finally:
        subprocess.run([str(ROOT / "hack" / "cluster"), "down"], env=ENV, check=False, capture_output=True)


@pytest.fixture(scope="session")
def chart(cluster: Cluster) -> str:
    """The chart installed with helm: CRDs, RBAC, ServiceAccount, operator Deployment."""
    cluster.kubectl("create", "namespace", RELEASE_NS, check=False)
    cluster.run(
        "helm", "install", RELEASE, str(ROOT / "charts" / "modeld"), "-n", RELEASE_NS, "--wait=false",
        "--set", "operator.statusIntervalSeconds=1",
    )
    wait_until("CRDs established", lambda: cluster.kubectl(
        "wait", "--for=condition=Established", "crd/cells.modeld.contenox.io", "crd/sessions.modeld.contenox.io",
        "--timeout=5s", check=False).returncode == 0)
    return RELEASE


@pytest.fixture(scope="session")
def operator_kubeconfig(cluster: Cluster, chart: str) -> Path:
    """A kubeconfig holding a token of the chart's ServiceAccount: the operator gets the chart's RBAC and no more."""
    res = subprocess.run([str(ROOT / "hack" / "cluster"), "sa-kubeconfig", RELEASE_NS, RELEASE],
                         env=ENV, capture_output=True, text=True, timeout=120, check=True)
    return Path(res.stdout.strip().splitlines()[-1])


OPERATORS: list[subprocess.Popen] = []      # every operator process a test started: stopped at the session's end
LEASE_DURATION_S = 10                        # short, so a standby takes over quickly after its leader is killed
OPERATOR_LOGS: list[Path] = []               # their logs: a failing test's report ends with their tails


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failing e2e test's report carries the last lines of each operator's log: what the operator did (or failed
    to) is most of what explains a failure here, and CI keeps only the test output."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed and call.when == "call":
        for log in OPERATOR_LOGS:
            try:
                # a timer's success every second says nothing and would push everything else out of the tail
                lines = [line for line in log.read_text(errors="replace").splitlines()
                         if not line.endswith("succeeded.")][-60:]
            except OSError:
                continue
            report.sections.append((f"{log.name} (last {len(lines)} lines)", "\n".join(lines)))
        cluster, namespace = item.funcargs.get("cluster"), item.funcargs.get("namespace")   # type: ignore[attr-defined]
        if isinstance(cluster, Cluster) and isinstance(namespace, str):
            report.sections.append((f"namespace {namespace} at the failure", cluster_state(cluster, namespace)))


def cluster_state(cluster: Cluster, namespace: str) -> str:
    """What a failing test's namespace held: its Cells' conditions, pods, Jobs and Events, oldest first."""
    out = []
    for args in (["get", "cells,sessions,pods,jobs", "-o", "wide"],
                 ["get", "cells", "-o", "jsonpath={range .items[*]}{.metadata.name}: {.status.conditions}{'\\n'}{end}"],
                 ["get", "events", "--sort-by=.lastTimestamp"]):
        try:
            res = cluster.kubectl(*args, "-n", namespace, check=False)
            out.append(res.stdout + res.stderr)
        except subprocess.TimeoutExpired:
            out.append(f"kubectl {' '.join(args)}: timed out")
    return "\n".join(out)[-12000:]


def start_operator(kubeconfig: Path, log: Path) -> subprocess.Popen:
    """An operator process with leader election on (as the chart runs it): the first to start leads, the others
    stand by on the Lease."""
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "MODELD_STATUS_INTERVAL": "1",
        "MODELD_RETRY_DELAY": "2",
        "MODELD_METRICS_PORT": "0",
        "MODELD_LOG_FORMAT": "plain",
        "MODELD_LEADER_ELECTION": "true",
        "MODELD_LEASE_NAMESPACE": RELEASE_NS,
        "MODELD_LEASE_DURATION": str(LEASE_DURATION_S),
    }
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "modeld_operator"], env=env, stdout=out, stderr=subprocess.STDOUT)
    OPERATORS.append(proc)
    OPERATOR_LOGS.append(log)
    return proc


@pytest.fixture(scope="session")
def operator(cluster: Cluster, operator_kubeconfig: Path) -> Iterator[Path]:
    log = cluster.dir / "operator.log"
    proc = start_operator(operator_kubeconfig, log)
    try:
        wait_until("the operator leads (holds the Lease)", lambda: proc.poll() is None and "now held by" in
                   log.read_text(errors="replace"), timeout=60)
        yield log
    finally:
        for p in OPERATORS:
            p.terminate()
        for p in OPERATORS:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    name = "t-" + request.node.name.lower().replace("_", "-").replace("[", "-").replace("]", "")[:40].strip("-")
    cluster.kubectl("create", "namespace", name)
    yield name
    # Wait, so GPUs held by this test's pods are free again for the next test.
    cluster.kubectl("delete", "namespace", name, "--timeout=120s", check=False)
