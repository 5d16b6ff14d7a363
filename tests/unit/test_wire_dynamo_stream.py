"""Dynamo messages through StreamSequencer and BlockIndex: event_id as the sequence (fresh start
complete, gaps, restarts, duplicates), resident tokens from the configured block size, and
TierCleared clearing one medium."""

from __future__ import annotations

from typing import Any

from kvobserve.analysis.blocks import BlockIndex
from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.simulate import dynamo_encode as enc
from kvobserve.wire import dynamo as d
from kvobserve.wire.kv_events import KvBatch

W = 7855569312903942451
SUBJ = "namespace.dynamo.component.backend.endpoint.generate.kv-events"


def messages(*groups: list[dict[str, Any]], start_seq: int = 0) -> list[bytes]:
    """NATS bodies, one per group of RouterEvents, envelope sequence from `start_seq`."""
    return [
        enc.envelope("kv-events", 42, start_seq + i, 1_000 * (i + 1), enc.kv_events_payload(g))
        for i, g in enumerate(groups)
    ]


def feed(streams: dict[tuple[int, int], StreamSequencer], body: bytes, now: float = 0.0) -> None:
    msg = d.decode_nats_message(SUBJ, body)
    assert msg.published_at_ms is not None
    events = d.decode_router_events(msg)
    for key, batch, raw in d.to_batches(events, msg.published_at_ms / 1000, block_size=16):
        seqr = streams.setdefault(key, StreamSequencer(key[1], replay=False))
        assert seqr.on_batch(batch, raw, now) is None  # no replay on this plane


def store(event_id: int, hashes: list[int], rank: int = 0, **kw: Any) -> dict[str, Any]:
    blocks = [enc.block(h, h * 31) for h in hashes]
    return enc.router_event(W, event_id, enc.stored(blocks), rank, **kw)


def test_fresh_publisher_is_complete_and_counts_tokens_from_block_size() -> None:
    streams: dict[tuple[int, int], StreamSequencer] = {}
    for body in messages(
        [store(1, [1, 2]), store(2, [3], storage_tier="host_pinned")],
        [store(1, [10], rank=1)],
        [enc.router_event(W, 3, enc.removed([2]))],
    ):
        feed(streams, body)
    r0, r1 = streams[(W, 0)], streams[(W, 1)]
    assert r0.state_complete and r1.state_complete
    assert (r0.last_seq, r0.gaps, r0.batches_applied) == (2, 0, 3)
    assert r0.index.blocks == {"GPU": 1, "CPU": 1}
    assert r0.index.tokens == {"GPU": 16, "CPU": 16}
    assert r1.index.resident_hashes() == {"GPU": {10}}
    assert r0.last_ts == 3.0  # published_at of the third message, in seconds


def test_skipped_event_ids_are_a_gap_and_lost() -> None:
    streams: dict[tuple[int, int], StreamSequencer] = {}
    for body in messages([store(1, [1])], [store(2, [2])], [store(5, [5])]):
        feed(streams, body)
    s = streams[(W, 0)]
    assert (s.gaps, s.missed, s.lost, s.state_complete) == (1, 2, 2, False)
    assert s.index.resident_hashes() == {"GPU": {1, 2, 5}}


def test_joining_mid_stream_is_not_complete_until_a_clear() -> None:
    streams: dict[tuple[int, int], StreamSequencer] = {}
    for body in messages(
        [store(40, [1])], [enc.router_event(W, 41, enc.CLEARED)], [store(42, [9])]
    ):
        feed(streams, body)
    s = streams[(W, 0)]
    assert s.state_complete and s.index.resident_hashes() == {"GPU": {9}}


def test_redelivered_message_is_a_duplicate_not_applied_twice() -> None:
    streams: dict[tuple[int, int], StreamSequencer] = {}
    first, second = messages([store(1, [1])], [enc.router_event(W, 2, enc.removed([1]))])
    for body in (first, second, second):
        feed(streams, body)
    s = streams[(W, 0)]
    assert (s.duplicate_batches, s.index.removed_events_total, s.gaps) == (1, 1, 0)


def test_publisher_restart_in_the_same_worker_is_a_restart() -> None:
    streams: dict[tuple[int, int], StreamSequencer] = {}
    old = messages(*[[store(i, [i])] for i in range(1, 6)])
    new = messages(*[[store(i, [100 + i])] for i in range(1, 5)])  # event_id back to 1
    for body in old + new:
        feed(streams, body)
    s = streams[(W, 0)]
    assert s.restarts == 1 and s.last_seq == 3
    assert s.index.resident_hashes() == {"GPU": {101, 102, 103, 104}}


def batch(seq: int, ts: float, *events: Any) -> KvBatch:
    return KvBatch("kv-events", seq, ts, 0, list(events))


def test_tier_cleared_drops_one_medium_only() -> None:
    idx = BlockIndex()
    gpu = d.DynamoStored([1, 2], block_size=16, medium="GPU")
    cpu = d.DynamoStored([3], block_size=16, medium="CPU")
    idx.apply_batch(batch(0, 10.0, gpu, cpu))
    idx.apply_batch(batch(1, 40.0, d.TierCleared("CPU"), d.TierCleared("DISK")))
    assert idx.resident_hashes() == {"GPU": {1, 2}, "CPU": set()}
    assert idx.tokens == {"GPU": 32, "CPU": 0}
    assert idx.removed_total == {"GPU": 0, "CPU": 1}
    assert idx.lifetime["CPU"].count == 1 and idx.lifetime["CPU"].sum == 30.0
    assert (idx.clears_total, idx.tier_clears_total) == (
        0,
        2,
    )  # DISK was never seen: nothing to drop
    assert idx.events_total["cleared"] == 2
    assert "DISK" not in idx.blocks  # a clear does not create a medium


def test_tier_clear_does_not_make_a_gapped_stream_complete() -> None:
    # only a whole-cache clear may: the other media still miss what the gap lost
    streams: dict[tuple[int, int], StreamSequencer] = {}
    cleared = enc.router_event(W, 4, enc.tier_cleared("device"))
    for body in messages([store(1, [1])], [store(3, [3], storage_tier="host_pinned")], [cleared]):
        feed(streams, body)
    s = streams[(W, 0)]
    assert not s.state_complete
    assert s.index.resident_hashes() == {"GPU": set(), "CPU": {3}}
