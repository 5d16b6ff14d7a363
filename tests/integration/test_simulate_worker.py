"""A running simulated worker on real ZMQ sockets: batches, replay, truth, and every fault."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from kvobserve.analysis.blocks import BlockIndex
from kvobserve.simulate import FaultConfig, SimConfig, SimulatedWorker, SimulatorGroup, nodes_of
from kvobserve.wire.errors import WireError
from kvobserve.wire.kv_events import END_SEQ, KvBatch, decode_message, decode_payload
from tests.polling import until

pytestmark = pytest.mark.integration
Msg = tuple[float, list[bytes]]


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    c.destroy(linger=0)


def collect(
    ctx: zmq.Context[zmq.Socket[bytes]],
    url: str,
    done: Callable[[list[Msg]], bool],
    deadline_s: float = 8.0,
) -> list[Msg]:
    """SUB to url and gather (arrival time, frames) until `done` or the deadline."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(url)
    out: list[Msg] = []
    end = time.monotonic() + deadline_s
    try:
        while not done(out):
            left = end - time.monotonic()
            assert left > 0, f"deadline: {len(out)} messages from {url}"
            if sub.poll(int(min(left, 0.2) * 1000)):
                out.append((time.monotonic(), sub.recv_multipart()))
    finally:
        sub.close(0)
    return out


def replay(ctx: zmq.Context[zmq.Socket[bytes]], url: str, start: int) -> list[list[bytes]]:
    """DEALER replay request `["", start]`; every reply up to and including the end marker."""
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(url)
    d.send_multipart([b"", start.to_bytes(8, "big")])
    out: list[list[bytes]] = []
    end = time.monotonic() + 5.0
    try:
        while not out or END_SEQ not in out[-1]:
            assert time.monotonic() < end, "replay deadline"
            if d.poll(200):
                out.append(d.recv_multipart())
    finally:
        d.close(0)
    return out


def seqs_of(msgs: list[Msg]) -> list[int]:
    return [int.from_bytes(f[1], "big") for _, f in msgs]


def instances(msgs: list[Msg]) -> list[list[Msg]]:
    """The messages split where seq goes back: one list per publisher instance seen (a SUB
    that reconnects after a restart misses the new instance's first batches)."""
    out: list[list[Msg]] = []
    last = None
    for m, seq in zip(msgs, seqs_of(msgs), strict=True):
        if last is None or seq <= last:
            out.append([])
        out[-1].append(m)
        last = seq
    return out


def url(w: SimulatedWorker, kind: str, rank: int) -> str:
    return next(e.url for e in w.endpoints() if e.kind == kind and e.dp_rank == rank)


