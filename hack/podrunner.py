"""Runs opted-in pods of the local cluster as local processes, bound to their loopback pod IPs.

kwok marks pods on fake nodes Running and gives them an IP from a loopback CIDR, but runs nothing. For pods labelled
``modeld.contenox.io/local-run: "true"`` this runner starts the first container's command + args as a local process
with the container's environment (plain values and the downward-API fields status.podIP, metadata.name,
metadata.namespace, spec.nodeName), so clients reach a real worker at http://<podIP>:<port> exactly as in a cluster.
A process stops when its pod goes away; one that exits is restarted with back-off, as the kubelet would, unless
the pod's restartPolicy is Never (a Job's pod): then the runner reports the pod Succeeded or Failed with the
container's termination message, read from a local file that stands in for terminationMessagePath.

    python hack/podrunner.py --kubeconfig FILE --log-dir DIR
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes import client, config, watch

LABEL = "modeld.contenox.io/local-run=true"
# How long a stopped pod's processes get between SIGTERM and SIGKILL. Shorter than the kubelet's 30 s default grace
# (and than a worker's 25 s drain limit), so `hack/cluster down` waits for it and no worker outlives its cluster
# holding a pod IP the next cluster hands out again.
STOP_GRACE_S = 10.0
log = logging.getLogger("podrunner")


# prctl(PR_SET_PDEATHSIG, SIGTERM): the kernel sends a pod's process SIGTERM when the runner dies, even by SIGKILL, so a
# killed runner cannot leave workers holding pod IPs that the next cluster hands out again (a stray worker of an
# earlier run once kept 127.30.0.5:8080 and failed the next run's e2e test). Linux only; elsewhere stop_all alone.
PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _die_with(parent: int) -> None:
    """Runs in the child between fork and exec: nothing here may take a lock or allocate much (a ctypes call and two
    system calls)."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
    if os.getppid() != parent:        # the runner died before prctl took effect: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


def _signal_group(run: Running, sig: signal.Signals) -> None:
    assert run.proc is not None
    try:
        os.killpg(run.proc.pid, sig)
    except ProcessLookupError:       # exited between the check and the signal
        pass


@dataclass
class Running:
    key: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    namespace: str = ""
    name: str = ""
    restart_policy: str = "Always"
    termination_file: Path | None = None
    restarts: int = 0
    next_start: float = 0.0
    stopped: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


def _field(pod: client.V1Pod, path: str) -> str:
    values = {
        "status.podIP": pod.status.pod_ip,
        "metadata.name": pod.metadata.name,
        "metadata.namespace": pod.metadata.namespace,
        "spec.nodeName": pod.spec.node_name,
    }
    if path not in values:
        raise ValueError(f"fieldRef {path} is not supported by the local pod runner")
    return values[path] or ""


def _expand(text: str, env: dict[str, str]) -> str:
    # Kubernetes expands $(VAR) in command and args; $$(VAR) escapes it.
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def plan(pod: client.V1Pod, log_dir: Path) -> Running:
    container = pod.spec.containers[0]
    env = dict(os.environ)
    for var in container.env or []:
        if var.value is not None:
            env[var.name] = _expand(var.value, env)
        elif var.value_from is not None and var.value_from.field_ref is not None:
            env[var.name] = _field(pod, var.value_from.field_ref.field_path)
        else:
            raise ValueError(f"env {var.name}: only value and fieldRef are supported by the local pod runner")
    argv = [_expand(a, env) for a in (container.command or []) + (container.args or [])]
    # The kubelet mounts a file at terminationMessagePath; here an argument naming it points at a local file instead.
    term_path = container.termination_message_path or "/dev/termination-log"
    termination_file = log_dir / f"{pod.metadata.namespace}_{pod.metadata.name}.termination"
    argv = [str(termination_file) if a == term_path else a for a in argv]
    if not argv:
        raise ValueError("container has no command: the local runner cannot use the image's entrypoint")
    # Prefer executables of this interpreter's environment (the project's virtualenv).
    local = Path(sys.executable).parent / argv[0]
    if local.exists():
        argv[0] = str(local)
    elif shutil.which(argv[0]) is None:
        raise ValueError(f"command {argv[0]!r} not found on this machine")
    key = f"{pod.metadata.namespace}/{pod.metadata.name}"
    return Running(
        key, argv, env, log_dir / f"{pod.metadata.namespace}_{pod.metadata.name}.log",
        namespace=pod.metadata.namespace, name=pod.metadata.name,
        restart_policy=pod.spec.restart_policy or "Always", termination_file=termination_file,
    )


