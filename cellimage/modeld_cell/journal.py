"""The session store: each session's committed state at turn boundaries, so a session outlives its worker process.

With ``MODELD_SESSION_STORE`` set to a directory (the Cell's ``sessionStore`` volume, or a directory the local
cluster's pods share), the engine writes one small JSON file per session after every request that completes: an
EnsurePrefix, a PrefillSuffix, a decode that finished (its stream ended with ``done``). The file holds the session's
tokens, its token totals, its cache scope's chain root and the cell's identity root; not the KV. Closing a session
deletes it. A decode killed mid-stream was never committed: the file still holds the state before it, so the retried
decode regenerates from there (greedy: the same tokens).

After the process is lost (``kill -9``, a replaced pod), the first request on a session id the engine does not hold
recovers it from the file: the tokens are prefilled again (the cell's own prefix cache and chunked prefill; exact
where the engine's reuse is exact, docs/reuse.md) and the totals carried over; the response says so
(``restored``). A file written under another cache identity (other weights, KV format, backend...) is never used:
the session is reported lost, with that reason.

Why tokens and not the KV: a turn's commit then costs a few kilobytes (4 bytes a token, as JSON digits) however long
the session, where a KV snapshot costs ``kv_bytes`` (23,040 bytes a token for SmolLM2-135M in bf16) on every turn; the
price is paid once, at recovery, as one prefill. Explicit snapshots (``/snapshot``, ``/restore``) stay for moving a
session's KV itself. Writes are atomic (a temporary file, then ``os.replace``): a reader sees the old state or the
new, never half of one. They are not fsync'd: they survive the loss of the process, not of the node's page cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("modeld_cell.journal")
VERSION = 1


class Journal:
    def __init__(self, directory: str, identity_root: bytes) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.identity = identity_root.hex()
        self.commits, self.bytes_written, self.commit_s = 0, 0, 0.0

    def path(self, session_id: str) -> Path:
        """The session's file: named by a hash of its id (ids may hold characters a file name should not)."""
        return self.dir / f"{hashlib.sha256(session_id.encode()).hexdigest()[:40]}.json"

    def commit(self, session_id: str, tokens: list[int], totals: dict[str, int], scope_root: bytes) -> int:
        """Write the session's committed state atomically; returns the bytes written."""
        t = time.perf_counter()
        body = json.dumps({"version": VERSION, "session_id": session_id, "identity": self.identity,
                           "scope": scope_root.hex(), "tokens": tokens, "totals": totals,
                           "committed_at": time.time()}, separators=(",", ":")).encode()
        p = self.path(session_id)
        tmp = p.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(body)
        os.replace(tmp, p)
        self.commits += 1
        self.bytes_written += len(body)
        self.commit_s += time.perf_counter() - t
        return len(body)

    def read(self, session_id: str) -> tuple[dict[str, Any] | None, str | None]:
        """(the committed state, None), or (None, why it cannot be used), or (None, None) when there is none."""
        p = self.path(session_id)
        try:
            d = json.loads(p.read_bytes())
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError) as e:
            return None, f"the stored state of session {session_id!r} is unreadable: {e}"
        if not isinstance(d, dict) or d.get("version") != VERSION or d.get("session_id") != session_id:
            return None, f"the stored state of session {session_id!r} is not a version-{VERSION} record of it"
        if d.get("identity") != self.identity:
            return None, (f"session {session_id!r} was stored by a cell with another cache identity (other weights, "
                          "KV format, backend, attention or CPU/GPU kernels); its tokens would not continue the same "
                          "computation here")
        toks = d.get("tokens")
        if not isinstance(toks, list) or not toks or not all(isinstance(x, int) and x >= 0 for x in toks):
            return None, f"the stored state of session {session_id!r} holds no valid tokens"
        return d, None

    def drop(self, session_id: str) -> bool:
        """Delete the session's stored state; False when there was none."""
        try:
            self.path(session_id).unlink()
        except FileNotFoundError:
            return False
        return True

    def stats(self) -> dict[str, Any]:
        return {"dir": str(self.dir), "commits": self.commits, "bytes_written": self.bytes_written,
                "commit_ms_total": round(self.commit_s * 1e3, 3)}
