"""The snapshot file format (version 2; docs/reuse.md "Snapshot format"): atomic writes, one-read verification.

File: MAGIC(16) | u32 version | u64 header length | header JSON (space-padded so the payload starts 64-byte aligned)
| payload tensors as the header's table lists them | sha256(32) of everything before it. The engine builds the
header (identity, session, payload table) and checks identity and shapes on restore; this module owns the bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import os
import struct
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from . import __version__, errors
from .blocks import Session
from .contract import Trace, elapsed_ms

if TYPE_CHECKING:
    from .engine import Engine

SNAPSHOT_MAGIC = b"MODELD-SNAPSHOT\x00"   # 16 bytes
SNAPSHOT_VERSION = 2                      # v2: full cache identity, typed payload table (docs/reuse.md)


class SnapshotError(Exception):
    def __init__(self, msg: str, **details: Any) -> None:
        super().__init__(msg)
        self.details = details


def tensor_view(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor without copying (bf16/fp16 through an int16 view, fp8 through uint8: numpy has
    neither)."""
    t = t.contiguous().cpu()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    elif t.dtype == torch.float8_e4m3fn:
        t = t.view(torch.uint8)
    return memoryview(t.numpy()).cast("B")


def buffer_tensor(buf: bytearray, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over ``buf`` (no copy)."""
    n = math.prod(shape)
    if dtype in (torch.bfloat16, torch.float16):
        return torch.frombuffer(buf, dtype=torch.int16, count=n, offset=offset).view(dtype).reshape(shape)
    if dtype == torch.float8_e4m3fn:
        return torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=offset).view(dtype).reshape(shape)
    return torch.frombuffer(buf, dtype=dtype, count=n, offset=offset).reshape(shape)


def _write_chunk(f: Any, b: Any) -> None:
    f.write(b)


def write_atomic(path: str, parts: Sequence[Any]) -> tuple[int, str]:
    """Write parts + their sha256 to ``path``: tmp file beside it, fsync, os.replace, fsync the directory.
    Returns (bytes, sha256 hex). On any failure the tmp file is removed and ``path`` is untouched."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    h = hashlib.sha256()
    size = 0
    try:
        with open(tmp, "wb") as f:
            for p in parts:
                h.update(p)
                _write_chunk(f, p)
                size += memoryview(p).nbytes
            digest = h.digest()
            _write_chunk(f, digest)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):                 # make the rename durable (not every filesystem allows it)
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return size + 32, digest.hex()


