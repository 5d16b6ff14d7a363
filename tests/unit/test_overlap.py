"""Where would a request hit: the walk, the hash text form, the messages, the merge, the asking.

The walk (`BlockIndex.leading_blocks`) on synthetic batches; `parse_hash` against every hash of
the real engine captures as `kvobserve tap` prints it; the merge of the collectors' answers with
a fleet view (missing, not up, uncovered, failed); the local bus's asking with a slow and a
failing collector; the API's query errors and the CLI's reading of tap lines.
"""

from __future__ import annotations

import asyncio
import io
import json
import time

import pytest

from kvobserve.aggregator import Aggregator
from kvobserve.analysis.blocks import BlockIndex
from kvobserve.analysis.fleet import FleetState
from kvobserve.analysis.overlap import PoolError, awaited_collectors, merge_answers, pool_workers
from kvobserve.commands.overlap import InputError, Question, read_requests
from kvobserve.export.api import QueryError, overlap_json, overlap_query
from kvobserve.transport.local import LocalBus
from kvobserve.wire.errors import WireError
from kvobserve.wire.kv_events import BlockHash, BlockStored, decode_message, hash_json
from kvobserve.wire.overlap import (
    MAX_HASHES,
    HashError,
    OverlapReply,
    OverlapRequest,
    RankOverlap,
    decode_reply,
    decode_request,
    encode_overlap,
    parse_hash,
)
from kvobserve.wire.snapshot import CollectorInfo, Snapshot, StreamStats, WorkerInfo
from tests.unit.test_blocks import VERSIONS, batch, capture_messages, cleared, removed, stored

H = [1000 + i for i in range(8)]


# --- the walk -----------------------------------------------------------------------------------


def test_walk_stops_at_the_first_miss() -> None:
    idx = BlockIndex()
    idx.apply_batch(batch(0, 1.0, stored(H[:3]), stored(H[4:6])))
    assert idx.leading_blocks(H[:3]) == 3
    assert idx.leading_blocks(H) == 3, "H[3] is missing: H[4:6] behind it do not count"
    assert idx.leading_blocks(H[4:6]) == 2
    assert idx.leading_blocks([H[7], *H[:3]]) == 0
    assert idx.leading_blocks([]) == 0
    idx.apply_batch(batch(1, 2.0, removed([H[1]])))
    assert idx.leading_blocks(H) == 1
    idx.apply_batch(batch(2, 3.0, cleared()))
    assert idx.leading_blocks(H) == 0


def test_walk_reads_the_top_tier_only() -> None:
    idx = BlockIndex()
    idx.apply_batch(batch(0, 1.0, stored(H[:4], medium="CPU_PINNED"), stored(H[:2])))
    assert idx.leading_blocks(H) == 2, "an offloaded block is not where the engine computes"
    dev = BlockIndex()
    dev.apply_batch(batch(0, 1.0, stored(H[:4], medium="DEVICE")))
    assert dev.leading_blocks(H) == 4
    none = BlockIndex()
    none.apply_batch(batch(0, 1.0, stored(H[:4], medium="DISK")))
    assert none.leading_blocks(H) == 0


def test_walk_tells_int_and_bytes_hashes_apart() -> None:
    b = [bytes([i]) * 32 for i in range(3)]
    idx = BlockIndex()
    idx.apply_batch(batch(0, 1.0, stored(b), stored([-5, 2**64 - 1])))
    assert idx.leading_blocks(b) == 3
    assert idx.leading_blocks([-5, 2**64 - 1]) == 2
    assert idx.leading_blocks([5]) == 0 and idx.leading_blocks([b[0].hex()]) == 0  # type: ignore[list-item]


