"""Cross-session prefix reuse on the real SmolLM2 (fp32): exact hits, copy-on-write branches, edits, identity, eviction.

Small engines share the loaded weights (``make_engine``); each has its own KV pool and prefix index unless a test
builds two engines over one pool to show that the cache identity keeps them apart.
"""

from __future__ import annotations

import pytest
import torch

from modeld_cell import errors
from modeld_cell.engine import CellConfig, Engine, EngineSettings
from modeld_cell.kv_cache import PagedKVCache, kv_format
from modeld_cell.prefix_index import ENGINE_IDENTITY_FIELDS, IDENTITY_KEY_FIELDS, chain_hash
from modeld_cell.runner import TorchRunner

from .cellutil import LOGIT_ATOL, full_logits, generate, greedy_reference
from .conftest import SPEC

pytestmark = pytest.mark.cell

TEXT = ("The lighthouse keeper counted the ships every night and wrote their names in a blue book. "
        "One winter a ship without a name came into the harbour, and nobody on board would say where from. ")


def prompt(engine: Engine, n: int, text: str = TEXT) -> list[int]:
    ids = engine.tokenizer.encode(text * 8)[:n]
    assert len(ids) == n
    return ids


def assert_exact(eng: Engine, sid: str, toks: list[int]) -> None:
    """The session's next-token logits equal a one-pass recompute of what it holds."""
    torch.testing.assert_close(eng._sessions[sid].logits, full_logits(eng, toks)[-1], atol=LOGIT_ATOL, rtol=0)


async def test_cross_session_hit_is_exact(engine, make_engine):
    eng = make_engine(kv_mib=16)
    off = make_engine(kv_mib=16, profile={**SPEC["profile"], "prefixReuse": False})
    p = prompt(engine, 45)
    await eng.ensure_prefix("a", p)
    a_out, _, _ = await generate(eng, "a", 6, stop_token_ids=[])
    eng.close_session("a")                               # its full blocks stay cached
    assert eng.kv.cached_blocks == 3 and eng.kv.index.evictable == 3
    tr = await eng.ensure_prefix("b", p)
    # 2 full blocks shared, the divergence block's first 12 tokens copied; the last token runs (its logits start decode)
    assert (tr.tokens_reused, tr.tokens_computed) == (44, 1)
    assert tr.reuse["source"] == "prefix-cache" and tr.reuse["blocks_shared"] == 2 and tr.reuse["blocks_copied"] == 1
    assert_exact(eng, "b", p)
    b_out, _, _ = await generate(eng, "b", 6, stop_token_ids=[])
    tr_off = await off.ensure_prefix("c", p)
    assert tr_off.tokens_reused == 0 and off.kv.cached_blocks == 0      # prefixReuse off: nothing is shared
    c_out, _, _ = await generate(off, "c", 6, stop_token_ids=[])
    assert a_out == b_out == c_out == greedy_reference(engine, p, 6)
    # prefixReuse off still continues a session from its own KV (the next turn computes only what changed) ...
    tr_next = await off.ensure_prefix("c", p + c_out + [c_out[0]])
    assert (tr_next.tokens_reused, tr_next.tokens_computed) == (len(p) + 5, 2)
    assert tr_next.reuse["source"] == "session"
    # ... but nothing is shared across sessions, not even after a close
    off.close_session("c")
    assert off.kv.cached_blocks == 0 and (await off.ensure_prefix("e", p)).tokens_reused == 0
    # full blocks a live session holds are shared, not copied: refcount 2
    tr = await eng.ensure_prefix("d", p + b_out[:3])
    assert tr.tokens_reused == len(p) + 2
    shared = set(eng._sessions["b"].blocks) & set(eng._sessions["d"].blocks)
    assert len(shared) == 2 and all(eng.kv.ref[x] == 2 for x in shared)


