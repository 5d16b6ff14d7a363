"""The stream guarantees on Dynamo's event planes (sources/dynamo_streams.py), without sockets.

Dynamo's planes are the sixth receiving mode of tests/unit/test_stream_core.py's matrix: the
cells that apply run here, on the DynamoTable with a fake clock and the bytes Dynamo's own
encoding gives (kvobserve/simulate/dynamo_encode.py, held to Dynamo 1.6.1's captures by
tests/unit/test_dynamo_streams.py). Dynamo's event plane has no replay: a gap is lost at once
and what a replay would bring back does not apply.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvobserve.analysis.fleet import FleetState
from kvobserve.config import load_config
from kvobserve.export.prometheus import FleetCollector
from kvobserve.simulate import dynamo_encode as enc
from kvobserve.sources.dynamo_plan import plan_dynamo
from kvobserve.sources.dynamo_state import DynamoOptions
from kvobserve.sources.dynamo_streams import DynamoTable
from kvobserve.wire.snapshot import CollectorInfo, Snapshot
from tests.unit.test_dynamo_streams import SUBJ, Clock, W, body, store, table
from tests.unit.test_stream_core import TABLE

NO_REPLAY = "Dynamo's event plane has no replay: a gap is lost at once (counted, trust partial)"
DYNAMO: dict[str, str | None] = {
    "gaps_recovered_by_replay": NO_REPLAY,
    "a_partial_reply_loses_what_the_ring_no_longer_holds": NO_REPLAY,
    "several_gaps_filled_by_one_reply": NO_REPLAY,
    "a_restarted_publisher_resets_the_index": None,
    "two_publishers_on_one_stream_are_a_duplicate_stream": None,
    "a_tail_lost_before_the_publisher_idles_is_recovered": NO_REPLAY,
    "joining_mid_stream_replays_from_seq_0": NO_REPLAY + "; a late join is partial",
    "joining_an_idle_publisher_asks_its_ring": NO_REPLAY,
    "a_dead_publisher_goes_down_and_its_gauges_leave": None,
    "a_reconnect_of_the_same_publisher_recovers_what_it_missed": NO_REPLAY,
    "streams_past_max_streams_are_refused_and_counted": None,
    "metrics_render_in_every_mode": None,
    "a_restarted_collector_resumes_from_its_checkpoint": (
        "not built: a Dynamo stream starts anew after kvobserve restarts (no replay confirms a "
        "checkpoint; the envelope's publisher and sequence could: docs/reliability.md)"
    ),
}
KEY = (f"dynamo/{W}", 0)


def test_the_dynamo_column_names_every_guarantee() -> None:
    assert set(DYNAMO) == set(TABLE)
    tests = {n.removeprefix("test_") for n in globals() if n.startswith("test_")}
    ran = {g for g, why in DYNAMO.items() if why is None}
    assert all(any(t.startswith(g) for t in tests) for g in ran)


def _served(t: object, now: float) -> dict[tuple[str, int], float]:
    snap_parts = t.stats()  # type: ignore[attr-defined]
    snap = Snapshot(CollectorInfo("node-0", 0, "h", 0.0), seq=1, time=now,
                    workers=snap_parts.workers, streams=snap_parts.streams,
                    dynamo=snap_parts.dynamo, dynamo_planes=snap_parts.planes)  # fmt: skip
    fs = FleetState()
    fs.update(snap, now)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FleetCollector(lambda: fs.view(now), per_stream_detail=True))
    out: dict[tuple[str, int], float] = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            if "dp_rank" in s.labels:
                out[(s.name, int(s.labels["dp_rank"]))] = s.value
    return out


def test_a_gap_is_lost_at_once_and_the_index_is_partial() -> None:
    t, _ = table()
    for eid, h in ((1, 1), (2, 2), (5, 5)):  # event ids 3, 4 never arrive
        t.on_nats(0, SUBJ, body([store(eid, [h])], seq=eid))
    sq = t.streams[KEY].seq
    assert (sq.gaps, sq.missed, sq.lost, sq.trust.state) == (1, 2, 2, "partial")


def test_a_restarted_publisher_resets_the_index() -> None:
    t, clock = table()
    for eid in range(1, 6):
        t.on_nats(0, SUBJ, body([store(eid, [eid])], pid=1, seq=eid))
    for eid in range(1, 5):  # a new process: event ids from 1 again, a new publisher id
        clock.t += 1
        t.on_nats(0, SUBJ, body([store(eid, [100 + eid])], pid=2, seq=eid))
    sq = t.streams[KEY].seq
    assert sq.restarts == 1
    assert sq.index.resident_hashes()["GPU"] == {101, 102, 103, 104}


def test_two_publishers_on_one_stream_are_a_duplicate_stream() -> None:
    t, clock = table()
    for i in range(1, 5):  # two live processes claim the same (worker, rank)
        t.on_nats(0, SUBJ, body([store(i, [i])], pid=1, seq=i))
        t.on_nats(0, SUBJ, body([store(i, [50 + i])], pid=2, seq=i))
    st = t.streams[KEY]
    assert st.seq.duplicate_stream(clock.t) and st.pids_seen == 2


def test_a_dead_publisher_goes_down_and_its_gauges_leave() -> None:
    ep = "tcp://127.0.0.1:1"
    flags = {"worker.engine": "dynamo", "worker.event_plane": "zmq", "worker.zmq_endpoints": [ep]}
    cfg = load_config(None, flags, {})
    clock = Clock()
    t = DynamoTable([plan_dynamo(0, cfg.workers[0], cfg.collector)], clock=clock, wall=clock)
    t.planes[0].connected.add(ep)  # its SUB connected (the shell's monitor says so)
    frames = enc.zmq_frames("kv-events", 1, 0, body([store(1, [1, 2])], pid=1, seq=0))
    t.on_zmq(0, ep, frames)
    assert _served(t, clock.t)[("kvobserve_kv_blocks", 0)] == 2
    t.planes[0].connected.discard(ep)  # its ZMQ publisher went away: down at once
    served = _served(t, clock.t)
    assert served[("kvobserve_stream_up", 0)] == 0
    assert ("kvobserve_kv_blocks", 0) not in served
    assert served[("kvobserve_kv_event_batches_total", 0)] == 1


def test_a_dead_publisher_on_nats_goes_down_after_quiet_s() -> None:
    t, clock = table()
    t.on_nats(0, SUBJ, body([store(1, [1])], seq=1))
    assert _served(t, clock.t)[("kvobserve_stream_up", 0)] == 1
    clock.t += DynamoOptions().quiet_s  # one NATS connection for every worker: silence tells
    assert ("kvobserve_kv_blocks", 0) not in _served(t, clock.t)


def test_streams_past_max_streams_are_refused_and_counted() -> None:
    t, _ = table(DynamoOptions(max_streams=1))
    t.on_nats(0, SUBJ, body([store(1, [1], 0), store(1, [2], 1)]))
    s = t.stats()
    assert [(x.worker_id, x.dp_rank) for x in s.streams] == [KEY]
    assert s.refused_streams == 1


def test_metrics_render_in_every_mode() -> None:
    t, clock = table()
    t.on_nats(0, SUBJ, body([store(1, [1, 2, 3], 0), store(1, [4], 1)]))
    served = _served(t, clock.t)
    assert (served[("kvobserve_kv_blocks", 0)], served[("kvobserve_kv_blocks", 1)]) == (3, 1)