def read_snapshot(path: str) -> tuple[dict, bytearray, int]:
    """Read and verify a snapshot file in one go: (header, whole file buffer, payload offset). SnapshotError names
    what is wrong: magic, version, checksum (corrupt or truncated), header."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        buf = bytearray(size)
        got = f.readinto(buf)
    if got != size:
        raise SnapshotError(f"short read ({got} of {size} bytes)")
    head = len(SNAPSHOT_MAGIC) + 12
    if size < head + 32 or not buf.startswith(SNAPSHOT_MAGIC):
        raise SnapshotError("not a modeld snapshot (bad magic or too short)")
    version, hlen = struct.unpack_from("<IQ", buf, len(SNAPSHOT_MAGIC))
    if version != SNAPSHOT_VERSION:
        raise SnapshotError(f"snapshot format version {version}, this worker reads version {SNAPSHOT_VERSION} "
                             "(re-create the snapshot with this worker)", version=version,
                             supported=SNAPSHOT_VERSION)
    mv = memoryview(buf)
    if hashlib.sha256(mv[:-32]).digest() != bytes(mv[-32:]):
        raise SnapshotError("checksum mismatch: the file is corrupt or truncated")
    if head + hlen > size - 32:
        raise SnapshotError("header length points past the end of the file")
    try:
        header = json.loads(bytes(mv[head : head + hlen]))
    except ValueError as e:
        raise SnapshotError(f"unreadable header: {e}") from None
    if not isinstance(header, dict):
        raise SnapshotError("header is not a JSON object")
    return header, buf, head + hlen


# ---- the engine side: a session written and read back (the header is built here, K/V go through the cache)


async def write_session(eng: Engine, session_id: str, path: str) -> dict:
    """Write the session (K/V, token ids, identity, accounting) to ``path`` atomically: a temporary file in the
    same directory, fsync, ``os.replace``, fsync of the directory. A failure leaves any earlier file at
    ``path`` as it was and no partial file under that name.

    File (v2): MAGIC(16) | u32 version | u64 header length | header JSON (space-padded so the payload starts
    64-byte aligned) | payload tensors as the header's table lists them | sha256(32) of everything before it.
    """
    t0 = time.perf_counter()
    eng._check_ready()
    s = eng._session(session_id)
    eng._claim(s, "snapshot")
    try:
        def work() -> dict:
            a = eng.model.args
            # k, v: [L, kv_len, Hkv, D] (copies), + fp16 k_scale, v_scale when quantized
            tensors = eng.kv.read_payload(s.blocks, s.kv_len)
            tensors += [("logits", s.logits.float().cpu())] if s.logits is not None else []
            table, off = [], 0
            for name, t in tensors:
                n = t.numel() * t.element_size()
                table.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                              "offset": off, "bytes": n})
                off += n
            header = {"version": SNAPSHOT_VERSION, "identity": eng._snapshot_identity(),
                      "session": {"tokens": s.tokens, "kv_len": s.kv_len, "totals": s.totals,
                                  "has_logits": s.logits is not None, "vocab_size": eng.vocab_size,
                                  "kv_layout": [a.n_layers, s.kv_len, a.n_kv_heads, a.head_dim]},
                      "payload": table, "payload_bytes": off, "writer": f"modeld {__version__}",
                      "created": time.time()}
            hb = json.dumps(header, separators=(",", ":")).encode()
            pad = -(len(SNAPSHOT_MAGIC) + 12 + len(hb)) % 64
            hb += b" " * pad
            head = SNAPSHOT_MAGIC + struct.pack("<IQ", SNAPSHOT_VERSION, len(hb)) + hb
            size, digest = write_atomic(path, [head] + [tensor_view(t) for _, t in tensors])
            return {"path": path, "bytes": size, "sha256": digest, "version": SNAPSHOT_VERSION,
                    "session_tokens": len(s.tokens), "kv_tokens": s.kv_len, "identity": header["identity"]}

        await eng.recompute_decoded(s)     # the file holds a prefill's K/V only (the recomputing decode step's not)
        info, cancelled = await eng._thread.run(work)   # a cancellation waits for the write to finish
        if cancelled:
            raise asyncio.CancelledError()
        info["write_ms"] = elapsed_ms(t0)
        return info
    except (FileExistsError, IsADirectoryError, NotADirectoryError) as e:
        # what the snapshot directory holds is in the way: a file where a folder is needed, or a folder at path
        raise eng._err(errors.Conflict(f"cannot write snapshot to {path}: {e.strerror} ({e.filename})", path=path,
                                       field="path")) from e
    except OSError as e:
        raise eng._err(errors.BadRequest(f"cannot write snapshot to {path}: {e}", path=path)) from e
    except RuntimeError as e:      # the backend failed reading the K/V (e.g. a lost rank): Fatal, not ready
        raise eng._fatal(e) from e
    finally:
        s.busy = None

async def restore_session(eng: Engine, session_id: str, path: str, cache_salt: str | None = None) -> Trace:
    """Load a snapshot into ``session_id`` (replacing what it held). Refuses foreign, corrupt, truncated or
    other-version files with BadRequest, a missing one with NotFound, one beyond the tier or the budget with
    Overflow; on any error the session is untouched. The file is read in one go into a buffer, verified, and
    its K/V copied into the session's blocks with one indexed copy per tensor (no per-token work)."""
    t0 = time.perf_counter()
    eng._check_ready()
    if not os.path.isfile(path):
        raise eng._err(errors.NotFound(f"snapshot {path} not found", path=path))
    try:
        header, buf, base = await asyncio.to_thread(read_snapshot, path)
    except SnapshotError as e:
        raise eng._err(errors.BadRequest(f"snapshot {path} refused: {e}", path=path, **e.details)) from None
    except OSError as e:
        raise eng._err(errors.BadRequest(f"snapshot {path} refused: unreadable: {e}", path=path)) from None

    def bad(msg: str, **kw: Any) -> errors.BadRequest:
        return eng._err(errors.BadRequest(f"snapshot {path} refused: {msg}", path=path, **kw))

    mine, theirs = eng._snapshot_identity(), header.get("identity") or {}
    diff = {k: {"snapshot": theirs.get(k), "engine": v} for k, v in mine.items() if theirs.get(k) != v}
    if diff:
        raise bad("foreign snapshot (identity differs: " + ", ".join(sorted(diff)) + ")", mismatch=diff)
    try:
        sess = header["session"]
        toks = eng._validate_tokens(sess["tokens"], "snapshot tokens")
        kv_len = int(sess["kv_len"])
        table = {t["name"]: t for t in header["payload"]}
        spec = eng.kv.payload_spec(kv_len)                          # {name: (dtype, shape)} as stored here
        for name, (dt, shp) in spec.items():
            t, want = table[name], str(dt).removeprefix("torch.")
            if tuple(t["shape"]) != shp or t["dtype"] != want:
                hint = (" (written with fp32 KV scales, before they became fp16; recompute the session)"
                        if name.endswith("_scale") and t["dtype"] == "float32" else "")
                raise bad(f"tensor {name} is {t['dtype']}{t['shape']}, expected {want}{list(shp)}{hint}")
        if sess.get("has_logits") and (tuple(table["logits"]["shape"]) != (eng.vocab_size,)
                                       or table["logits"]["dtype"] != "float32"):
            raise bad("logits do not match the vocabulary")
        ends = [base + t["offset"] + t["bytes"] for t in table.values()]
        if max(ends, default=base) > len(buf) - 32:
            raise bad("payload table points past the end of the file")
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, errors.ContractError):
            raise
        raise bad(f"malformed header: {type(e).__name__}: {e}") from None
    if not len(toks) - 1 <= kv_len <= len(toks) or kv_len < 0:
        raise bad(f"kv_len {kv_len} inconsistent with {len(toks)} tokens")
    if len(toks) > eng.context_tier:
        raise eng._err(errors.Overflow(f"snapshot holds {len(toks)} tokens, beyond the context tier "
                                        f"{eng.context_tier}", session_id=session_id))
    s = eng.scoped_session(session_id, cache_salt)
    if s is not None and s.busy is not None:
        eng._claim(s, "restore")
    released = sum(1 for b in s.blocks if eng.kv.ref[b] == 1) if s is not None else 0
    eng.blocks.fits(eng.kv.blocks_for(len(toks)), released=released)
    # ---- commit (nothing below can fail on input)
    if s is None:
        s = Session(session_id, root=eng.scope_root(cache_salt))
        eng._sessions[session_id] = s
    eng._claim(s, "restore")
    try:
        eng.kv.free(s.blocks[::-1])
        s.blocks, s.hashes = [], []
        s.tokens, s.kv_len, s.logits = [], 0, None
        eng.blocks.grow(s, len(toks))
        k, v, *sc = (buffer_tensor(buf, base + table[n]["offset"], *spec[n]) for n in spec)
        scales = (sc[0], sc[1]) if sc else None
        logits = None
        if sess.get("has_logits"):
            logits = buffer_tensor(buf, base + table["logits"]["offset"], torch.float32,
                                    (eng.vocab_size,)).clone()
        _, cancelled = await eng._torch(eng.kv.write_tokens, s.blocks, k, v, scales)
        s.tokens, s.kv_len, s.logits = toks, kv_len, logits
        s.totals = {k2: int(sess["totals"].get(k2, 0)) for k2 in s.totals}
        eng.blocks.register(s)
        if cancelled:
            raise asyncio.CancelledError()
    finally:
        s.busy = None
    ms = elapsed_ms(t0)
    return Trace(session_id=s.id, tokens_reused=0, session_tokens=len(s.tokens),
                 kv_bytes=len(s.blocks) * eng.kv.block_bytes, total_ms=ms, totals=dict(s.totals),
                 restore_ms=ms, reuse={"hit": False, "source": "snapshot", "tokens_restored": kv_len,
                                       "bytes_read": len(buf), "blocks_written": len(s.blocks)})
