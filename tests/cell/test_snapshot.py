"""Snapshot / restore (format v2, docs/reuse.md): exact continuation in another engine, refusals that leave the
target session untouched, atomic writes."""

from __future__ import annotations

import hashlib
import os
import struct

import pytest
import torch

import modeld_cell.snapshot as E  # the file format: constants and the write hook
from modeld_cell import errors

from .cellutil import generate, greedy_reference

pytestmark = pytest.mark.cell


def _held(eng, sid):
    s = eng._sessions[sid]
    return list(s.tokens), s.kv_len, list(s.blocks), None if s.logits is None else s.logits.clone()


def _same(a, b) -> bool:
    return a[:3] == b[:3] and (a[3] is None) == (b[3] is None) and (a[3] is None or torch.equal(a[3], b[3]))


async def _source(eng, sid: str) -> list[int]:
    tok = eng.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me about lighthouses and ships."}]))
    await eng.ensure_prefix(sid, ids)
    await generate(eng, sid, 4, stop_token_ids=[])
    return ids


async def test_round_trip_into_a_second_engine_continues_exactly(make_engine, tmp_path):
    src, dst = make_engine(kv_mib=16), make_engine(kv_mib=16)
    await _source(src, "s")
    path = str(tmp_path / "s.snap")
    info = await src.snapshot("s", path)
    assert info["version"] == E.SNAPSHOT_VERSION == 2 and info["bytes"] == os.path.getsize(path)
    assert info["sha256"] == hashlib.sha256(open(path, "rb").read()[:-32]).hexdigest()
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    tr = await dst.restore("r", path)
    held = src.session_tokens("s")
    assert dst.session_tokens("r") == held and tr.session_tokens == len(held)
    assert tr.restore_ms is not None and tr.reuse["source"] == "snapshot" and tr.reuse["bytes_read"] == info["bytes"]
    assert tr.totals == src.sessions()[0]["totals"]
    a, _, _ = await generate(src, "s", 6, stop_token_ids=[])
    b, _, _ = await generate(dst, "r", 6, stop_token_ids=[])
    assert a == b == greedy_reference(src, held, 6)
    # the restored blocks are in the target's prefix index: another session there reuses them
    tr = await dst.ensure_prefix("other", held[:-1])
    assert tr.tokens_reused == len(held) - 2 and tr.reuse["source"] == "prefix-cache"
    # restoring over a session that holds something replaces it (same engine, same file)
    await src.restore("s", path)
    assert src.session_tokens("s") == held


def _rewrite(data: bytes, version: int | None = None) -> bytes:
    """The same snapshot with another format version and a valid checksum."""
    body = bytearray(data[:-32])
    if version is not None:
        struct.pack_into("<I", body, len(E.SNAPSHOT_MAGIC), version)
    return bytes(body) + hashlib.sha256(body).digest()


async def test_refusals_leave_the_target_untouched(make_engine, tmp_path):
    src, dst = make_engine(kv_mib=16), make_engine(kv_mib=16)
    await _source(src, "s")
    good = tmp_path / "good.snap"
    await src.snapshot("s", str(good))
    data = good.read_bytes()
    await dst.ensure_prefix("t", src.session_tokens("s")[:7])
    before, free = _held(dst, "t"), dst.kv.free_blocks
    hlen = struct.unpack_from("<Q", data, 20)[0]
    # name -> (file, what the message names where no detail can, the details beyond the path)
    cases = {
        "header-byte": (data[:40] + bytes([data[40] ^ 0x01]) + data[41:], "checksum", {}),
        "payload-byte": (data[:-100] + bytes([data[-100] ^ 0x80]) + data[-99:], "checksum", {}),
        "truncated": (data[: 28 + hlen + 1000], "checksum", {}),
        "no-checksum": (data[:-32], "checksum", {}),
        "empty": (b"", "magic", {}),
        "junk": (os.urandom(300), "magic", {}),
        "version-1": (_rewrite(data, version=1), None, {"version": 1, "supported": E.SNAPSHOT_VERSION}),
        "version-3": (_rewrite(data, version=3), None, {"version": 3, "supported": E.SNAPSHOT_VERSION}),
    }
    for name, (blob, word, details) in cases.items():
        p = tmp_path / f"{name}.snap"
        p.write_bytes(blob)
        for target in ("t", "fresh"):
            with pytest.raises(errors.BadRequest, match=word) as ei:
                await dst.restore(target, str(p))
            assert ei.value.details == {"path": str(p), **details}, name
            assert _same(_held(dst, "t"), before) and dst.kv.free_blocks == free, name
            assert "fresh" not in dst._sessions
    for field in ("model_digest", "adapter", "manifest_hash", "backend_version", "kernels", "template_hash"):
        foreign = make_engine(kv_mib=16, identity={field: "something-else"})
        await foreign.ensure_prefix("t", [1, 2, 3])
        kept = _held(foreign, "t")
        with pytest.raises(errors.BadRequest) as ei:
            await foreign.restore("t", str(good))
        mismatch = ei.value.details["mismatch"]
        assert set(mismatch) == {field} and mismatch[field]["engine"] == "something-else", mismatch
        assert _same(_held(foreign, "t"), kept)
    bf16 = make_engine(kv_mib=16, kv="bf16")
    with pytest.raises(errors.BadRequest) as ei:
        await bf16.restore("t", str(good))
    assert ei.value.details["mismatch"] == {"kv_dtype": {"snapshot": "fp32", "engine": "bf16"}}
    with pytest.raises(errors.NotFound):
        await dst.restore("t", str(tmp_path / "missing.snap"))
    assert _same(_held(dst, "t"), before)
    # and the good file still restores
    await dst.restore("t", str(good))
    assert dst.session_tokens("t") == src.session_tokens("s")


async def test_write_is_atomic(make_engine, tmp_path, monkeypatch):
    eng = make_engine(kv_mib=16)
    await _source(eng, "s")
    path = tmp_path / "a.snap"
    await eng.snapshot("s", str(path))
    good, held = path.read_bytes(), eng.session_tokens("s")
    await generate(eng, "s", 2, stop_token_ids=[])      # the session moves on; a new snapshot would differ
    real, calls = E._write_chunk, {"n": 0}

    def failing(f, b):
        calls["n"] += 1
        if calls["n"] == 2:                              # midway: after the header, in the K payload
            f.write(bytes(memoryview(b)[: len(memoryview(b)) // 2]))
            raise OSError(28, "No space left on device (simulated)")
        real(f, b)

    monkeypatch.setattr(E, "_write_chunk", failing)
    with pytest.raises(errors.BadRequest, match="No space left"):
        await eng.snapshot("s", str(path))
    calls["n"] = 0
    with pytest.raises(errors.BadRequest):
        await eng.snapshot("s", str(tmp_path / "new.snap"))
    monkeypatch.setattr(E, "_write_chunk", real)
    assert path.read_bytes() == good                     # the earlier snapshot is intact under its name
    assert not (tmp_path / "new.snap").exists()
    assert sorted(os.listdir(tmp_path)) == ["a.snap"]    # no temporary file left behind
    assert eng._sessions["s"].busy is None
    await eng.restore("s", str(path))                    # and it still restores
    assert eng.session_tokens("s") == held
