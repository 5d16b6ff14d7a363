"""The Dynamo stream table: envelopes, a second live publisher, ownership, the stream cap,
forgetting, scheduler values from ActiveLoad and forward-pass metrics, bad messages."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from kvobserve.config import load_config
from kvobserve.simulate import dynamo_encode as enc
from kvobserve.sources.dynamo_plan import plan_dynamo
from kvobserve.sources.dynamo_state import DynamoOptions
from kvobserve.sources.dynamo_streams import DynamoTable

W = 7855569312903942451
SUBJ = enc.subject("dynamo", "backend", "generate", "kv-events")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def table(opts: DynamoOptions | None = None, **kw: Any) -> tuple[DynamoTable, Clock]:
    flags = {"worker.engine": "dynamo", "worker.event_plane_url": "nats://h:1"}
    flags.update({f"worker.{k}": v for k, v in kw.items()})
    cfg = load_config(None, flags, {})
    clock = Clock()
    t = DynamoTable([plan_dynamo(0, cfg.workers[0], cfg.collector)], opts, clock=clock, wall=clock)
    t.planes[0].connected.add(t.planes[0].plan.shown)
    return t, clock


def store(eid: int, hashes: list[int], rank: int = 0, worker: int = W) -> dict[str, Any]:
    return enc.router_event(worker, eid, enc.stored([enc.block(h, h) for h in hashes]), rank)


def body(events: list[dict[str, Any]], pid: int = 1, seq: int = 0) -> bytes:
    return enc.envelope("kv-events", pid, seq, 5_000, enc.kv_events_payload(events))


def test_envelope_gaps_duplicates_and_two_live_publishers() -> None:
    t, _ = table()
    t.on_nats(0, SUBJ, body([store(1, [1])], pid=1, seq=0))
    t.on_nats(0, SUBJ, body([store(2, [2])], pid=1, seq=3))  # sequences 1, 2 lost
    t.on_nats(0, SUBJ, body([store(3, [3])], pid=1, seq=3))  # sequence seen again
    st = t.streams[(f"dynamo/{W}", 0)]
    assert (st.env_gaps, st.env_missed, st.env_dups, st.pids_seen) == (1, 2, 1, 1)
    assert not st.seq.duplicate_stream(100.0)
    t.on_nats(0, SUBJ, body([store(1, [9])], pid=2, seq=0))  # a new publisher: maybe a restart
    assert not st.seq.duplicate_stream(100.0)
    t.on_nats(0, SUBJ, body([store(4, [4])], pid=1, seq=4))  # the first one speaks again
    assert st.seq.duplicate_stream(100.0) and st.pids_seen == 2
    snap = t.stats()
    d = snap.dynamo[0]
    assert (d.publisher_id, d.envelope_gaps, d.replay) == (1, 1, "unavailable")


def test_streams_appear_as_events_arrive_and_the_cap_refuses() -> None:
    t, _ = table(DynamoOptions(max_streams=2))
    t.on_nats(0, SUBJ, body([store(1, [1], 0), store(1, [2], 1), store(1, [3], 2)]))
    assert sorted(t.streams) == [(f"dynamo/{W}", 0), (f"dynamo/{W}", 1)]
    t.on_nats(0, SUBJ, body([store(2, [4], 2)], seq=1))
    snap = t.stats()
    assert snap.refused_streams == 1  # one key, counted once
    assert [(s.worker_id, s.dp_rank, s.engine, s.up) for s in snap.streams] == [
        (f"dynamo/{W}", 0, "dynamo", True),
        (f"dynamo/{W}", 1, "dynamo", True),
    ]
    w = snap.workers[0]
    assert (w.worker_id, w.engine, w.dp_size, w.ranks_owned, w.leader) == (
        f"dynamo/{W}", "dynamo", 2, [0, 1], True,
    )  # fmt: skip


def test_keep_ranks_node_drops_other_nodes_ranks() -> None:
    flags = {"worker.engine": "dynamo", "worker.event_plane_url": "nats://h:1",
             "worker.dp_size": 4, "worker.keep_ranks": "node", "collector.node_rank": 1,
             "collector.nnodes": 2}  # fmt: skip
    cfg = load_config(None, flags, {})
    t = DynamoTable([plan_dynamo(0, cfg.workers[0], cfg.collector)])
    t.on_nats(0, SUBJ, body([store(1, [1], r) for r in range(4)]))
    assert sorted(k[1] for k in t.streams) == [2, 3] and t.planes[0].not_owned_events == 2
    w = t.stats().workers[0]
    assert (w.dp_size, w.ranks_owned, w.leader) == (4, [2, 3], False)


def test_silent_streams_go_down_then_are_forgotten() -> None:
    t, clock = table(DynamoOptions(quiet_s=30, forget_after_s=300))
    t.on_nats(0, SUBJ, body([store(1, [1])]))
    clock.t += 31
    assert [s.up for s in t.stats().streams] == [False]
    load = enc.envelope("kv_metrics", 3, 0, 1, enc.active_load(W, 0, 1, None, 1))
    t.on_nats(0, enc.subject("dynamo", "backend", "generate", "kv_metrics"), load)
    assert [s.up for s in t.stats().streams] == [True]  # a load heartbeat keeps it up
    clock.t += 301
    snap = t.stats()
    assert (snap.streams, snap.workers, snap.scheduler) == ([], [], [])


def test_overlap_walks_each_streams_blocks_and_says_when_it_is_down() -> None:
    """Where would a request hit (docs/cache-analytics.md), on the Dynamo plane's streams."""
    t, clock = table(DynamoOptions(quiet_s=30))
    t.on_nats(0, SUBJ, body([store(1, [1, 2, 3], 0), store(1, [1, 5], 1)]))
    got = {(r.worker_id, r.dp_rank): (r.leading_blocks, r.up) for r in t.overlap([1, 2, 3, 4])}
    assert got == {(f"dynamo/{W}", 0): (3, True), (f"dynamo/{W}", 1): (1, True)}
    assert t.overlap([1], frozenset({"other"})) == []
    clock.t += 31  # silent: the rank's blocks are no longer known to be the engine's
    assert [r.up for r in t.overlap([1])] == [False, False]


