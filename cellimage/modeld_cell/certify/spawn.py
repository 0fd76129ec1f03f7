"""``--spawn``: start cell workers as local subprocesses (``python -m modeld_cell serve``) on free loopback ports,
wait until they are ready, and stop them (SIGTERM, then SIGKILL) afterwards. A multi-rank cell (``runtime.ranks``
processes for any parallelism but ``single``) starts the way its pod does: under torch's launcher
(``python -m torch.distributed.run --standalone --nproc-per-node N``), which stops every rank when it is stopped; a
data-parallel cell's copies serve on consecutive ports and the certification measures copy 0."""

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

from .client import CellError, Client

log = logging.getLogger("modeld_cell.certify")
READY_S = 900.0  # model load on a loaded machine; a safety net, never a measured timing


def free_port(span: int = 1) -> int:
    """A loopback port ``p`` with ``p .. p + span - 1`` all free when asked (a data-parallel cell's copies)."""
    for _ in range(64):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + span <= 65536 and all(_free(port + i) for i in range(1, span)):
            return port
    raise RuntimeError(f"no {span} consecutive free loopback ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class Worker:
    def __init__(self, name: str, cell_file: str, log_path: Path, spec: dict | None = None):
        import modeld_api  # the worker validates its spec with the API package

        cell = modeld_api.parse_cell_spec(spec) if spec else None   # invalid: ValueError, reported as a failed run
        ranks = modeld_api.ranks_of(cell) if cell else 1
        data = cell is not None and modeld_api.enum_value(cell.runtime.parallelism) == "data"
        self.name, self.port = name, free_port(ranks if data else 1)
        self.url = f"http://127.0.0.1:{self.port}"

        paths = [str(Path(m.__file__).resolve().parents[1]) for m in (modeld_cell, modeld_api)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = open(log_path, "wb")
        launcher = ([] if ranks == 1 else
                    ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "--max-restarts=0"])
        self.proc = subprocess.Popen(
            [sys.executable, *launcher, "-m", "modeld_cell", "serve", "--cell", cell_file, "--host", "127.0.0.1",
             "--port", str(self.port)], stdout=self._log, stderr=subprocess.STDOUT, env=env)
        log.info("spawned %s (pid %d, ranks %d) on %s, log %s", name, self.proc.pid, ranks, self.url, log_path)

    def wait_ready(self, timeout_s: float = READY_S) -> None:
        client, end = Client(self.url, timeout_s=10), time.monotonic() + timeout_s
        while True:
            try:
                if client.call("GET", "/readyz").get("ready"):
                    return
            except CellError as e:   # a worker that refused its spec stays up saying why: no point waiting
                if "refused its cell spec" in e.message:
                    raise RuntimeError(f"worker {self.name}: {e.message}") from None
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