# --- the hash text form -------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_every_captured_hash_reads_back_from_its_tap_form(version: str) -> None:
    seen = 0
    for m in capture_messages(version):
        for ev in decode_message(m["frames"]).events:
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    assert parse_hash(str(hash_json(h))) == h
                    seen += 1
    assert seen > 0


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("-9223372036854775808", -(2**63)),
        ("18446744073709551615", 2**64 - 1),
        (" 42 ", 42),
        ("AB" * 32, b"\xab" * 32),
        ("1" * 64, bytes.fromhex("1" * 64)),  # 64 digits are never a 64-bit integer
    ],
)
def test_parse_hash(text: str, want: BlockHash) -> None:
    assert parse_hash(text) == want


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("0xdeadbeef", "'0xdeadbeef'"),
        ("ab" * 31, repr("ab" * 31)),
        ("18446744073709551616", "outside the 64-bit range"),
        ("", "expected an integer"),
        ("1.5", "'1.5'"),
    ],
)
def test_parse_hash_names_the_bad_value(text: str, says: str) -> None:
    with pytest.raises(HashError, match="hash") as exc:
        parse_hash(text)
    assert says in str(exc.value)


# --- the messages -------------------------------------------------------------------------------


def test_messages_round_trip_and_bound_the_request() -> None:
    req = OverlapRequest([-1, 2**64 - 1, b"\x01" * 32], ["w0"])
    assert decode_request(encode_overlap(req)) == req
    reply = OverlapReply("node-1", 1, [RankOverlap("w0", 3, 7, True, "complete")])
    assert decode_reply(encode_overlap(reply)) == reply
    with pytest.raises(WireError, match="4097 hashes"):
        decode_request(encode_overlap(OverlapRequest([1] * (MAX_HASHES + 1))))
    with pytest.raises(WireError):
        decode_reply(b"\xc1")


# --- the merge ----------------------------------------------------------------------------------


def _snap(cid: str, node: int, ranks: list[int], dp_size: int = 4, t: float = 0.0) -> Snapshot:
    return Snapshot(
        collector=CollectorInfo(cid, node_rank=node, start_time=1.0),
        seq=1,
        time=t or time.time(),
        interval_s=1.0,
        workers=[WorkerInfo("w0", "sglang", dp_size, ranks, node == 0)],
        streams=[StreamStats("w0", r, engine="sglang", up=True) for r in ranks],
    )


def _fleet(now: float, *snaps: tuple[Snapshot, float]) -> FleetState:
    fleet = FleetState(stale_intervals=3)
    for snap, received in snaps:
        fleet.update(snap, received)
    return fleet


def test_merge_lists_every_rank_of_the_pool_and_who_did_not_answer() -> None:
    now = 1000.0
    fleet = _fleet(
        now,
        (_snap("node-0", 0, [0, 1], dp_size=7), now),
        (_snap("node-1", 1, [2, 3], dp_size=7), now),
        (_snap("node-2", 2, [4], dp_size=7), now - 60),  # down: its rank has no live owner
        (_snap("node-3", 3, [5], dp_size=7), now - 30),  # down, and it does not answer
    )
    view = fleet.view(now)
    assert pool_workers(view, None) == ["w0"] and pool_workers(view, "w0") == ["w0"]
    with pytest.raises(PoolError, match="pool 'w9': no worker of that id \\(workers: w0\\)"):
        pool_workers(view, "w9")
    assert awaited_collectors(view, ["w0"]) == {"node-0", "node-1"}
    replies = [
        OverlapReply(
            "node-0",
            0,
            [
                RankOverlap("w0", 0, 5, True, "complete"),
                RankOverlap("w0", 1, 9, False, "partial"),
                RankOverlap("other", 0, 3, True, "complete"),  # not in the pool
            ],
        ),
        OverlapReply("node-2", 2, error="overlap request: schema: ..."),
    ]
    a = merge_answers(view, None, ["w0"], 12, replies, 0.5)
    got = {(r.dp_rank, r.collector): (r.leading_blocks, r.node_rank, r.reason) for r in a.ranks}
    assert got == {
        (0, "node-0"): (5, 0, ""),
        (1, "node-0"): (None, 0, "stream not up: its blocks are unknown"),
        (2, "node-1"): (None, 1, "collector node-1 did not answer within 0.5 s"),
        (3, "node-1"): (None, 1, "collector node-1 did not answer within 0.5 s"),
        (4, "node-2"): (None, 2, "collector node-2 could not answer: overlap request: schema: ..."),
        (5, "node-3"): (None, 3, "collector node-3 is down (no snapshot for 30 s)"),
        (6, None): (None, None, "no collector watches this rank"),
    }
    assert a.missing == ["node-1", "node-2", "node-3"]
    doc = overlap_json(a)
    assert doc["ranks"][0] == {
        "worker_id": "w0", "node_rank": 0, "dp_rank": 0, "leading_blocks": 5,
        "collector": "node-0", "trust": "complete", "reason": None,
    }  # fmt: skip
    assert doc["missing"] == ["node-1", "node-2", "node-3"] and doc["hashes"] == 12


