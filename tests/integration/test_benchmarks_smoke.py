"""The benchmarks that run over real sockets and processes (ZMQ, nats-server, aggregators), on
tiny inputs: each one's wiring works end to end (no timing asserted: figures are for
`make bench`). Their pure cores are unit tests (tests/unit/test_benchmarks_smoke.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from benchmarks import ingest, relay, scale

pytestmark = pytest.mark.integration


def test_ingest_consumers_agree_over_real_zmq() -> None:
    bare = ingest.measure(32, 300, "bare")
    ours = ingest.measure(32, 300, "kvobserve")
    assert (bare.batches, bare.gaps) == (300, 0)
    assert (ours.batches, ours.gaps) == (300, 0)
    assert bare.rate > 0 and ours.rate > 0


def test_scale_short_run_measures_both_renderers(tmp_path: Path) -> None:
    plan = scale.Plan(steady=scale.LEARN + 1, interval_s=1.0, cold=1, warm=1, idle_s=0.2)
    figs = asyncio.run(scale.run(2, 2, plan, tmp_path))
    assert list(figs[4]) == ["main", "new"]
    main, new = figs[4]["main"], figs[4]["new"]
    for f in (main, new):
        assert f.streams == 4 and all(len(t) == 1 for t in f.times.values()), f.times
        assert 0 < f.gzip_bytes < f.plain_bytes
    assert main.samples == new.samples  # the same series, rendered on request and ahead


def test_scale_against_another_checkout(tmp_path: Path) -> None:
    # "other" stands in for a worktree of main: its own kvobserve (this one's, by a link)
    other = tmp_path / "other"
    other.mkdir()
    (other / "kvobserve").symlink_to(Path(scale.__file__).resolve().parents[1] / "kvobserve")
    work = tmp_path / "work"
    work.mkdir()
    plan = scale.Plan(steady=scale.LEARN + 1, interval_s=1.0, cold=1, warm=1, idle_s=0.2)
    rounds = asyncio.run(scale.compare(other, 2, 2, plan, work, 1))
    assert [list(r) for r in rounds] == [["other", "this"]]
    a, b = rounds[0]["other"], rounds[0]["this"]
    assert a.streams == b.streams == 4 and a.samples == b.samples > 0
    # one-off scrapes (one per encoding); those that met no render ahead have their thread CPU
    assert len(a.cold_cpu) == len(b.cold_cpu) == 2
    assert all(len(f.cold_render_cpu) <= 2 for f in (a, b))
    assert all(x > 0 for f in (a, b) for x in f.cold_render_cpu)


def test_scale_short_run_over_shards(tmp_path: Path) -> None:
    plan = scale.Plan(steady=1, interval_s=1.0, cold=1, warm=1, idle_s=0.2)
    figs = asyncio.run(scale.run(24, 1, plan, tmp_path, shards=2))
    shards = figs[24]
    assert list(shards) == ["shard 0", "shard 1"]
    assert sum(f.streams for f in shards.values()) == 24  # every stream in one shard
    assert all(f.streams > 0 and f.samples > 0 for f in shards.values())


def test_ingest_without_analytics_runs_the_same_loop() -> None:
    off = ingest.measure(32, 300, "kvobserve-off")
    assert (off.batches, off.gaps) == (300, 0)


def test_relay_benchmark_delivers_every_frame_both_ways() -> None:
    f = relay.run(seconds=0.05, rounds=1, unpaced=300)  # 500 paced and 300 unpaced per path
    for mode in ("direct", "relay"):
        assert (f["paced"][mode]["sent"], f["paced"][mode]["lost"]) == (500, 0)
        assert (f["unpaced"][mode]["sent"], f["unpaced"][mode]["lost"]) == (300, 0)
        assert 0 < f["paced"][mode]["p50_ms"] <= f["paced"][mode]["p99_ms"]
    k = f["kvobserve"]
    assert (k["forwarded"], sum(k["dropped"].values()), k["applied"], k["gaps"]) == (800, 0, 800, 0)
