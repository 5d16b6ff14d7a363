"""Acceptance (issue 24 b): llm-d's central mode with kvobserve relaying to the scheduler.

Four pods (two models) run vLLM-format publishers with llm-d topics (`kv@<pod-ip>:8000@<model>`)
that connect to the endpoint kvobserve binds, each from its own loopback address, where its replay
ROUTER binds too. kvobserve relays every frame to a SUB bound where the scheduler would be (the
stand-in). The stand-in must get every frame byte for byte and in order per publisher, except
while it is away; kvobserve's own view must be exact throughout: a pod restart and a batch lost
on the wire (recovered by replay) are counted, the stand-in's absence loses nothing here and is
reported as the relay's state, its drops and a relay_dropping condition.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable

import pytest
import zmq

from kvobserve.analysis.conditions import active
from kvobserve.analysis.fleet import FleetState
from kvobserve.collector import Collector
from kvobserve.simulate import FaultConfig, SimConfig, SimulatedWorker
from kvobserve.simulate.ports import free_port_range
from kvobserve.sources.ingest_options import IngestOptions
from kvobserve.wire.snapshot import BindStats, Snapshot
from tests.integration.collector_helpers import (
    Sims,
    collector_config,
    describe,
    resident,
    running_collector,
    stream,
    truth_instance,
    truth_resident,
    wait_snapshot,
)
from tests.polling import until_async

pytestmark = pytest.mark.integration
PODS = (("127.0.0.2", "model-a"), ("127.0.0.3", "model-a"), ("127.0.0.4", "model-b"),
        ("127.0.0.5", "model-b"))  # fmt: skip
RESTARTED, DROPPING, DROPPED_SEQ = 2, 3, 40
RATE, BATCHES = 200.0, 900
Frame = tuple[bytes, bytes]  # (seq frame, payload)


class StandIn:
    """The scheduler's SUB, bound at `endpoint` with llm-d's prefix `kv@`: frames by topic."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.frames: dict[bytes, list[Frame]] = {}
        self.received = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.odd: list[list[bytes]] = []  # anything that is not [topic, seq, payload]

    def open(self) -> None:
        """Bind (retried while the OS releases the port after a close) and start reading."""
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"kv@")
        end = time.monotonic() + 5.0
        while True:
            try:
                sock.bind(self.endpoint)
                break
            except zmq.ZMQError:
                assert time.monotonic() < end, f"cannot bind {self.endpoint} again"
                time.sleep(0.02)  # polling for the port, not synchronization
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(sock,), daemon=True)
        self._thread.start()

    def _run(self, sock: zmq.Socket[bytes]) -> None:
        try:
            while not self._stop.is_set():
                if not sock.poll(20):
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 3:
                    self.odd.append(frames)
                    continue
                self.frames.setdefault(frames[0], []).append((frames[1], frames[2]))
                self.received += 1
        finally:
            sock.close(linger=0)

    def close(self) -> None:
        """Go away: stop reading and close the socket (what a scheduler restart does)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    def stop(self) -> None:
        """Close and end the context."""
        self.close()
        self.ctx.destroy(linger=0)


def _published(*sims: SimulatedWorker) -> list[Frame]:
    """What the publisher instances of one pod put on the wire, in order (dropped ones not)."""
    out: list[Frame] = []
    for sim in sims:
        st = sim.rank(0)
        for inst in (*st.past, *st.streams):
            dropped = set(inst.live_dropped)
            out += [(seq_b, p) for seq, seq_b, p in inst.ring if seq not in dropped]
    return out


def _one_hole(got: list[Frame], sent: list[Frame]) -> tuple[int, int]:
    """(a, b) with got == sent[:a] + sent[b:], a < b: in order, byte for byte, one hole."""
    a = 0
    while a < len(got) and a < len(sent) and got[a] == sent[a]:
        a += 1
    b = len(sent) - (len(got) - a)
    assert got[a:] == sent[b:], f"frames after the first difference at {a} are not the tail"
    assert a < b, "no frame missing: the stand-in's absence went unnoticed"
    return a, b


def _relay(snap: Snapshot) -> BindStats:
    (b,) = snap.binds
    assert b.relay is not None
    return b


def _relay_is(state: str, no_target_over: int = -1) -> Callable[[Snapshot], bool]:
    """A snapshot predicate: the relay is in `state` (having dropped more than so many)."""

    def pred(snap: Snapshot) -> bool:
        r = _relay(snap).relay
        return r is not None and r.state == state and r.dropped.get("no_target", 0) > no_target_over

    return pred


def _start_again(sims: Sims, cfg: SimConfig) -> SimulatedWorker:
    """A pod's engine restarted: its replay port is bound again once the OS released it."""
    end = time.monotonic() + 5.0
    while True:
        try:
            return sims.start(cfg)
        except (OSError, zmq.ZMQError):
            assert time.monotonic() < end, "replay port not released"
            time.sleep(0.02)  # polling for the port, not synchronization