class Runner:
    def __init__(self, log_dir: Path, core: client.CoreV1Api | None = None) -> None:
        self.log_dir = log_dir
        self.core = core
        self.pods: dict[str, Running] = {}
        self.lock = threading.Lock()

    def ensure(self, pod: client.V1Pod) -> None:
        key = f"{pod.metadata.namespace}/{pod.metadata.name}"
        ready = pod.status.phase == "Running" and pod.status.pod_ip and not pod.metadata.deletion_timestamp
        with self.lock:
            if pod.status.phase in ("Succeeded", "Failed") and key in self.pods:
                return  # finished: keep the record so it is not started again
            if not ready:
                if key in self.pods:
                    self.stop(self.pods.pop(key))
                return
            if key in self.pods:
                return
            try:
                run = plan(pod, self.log_dir)
            except ValueError as exc:
                log.error("pod %s: %s", key, exc)
                return
            self.pods[key] = run
            self.spawn(run)

    def forget(self, key: str) -> None:
        with self.lock:
            if key in self.pods:
                self.stop(self.pods.pop(key))

    def spawn(self, run: Running) -> None:
        out = open(run.log_path, "ab")
        out.write(f"--- start {time.strftime('%FT%TZ', time.gmtime())}: {' '.join(run.argv)}\n".encode())
        out.flush()
        parent = os.getpid()
        # The death signal is tied to the thread that forks: spawn runs on the main thread or the reaper thread, and
        # both live as long as the runner does.
        run.proc = subprocess.Popen(run.argv, env=run.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=lambda: _die_with(parent))
        log.info("pod %s: started pid %d", run.key, run.proc.pid)

    def stop(self, run: Running) -> None:
        self.stop_all([run])

    @staticmethod
    def stop_all(runs: list[Running], grace: float = STOP_GRACE_S) -> None:
        """SIGTERM every process group at once, then SIGKILL those still alive after ``grace`` seconds: a worker
        drains in flight requests on SIGTERM, and stopping N of them costs one grace period, not N."""
        live = [r for r in runs if r.proc is not None and r.proc.poll() is None]
        for run in runs:
            run.stopped = True
        for run in live:
            _signal_group(run, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for run in live:
            assert run.proc is not None
            try:
                run.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(run, signal.SIGKILL)
                run.proc.wait()
        for run in runs:
            log.info("pod %s: stopped", run.key)

    def reap(self) -> None:
        """Restart exited processes with back-off (10 s doubling to 5 min), as the kubelet does."""
        now = time.monotonic()
        with self.lock:
            for run in self.pods.values():
                if run.proc is None or run.proc.poll() is None or run.stopped:
                    continue
                if run.restart_policy == "Never":
                    self.finish(run)
                    continue
                if run.next_start == 0.0:
                    delay = min(300.0, 10.0 * 2**run.restarts)
                    run.next_start = now + delay
                    log.warning("pod %s: exited with %s; restart in %.0f s", run.key, run.proc.returncode, delay)
                elif now >= run.next_start:
                    run.restarts += 1
                    run.next_start = 0.0
                    self.spawn(run)

    def finish(self, run: Running) -> None:
        """Report a pod that must not restart as Succeeded or Failed, with its termination message (4 KiB, as the kubelet)."""
        run.stopped = True
        assert run.proc is not None
        code = run.proc.returncode
        message = ""
        if run.termination_file and run.termination_file.exists():
            message = run.termination_file.read_bytes()[:4096].decode(errors="replace")
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        status = {
            "phase": "Succeeded" if code == 0 else "Failed",
            "conditions": [{"type": "Ready", "status": "False", "reason": "PodCompleted", "lastTransitionTime": now}],
            "containerStatuses": [
                {
                    "name": "main",
                    "image": "local",
                    "imageID": "",
                    "ready": False,
                    "restartCount": run.restarts,
                    "state": {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                             "message": message, "finishedAt": now}},
                }
            ],
        }
        if self.core is not None:
            try:
                pod = self.core.read_namespaced_pod(run.name, run.namespace)
                status["containerStatuses"][0]["name"] = pod.spec.containers[0].name
                status["containerStatuses"][0]["image"] = pod.spec.containers[0].image
                self.core.patch_namespaced_pod_status(run.name, run.namespace, {"status": status})
            except Exception as exc:  # the pod may be gone already
                log.warning("pod %s: cannot report completion: %s", run.key, exc)
        log.info("pod %s: exited %s, reported %s", run.key, code, status["phase"])

    def shutdown(self) -> None:
        with self.lock:
            self.stop_all(list(self.pods.values()))
            self.pods.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--log-dir", required=True, type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    config.load_kube_config(args.kubeconfig)
    core = client.CoreV1Api()
    runner = Runner(args.log_dir, core)

    def on_signal(*_: object) -> None:
        runner.shutdown()
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    threading.Thread(target=lambda: [(runner.reap(), time.sleep(1.0)) for _ in iter(int, 1)], daemon=True).start()
    while True:
        try:
            listing = core.list_pod_for_all_namespaces(label_selector=LABEL)
            seen = set()
            for pod in listing.items:
                seen.add(f"{pod.metadata.namespace}/{pod.metadata.name}")
                runner.ensure(pod)
            for key in set(runner.pods) - seen:
                runner.forget(key)
            stream = watch.Watch().stream(
                core.list_pod_for_all_namespaces,
                label_selector=LABEL,
                resource_version=listing.metadata.resource_version,
                timeout_seconds=60,
                _request_timeout=90,
            )
            for event in stream:
                pod = event["object"]
                if event["type"] == "DELETED":
                    runner.forget(f"{pod.metadata.namespace}/{pod.metadata.name}")
                else:
                    runner.ensure(pod)
        except Exception as exc:  # the apiserver restarting or a dropped watch: list again
            log.warning("watch interrupted (%s); listing again", exc)
            time.sleep(1.0)


if __name__ == "__main__":
    main()