async def test_branch_copies_the_divergence_block(engine, make_engine):
    eng = make_engine(kv_mib=16)
    p = prompt(engine, 45)
    await eng.ensure_prefix("trunk", p)
    trunk = eng._sessions["trunk"]
    tail_before = (eng.kv.k[:, trunk.blocks[2]].clone(), eng.kv.v[:, trunk.blocks[2]].clone())
    branch = p[:37] + engine.tokenizer.encode(" Then the bells rang twice and the story changed.")
    tr = await eng.ensure_prefix("branch", branch)
    assert tr.tokens_reused == 37 and tr.tokens_computed == len(branch) - 37
    assert tr.reuse["blocks_shared"] == 2 and tr.reuse["blocks_copied"] == 1
    b = eng._sessions["branch"]
    assert b.blocks[:2] == trunk.blocks[:2] and b.blocks[2] != trunk.blocks[2]
    # the trunk's partly filled block was copied, never written
    assert torch.equal(eng.kv.k[:, trunk.blocks[2]], tail_before[0])
    assert torch.equal(eng.kv.v[:, trunk.blocks[2]], tail_before[1])
    assert_exact(eng, "branch", branch)
    got, _, _ = await generate(eng, "branch", 5, stop_token_ids=[])
    assert got == greedy_reference(engine, branch, 5)
    got, _, _ = await generate(eng, "trunk", 5, stop_token_ids=[])
    assert got == greedy_reference(engine, p, 5)
    # the trunk now edits inside a block the branch shares: it gets its own copy; the branch is unaffected
    edited = p[:20] + [p[20] + 1] + p[21:30]
    tr = await eng.ensure_prefix("trunk", edited)
    assert tr.tokens_reused == 20 and eng._sessions["trunk"].blocks[1] != b.blocks[1]
    assert_exact(eng, "trunk", edited)
    got, _, _ = await generate(eng, "branch", 3, stop_token_ids=[])
    held = eng.session_tokens("branch")
    assert got == greedy_reference(engine, held[: len(held) - 3], 3)


@pytest.mark.parametrize("at", [0, 16, 23, 40], ids=lambda n: f"edit{n}")
async def test_edit_stops_reuse_at_the_first_changed_token(engine, make_engine, at):
    eng = make_engine(kv_mib=16)
    p = prompt(engine, 50)
    await eng.ensure_prefix("orig", p)
    eng.close_session("orig")
    edited = list(p)
    edited[at] = (edited[at] + 7) % engine.vocab_size
    tr = await eng.ensure_prefix("edited", edited)
    assert tr.tokens_reused == at and tr.tokens_computed == len(p) - at
    assert tr.reuse["hit"] is (at > 0) and tr.reuse["blocks_shared"] == at // 16
    assert tr.reuse["blocks_copied"] == int(at % 16 != 0)
    assert_exact(eng, "edited", edited)


def _twin(engine: Engine, cache: PagedKVCache, **identity) -> Engine:
    """An engine over ``engine``'s weights and ``cache``. The fields the engine names from what it computes with
    (ENGINE_IDENTITY_FIELDS) are changed by changing that: ``prefill_attention`` makes the twin attend through the
    segmented flash calls (its runner without the row attention), ``prefill_sparse`` makes it a block-sparse cell,
    ``decode_attention`` decodes through kernels.dispatch."""
    spec = {**SPEC, "kvMemoryMiB": 16}
    settings = EngineSettings(threads=torch.get_num_threads())
    runner = None
    if identity.pop("prefill_attention", None) is not None:
        runner = TorchRunner(engine.model, cache)
        runner.rows_attention = None
    if identity.pop("prefill_sparse", None) is not None:
        spec["profile"] = {**SPEC["profile"], "attention": "block-sparse"}
    if identity.pop("decode_attention", None) is not None:
        settings.decode_attention = "dispatch"
    base = {k: v for k, v in engine.identity.items() if k not in ENGINE_IDENTITY_FIELDS}
    return Engine(engine.model, engine.tokenizer, cache, CellConfig.from_spec(spec), dict(base, **identity),
                  settings, runner=runner)


IDENTITY_FIELDS = [f for f in IDENTITY_KEY_FIELDS if f not in ("kv_layout", "block_size")]