async def test_llm_d_central_mode_relayed_to_the_scheduler(sims: Sims) -> None:
    port = free_port_range("127.0.0.1", 2)  # kvobserve binds port; the stand-in port + 1
    replay = free_port_range([ip for ip, _ in PODS], 1)  # every pod binds it on its own address
    scheduler = StandIn(f"tcp://127.0.0.1:{port + 1}")
    scheduler.open()
    cfg = collector_config(
        "vllm", worker_id="llmd", bind=f"tcp://127.0.0.1:{port}", topic="kv@{pod}@{model}",
        replay_endpoint=f"tcp://{{pod_ip}}:{replay}", relay_to=scheduler.endpoint, dp_size=1,
    )  # fmt: skip
    try:
        async with running_collector(cfg) as col:
            await wait_snapshot(col, _relay_is("up"), what="relay up")
            pods = [
                sims.start(
                    SimConfig(
                        worker_id=f"pod-{i}", format="vllm-0.33", dp_size=1, host=ip,
                        kv_connect=f"tcp://127.0.0.1:{port}", replay_port=replay,
                        topic=f"kv@{ip}:8000@{model}", rate=RATE, max_batches=BATCHES,
                        start_delay_s=1.0, http_port=None, prompts=40, seed=i,
                        faults=FaultConfig(drop_seqs=frozenset({DROPPED_SEQ}))
                        if i == DROPPING else FaultConfig(),
                    )
                )
                for i, (ip, model) in enumerate(PODS)
            ]  # fmt: skip
            await _pods_restart_and_the_scheduler_goes_away(col, sims, pods, scheduler)
    finally:
        scheduler.stop()


async def _pods_restart_and_the_scheduler_goes_away(
    col: Collector, sims: Sims, pods: list[SimulatedWorker], scheduler: StandIn
) -> None:
    ids = [f"llmd/{ip}:8000" for ip, _ in PODS]
    await wait_snapshot(col, lambda s: len(s.streams) == 4, what="every pod sent")
    # a pod restarts: the same topic from seq 0 again, a new engine (another seed)
    old = pods[RESTARTED]
    await until_async(lambda: old.rank(0).streams[0].seq >= 150, 20.0, "pod 2 published 150")
    old.pause()  # between two ticks: what it published has left its PUB before it stops
    first = old.rank(0).streams[0].seq
    await wait_snapshot(
        col, lambda s: stream(s, 0, ids[RESTARTED]).batches_total == first, what="pod 2 drained"
    )
    old.stop()
    new = _start_again(
        sims, dataclasses.replace(old.cfg, seed=99, max_batches=500, start_delay_s=0.5)
    )
    await until_async(
        lambda: new.rank(0).streams[0].seq >= 50, 20.0, "the restarted pod published 50"
    )
    # the scheduler goes away for a second and comes back
    await wait_snapshot(col, lambda s: stream(s, 0, ids[RESTARTED]).restarts == 1, what="restart")
    # The scheduler goes away between two batches of every pod: a frame still in flight when its
    # SUB closes (in its queue, in the kernel, or sent before the relay's XPUB noticed) is lost
    # without anyone knowing, on any ZMQ transport. Held here, the accounting below is exact.
    live = [*pods[:RESTARTED], new, *pods[RESTARTED + 1 :]]
    for p in live:
        p.pause()
    published = len(_published(old, new)) + sum(len(_published(p)) for p in pods if p is not old)
    await until_async(
        lambda: scheduler.received == published, 20.0, "the stand-in read every frame sent"
    )
    scheduler.close()
    await wait_snapshot(col, _relay_is("connecting"), what="relay sees its target gone")
    for p in live:
        p.resume()
    away = await wait_snapshot(
        col, _relay_is("connecting", 100), what="relay reports its target gone, and drops"
    )
    relay = _relay(away).relay
    assert relay is not None
    assert relay.reason.startswith(("disconnected: ", "connection refused: "))
    fleet = FleetState()
    fleet.update(away, away.time)
    (cond,) = [c for c in active(fleet.view(away.time)) if c.kind == "relay_dropping"]
    assert dict(cond.labels) == {"collector": "c0", "worker_id": "llmd", "dp_rank": "0"}
    assert f"frames not forwarded to {scheduler.endpoint} (no_target " in cond.description
    assert all(s.lost == 0 and s.up for s in away.streams), describe(away)  # nothing lost here
    scheduler.open()
    await wait_snapshot(col, _relay_is("up"), what="relay up again")
    # every engine done, every batch applied (the dropped one by replay)
    done = [BATCHES, BATCHES, None, BATCHES]
    await until_async(lambda: all(p.rank(0).streams[0].seq >= (n or 500) for p, n in zip(
            [*pods[:RESTARTED], new, *pods[RESTARTED + 1:]], done, strict=True)), 20.0, "engines done")  # fmt: skip
    applied = {ids[i]: BATCHES for i in (0, 1, 3)} | {ids[RESTARTED]: first + 500}
    snap = await wait_snapshot(
        col,
        lambda s: (
            {x.worker_id: x.batches_total for x in s.streams} == applied
            and all(x.replay_requests.get("ok", 0) >= 1 for x in s.streams if x.worker_id == ids[3])
        ),
        what="every batch applied at kvobserve",
    )
    await _check_kvobserve(col, snap, ids, [*pods[:RESTARTED], new, *pods[RESTARTED + 1 :]])
    await _check_scheduler(col, scheduler, ids, pods, old, new)


