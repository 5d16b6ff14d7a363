"""Each benchmark's pure core runs on a tiny input (no timing asserted); the fast /metrics writer is
exact. The benchmarks over sockets and processes: tests/integration/test_benchmarks_smoke.py."""

from __future__ import annotations

import random
import time
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics.exposition import generate_latest as om_generate_latest
from prometheus_client.utils import floatToGoString

from benchmarks import capacity, checkpoint, e2e, ingest, memory, misses, overlap, scale, sketch
from benchmarks._common import build_cycle
from kvobserve.analysis.analytics import CacheAnalytics
from kvobserve.analysis.blocks import BlockIndex
from kvobserve.analysis.fleet import FleetState
from kvobserve.analysis.views import FleetView
from kvobserve.export.exposition import format_value
from kvobserve.export.prometheus import FleetCollector, catalog_metric
from kvobserve.export.scrape import ScrapeCache
from kvobserve.wire.kv_events import decode_payload
from kvobserve.wire.snapshot import decode_snapshot, encode_snapshot
from tests.unit.test_export_fleet import rich_view


def test_ingest_cycle_is_store_remove_balanced() -> None:
    cycle = build_cycle(32)
    idx = BlockIndex()
    for seq, p in enumerate(cycle * 2):  # twice round: every re-store follows its removal
        idx.apply_batch(decode_payload("kv-events", seq, p))
    assert idx.blocks == {"GPU": 4096 * 16}
    # the first WINDOW removes of the first cycle find nothing; after that, nothing is stale
    assert idx.remove_of_unknown_total == 4096 * 16
    assert idx.store_of_resident_total == 0


def test_bare_and_naive_handlers_track_the_same_blocks_as_the_index() -> None:
    payloads = build_cycle(1)[:64]  # 32 stores; the 32 removes are of groups never stored
    bare, bare_resident = ingest.bare_handler()
    naive, naive_resident = ingest.naive_handler()
    idx = BlockIndex()
    for seq, p in enumerate(payloads):
        bare(p)
        naive(p)
        idx.apply_batch(decode_payload("kv-events", seq, p))
    assert bare_resident == set(naive_resident) == idx.resident_hashes()["GPU"]
    assert len(bare_resident) == 32 * 16


def test_overlap_lookup_walks_the_requests_it_times() -> None:
    stored = overlap.chains(1024)
    assert len(stored) == 4 and len({h for c in stored for h in c}) == 1024
    costs = overlap.lookup_costs(1024, calls=16)  # asserts each request's walk inside
    assert set(costs) == {"held 16", "held 64", "held 256", "miss first", "answer", "encode"}
    assert all(v > 0 for v in costs.values())


def test_memory_fill_counts_every_block() -> None:
    per = memory.per_block_traced(5_000, bytes_hashes=False, analytics=False)
    assert 40 < per < 400  # an int object plus a dict slot, give or take a resize


def test_scale_snapshot_round_trips_and_renders() -> None:
    now = time.time()
    fs = FleetState()
    for c in range(2):
        snap = decode_snapshot(encode_snapshot(scale.synthetic_snapshot(c, 8, 1, now)))
        fs.update(snap, now)
    body = ScrapeCache().render(fs.view(now), [], generate_latest)
    assert body.count(b"\nkvobserve_stream_up{") == 16


def test_e2e_payload_decodes_as_one_stored_event() -> None:
    batch = decode_payload("kv-events", 5, e2e.payload(5))
    assert [len(ev.block_hashes) for ev in batch.events] == [16]  # type: ignore[attr-defined]


def _fleets() -> list[FleetView]:
    now = time.time()
    fs = FleetState()
    for c in range(4):
        fs.update(scale.synthetic_snapshot(c, 8, 3, now), now)
    return [rich_view(), fs.view(now), FleetView()]


@pytest.mark.parametrize("accept", ["", "application/openmetrics-text; version=1.0.0"])
def test_fast_exposition_is_byte_identical_to_prometheus_client(accept: str) -> None:
    encoder, _ = choose_encoder(accept)
    om = accept != ""
    extra = [catalog_metric("kvobserve_nats_connected", [({}, 1.0)])]
    for view in _fleets():
        reg = CollectorRegistry(auto_describe=False)
        reg.register(FleetCollector(lambda v=view: v, lambda: extra))  # type: ignore[misc]
        want = (om_generate_latest if om else generate_latest)(reg)
        got = ScrapeCache().render(view, extra, encoder, om)
        assert got == want