def test_batches_decode_and_truth_matches_block_index(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    cfg = SimConfig(format="sglang-0.5.23", topic="kv-events", rate=400, max_batches=150,
                    capacity_tokens=1024, flush_every=60, http_port=None, start_delay_s=0.3)  # fmt: skip
    with SimulatedWorker(cfg) as w:
        live = collect(ctx, url(w, "kv", 1), lambda m: len(m) >= 20)
        for _, frames in live:
            b = decode_message(frames)
            assert b.topic == "kv-events" and b.dp_rank == 1 and b.events
        until(
            lambda: all(w.rank(r).streams[0].seq >= 150 for r in (0, 1)),
            8.0,
            "150 batches on both ranks",
        )
        for rank in (0, 1):
            msgs = replay(ctx, url(w, "replay", rank), 0)
            assert [len(m) for m in msgs] == [4] * 150 + [4]  # 0.5.23: topic in every reply
            index = BlockIndex()
            for m in msgs[:-1]:
                batch: KvBatch = decode_payload(m[1].decode(), int.from_bytes(m[2], "big"), m[3])
                index.apply_batch(batch)
            inst = w.truth()["ranks"][str(rank)]["instances"][-1]
            assert inst["batches"] == 150 and inst["live_dropped_seqs"] == []
            assert index.resident_hashes() == {"GPU": set(inst["resident"]["GPU"])}
            assert index.tokens == inst["resident_tokens"]


def test_wire_faults_appear_as_specified(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    faults = FaultConfig(
        ranks=(0,), drop_seqs=frozenset({5, 6}), ring_drop_seqs=frozenset({8}),
        malformed_seqs=frozenset({10}), second_publisher=(1,), mirror=((1, 2),),
        wrong_rank=((3, 7),), stray_publisher=True,
    )  # fmt: skip
    cfg = SimConfig(format="vllm-0.23", dp_size=4, rate=200, max_batches=30, http_port=None,
                    start_delay_s=0.4, faults=faults)  # fmt: skip
    with SimulatedWorker(cfg) as w:
        stray = next(e for e in w.endpoints() if e.kind == "stray")
        assert stray.url.endswith(f":{w.kv_base + 4}")
        sockets = {k: url(w, "kv", k) for k in range(4)}
        got: dict[str, list[Msg]] = {}
        # all five SUBs at once, so each sees the same publishing window
        subs = {}
        for name, u in [*((str(k), v) for k, v in sockets.items()), ("stray", stray.url)]:
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(u)
            subs[name] = s
            got[name] = []
        end = time.monotonic() + 8
        while not all(len(v) >= 25 for k, v in got.items() if k != "1") or len(got["1"]) < 50:
            assert time.monotonic() < end, {k: len(v) for k, v in got.items()}
            for name, s in subs.items():
                while s.poll(0):
                    got[name].append((time.monotonic(), s.recv_multipart()))
            time.sleep(0.005)  # polling interval across five sockets, not synchronization
        for s in subs.values():
            s.close(0)

        r0 = seqs_of(got["0"])
        assert {5, 6, 8}.isdisjoint(r0) and {4, 7, 9, 10, 11} <= set(r0)
        replayed = [int.from_bytes(m[1], "big") for m in replay(ctx, url(w, "replay", 0), 0)[:-1]]
        assert {5, 6} <= set(replayed) and 8 not in replayed and {7, 9} <= set(replayed)
        for _, f in got["0"]:
            if int.from_bytes(f[1], "big") == 10:
                with pytest.raises(WireError):
                    decode_message(f)
            else:
                decode_message(f)

        r1 = seqs_of(got["1"])  # two publishers, two interleaved monotonic sequences
        assert all(r1.count(s) == 2 for s in range(3, 20))
        first_seen: dict[bytes, list[bytes]] = {}
        for _, f in got["1"]:
            first_seen.setdefault(f[1], []).append(f[2])
        assert any(len(set(p)) == 2 for p in first_seen.values())

        mirror = {bytes(f[1]): f[2] for _, f in got["2"]}
        source: dict[bytes, set[bytes]] = {}
        for _, f in got["1"]:
            source.setdefault(bytes(f[1]), set()).add(f[2])
        common = set(mirror) & set(source)
        assert len(common) >= 10 and all(mirror[s] in source[s] for s in common)

        assert {decode_message(f).dp_rank for _, f in got["3"]} == {7}
        assert {decode_message(f).dp_rank for _, f in got["stray"]} == {4}


def test_restart_and_stall(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    faults = FaultConfig(
        ranks=(0,), restart_every=12, restart_pause_s=0.4, stall_after=6, stall_s=0.8
    )
    cfg = SimConfig(format="sglang-0.5.12", dp_size=1, rate=100, http_port=None,
                    start_delay_s=0.3, faults=faults)  # fmt: skip
    with SimulatedWorker(cfg) as w:
        msgs = collect(
            ctx, url(w, "kv", 0), lambda m: len(instances(m)) >= 2 and len(instances(m)[1]) >= 3
        )
        first, second = instances(msgs)[:2]
        # the first instance got to 11, then seq starts again (from 0, or from where the SUB,
        # reconnecting to the new socket, came in)
        assert seqs_of(first)[-1] == 11 and seqs_of(second)[0] < 11
        times = {s: t for (t, _), s in zip(first, seqs_of(first), strict=True)}
        assert times[6] - times[5] >= 0.7  # stalled: nothing for stall_s
        assert all(times[s + 1] - times[s] < 0.5 for s in range(6, 11))
        truth = w.truth()["ranks"]["0"]
        assert truth["restarts"] >= 1
        assert truth["instances"][0]["ended_by_restart"] and truth["instances"][0]["batches"] == 12


def test_periodic_stall_repeats_in_every_publisher_instance(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    faults = FaultConfig(ranks=(0,), stall_after=5, stall_s=1.0, period=15, restart_every=30,
                         restart_pause_s=0.2)  # fmt: skip
    cfg = SimConfig(format="sglang-0.5.23", dp_size=1, rate=100, http_port=None,
                    start_delay_s=0.3, faults=faults)  # fmt: skip

    def second_instance_past_21(m: list[Msg]) -> bool:
        seen = instances(m)
        return len(seen) >= 2 and seqs_of(seen[1])[-1] >= 21

    with SimulatedWorker(cfg) as w:
        msgs = collect(ctx, url(w, "kv", 0), second_instance_past_21, deadline_s=20.0)
    for part in instances(msgs)[:2]:  # the instance seen first, and the next
        # the publisher's own stamps, not arrival times (a busy machine delivers in bursts):
        # a 1 s stall is at least 1 s between two stamps; 10 ms batches are far from 0.95 s
        times = {(b := decode_message(f)).seq: b.ts for _, f in part}
        long_pauses = {s for s in times if s - 1 in times and times[s] - times[s - 1] >= 0.95}
        # a stall before seq 5 and 20 (every period), where both sides of it were seen: at
        # least the one before 20 (a SUB reconnecting to a new instance is back well before)
        assert {19, 20} <= set(times)
        assert {s for s in (5, 20) if s in times and s - 1 in times} <= long_pauses
        assert long_pauses <= {5, 20}


def test_multi_node_layout_and_pure_dp_collision(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    nodes = nodes_of(SimConfig(format="sglang-0.5.19", dp_size=3, nnodes=2, http_port=None))
    with SimulatorGroup(nodes) as g:
        kv = sorted((e.dp_rank, e.url) for e in g.endpoints() if e.kind == "kv")
        base = g.workers[0].kv_base
        assert kv == [(r, f"tcp://127.0.0.1:{base + r}") for r in range(3)]
        assert [[st.rank for st in w.ranks] for w in g.workers] == [[0, 1], [2]]
        msgs = collect(ctx, kv[2][1], lambda m: len(m) >= 2)
        assert {decode_message(f).dp_rank for _, f in msgs} == {2}
    old = SimConfig(format="sglang-0.5.12", dp_size=2, dp_attention=False, http_port=None)
    with SimulatedWorker(old) as w:
        kinds = [(e.kind, e.dp_rank) for e in w.endpoints()]
        assert ("kv", 0) in kinds and ("kv", 1) not in kinds and ("bind_failed", None) in kinds
