"""The status page of a real fleet in seven cases, rendered by headless Chromium, with screenshots.

Each case runs a simulated engine with one fault profile (or a wrong configuration), the embedded
kvobserve with HTTP, waits for the condition the case is about, then dumps the DOM and takes a
screenshot. Screenshots are artifacts, not fixtures: they land in build/status-page/ (or in
$KVOBSERVE_ARTIFACTS) for a person to look at; the assertions are on the DOM.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from kvobserve.analysis.conditions import active
from kvobserve.analysis.views import FleetView
from kvobserve.commands.embedded import Embedded, start_embedded
from kvobserve.config import CollectorConfig, Config, HttpConfig, WorkerConfig
from kvobserve.simulate import SimConfig, SimulatedWorker
from kvobserve.simulate.ports import free_port
from kvobserve.simulate.profiles import profile
from tests.integration.test_export_status_page import run_chromium
from tests.polling import until_async

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RATE = 50.0


def artifacts() -> Path:
    """Where screenshots go (created)."""
    out = Path(os.environ.get("KVOBSERVE_ARTIFACTS", ROOT / "build" / "status-page"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def _worker(sim: SimulatedWorker, **kw: object) -> WorkerConfig:
    c = sim.cfg
    base: dict[str, object] = {
        "id": c.worker_id,
        "engine": sim.fmt.engine,
        "kv_endpoint": f"tcp://127.0.0.1:{sim.kv_base}",
        "replay_endpoint": f"tcp://127.0.0.1:{sim.replay_base}",
        "topic": c.topic,
        "dp_size": c.dp_size,
        "dp_attention": True,
        "metrics_url": f"http://127.0.0.1:{sim.http_port}/metrics",
    }
    base.update(kw)
    return WorkerConfig(**base)  # type: ignore[arg-type]


def _has(kind: str, rank: int | None = None) -> Callable[[FleetView], bool]:
    def check(v: FleetView) -> bool:
        return any(
            c.kind == kind and (rank is None or dict(c.labels).get("dp_rank") == str(rank))
            for c in active(v)
        )

    return check


def _clean(v: FleetView) -> bool:
    return (
        len(v.streams) == 2
        and all(s.stats.state == "up" and s.stats.batches_total > 20 for s in v.streams)
        and not active(v)
    )


# case -> (fault profile, what to wait for, strings the page must show)
CASES: dict[str, tuple[str, Callable[[FleetView], bool], list[str]]] = {
    "clean": (
        "clean",
        _clean,
        ["No active conditions.", 'data-state="up"', "complete<br>", "from_start", 'id="hot"'],
    ),
    "silent": (
        "silent",
        _has("silent_loss", 1),
        ["KVEventSilentLoss", "silent loss: ", "evidence of events lost without a sequence gap"],
    ),
    "gap": (
        "gap",
        _has("sequence_gap", 1),
        ["KVEventSequenceGap", "gap: seq 20-22 missed (3); recovered by replay"],
    ),
    "restart": (
        "restart",
        _has("publisher_restarted", 0),
        ["KVEventPublisherRestarted", "publisher restarted: seq fell back from"],
    ),
    "duplicate": (
        "duplicate",
        _has("duplicate_stream", 1),
        ['data-state="duplicate"', "KVEventDuplicateStream", "two publishers wrote into it"],
    ),
    "stray": ("stray", _has("unexpected_stream"), ['id="strays-table"', "KVEventUnexpectedStream"]),
    "down": (
        "clean",
        lambda v: (
            _has("stream_down", 2)(v)
            and any("HTTP server" in c.description for c in active(v) if c.kind == "stream_down")
        ),
        [
            "connection refused: nothing listens there",
            "answers like an HTTP server (the engine's HTTP port?)",
            'class="c-critical"><span class="st">connecting</span>',
            "KVEventStreamDown",
        ],
    ),
}


async def _start(case: str, fault: str) -> tuple[list[SimulatedWorker], Embedded, str]:
    faults = profile(fault, rate=RATE, period_s=3.0)
    cfg = SimConfig(worker_id=f"sim-{case}", format="sglang-0.5.23", dp_size=2,
                    topic="kv-events", rate=RATE, start_delay_s=0.5, prompts=60, faults=faults)  # fmt: skip
    sim = SimulatedWorker(cfg).start()
    workers = [_worker(sim)]
    if case == "down":
        # one rank too many (nothing listens on the third port) and a worker pointed at the
        # engine's HTTP port instead of its KV-event port
        http_port = f"tcp://127.0.0.1:{sim.http_port}"
        workers = [
            _worker(sim, dp_size=3, probe_extra_ports=0),
            _worker(sim, id="sim-http-port", kv_endpoint=http_port, replay_endpoint=None,
                    dp_size=1, leader=False),
        ]  # fmt: skip
    listen = f"127.0.0.1:{free_port()}"
    config = Config("cases", CollectorConfig("node-0", 0, 1, 0.5), tuple(workers))
    try:
        emb = await start_embedded([config], HttpConfig(listen=listen))
    except BaseException:
        sim.stop()
        raise
    return [sim], emb, f"http://{listen}"


@pytest.mark.parametrize("case", list(CASES))
async def test_status_page_case(case: str, tmp_path: Path) -> None:
    fault, ready, must_show = CASES[case]
    sims, emb, url = await _start(case, fault)
    try:
        agg = emb.aggregator
        await until_async(lambda: ready(agg.view()), 30.0, f"{case}: the condition")
        await agg.check_conditions()  # the transitions into the event list now, not at a tick
        if case == "gap":
            await until_async(
                lambda: any(e["kind"] == "gap" for e in agg.events), 10.0, "the gap event"
            )
        dom = await run_chromium(["--dump-dom", f"{url}/"], tmp_path / "p1")
        shot = artifacts() / f"{case}.png"
        await run_chromium(
            [f"--screenshot={shot}", "--window-size=1600,1800", f"{url}/"], tmp_path / "p2"
        )
    finally:
        await emb.close()
        for s in sims:
            s.stop()
    for text in must_show:
        assert text in dom, f"{case}: {text!r} not on the page"
    # Colour only for conditions: with none active (and a warm cache), nothing is tinted.
    body = dom.split("</style>", 1)[1]
    tinted = re.findall(r'class="[^"]*\bc-(critical|warning|info)', body)
    assert bool(tinted) == (case != "clean"), f"{case}: tints {tinted}"
    assert shot.stat().st_size > 20_000  # a rendered page, not a blank one