def test_a_collector_that_answers_without_a_rank_is_not_missing() -> None:
    now = 1000.0
    view = _fleet(now, (_snap("node-0", 0, [0, 1], dp_size=2), now)).view(now)
    a = merge_answers(
        view,
        "w0",
        ["w0"],
        3,
        [OverlapReply("node-0", 0, [RankOverlap("w0", 0, 3, True, "complete")])],
        1.0,
    )
    assert a.missing == []
    assert [(r.dp_rank, r.leading_blocks, r.reason) for r in a.ranks] == [
        (0, 3, ""),
        (1, None, "collector node-0 has no stream of this rank"),
    ]


# --- asking through the local bus ---------------------------------------------------------------


async def test_aggregator_asks_the_local_bus_and_reports_the_slow_collector() -> None:
    bus = LocalBus()
    agg = Aggregator(FleetState(stale_intervals=3))
    await agg.start(bus)
    try:
        for cid, node, ranks in (("node-0", 0, [0, 1]), ("node-1", 1, [2, 3])):
            agg.apply(_snap(cid, node, ranks))
        asked: list[OverlapRequest] = []

        async def fast(data: bytes) -> bytes:
            req = decode_request(data)
            asked.append(req)
            n = len(req.hashes)
            ranks = [RankOverlap("w0", r, n - r, True, "complete") for r in (0, 1)]
            return encode_overlap(OverlapReply("node-0", 0, ranks))

        slow_done = asyncio.Event()

        async def slow(data: bytes) -> bytes:
            try:
                await asyncio.sleep(30)
            finally:
                slow_done.set()  # cancelled when the asker gave up
            return b""

        await bus.serve_overlap("node-0", fast)
        await bus.serve_overlap("node-1", slow)
        a = await agg.overlap([1, 2, 3], "w0", timeout_s=0.2)
        assert asked == [OverlapRequest([1, 2, 3], ["w0"])]
        assert [(r.dp_rank, r.leading_blocks) for r in a.ranks] == [
            (0, 3), (1, 2), (2, None), (3, None),
        ]  # fmt: skip
        assert a.missing == ["node-1"]
        assert slow_done.is_set(), "the unanswered question is not left running"

        async def fails(data: bytes) -> bytes:
            raise RuntimeError("boom")

        await bus.serve_overlap("node-1", fails)
        a = await agg.overlap([1], None, timeout_s=0.2)
        assert a.missing == ["node-1"] and bus.counters.handler_errors == 1
    finally:
        await agg.stop()
        await bus.close()


async def test_aggregator_without_a_transport_says_so() -> None:
    with pytest.raises(RuntimeError, match="no transport"):
        await Aggregator(FleetState()).overlap([1])


# --- the API's query and the CLI's input --------------------------------------------------------


def test_overlap_query() -> None:
    h, pool, timeout = overlap_query({"pool": "w0", "timeout_s": "0.5"}, ["-1,2", "ab" * 32])
    assert h == [-1, 2, b"\xab" * 32] and pool == "w0" and timeout == 0.5
    for query, given, says in (
        ({}, [], "hashes: required"),
        ({}, ["1,,2"], "hashes: item 2 of 3 is empty"),
        ({}, ["1,x"], "hashes: item 2: hash 'x'"),
        ({}, [",".join(["1"] * (MAX_HASHES + 1))], f"{MAX_HASHES + 1} given, at most {MAX_HASHES}"),
        ({"timeout_s": "nan"}, ["1"], "timeout_s: 'nan'"),
        ({"timeout_s": "11"}, ["1"], "timeout_s: '11' is not a number in (0, 10]"),
    ):
        with pytest.raises(QueryError) as exc:
            overlap_query(query, given)
        assert says in str(exc.value)


