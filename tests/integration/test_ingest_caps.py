"""Cardinality caps of the ingest loop: streams past max_streams are refused and counted."""

from __future__ import annotations

from kvobserve.simulate.ports import free_port
from kvobserve.sources.ingest_options import IngestOptions
from kvobserve.sources.kv_stream import IngestLoop
from kvobserve.sources.plan import StreamSpec


def test_streams_past_the_cap_are_refused_and_counted() -> None:
    specs = [
        StreamSpec("w", r, "vllm", f"tcp://127.0.0.1:{free_port()}", replay_endpoint=None)
        for r in range(3)
    ]
    loop = IngestLoop(specs, IngestOptions(max_streams=2))
    loop.start()
    try:
        stats = loop.stats().result(timeout=5)
        assert [s.dp_rank for s in stats.streams] == [0, 1]
        assert stats.refused == {"streams": 1}
        # a re-plan that drops a stream makes room: rank 2 is watched now; the counter is
        # cumulative, and a stream refused again by the next plan is not counted twice
        loop.set_specs(specs[1:]).result(timeout=5)
        stats = loop.stats().result(timeout=5)
        assert sorted(s.dp_rank for s in stats.streams) == [1, 2]
        assert stats.refused == {"streams": 1}
        loop.set_specs([*specs[1:], StreamSpec("w", 3, "vllm", specs[0].endpoint)]).result(5)
        loop.set_specs([*specs[1:], StreamSpec("w", 3, "vllm", specs[0].endpoint)]).result(5)
        assert loop.stats().result(timeout=5).refused == {"streams": 2}
    finally:
        loop.stop()
