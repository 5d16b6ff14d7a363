"""Router-index drift: set and size comparisons, in-flight blocks, and the indexer answer forms."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvobserve.analysis.drift import compare_blocks, compare_sizes
from kvobserve.config import load_config
from kvobserve.simulate import dynamo_encode as enc
from kvobserve.sources.dynamo_drift import compare, indexer_endpoint
from kvobserve.sources.dynamo_plan import plan_dynamo
from kvobserve.sources.dynamo_state import Touched
from kvobserve.wire.dynamo_indexer import IndexerDump, decode_dump, decode_tree_sizes
from kvobserve.wire.errors import WireError

W = 2**63 + 5  # worker ids are u64


def test_compare_blocks_counts_phantom_missing_and_jaccard() -> None:
    d = compare_blocks({1, 2, 3, 4}, {3, 4, 5}, set())
    assert (d.router_blocks, d.engine_blocks, d.phantom, d.missing, d.in_flight) == (4, 3, 2, 1, 0)
    assert d.jaccard == pytest.approx(2 / 5)
    assert compare_blocks(set(), set(), set()).jaccard == 1.0


def test_blocks_touched_in_the_window_are_in_flight_not_drift() -> None:
    # 2 was removed and 5 stored while the dump was taken: the router may show either state
    d = compare_blocks({1, 2, 3}, {1, 3, 5}, {2, 5, 9})
    assert (d.phantom, d.missing, d.in_flight, d.jaccard) == (0, 0, 2, 1.0)
    d = compare_blocks({1, 2, 7}, {1, 3}, {2})
    assert (d.phantom, d.missing, d.in_flight) == (1, 1, 1)  # 7 and 3 are real drift


def test_compare_sizes_is_a_bound() -> None:
    assert compare_sizes(110, 100, 0).phantom == 10
    d = compare_sizes(110, 100, 4)  # 4 blocks changed in the window explain 4 of the 10
    assert (d.phantom, d.missing, d.in_flight, d.jaccard) == (6, 0, 4, None)
    assert compare_sizes(90, 100, 20).missing == 0


def _ev(worker: int, rank: int, hashes: list[int], tier: str = "device", eid: int = 0) -> Any:
    blocks = [enc.block(h, h + 1) for h in hashes]
    return enc.router_event(worker, eid, enc.stored(blocks), rank, storage_tier=tier)


def test_decode_dump_every_form() -> None:
    events = [_ev(W, 0, [1, 2]), _ev(W, 0, [3], "host_pinned"), _ev(7, 1, [4])]
    want = {(W, 0, "GPU"): {1, 2}, (W, 0, "CPU"): {3}, (7, 1, "GPU"): {4}}
    newest = {"m:default": {"block_size": 16, "events": events}, "x:g": {"error": "boom"}}
    d = decode_dump(json.dumps(newest).encode())
    assert (d.blocks, d.block_size, d.failed_groups) == (want, 16, ["x:g"])
    assert decode_dump(json.dumps({"m:default": events}).encode()).blocks == want
    assert decode_dump(json.dumps(events).encode()).blocks == want
    # only the configured model's groups
    two = {"m:default": {"events": events[:1]}, "n:default": {"events": events[2:]}}
    assert decode_dump(json.dumps(two).encode(), "n").blocks == {(7, 1, "GPU"): {4}}
    removal = enc.router_event(W, 9, enc.removed([1]), 0)
    assert decode_dump(json.dumps([removal]).encode()).other_events == 1


@pytest.mark.parametrize(
    ("body", "reason"),
    [(b"{", "msgpack"), (b'"x"', "schema"), (b'[{"worker_id": 1}]', "schema")],
)
def test_decode_dump_errors(body: bytes, reason: str) -> None:
    with pytest.raises(WireError) as exc:
        decode_dump(body)
    assert exc.value.reason == reason


def test_decode_tree_sizes() -> None:
    body = {"scores": {}, "frequencies": [], "tree_sizes": {str(W): {"0": 5, "1": 3}}}
    assert decode_tree_sizes(json.dumps(body).encode()) == {(W, 0): 5, (W, 1): 3}
    with pytest.raises(WireError, match="no tree_sizes"):
        decode_tree_sizes(b'{"scores": {}, "instances": {}}')


def _plan(**kw: Any) -> Any:
    flags = {"worker.engine": "dynamo", "worker.event_plane_url": "nats://h:1"}
    flags.update({f"worker.{k}": v for k, v in kw.items()})
    cfg = load_config(None, flags, {})
    return plan_dynamo(0, cfg.workers[0], cfg.collector)


def test_compare_streams_against_a_dump() -> None:
    plan = _plan()
    label = plan.label(W)
    ours = {
        (label, 0): Touched(W, {"GPU": {1, 2, 3}}, {3}, False, True),
        (label, 1): Touched(W, {"GPU": {9}}, set(), True, True),  # cleared in the window
        (plan.label(8), 0): Touched(8, {"GPU": {5}}, set(), False, False),  # router lacks it
    }
    dump = IndexerDump({(W, 0, "GPU"): {1, 4}, (W, 0, "CPU"): {6}, (11, 3, "GPU"): {7}}, [])
    got, unseen = compare(plan, dump, ours, 100.0)
    view = {k: (d.phantom, d.missing, d.in_flight, d.complete) for k, d in got.items()}
    assert view == {
        (label, 0, "GPU"): (1, 1, 1, True),  # 4 phantom, 2 missing, 3 stored in the window
        (label, 0, "CPU"): (1, 0, 0, True),  # a tier kvobserve never saw for this stream
        (plan.label(8), 0, "GPU"): (0, 1, 0, False),
    }
    assert unseen == 1  # worker 11 rank 3: in the router, never on our plane
    node = _plan(dp_size=8, keep_ranks="node")  # one node: every rank is this node's
    assert compare(node, dump, {}, 0.0)[1] == 2


def test_indexer_endpoint() -> None:
    assert indexer_endpoint("http://h:8090/", "dump") == "http://h:8090/dump"
    assert indexer_endpoint("http://h:8090/query", "dump") == "http://h:8090/query"