def _tap(*events: dict[str, object]) -> str:
    return json.dumps({"topic": "kv", "seq": 0, "dp_rank": 0, "ts": 1.0, "events": list(events)})


def _st(hashes: list[int], parent: int | None) -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent}


def _hashes(qs: list[Question]) -> list[tuple[list[str], str | None]]:
    return [(q.hashes, q.parent) for q in qs]


def test_read_requests_from_arguments_and_stdin() -> None:
    (q,) = read_requests(["1,2", " 3 4"], None)
    assert (q.hashes, q.where, q.title(1, 1)) == (["1", "2", "3", "4"], "", "")
    (q,) = read_requests([], io.StringIO('1, 2\n\n3\t4\n[5, "ab"]\n'))
    assert q.hashes == ["1", "2", "3", "4", "5", "ab"]
    # tap lines: each batch's requests, split by parent chains; a request hanging off a block
    # stored earlier in the input gets its chain first, one off a block before it keeps it
    text = "\n".join(
        [
            _tap(_st([1, 2], 99), {"type": "BlockRemoved", "block_hashes": [7]}, _st([3], 2)),
            _tap(_st([4, 5], 3), _st([8], None), _st([6], 1)),
        ]
    )
    qs = read_requests([], io.StringIO(text))
    assert _hashes(qs) == [
        (["1", "2", "3"], "99"),
        (["1", "2", "3", "4", "5"], "99"),
        (["8"], None),
        (["1", "6"], "99"),
    ]
    assert [q.where for q in qs] == [
        "seq 0 request 1 (stdin line 1)",
        "seq 0 request 1 (stdin line 2)",
        "seq 0 request 2 (stdin line 2)",
        "seq 0 request 3 (stdin line 2)",
    ]
    assert qs[1].title(2, 4) == (
        "request 2 of 4: seq 0 request 1 (stdin line 2); after block 99, stored before the input"
    )
    assert qs[2].title(3, 4) == "request 3 of 4: seq 0 request 2 (stdin line 2)"
    # `tap --requests` lines: one request each
    line = {"topic": "kv", "seq": 7, "dp_rank": 0, "ts": 1.0, "request": 2,
            "block_hashes": [4, 5], "stored": 1, "parent_block_hash": 3}  # fmt: skip
    (q,) = read_requests([], io.StringIO(json.dumps(line)))
    assert (q.hashes, q.parent, q.where) == (["4", "5"], "3", "seq 7 request 2 (stdin line 1)")
    assert q.title(1, 1) == "request: after block 3, stored before the input"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (_tap({"type": "BlockRemoved", "block_hashes": [1]}), "no BlockStored event with block hashes on stdin"),
        ('{"seq": 1}', "stdin line 1: a JSON object without `events` or `block_hashes` (not a `kvobserve tap` line)"),
        (_tap({"type": "BlockStored", "block_hashes": "ab"}), 'stdin line 1: block_hashes "ab" is not a list'),
        (_tap({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": True}), "stdin line 1: true is not a block hash"),
        ("[1, true]", "stdin line 1: true is not a block hash"),
        ("{oops", "stdin line 1: not JSON"),
        ("", "no hashes on stdin"),
        (_tap(_st([1], None)) + "\n5 6", "stdin holds `kvobserve tap` lines and plain hashes: give one or the other"),
        (_tap(*(_st([i], None) for i in range(101))), "101 requests on stdin: at most 100 a run"),
    ],
)  # fmt: skip
def test_read_requests_says_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(InputError) as exc:
        read_requests([], io.StringIO(text))
    assert says in str(exc.value)
    with pytest.raises(InputError, match="no hashes: give them as arguments or on stdin"):
        read_requests([], None)