async def _check_kvobserve(
    col: Collector, snap: Snapshot, ids: list[str], pods: list[SimulatedWorker]
) -> None:
    assert sorted(w.worker_id for w in snap.workers) == ids  # each pod declared, every rank
    assert all((w.dp_size, w.ranks_owned, w.leader) == (1, [0], True) for w in snap.workers)
    for i, (pod_id, (ip, model), sim) in enumerate(zip(ids, PODS, pods, strict=True)):
        st = stream(snap, 0, pod_id)
        assert (st.topic, st.state) == (f"kv@{ip}:8000@{model}", "up")
        counts = (st.restarts, st.gaps, st.missed, st.recovered, st.lost, st.duplicate_stream)
        if i == RESTARTED:
            assert counts == (1, 0, 0, 0, 0, False), describe(snap)
        elif i == DROPPING:
            assert counts == (0, 1, 1, 1, 0, False), describe(snap)
            assert st.replay_requests == {"ok": 1}
        else:
            assert counts == (0, 0, 0, 0, 0, False), describe(snap)
        assert st.state_complete is True
        assert await resident(col, pod_id, 0) == truth_resident(truth_instance(sim.truth(), 0))
    b = _relay(snap)
    assert (b.publishers, b.streams, b.skipped) == (4, 4, {})


async def _check_scheduler(
    col: Collector,
    scheduler: StandIn,
    ids: list[str],
    pods: list[SimulatedWorker],
    old: SimulatedWorker,
    new: SimulatedWorker,
) -> None:
    sent = {
        f"kv@{ip}:8000@{model}".encode(): _published(*([old, new] if i == RESTARTED else [p]))
        for i, ((ip, model), p) in enumerate(zip(PODS, pods, strict=True))
    }

    def counted(s: Snapshot) -> bool:  # the relay process reports its counts on its own turn
        b = _relay(s)
        r = b.relay
        return (
            b.messages_total == sum(len(f) for f in sent.values())
            and r is not None
            and r.forwarded + r.filtered + sum(r.dropped.values()) >= b.messages_total
        )

    final = await wait_snapshot(col, counted, what="every frame received and counted")
    await until_async(
        lambda: all(scheduler.frames[t][-1:] == f[-1:] for t, f in sent.items()),
        20.0,
        "the last frame of every pod delivered",
    )
    assert scheduler.odd == []
    missing = 0
    for topic, frames in sent.items():
        got = scheduler.frames[topic]
        a, b = _one_hole(got, frames)  # in order and byte for byte, but for the absence
        missing += b - a
        if topic == f"kv@{PODS[RESTARTED][0]}:8000@{PODS[RESTARTED][1]}".encode():
            assert a > old.rank(0).streams[0].seq  # the restart fell before the absence
    bind = _relay(final)
    relay = bind.relay
    assert relay is not None and relay.state == "up"
    assert relay.filtered == 0 and relay.dropped.get("queue_full", 0) == 0
    # every frame counted once: forwarded (and received), or dropped while no scheduler subscribed
    assert relay.forwarded + relay.dropped["no_target"] == bind.messages_total
    assert (relay.forwarded, missing) == (scheduler.received, relay.dropped["no_target"])