@pytest.mark.parametrize("field", IDENTITY_FIELDS)
async def test_identity_is_part_of_the_key(engine, field):
    """Two engines over ONE KV pool: the same identity shares blocks; any one field changed shares none."""
    a = engine.model.args
    if field == "prefill_attention" and engine.identity.get(field) is None:
        pytest.skip("this engine prefills through the segmented flash calls (no cpu.c row attention here): "
                    "no second prefill attention to compare it with")
    cache = PagedKVCache(a.n_layers, a.n_kv_heads, a.head_dim, kv_format("fp32"), 8 << 20)
    first, same, other = (_twin(engine, cache), _twin(engine, cache),
                          _twin(engine, cache, **{field: f"changed-{field}"}))
    try:
        p = prompt(engine, 48)
        await first.ensure_prefix("s", p)
        first.close_session("s")
        assert (await same.ensure_prefix("s", p)).tokens_reused == 47   # control: same identity hits
        tr = await other.ensure_prefix("s", p)
        assert tr.tokens_reused == 0 and tr.reuse["hit"] is False
        assert other.reuse_key()[field] != first.reuse_key()[field]
    finally:
        for e in (first, same, other):
            e.shutdown()


def test_the_loaded_identity_names_what_computes_the_kv(engine):
    """The loader's identity carries the kernels' ISA (profile_gate.kernels_identity), and the engine names the
    attention it computes with: the row attention where it serves, no sparse settings and no dispatch decode in a
    dense cell with the default decode."""
    from modeld_cell.profile_gate import kernels_identity

    key = engine.reuse_key()
    assert key["kernels"] == kernels_identity("cpu") and key["kernels"]["isa_flags"] is not None
    assert key["prefill_attention"] == engine.runner.rows_attention
    assert key["prefill_sparse"] is None and key["decode_attention"] is None


async def test_eviction_is_lru_and_spares_live_blocks(engine, make_engine):
    eng = make_engine(kv_mib=4)                         # 5 blocks of 16 tokens
    assert eng.kv.num_blocks == 5
    x, y = prompt(engine, 16), prompt(engine, 16, "Completely different words about cooking rice slowly. ")
    z = prompt(engine, 80, "Numbers: one two three four five six seven eight nine ten eleven twelve. ")
    idx, root = eng.kv.index, eng._root
    await eng.ensure_prefix("x", x)
    eng.close_session("x")
    await eng.ensure_prefix("y", y)
    eng.close_session("y")
    hx, hy = chain_hash(root, x), chain_hash(root, y)
    bx, by = idx.lookup(hx), idx.lookup(hy)
    assert idx.evictable_blocks() == [bx, by]           # least recent first
    tr = await eng.ensure_prefix("x2", x)               # a hit touches x's block: y's is now the oldest
    assert tr.tokens_reused == 15
    eng.close_session("x2")
    assert idx.evictable_blocks() == [by, bx]
    assert eng.kv.free_blocks == 5 and eng.kv.used_blocks == 0
    await eng.ensure_prefix("z", z[:64])                # 4 blocks: 3 free + the least recently used cached one
    assert idx.evictions == 1 and idx.lookup(hy) is None and idx.lookup(hx) == bx
    assert eng.metrics()["prefix_cache_evictions"] == 1
    # live blocks are never evicted: only x's cached block is available, so 2 more blocks is an Overflow
    live = list(eng._sessions["z"].blocks)
    with pytest.raises(errors.Overflow):
        await eng.ensure_prefix("w", y + z[:17])
    assert "w" not in eng._sessions and eng._sessions["z"].blocks == live and idx.lookup(hx) == bx
    tr = await eng.ensure_prefix("w", y)                # 1 block: evicts x's, the only unreferenced one
    assert tr.tokens_reused == 0 and idx.evictions == 2 and idx.lookup(hx) is None
    assert eng._sessions["z"].blocks == live
    assert eng.kv.used_blocks == 5 and eng.kv.usage_ratio == 1.0
    eng.close_session("w")
    got, _, _ = await generate(eng, "z", 2, stop_token_ids=[])   # z's KV survived all of it
    assert got == greedy_reference(engine, z[:64], len(got)) and len(got) == 2