def test_scheduler_values_from_load_and_forward_pass_metrics() -> None:
    t, _ = table(block_size=16, capacity_tokens=1600)
    load = enc.envelope("kv_metrics", 3, 0, 1, enc.active_load(W, 1, 7, None, 25, 4))
    t.on_nats(0, enc.subject("dynamo", "backend", "generate", "kv_metrics"), load)
    fpm = enc.forward_pass_metrics(
        str(W), 1, 1, 5.0, (1, 10, 0.0, 0, 2, 30, 0.0), (3, 9, 0.0, 1, 0, 0.0)
    )
    t.on_nats(0, enc.subject("dynamo", "backend", "generate", "forward-pass-metrics"),
              enc.envelope("forward-pass-metrics", 4, 0, 1, fpm))  # fmt: skip
    (s,) = t.stats().scheduler
    assert (s.worker_id, s.dp_rank) == (f"dynamo/{W}", 1)
    assert (s.running_requests, s.queued_requests) == (3.0, 4.0)  # FPM 1+2, its queue 3+1
    assert s.token_usage_ratio == 25 * 16 / 1600 and s.max_total_tokens == 1600.0


def test_bad_messages_are_counted_by_reason() -> None:
    t, _ = table(namespace="dynamo")
    t.on_nats(0, SUBJ, b"\xc1")
    t.on_nats(0, "not.a.dynamo.subject", body([store(1, [1])]))
    other = enc.subject("other", "backend", "generate", "kv-events")
    t.on_nats(0, other, body([store(1, [1])]))
    frames = enc.zmq_frames("kv-events", 9, 1, body([store(1, [1])], pid=1, seq=0))
    t.on_zmq(0, "tcp://h:1", frames)  # header pid/seq disagree with the envelope
    t.on_zmq(0, "tcp://h:1", frames[:3])
    errors = t.planes[0].errors
    assert errors == {"msgpack": 1, "schema": 1, "other_namespace": 1, "frame_count": 1}
    assert t.streams[(f"dynamo/{W}", 0)].header_mismatch == 1


def test_drift_window_notes_touched_blocks_and_clears() -> None:
    t, _ = table()
    t.on_nats(0, SUBJ, body([store(1, [1, 2])]))
    t.start_touch(0)
    t.on_nats(0, SUBJ, body([enc.router_event(W, 2, enc.removed([1]), 0), store(3, [5])], seq=1))
    (touched,) = t.end_touch(0).values()
    assert (touched.resident, touched.touched, touched.unsettled) == (
        {"GPU": {2, 5}},
        {1, 5},
        False,
    )
    t.start_touch(0)
    t.on_nats(0, SUBJ, body([enc.router_event(W, 4, enc.CLEARED, 0)], seq=2))
    assert next(iter(t.end_touch(0).values())).unsettled
    assert t.end_touch(0) == {}  # the window is closed


CAPTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dynamo-captures" / "1.6.1"


def _capture_keys(run: str) -> set[tuple[str, int]]:
    """(worker_id label, dp_rank) of every kv-events RouterEvent of one 1.6.1 capture run."""
    doc = json.loads((CAPTURES / "expected.json").read_text())
    out = set()
    for m in doc[run]:
        if m["envelope"]["topic"] == "kv-events":
            for ev in m["payload"]:
                out.add((f"dynamo/{ev['worker_id']}", ev["event"]["dp_rank"]))
    return out


def test_real_dynamo_1_6_1_bytes_nats_and_zmq_direct() -> None:
    nats_t, _ = table(block_size=16)
    for line in (CAPTURES / "nats.jsonl").read_text().splitlines():
        m = json.loads(line)
        nats_t.on_nats(0, m["subject"], base64.b64decode(m["body"]))
    zmq_t, _ = table(block_size=16)
    for line in (CAPTURES / "zmq-direct.jsonl").read_text().splitlines():
        m = json.loads(line)
        zmq_t.on_zmq(0, "tcp://127.0.0.1:1", [base64.b64decode(f) for f in m["frames"]])
    for t, run in ((nats_t, "nats"), (zmq_t, "zmq-direct")):
        want = _capture_keys(run)
        assert len(want) == 4  # two workers, two ranks each
        assert t.planes[0].errors == {}
        snap = t.stats()
        assert {(s.worker_id, s.dp_rank) for s in snap.streams} == want
        assert all(s.state_complete and s.gaps == 0 for s in snap.streams)  # ids from 1
        assert {(s.worker_id, s.dp_rank) for s in snap.scheduler} >= want
        assert all(d.header_mismatches == 0 for d in snap.dynamo)
