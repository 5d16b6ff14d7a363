"""Fault matrix, stream side: faults not covered elsewhere, each with exact counters and a check
that nothing already collected is lost. docs/reliability.md maps every fault to its test."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import zmq

from kvobserve.analysis.blocks import BlockIndex
from kvobserve.simulate import FaultConfig, SimulatedWorker
from kvobserve.simulate.encoders import encode_batch, get_format
from kvobserve.sources.ingest_options import IngestOptions
from kvobserve.wire.kv_events import decode_message, decode_payload
from kvobserve.wire.snapshot import Snapshot
from tests.integration.collector_helpers import (
    Resident,
    Sims,
    capture_publisher,
    collector_config,
    normalized,
    resident,
    running_collector,
    sim_collector_config,
    sim_config,
    stream,
    truth_instance,
    truth_resident,
    wait_connected,
    wait_snapshot,
)

pytestmark = pytest.mark.integration


@contextmanager
def live_tap(sim: SimulatedWorker, rank: int) -> Iterator[zmq.Socket[bytes]]:
    """A raw SUB on one rank's port, connected before the engine publishes; read it at the end."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, sim.cfg.topic.encode())
    sub.connect(f"tcp://{sim.cfg.host}:{sim.kv_base + rank}")
    try:
        yield sub
    finally:
        ctx.destroy(linger=0)


def _drain(sub: zmq.Socket[bytes]) -> dict[int, list[bytes]]:
    out: dict[int, list[bytes]] = {}
    while sub.poll(0):
        frames = sub.recv_multipart()
        out[int.from_bytes(frames[1], "big")] = frames
    return out


def _runs(seqs: set[int]) -> int:
    """Runs of consecutive seqs: one gap each."""
    return sum(1 for s in seqs if s - 1 not in seqs)


async def test_a_hole_longer_than_the_replay_ring_recovers_what_the_ring_still_holds(
    sims: Sims,
) -> None:
    # rank 1 loses seqs 40-58 on the wire; the ring keeps 8 batches, so when seq 59 reveals the
    # hole (the engine has finished: its ring is frozen at 52-59) only 52-58 can come back
    dropped = frozenset(range(40, 59))
    faults = FaultConfig(ranks=(1,), drop_seqs=dropped)
    sim = sims.start(sim_config("vllm-0.33", buffer_steps=8, faults=faults), held=True)
    with live_tap(sim, 1) as tap:
        async with running_collector(sim_collector_config(sim)) as col:
            await wait_connected(col, sim)
            snap = await wait_snapshot(
                col,
                lambda s: (
                    stream(s, 0).batches_total == 60
                    and stream(s, 1).batches_total == 48
                    and sum(stream(s, 1).replay_requests.values()) == 1
                ),
                what="rank 0 complete; rank 1: 40 + 7 recovered + 1 held",
            )
            truth = sim.truth()
            st1 = stream(snap, 1)
            assert (st1.gaps, st1.missed, st1.recovered, st1.lost) == (1, 19, 7, 12)
            assert st1.replay_requests == {"partial": 1}
            assert st1.state_complete is False  # 40-51 are gone for good
            st0 = stream(snap, 0)
            assert (st0.gaps, st0.missed, st0.lost, st0.state_complete) == (0, 0, 0, True)
            assert await resident(col, "w", 0) == truth_resident(truth_instance(truth, 0))
            # nothing collected before the hole is lost, and what came back is applied in order:
            # live 0-39, then the ring's 52-59 (59 also arrived live)
            live = _drain(tap)
            assert sorted(live) == [*range(40), 59], "the tap must see every live batch"
            ring = sim.rank(1).streams[0].ring
            assert [seq for seq, _, _ in ring] == list(range(52, 60))
            want = BlockIndex()
            for s in range(40):
                want.apply_batch(decode_message(live[s]))
            for seq, _, payload in ring:
                want.apply_batch(decode_payload("", seq, payload))
            assert await resident(col, "w", 1) == normalized(want.resident_hashes())


async def test_ten_percent_malformed_payloads_are_counted_once_and_the_rest_applied(
    sims: Sims,
) -> None:
    faults = FaultConfig(ranks=(0,), malformed_rate=0.1)
    sim = sims.start(sim_config("sglang-0.5.23", rate=2000.0, max_batches=300, seed=11, faults=faults), held=True)  # fmt: skip
    async with running_collector(sim_collector_config(sim)) as col:
        await wait_connected(col, sim)
        end = time.monotonic() + 10
        while sim.truth()["ranks"]["0"]["instances"][0]["batches"] < 300:
            assert time.monotonic() < end, "engine did not finish"
            await asyncio.sleep(0.02)  # polling interval, not synchronization
        truth = sim.truth()
        bad = set(truth_instance(truth, 0)["malformed_seqs"])
        assert 15 <= len(bad) <= 45 and 299 not in bad, f"seed 11 gives ~10%: {sorted(bad)}"
        snap = await wait_snapshot(
            col,
            lambda s: (
                stream(s, 0).batches_total == 300 - len(bad)
                and stream(s, 1).batches_total == 300
                and stream(s, 0).lost == len(bad)
            ),
            what="every good batch applied, every bad one written off",
        )
        st = stream(snap, 0)
        # the ring returns the same bad bytes on replay: still one error per bad batch
        assert st.decode_errors == {"msgpack": len(bad)}
        assert (st.gaps, st.missed, st.recovered, st.lost) == (_runs(bad), len(bad), 0, len(bad))
        assert st.state_complete is False
        assert stream(snap, 1).decode_errors == {}
        # a malformed batch carries no cache change: the index is the engine's cache exactly
        for r in (0, 1):
            assert await resident(col, "w", r) == truth_resident(truth_instance(truth, r))