def test_label_values_needing_escapes_render_as_prometheus_client_does() -> None:
    view = rich_view()
    st = view.streams[0].stats
    odd = msgspec.structs.replace(st, endpoint='tcp://a"b\\c\nd', worker_id="w\\x")
    view.streams[0] = msgspec.structs.replace(view.streams[0], stats=odd)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FleetCollector(lambda: view))
    want = generate_latest(reg)
    assert b'endpoint="tcp://a\\"b\\\\c\\nd"' in want  # the escapes are exercised
    assert ScrapeCache().render(view, [], generate_latest) == want


@pytest.mark.parametrize(
    "v",
    [
        0, 1, -1, 999_999, 1_000_000, -1_000_000, 123_456_789, 0.5, 1e-9, 2.5e20, True, False,
        1_000_000.0, 1_795_291_773.25, 16_000_000, 10**10, 12_345_678_901_234, 2**53 - 1, 2**53,
        10**20, 9.999_999_999_999_998e15, 1e16, -1_795_291_773.25, -(2**40), float("inf"),
        float("-inf"), float("nan"), -0.0, 1_000_000.5, 123_456_789.000_001,
    ],
)  # fmt: skip
def test_value_formatting_matches_float_to_go_string(v: float) -> None:
    assert format_value(v) == floatToGoString(v)


def test_benchmark_modules_have_a_main() -> None:
    for mod in (ingest, e2e, scale, memory, misses, capacity):
        assert callable(mod.main), mod.__name__
    assert Path(ingest.__file__).parent.name == "benchmarks"


def test_memory_fill_with_the_analytics_attributes_lora_blocks() -> None:
    idx = BlockIndex()
    idx.analytics = CacheAnalytics()
    memory.fill(idx, 3_584, bytes_hashes=False)  # 7 batches of 32 events of 16 hashes
    assert idx.blocks == {"GPU": 3_584}
    assert idx.analytics.lora_blocks == {"GPU": {"sql-lora": 3_584 // memory.LORA_EVERY}}


def test_sketch_benchmark_runs_on_a_tiny_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert sketch.main(["--seeds", "2", "--blocks", "2000", "--k", "64"]) == 0
    out = capsys.readouterr().out
    assert "KMV   k=64" in out and "distinct max" in out


def test_misses_benchmark_runs_offline_on_a_tiny_input(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--no-live", "--no-whole", "--salts", "2", "--trace-seconds", "30", "--page-size", "64"]
    assert misses.main(args) == 0
    out = capsys.readouterr().out
    assert "2 draws of the sample" in out and "10,000 stores" in out and "seen set" in out


def test_ingest_inprocess_comparison_runs_both_ways() -> None:
    cpu = ingest.inprocess(32, rounds=1)
    assert set(cpu) == {"off", "on"} and all(v > 0 for v in cpu.values())


def test_value_formatting_matches_float_to_go_string_at_random() -> None:
    r = random.Random(16)
    for _ in range(20_000):
        v = r.choice([
            r.randrange(-(10**17), 10**17), r.uniform(-1e17, 1e17), r.randrange(10**6, 2**53),
            r.uniform(1e6, 1e16), float(r.randrange(-(10**7), 10**7)), 10 ** r.randrange(20),
        ])  # fmt: skip
        assert format_value(v) == floatToGoString(v), v


def test_checkpoint_benchmark_writes_and_restores_every_stream(tmp_path: Path) -> None:
    r = checkpoint.measure(8, 200, 4, 0.2, str(tmp_path / "state"), steady_s=0.3)
    assert r["resident"] == 8 * 200  # restored block for block (asserted inside too)
    assert 15.0 < r["bytes_per_block_no_anchor"] <= 16.0  # 9 + 4 + 2 B a block, and the rest
    assert r["bytes_per_block"] > r["bytes_per_block_no_anchor"]
    assert r["copy_cpu_s"] > 0 and r["write_cpu_s"] > 0 and r["capped_written_per_s"] >= 0


def test_capacity_benchmark_runs_on_a_tiny_input(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--requests", "300", "--blocks", "300", "--pool-blocks", "80", "--rounds", "1"]
    assert capacity.main(args) == 0
    out = capsys.readouterr().out
    for line in ("one rank of 300 pages", "pool,   random", "pool, kv_aware", "per resident block",
                 "B per entry", "events/s on/off", "against the miss split's deltas"):  # fmt: skip
        assert line in out, line