async def test_a_relay_without_its_target_binds_after_waiting_and_counts_what_it_drops(
    sims: Sims,
) -> None:
    port = free_port_range("127.0.0.1", 2)
    target = f"tcp://127.0.0.1:{port + 1}"  # nothing binds it
    cfg = collector_config(
        "vllm", worker_id="v", bind=f"tcp://127.0.0.1:{port}", relay_to=target, dp_size=1
    )
    async with running_collector(cfg, ingest=IngestOptions(relay_wait_s=1.0)) as col:
        snap = await wait_snapshot(
            col, lambda s: bool(s.binds) and _relay(s).reason.startswith("waiting"), what="wait"
        )
        b = _relay(snap)
        assert (b.state, b.reason) == (
            "starting",
            f"waiting up to 1 s for {target} to subscribe before binding tcp://127.0.0.1:{port}",
        )
        await wait_snapshot(col, lambda s: _relay(s).state == "listening", what="bound")
        sims.start(
            SimConfig(format="vllm-0.33", dp_size=1, host="127.0.0.2", replay_port=None,
                      kv_connect=f"tcp://127.0.0.1:{port}", rate=200.0, max_batches=100,
                      start_delay_s=0.5, http_port=None)
        )  # fmt: skip
        snap = await wait_snapshot(
            col,
            lambda s: (
                bool(s.streams)
                and s.streams[0].batches_total == 100
                and _relay_is("connecting", 99)(s)
            ),
            what="every batch analysed, none forwarded",
        )
        relay = _relay(snap).relay
        assert relay is not None
        assert relay.reason == f"connection refused: nothing listens at {target}"
        assert (relay.dropped, relay.forwarded) == ({"no_target": 100}, 0)


def _relay_processes() -> set[tuple[int, int]]:
    """The relay processes this test process runs, as the OS lists them: (pid, start time), as
    a pid can be used again."""
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            fields = _stat(int(pid))
        except OSError:  # ended meanwhile
            continue
        if int(fields[1]) == os.getpid() and b"kvobserve.sources.relay" in cmd:
            out.add((int(pid), int(fields[19])))
    return out


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name: state, ppid, ... start time at [19]."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()


def _exists(pid: int, start: int) -> bool:
    """Whether that process still exists, if only as a zombie that nobody waited for."""
    try:
        return int(_stat(pid)[19]) == start
    except OSError:
        return False


def _relayed_again(snap: Snapshot, why: str) -> bool:
    """The relay's death is reported, and the endpoint is bound, has its publisher back and
    forwards since then. The snapshot reads the recent events after the ingest state (they may
    be ahead of it): a state counts only if it began after the death."""
    died = [e.time for e in snap.events if why in e.message]
    b = _relay(snap)
    r = b.relay
    return (
        bool(died) and r is not None
        and (b.state, b.publishers, r.state) == ("connected", 1, "up")
        and min(b.since, r.since) > max(died)
    )  # fmt: skip


async def test_a_relay_process_that_dies_is_started_again(sims: Sims) -> None:
    port = free_port_range("127.0.0.1", 2)
    scheduler = StandIn(f"tcp://127.0.0.1:{port + 1}")
    scheduler.open()
    cfg = collector_config(
        "vllm", worker_id="v", bind=f"tcp://127.0.0.1:{port}", relay_to=scheduler.endpoint,
        dp_size=1, replay_endpoint=None,
    )  # fmt: skip
    try:
        async with running_collector(cfg) as col:
            await wait_snapshot(col, _relay_is("up"), what="relay up")
            sims.start(
                SimConfig(format="vllm-0.33", dp_size=1, host="127.0.0.2", replay_port=None,
                          kv_connect=f"tcp://127.0.0.1:{port}", rate=100.0, max_batches=0,
                          start_delay_s=0.5, http_port=None, topic="kv@127.0.0.2:8000@m")
            )  # fmt: skip
            await until_async(lambda: scheduler.received > 20, 20.0, "relaying")
            (first,) = _relay_processes()
            os.kill(first[0], signal.SIGKILL)  # by its PID, as an OOM kill would
            why = "the relay process ended (killed by SIGKILL); starting it again"
            snap = await wait_snapshot(
                col, lambda s: _relayed_again(s, why),
                what="reported, then a new relay process, bound and forwarding again",
            )  # fmt: skip
            (second,) = _relay_processes()
            assert second != first
            assert not _exists(*first)  # the collector reaped the dead one
            got = scheduler.received
            await until_async(
                lambda: scheduler.received > got + 20, 20.0, "frames reach the scheduler again"
            )
            st = snap.streams[0]
            assert st.restarts == 0  # the engine did not restart: the same sequence goes on
    finally:
        scheduler.stop()
