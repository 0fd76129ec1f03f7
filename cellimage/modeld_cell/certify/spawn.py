"""``--spawn``: start cell workers as local subprocesses (``python -m modeld_cell serve``) on free loopback ports,
wait until they are ready, and stop them (SIGTERM, then SIGKILL) afterwards."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import modeld_cell

from .client import Client

log = logging.getLogger("modeld_cell.certify")
READY_S = 900.0  # model load on a loaded machine; a safety net, never a measured timing


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    def __init__(self, name: str, cell_file: str, log_path: Path):
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        import modeld_api  # the worker validates its spec with the API package

        paths = [str(Path(m.__file__).resolve().parents[1]) for m in (modeld_cell, modeld_api)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "modeld_cell", "serve", "--cell", cell_file, "--host", "127.0.0.1",
             "--port", str(self.port)], stdout=self._log, stderr=subprocess.STDOUT, env=env)
        log.info("spawned %s (pid %d) on %s, log %s", name, self.proc.pid, self.url, log_path)

    def wait_ready(self, timeout_s: float = READY_S) -> None:
        client, end = Client(self.url, timeout_s=10), time.monotonic() + timeout_s
        while not client.ready():
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"worker {self.name} exited with {self.proc.returncode}:\n{tail}")
            if time.monotonic() > end:
                raise RuntimeError(f"worker {self.name} not ready after {timeout_s:.0f}s (log {self.log_path})")
            time.sleep(0.25)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
