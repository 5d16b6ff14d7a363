"""The demo is quiet but for its injected faults, over ten minutes' worth of batches (issue 30).

"Healthy fleets warn": a healthy run raised placement_misses after 36 s, KVCachePlacementMisses
pending after six minutes (a router that is simply not cache-aware), and recovered gaps as
warnings. Here `kvobserve demo`, with its own faults (demo.py: SGLang ranks 2 and 5 lose batches
200-204 on the wire, recovered by replay, and restart their publishers every 1,000 batches; vLLM
rank 1 has a second publisher), runs at SPEEDUP times its rate until every rank has published
ten minutes of batches at the demo's rate, as test_demo_usage.py runs the clean demo. Every
condition the aggregator shows is sampled through the run, and Prometheus (Debian's) evaluates
alerts/kvobserve-rules.yml over the demo's /metrics with every `for:` and `keep_firing_for:`
divided by SPEEDUP. Warning and critical (conditions, and alerts firing) are allowed only for the
injected second publisher: the recovered gaps and the restarts are information. (A restart's
moment of `kvobserve_stream_up 0` makes KVEventStreamDown pending at a scrape, ten times as often
as at the demo's rate; pending is not raised, and it never lasts its `for:`.) The simulator's workload sends every rank the
same prompt library whatever rank a request goes to: a router that is not cache-aware.

What the speed-up does not compress: wall-clock thresholds of the conditions. Those of warning
or critical ones are DOWN_AFTER_S (5 s, inside the run) and stream_stalled's RECENT_S (15 min of
quiet: beyond ten minutes whatever the rate), index_incomplete's unvouched_warn_s (10 min);
placement_misses' PLACEMENT_MIN_S (5 min) is info, and its behaviour over time is tests/unit/test_placement_condition.py's.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest

from kvobserve.analysis.conditions import DOWN_AFTER_S, RECENT_S, active
from kvobserve.commands.demo import Demo, start_demo
from kvobserve.config import HttpConfig
from kvobserve.simulate.worker import SimulatedWorker
from tests.integration.test_demo_usage import (  # noqa: F401 (the fixture)
    BATCHES,
    DEMO_RATE,
    NOT_UP,
    SPEEDUP,
    _get,
    _query,
    prometheus,
)
from tests.polling import until_async

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

LOUD = ("warning", "critical")


def _published(demo: Demo) -> list[int]:
    """Batches each rank published, over every publisher instance (a restart starts a new one
    from seq 0: the ended ones are in `past`); a second publisher's not counted."""
    return [
        st.streams[0].seq + sum(s.seq for s in st.past)
        for w in demo.sims
        if isinstance(w, SimulatedWorker)
        for st in w.ranks
    ]


# the demo's injected fault that is a warning by its nature: two publishers on vLLM rank 1
INJECTED = {("duplicate_stream", "vllm-dp4", "1")}
# The second publisher leaves rank 1's index unvouched: KVIndexIncomplete fires too, and the
# shipped Alertmanager config inhibits it under KVEventDuplicateStream (one page, the cause).
# The aggregator's own index_incomplete waits its wall-clock unvouched_warn_s (10 min).
INJECTED_ALERTS = {
    ("KVEventDuplicateStream", "vllm-dp4", "1"),
    ("KVIndexIncomplete", "vllm-dp4", "1"),
}


async def test_the_demo_warns_only_of_its_injected_faults_over_ten_minutes_of_batches(
    prometheus: tuple[str, int],  # noqa: F811 (the fixture)
) -> None:
    assert DOWN_AFTER_S < 60 < 600 < RECENT_S  # what the docstring says of the wall-time ones
    prom, demo_port = prometheus

    def ready() -> bool:
        return bool(urllib.request.urlopen(f"{prom}/-/ready").status == 200)

    await until_async(lambda: asyncio.to_thread(ready), 30, "Prometheus ready", retry_on=NOT_UP)
    await until_async(
        lambda: asyncio.to_thread(
            lambda: bool(_get(prom, "/api/v1/targets")["data"]["activeTargets"])
        ),
        30,
        "Prometheus knows the demo target",
        retry_on=NOT_UP,
    )
    demo = await start_demo(
        HttpConfig(listen=f"127.0.0.1:{demo_port}"), rate=DEMO_RATE * SPEEDUP
    )  # the demo's own snapshot interval (1 s)
    seen: dict[tuple[str, str, str], str] = {}  # (kind, worker, rank) -> severity
    first: dict[tuple[str, str, str], float] = {}  # -> seconds into the run it was first seen
    t0 = time.monotonic()
    try:
        agg = demo.kvobserve.aggregator
        deadline = t0 + BATCHES / (DEMO_RATE * SPEEDUP) * 2.5
        while min(_published(demo)) < BATCHES:
            assert time.monotonic() < deadline, (
                f"ten minutes of batches not published: {_published(demo)}"
            )
            for c in active(agg.view()):
                lb = dict(c.labels)
                key = (
                    c.kind,
                    lb.get("worker_id", lb.get("collector", "-")),
                    lb.get("dp_rank", "-"),
                )
                seen[key] = c.severity
                first.setdefault(key, round(time.monotonic() - t0, 1))
            await asyncio.sleep(0.25)  # the sampling interval, not synchronization
        ran = time.monotonic() - t0
        await asyncio.sleep(2.0)  # two more scrapes and evaluations after the last batch
        window = f"{int(ran) + 30}s"
        fired = await asyncio.to_thread(
            _query,
            prom,
            f'count_over_time(ALERTS{{alertstate="firing", severity=~"warning|critical"}}[{window}])',
        )  # pending is not raised: a restart's second of stream_up 0 is pending, never firing
        info = await asyncio.to_thread(
            _query,
            prom,
            f'count_over_time(ALERTS{{alertstate="firing", severity="info"}}[{window}])',
        )
    finally:
        await demo.close()
    print(f"\nran {ran:.1f} s; conditions seen (severity, first seen at s): "
          f"{sorted((k, seen[k], first[k]) for k in seen)}")  # fmt: skip

    loud = {k for k, sev in seen.items() if sev in LOUD}
    assert loud == INJECTED, f"warning or critical beyond the injected fault: {loud - INJECTED}"
    alerts = {(r["metric"]["alertname"], r["metric"].get("worker_id"), r["metric"].get("dp_rank"))
              for r in fired}  # fmt: skip
    assert alerts == INJECTED_ALERTS, alerts
    # Not quiet by being blind: the injected gaps were seen (recovered: information), and so
    # were the restarts, in the conditions and in the rules
    for rank in ("2", "5"):
        assert seen.get(("sequence_gap", "sglang-dp8", rank)) == "info", rank
        assert seen.get(("publisher_restarted", "sglang-dp8", rank)) == "info", rank
    assert {r["metric"]["alertname"] for r in info} >= {
        "KVEventSequenceGap", "KVEventPublisherRestarted"
    }  # fmt: skip
