"""Acceptance: a collector says why a stream or a scheduler source does not deliver.

Real sockets throughout: a simulated SGLang engine, its HTTP port, a port where nothing listens.
Each wrong configuration gets its state and reason in the snapshot, once in the log (never per
retry), and in the API and the conditions; a down stream shows no usage.
"""

from __future__ import annotations

import logging
import time

import pytest

from kvobserve.analysis.conditions import active
from kvobserve.analysis.fleet import FleetState
from kvobserve.config import CollectorConfig, Config, WorkerConfig
from kvobserve.export import api
from kvobserve.simulate import SimulatedWorker
from kvobserve.simulate.ports import free_port
from kvobserve.sources.ingest_options import IngestOptions
from kvobserve.sources.link import LinkTimes
from kvobserve.wire.snapshot import Snapshot
from tests.integration.collector_helpers import Sims, running_collector, sim_config, wait_snapshot

pytestmark = pytest.mark.integration

FAST = IngestOptions(link=LinkTimes(probe_after_s=1.0, probe_s=1.0, park_after_s=1.0))


def _w(wid: str, kv: str | None, **kw: object) -> WorkerConfig:
    base: dict[str, object] = {"dp_size": 1, "leader": False, "probe_extra_ports": 0}
    base.update(kw)
    return WorkerConfig(id=wid, engine="sglang", kv_endpoint=kv, **base)  # type: ignore[arg-type]


async def test_each_wrong_endpoint_has_its_reason(
    sims: Sims, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvobserve.health")
    sim: SimulatedWorker = sims.start(
        sim_config(dp_size=1, topic="kv-events", rate=50.0, max_batches=0, http_port=0)
    )
    kv, http = f"tcp://127.0.0.1:{sim.kv_base}", f"tcp://127.0.0.1:{sim.http_port}"
    workers = (
        _w("ok", kv, topic="kv-events"),
        _w("refused", f"tcp://127.0.0.1:{free_port()}", topic="kv-events"),
        _w("http", http, topic="kv-events"),
        _w("topic", kv, topic="foo"),
    )
    cfg = Config("t", CollectorConfig("c0", 0, 1, 0.2), workers)
    async with running_collector(cfg, ingest=FAST) as col:

        def settled(snap: Snapshot) -> bool:
            s = {st.worker_id: st for st in snap.streams}
            return (
                s["ok"].state == "up"
                and s["refused"].state == "connecting"
                and "HTTP server" in s["http"].reason
                and s["topic"].state == "wrong_topic"
            )

        snap = await wait_snapshot(col, settled, 20.0, "every stream has its reason")
        # the HTTP port never flips to up, however often libzmq reconnects
        ups = []
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            ups.append(next(s.up for s in (await col.snapshot()).streams if s.worker_id == "http"))
        snap = await col.snapshot()
    s = {st.worker_id: st for st in snap.streams}
    assert not any(ups) and len(ups) > 10
    assert s["refused"].reason == "connection refused: nothing listens there"
    assert not s["refused"].up and s["refused"].state_since > 0
    assert s["http"].state == "not_publisher" and not s["http"].up
    assert "the engine's HTTP port?" in s["http"].reason
    assert s["topic"].reason == "topic mismatch: subscribed 'foo', saw 'kv-events'"
    assert s["ok"].up and s["ok"].events_per_s and s["ok"].last_message_time > 0
    # Logged once per change, never per retry: the HTTP port had dozens of reconnects.
    http_lines = [r for r in caplog.records if "stream http rank 0" in r.getMessage()]
    assert 1 <= len(http_lines) <= 3, [r.getMessage() for r in http_lines]
    refused = [r for r in caplog.records if "stream refused rank 0" in r.getMessage()]
    assert len(refused) == 1 and "connection refused" in refused[0].getMessage()
    # The aggregator side: the reason in the API and the condition; no usage for a down stream.
    fleet = FleetState(stale_intervals=1000)
    fleet.update(snap, snap.time)
    view = fleet.view(snap.time + 10)  # past the few seconds a stream may settle
    streams = {j["worker_id"]: j for j in api.streams_json(view)}
    assert (
        streams["refused"]["cache_usage_ratio"] is None
        and streams["refused"]["state"] == "connecting"
    )
    assert streams["http"]["reason"] == s["http"].reason
    down = {dict(c.labels)["worker_id"]: c.description for c in active(view)
            if c.kind == "stream_down"}  # fmt: skip
    assert set(down) == {"refused", "http", "topic"}
    assert down["topic"].endswith("topic mismatch: subscribed 'foo', saw 'kv-events'")


async def test_scheduler_metrics_from_url_and_an_unreachable_metrics_url(
    sims: Sims, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvobserve.health")
    sim = sims.start(sim_config(dp_size=1, topic="kv-events", max_batches=0, http_port=0))
    url = f"http://127.0.0.1:{sim.http_port}"
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    workers = (
        WorkerConfig(id="by-url", engine="sglang", url=url, dp_size=None, topic="kv-events"),
        _w("dead", f"tcp://127.0.0.1:{sim.kv_base}", topic="kv-events", metrics_url=dead,
           leader=True),
    )  # fmt: skip
    cfg = Config("t", CollectorConfig("c0", 0, 1, 0.2), workers)
    async with running_collector(cfg) as col:

        def both(snap: Snapshot) -> bool:
            src = {s.worker_id: s for s in snap.sources}
            return (
                src.get("by-url") is not None
                and src["by-url"].state == "up"
                and (src.get("dead") is not None and src["dead"].state == "down")
            )

        snap = await wait_snapshot(col, both, 20.0, "both scheduler sources known")
        scrapes = {s.worker_id: s.messages_total for s in snap.sources}
        # several failed scrapes (every 0.2 s) later, still one log line for the dead URL
        await wait_snapshot(
            col,
            lambda sn: (
                next(s for s in sn.sources if s.worker_id == "by-url").messages_total
                >= scrapes["by-url"] + 5
            ),
            20.0,
            "five more scrapes",
        )
    src = {s.worker_id: s for s in snap.sources}
    assert src["by-url"].endpoint == f"{url}/metrics" and src["by-url"].source == "metrics"
    assert any(s.worker_id == "by-url" and s.dp_rank == 0 for s in snap.scheduler)
    assert src["dead"].reason.startswith("cannot connect:") and src["dead"].endpoint == dead
    lines = [
        r.getMessage() for r in caplog.records if "worker dead scheduler source" in r.getMessage()
    ]
    assert len(lines) == 1 and "down: cannot connect" in lines[0] and dead in lines[0]
    assert any(
        e.kind == "source" and e.worker_id == "dead" and "cannot connect" in e.message
        for e in snap.events
    )
