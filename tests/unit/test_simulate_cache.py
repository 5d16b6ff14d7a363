"""Prefix cache, prompt library and publisher-instance logic of the simulator (no sockets)."""

from __future__ import annotations

import pytest

from kvobserve.analysis.blocks import BlockIndex
from kvobserve.simulate.cache import PrefixCache, PromptLibrary, paginate
from kvobserve.simulate.encoders import FORMATS, get_format
from kvobserve.simulate.faults import FaultConfig
from kvobserve.simulate.stream import SimStream
from kvobserve.simulate.truth import stream_truth
from kvobserve.wire.errors import WireError
from kvobserve.wire.kv_events import BlockRemoved, BlockStored, decode_payload


def _stream(
    fmt: str, capacity: int = 1024, faults: FaultConfig | None = None, **kw: int
) -> SimStream:
    f = get_format(fmt)
    lib = PromptLibrary(7, f.hash_kind, 16, n_prompts=40, n_prefixes=4)
    return SimStream(
        f, "0.0", "primary", 0, 0, b"", lib, 11, capacity, 16, 10_000, faults or FaultConfig(), **kw
    )


def test_reinserting_a_sequence_hits_and_stores_nothing() -> None:
    c = PrefixCache(1000)
    pages = paginate("int64", list(range(40)), 16)
    first = c.insert(pages)
    assert [len(p.tokens) for p in first.stored] == [16, 16, 8] and first.hit_tokens == 0
    again = c.insert(pages)
    assert again.stored == [] and again.hit_tokens == 40 and c.used_tokens == 40


def test_lru_leaf_is_evicted_first_and_runs_go_leaf_to_root() -> None:
    c = PrefixCache(64)
    a = paginate("uint64", list(range(32)), 16)
    b = paginate("uint64", list(range(100, 132)), 16)
    c.insert(a)
    c.insert(b)
    c.insert(a)  # touch a: b is now least recently used
    new = paginate("uint64", list(range(200, 232)), 16)
    res = c.insert(new)
    assert res.evicted == [[b[1].hash, b[0].hash]]  # b's leaf, then the parent it exposed
    assert c.resident() == {p.hash for p in a + new}
    assert c.used_tokens == 64


def test_insert_larger_than_capacity_stores_what_fits() -> None:
    c = PrefixCache(32)
    res = c.insert(paginate("int64", list(range(80)), 16))
    assert len(res.stored) == 2 and c.used_tokens == 32


def test_hash_kinds_cover_each_engine_range() -> None:
    toks = [list(range(i, i + 16)) for i in range(200)]
    signed = [paginate("int64", t, 16)[0].hash for t in toks]
    unsigned = [paginate("uint64", t, 16)[0].hash for t in toks]
    raw = paginate("bytes32", toks[0], 16)[0].hash
    assert any(h < 0 for h in signed) and all(-(2**63) <= h < 2**63 for h in signed)  # type: ignore[operator]
    assert any(h >= 2**63 for h in unsigned) and all(h >= 0 for h in unsigned)  # type: ignore[operator]
    assert isinstance(raw, bytes) and len(raw) == 32


def test_library_is_deterministic_and_shares_prefixes() -> None:
    a = PromptLibrary(3, "int64", 16, n_prompts=10, n_prefixes=2)
    b = PromptLibrary(3, "int64", 16, n_prompts=10, n_prefixes=2)
    assert [p.hash for p in a.prompts[5]] == [p.hash for p in b.prompts[5]]
    assert a.prompts[0][0].hash == a.prompts[2][0].hash  # same system prefix
    assert a.prompts[0][0].hash != a.prompts[1][0].hash


def test_sglang_stores_one_page_each_with_short_last_page() -> None:
    s = _stream("sglang-0.5.23")
    sizes, multi = set(), 0
    for i in range(60):
        out = s.next_batch(float(i))
        assert out is not None
        for ev in decode_payload("", i, out[1]).events:
            if isinstance(ev, BlockStored):
                multi += len(ev.block_hashes) > 1
                sizes.add(ev.block_size)
    assert multi == 0 and 16 in sizes and any(x < 16 for x in sizes)


def test_vllm_stores_multi_block_runs_of_full_blocks() -> None:
    s = _stream("vllm-0.33")
    runs = []
    for i in range(60):
        out = s.next_batch(float(i))
        assert out is not None
        runs += [e for e in decode_payload("", i, out[1]).events if isinstance(e, BlockStored)]
    assert {e.block_size for e in runs} == {16}
    assert any(len(e.block_hashes) > 1 for e in runs)
    assert all(e.num_tokens == 16 * len(e.block_hashes) for e in runs)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_truth_equals_block_index_replay(fmt: str) -> None:
    s = _stream(fmt, capacity=512, flush_every=97)
    index = BlockIndex()
    removed = 0
    for i in range(250):
        out = s.next_batch(1000.0 + i)
        assert out is not None
        batch = decode_payload("", int.from_bytes(out[0], "big"), out[1])
        assert batch.dp_rank == 0 and batch.seq == i
        removed += sum(isinstance(e, BlockRemoved) for e in batch.events)
        index.apply_batch(batch)
    truth = stream_truth(s)
    want = {m: set(map(_unhex, hs)) for m, hs in truth["resident"].items()}
    assert removed > 0 and sum(map(len, want.values())) > 0
    assert {m: v for m, v in index.resident_hashes().items() if v} == want
    assert index.store_of_resident_total == 0 and index.remove_of_unknown_total == 0
    assert index.tokens == truth["resident_tokens"]
    assert truth["batches"] == 250 and truth["events"] > 250


def _unhex(h: int | str) -> int | bytes:
    return bytes.fromhex(h) if isinstance(h, str) else h


def test_faults_drop_ring_drop_and_malformed() -> None:
    f = FaultConfig(
        drop_seqs=frozenset({2}), ring_drop_seqs=frozenset({3}), malformed_seqs=frozenset({4})
    )
    s = _stream("sglang-0.5.19", faults=f)
    sent = {}
    for i in range(6):
        out = s.next_batch(float(i))
        if out is not None:
            sent[int.from_bytes(out[0], "big")] = out[1]
    assert sorted(sent) == [0, 1, 4, 5]
    assert [seq for seq, _, _ in s.ring] == [0, 1, 2, 4, 5]
    with pytest.raises(WireError) as err:
        decode_payload("", 4, sent[4])
    assert err.value.reason == "msgpack"
    assert (s.live_dropped, s.ring_dropped, s.malformed) == ([2], [3], [4])


def test_rate_faults_are_deterministic() -> None:
    f = FaultConfig(drop_rate=0.2, ring_drop_rate=0.1, malformed_rate=0.1)
    runs = []
    for _ in range(2):
        s = _stream("vllm-0.10", faults=f)
        for i in range(200):
            s.next_batch(float(i))
        runs.append((s.live_dropped, s.ring_dropped, s.malformed))
    assert runs[0] == runs[1]
    assert 20 < len(runs[0][0]) < 60 and 5 < len(runs[0][1]) < 40 and 5 < len(runs[0][2]) < 40


def test_sglang_047_roots_hang_off_the_empty_key_hash() -> None:
    s = _stream("sglang-0.4")
    out = s.next_batch(1.0)
    assert out is not None
    first = decode_payload("", 0, out[1]).events[0]
    assert isinstance(first, BlockStored) and first.parent_block_hash == 5740354900026072187