def _counted(oversize: int, batches: int) -> Callable[[Snapshot], bool]:
    return lambda s: (
        stream(s, 0).decode_errors.get("oversize") == oversize
        and stream(s, 0).batches_total == batches
    )


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))


async def test_payloads_over_the_size_limit_are_counted_and_not_kept() -> None:
    # Our limit (IngestOptions.max_payload, 32 MiB by default; 64 KiB here) drops them: the
    # SUB socket has no ZMQ_MAXMSGSIZE (that would drop the connection and every good batch
    # queued behind it), so ZMQ delivers the message whole and the decoder refuses it by length
    # before parsing. Nothing may hold on to it: RSS must not grow by N x the payload size.
    limit, size, warm, n = 64 * 1024, 4 * 1024 * 1024, 2, 16
    fmt = get_format("vllm-0.33")
    big = bytes(size)
    hashes: list[int] = []

    def good(seq: int) -> list[bytes]:
        h = 1000 + seq
        hashes.append(h)
        payload = encode_batch(time.time(), [fmt.stored([h], None, [1, 2, 3], 16)], 0)
        return [b"", seq.to_bytes(8, "big"), payload]

    with capture_publisher([0]) as pub:
        cfg = collector_config("vllm", kv_endpoint=pub.endpoint, dp_size=1, probe_extra_ports=0)
        async with running_collector(cfg, ingest=IngestOptions(max_payload=limit)) as col:
            await pub.wait_subscribed()
            for seq in range(10):
                pub.send(0, good(seq))
            rss0 = 0
            for k in range(warm + n):
                if k == warm:
                    rss0 = _rss()  # after the first ones: buffers and allocator arenas exist
                seq = 10 + 2 * k
                pub.send(0, [b"", seq.to_bytes(8, "big"), big])
                pub.send(0, good(seq + 1))
                await wait_snapshot(col, _counted(k + 1, 11 + k), what=f"oversize {k + 1} counted")
            grown = _rss() - rss0
            assert grown < n * size // 2, f"RSS grew {grown / 2**20:.1f} MiB over {n} x 4 MiB"
            snap = await col.snapshot()
            st = stream(snap, 0)
            k = warm + n
            assert st.decode_errors == {"oversize": k}
            assert (st.batches_total, st.gaps, st.missed, st.lost) == (10 + k, k, k, k)
            want: Resident = {"GPU": set(hashes)}
            assert await resident(col, "w", 0) == want  # every good batch before and after


async def test_a_bad_batch_seen_in_a_replay_before_its_live_copy_is_counted_once() -> None:
    # A collector behind its SUB queue asks for a hole the ring no longer has (reply starts
    # later than asked): the reply then carries batches whose live copies are still queued. A
    # malformed one among them is one bad batch: one decode error, not one per copy.
    fmt = get_format("vllm-0.33")
    bad = b"\xc1"

    def good(seq: int) -> bytes:
        return encode_batch(time.time(), [fmt.stored([seq + 1], None, [1], 16)], 0)

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    try:
        rport = router.bind_to_random_port("tcp://127.0.0.1")
        with capture_publisher([0]) as pub:
            cfg = collector_config(
                "vllm", kv_endpoint=pub.endpoint, replay_endpoint=f"tcp://127.0.0.1:{rport}",
                dp_size=1, probe_extra_ports=0,
            )  # fmt: skip
            async with running_collector(cfg) as col:
                await pub.wait_subscribed()
                for seq in (0, 2):  # seq 1 is lost on the wire
                    pub.send(0, [b"", seq.to_bytes(8, "big"), good(seq)])
                end = time.monotonic() + 10
                while not router.poll(0):
                    assert time.monotonic() < end, "no replay request"
                    await asyncio.sleep(0.01)  # polling interval, not synchronization
                ident, _, start = router.recv_multipart()
                assert int.from_bytes(start, "big") == 1
                for seq, payload in ((2, good(2)), (3, bad)):  # the ring lost seq 1 too
                    router.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload])
                router.send_multipart([ident, b"", b"\xff" * 8, b""])
                await wait_snapshot(col, lambda s: sum(stream(s, 0).replay_requests.values()) == 1)
                for seq, payload in ((3, bad), (4, good(4))):  # the live copies arrive late
                    pub.send(0, [b"", seq.to_bytes(8, "big"), payload])
                end = time.monotonic() + 10
                while stream(snap := await col.snapshot(), 0).batches_total != 3:
                    assert time.monotonic() < end, "batches 0, 2, 4 not applied"
                    while router.poll(0):  # asked again for what the ring no longer has
                        ident, _, _ = router.recv_multipart()
                        router.send_multipart([ident, b"", b"\xff" * 8, b""])
                    await asyncio.sleep(0.01)  # polling interval, not synchronization
                assert stream(snap, 0).decode_errors == {"msgpack": 1}
    finally:
        ctx.destroy(linger=0)