async def test_trace_metrics_and_capability_report_reuse(engine, make_engine):
    eng = make_engine(kv_mib=16)
    p = prompt(engine, 64)
    miss = await eng.ensure_prefix("m", p)
    assert miss.reuse["hit"] is False and miss.reuse["source"] is None and miss.reuse["time_saved_ms_est"] == 0
    rate = eng._prefill_rate()             # tokens/s this engine measured so far: the miss's 64 tokens
    assert rate is not None and rate > 0
    hit = await eng.ensure_prefix("h", p + [42])
    r = hit.reuse
    assert r["hit"] is True and r["tokens_reused"] == hit.tokens_reused == 64 and hit.tokens_computed == 1
    assert r["bytes_reused"] == 64 * eng.kv.bytes_per_token and r["blocks_shared"] == 4
    # the estimate is the reused tokens at the rate measured before this request (planned before it prefills)
    assert r["time_saved_ms_est"] == round(64 / rate * 1e3, 3)
    assert isinstance(r["lookup_ms"], float)
    m = eng.metrics()
    assert m["prefix_cache_queries"] == 64 + 65 and m["prefix_cache_hits"] == 64
    assert m["prefix_cache_blocks"] == 4 and m["prefix_cache_blocks_shared_total"] == 4
    cap = eng.capability()["reuse"]
    assert cap["enabled"] is True and cap["block_size"] == 16 and cap["cached_blocks"] == 4
    assert cap["cached_tokens"] == 64 and set(IDENTITY_KEY_FIELDS) == set(cap["identity_key_fields"])
    assert eng.sessions()[1]["kv_blocks_shared"] == 4


# ---- cache scopes (cache_salt): no session learns another scope's prompt through the prefix cache

SECRET = "The vault's access code for tonight is {pin}. Do not share it with anyone at all. "


async def test_a_probe_in_another_cache_scope_learns_nothing_from_the_reuse_counts(engine, make_engine):
    """Session A (salt "tenant-a") holds a prompt ending in a PIN. A probe in another scope re-sends it with the
    right PIN and with a wrong one (each probe in its own scope): the same reuse (none) either way, live or after A closed. Within A's scope the
    prefix is still shared (and, as in any shared cache, the right PIN reuses more: scopes are the boundary)."""
    eng = make_engine(kv_mib=64)                        # room for every probe: nothing of A's is evicted
    pre = engine.tokenizer.encode(TEXT * 2)
    secret = pre + engine.tokenizer.encode(SECRET.format(pin="4821"))
    right, wrong = secret, pre + engine.tokenizer.encode(SECRET.format(pin="9377"))
    assert right != wrong and len(right) == len(wrong)
    await eng.ensure_prefix("a", secret, cache_salt="tenant-a")
    for closed in (False, True):
        if closed:
            eng.close_session("a")                           # its blocks stay cached, in tenant-a's scope
        seen = []
        for i, guess in enumerate((right, wrong)):
            # each probe in a scope of its own (probes of one scope would share with each other, as they may)
            tr = await eng.ensure_prefix(f"probe-{closed}-{i}", guess, cache_salt=f"tenant-b-{closed}-{i}")
            seen.append((tr.tokens_reused, tr.tokens_computed, tr.reuse["source"]))
            eng.close_session(f"probe-{closed}-{i}")
        assert seen[0] == seen[1] == (0, len(right), None), seen
    # an unsalted probe is in the cell's default scope: nothing of tenant-a's either
    assert (await eng.ensure_prefix("plain", right)).tokens_reused == 0
    # the same scope still shares, exactly
    tr_right = await eng.ensure_prefix("a2", right, cache_salt="tenant-a")
    tr_wrong = await eng.ensure_prefix("a3", wrong, cache_salt="tenant-a")
    bs = eng.kv.block_size                                 # A's full blocks (its closed partial block is not indexed)
    assert tr_right.tokens_reused == len(right) // bs * bs and 0 < tr_wrong.tokens_reused < tr_right.tokens_reused
    assert_exact(eng, "a2", right)


async def test_a_session_keeps_the_cache_scope_it_was_created_in(engine, make_engine):
    eng = make_engine(kv_mib=16)
    p = prompt(engine, 40)
    await eng.ensure_prefix("s", p, cache_salt="tenant-a")
    with pytest.raises(errors.Conflict, match="another cache_salt") as e:
        await eng.ensure_prefix("s", p + p[:3], cache_salt="tenant-b")
    assert e.value.details["field"] == "cache_salt"
    assert eng._sessions["s"].tokens == p                  # refused before anything changed
    tr = await eng.ensure_prefix("s", p + p[:3])           # no salt: the session's own scope continues
    assert tr.tokens_reused == len(p)
    tr = await eng.ensure_prefix("s", p + p[:5], cache_salt="tenant-a")
    assert tr.tokens_reused == len(p) + 3
