"""The stream core (sources/stream_table.py) driven without sockets: engines, a fake clock, modes.

`Engine` is one KV-event publisher: the simulator's encoders give each engine version's bytes
(tests/unit/test_simulate_encoders.py holds them to the real engines' captures), its own model of
what it holds is the truth, and it keeps a replay ring. `Harness` owns a `StreamTable`, a fake
clock, and plays the shell: it carries out the core's socket actions (a `Replay` is answered from
the engine's ring when the test lets it, `pump()`), delivers what a mode's sockets would deliver,
and reads the snapshot and `/metrics` the aggregator would serve. Each mode (connect, bind, a
topic template, a relay, Kubernetes pods) says how an engine is planned, connected, heard and lost.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvobserve.analysis.checkpoint import encode_copy
from kvobserve.analysis.fleet import FleetState
from kvobserve.export.prometheus import FleetCollector
from kvobserve.simulate.encoders import encode_batch, event_from_dict, get_format, replay_end
from kvobserve.simulate.encoders import live_frames as encode_live
from kvobserve.simulate.encoders import replay_frames as encode_replay
from kvobserve.sources.bind import Listener
from kvobserve.sources.checkpoint_store import identity_of
from kvobserve.sources.ingest_actions import (
    Bind,
    Connect,
    Disconnect,
    EndProbe,
    EndReplay,
    Probe,
    Replay,
    Restore,
    SocketAction,
    Unbind,
)
from kvobserve.sources.ingest_options import IngestOptions
from kvobserve.sources.ingest_stats import IngestStats, build_stats
from kvobserve.sources.plan import ListenSpec, StreamSpec
from kvobserve.sources.stream_state import WatchedStream
from kvobserve.sources.stream_table import StreamTable
from kvobserve.wire.checkpoint import decode_checkpoint
from kvobserve.wire.snapshot import CollectorInfo, Snapshot, StreamStats, WorkerInfo

WALL0 = 1_800_000_000.0  # the wall clock at monotonic 0
_FDS = itertools.count(20)  # connection descriptors, as a bound SUB's monitor names them


class Engine:
    """One simulated publisher (one DP rank) and the truth of what it holds."""

    _ids = itertools.count(1)

    def __init__(
        self, fmt: str = "vllm-0.33", rank: int = 0, *, topic: str = "kv-events",
        ring: int = 10_000, replay: bool = True, pod: str = "", ip: str = "", keep: int = 6,
    ) -> None:  # fmt: skip
        self.fmt = get_format(fmt)
        self.rank = rank
        self.topic = topic
        self.ring_size = ring
        self.has_replay = replay
        self.keep = keep  # blocks it holds at most (the oldest are removed past it)
        self.pod = pod  # a pod's name (topic templates, Kubernetes)
        self.ip = ip or f"10.0.{next(self._ids)}.1"
        self.id = next(self._ids)
        self.seq = 0
        self.ring: deque[tuple[int, bytes]] = deque(maxlen=ring)
        self.sent: list[tuple[int, bytes]] = []  # every batch of this publisher process
        self.held: list[int] = []  # resident hashes, oldest first (the truth)
        self._next = 0
        self.alive = True
        self.answers = True  # its replay socket answers

    def _hash(self) -> int:
        self._next += 1
        return self.id * 1_000_003 + self._next * 7919 + self.seq

    def batch(self, ts: float, stores: int = 2) -> list[bytes]:
        """The next batch's live frames: `stores` new blocks chained from the newest, and the
        oldest removed down to `keep` resident; published (ring, truth)."""
        keep = self.keep
        parent = self.held[-1] if self.held else None
        hashes = [self._hash() for _ in range(stores)]
        if self.fmt.name.endswith("-bytes"):
            raise ValueError("bytes-hash formats: give int formats to the harness")
        events = [
            event_from_dict(self.fmt, {"type": "BlockStored", "block_hashes": hashes,
                                       "parent_block_hash": parent, "block_size": 16,
                                       "token_ids": list(range(16 * stores)), "medium": "GPU"})
        ]  # fmt: skip
        self.held += hashes
        if len(self.held) > keep:
            gone, self.held = self.held[: len(self.held) - keep], self.held[-keep:]
            events.append(
                event_from_dict(
                    self.fmt, {"type": "BlockRemoved", "block_hashes": gone, "medium": "GPU"}
                )
            )
        payload = encode_batch(ts, events, self.rank)
        seq = self.seq
        self.seq += 1
        self.ring.append((seq, payload))
        self.sent.append((seq, payload))
        return encode_live(self.topic.encode(), seq, payload)

    def clear(self, ts: float) -> list[bytes]:
        """An AllBlocksCleared batch."""
        payload = encode_batch(ts, [event_from_dict(self.fmt, {"type": "AllBlocksCleared"})],
                               self.rank)  # fmt: skip
        self.held = []
        seq = self.seq
        self.seq += 1
        self.ring.append((seq, payload))
        self.sent.append((seq, payload))
        return encode_live(self.topic.encode(), seq, payload)

    def replay(self, start: int) -> list[list[bytes]]:
        """What the ring answers a request from `start`: its batches from there, the end marker."""
        topic = self.topic.encode()
        out = [
            encode_replay(self.fmt, topic, seq.to_bytes(8, "big"), p)
            for seq, p in self.ring
            if seq >= start
        ]
        return [*out, replay_end(self.fmt)]

    def restart(self) -> None:
        """A new publisher process: seq from 0, an empty cache and ring."""
        self.seq = 0
        self.ring.clear()
        self.sent = []
        self.held = []

    @property
    def truth(self) -> set[int]:
        """The blocks it holds now."""
        return set(self.held)


@dataclass
class Harness:
    """A StreamTable with a fake clock, playing the shell (see the module doc)."""

    options: IngestOptions = field(default_factory=IngestOptions)
    now: float = 100.0
    auto_replay: bool = True  # answer replay requests at once (else on pump())
    table: StreamTable = field(init=False)
    replays: dict[WatchedStream, Replay] = field(default_factory=dict)  # asked, not answered
    answered: list[tuple[str, int]] = field(default_factory=list)  # (stream, start seq)
    engines: dict[WatchedStream, Engine] = field(default_factory=dict)  # who answers replays
    opened: set[WatchedStream] = field(default_factory=set)  # SUBs open
    probes: set[WatchedStream] = field(default_factory=set)
    bound: dict[Listener, bool] = field(default_factory=dict)
    bind_error: str | None = None  # what the next Bind answers (None: bound)
    actions: list[SocketAction] = field(default_factory=list)  # every action, in order
    # checkpoints on: the files a `Restore` reads, by stream key (None: checkpoints off)
    checkpoints: dict[tuple[str, int], bytes] | None = None

    def __post_init__(self) -> None:
        on = self.checkpoints is not None
        self.table = StreamTable(self.options, fingerprint=(lambda w: "cfg") if on else None)

    def checkpoint(self, key: tuple[str, int]) -> bytes:
        """What a checkpoint round writes of the stream now (its file's bytes)."""
        copy = self.table.streams[key].checkpoint_copy()
        assert copy is not None, f"nothing to checkpoint of {key}"
        return encode_copy(copy, "test", self.wall)

    @property
    def wall(self) -> float:
        """The wall clock now."""
        return WALL0 + self.now

    def settle(self) -> None:
        """Carry out what the core asked for (answering replays when `auto_replay`)."""
        while self.table.out:
            for a in self.table.take_actions():
                self.actions.append(a)
                self._act(a)
        if self.auto_replay and self.replays:
            self.pump()

    def _act(self, a: SocketAction) -> None:
        if isinstance(a, Connect):
            self.opened.add(a.stream)
        elif isinstance(a, Disconnect):
            self.opened.discard(a.stream)
        elif isinstance(a, Replay):
            self.replays[a.stream] = a
        elif isinstance(a, EndReplay):
            self.replays.pop(a.stream, None)
        elif isinstance(a, Probe):
            self.probes.add(a.stream)
        elif isinstance(a, EndProbe):
            self.probes.discard(a.stream)
        elif isinstance(a, Restore):
            st = a.stream
            data = self.checkpoints.get(st.spec.key)
            ck = decode_checkpoint(data, identity_of(st.spec), st.config) if data else None
            self.table.restored(st, ck, self.now, self.wall)
        elif isinstance(a, Bind):
            self.bound[a.listener] = self.bind_error is None
            self.table.bound(a.listener, self.bind_error, self.now, self.wall)
        elif isinstance(a, Unbind):
            self.bound.pop(a.listener, None)

    def pump(self) -> None:
        """Answer every replay asked for, from its engine's ring (an engine that is gone, or
        whose replay socket does not answer, answers nothing: the request times out)."""
        while self.replays:
            st, req = next(iter(self.replays.items()))
            eng = self.engines.get(st)
            if eng is None or not eng.alive or not eng.answers:
                return
            del self.replays[st]
            self.answered.append((st.spec.worker_id, req.start_seq))
            for frames in eng.replay(req.start_seq):
                if not self.table.on_replay_message(st, frames, self.now):
                    break
            self.settle()

    def advance(self, seconds: float, step: float = 0.05) -> None:
        """Let time pass, ticking the core as the shell does every turn."""
        end = self.now + seconds
        while self.now < end - 1e-9:
            self.now = min(end, self.now + step)
            self.table.tick(self.now, self.wall)
            self.settle()

    def stats(
        self, capacities: dict[tuple[str, int], tuple[float, float]] | None = None
    ) -> IngestStats:
        """The snapshot part the core reports now (`capacities`: the engines' KV capacity by
        stream, in tokens, with when it was read: what the collector passes)."""
        return build_stats(self.table, self.now, self.wall, capacities=capacities)

    def stream_stats(self, worker_id: str, rank: int = 0) -> StreamStats:
        """One stream's snapshot form."""
        got = [s for s in self.stats().streams if (s.worker_id, s.dp_rank) == (worker_id, rank)]
        assert got, f"no stream {worker_id} rank {rank}"
        return got[0]

    def resident(self, worker_id: str, rank: int = 0) -> set[int]:
        """The blocks the stream's index holds (GPU)."""
        st = self.table.streams[(worker_id, rank)]
        assert st.seq is not None
        return {h for h in st.seq.index.resident_hashes().get("GPU", set())}  # type: ignore[misc]

    def snapshot(self, workers: list[WorkerInfo]) -> Snapshot:
        """The collector's snapshot of the core now."""
        s = self.stats()
        return Snapshot(
            CollectorInfo("node-0", 0, "host-0", WALL0), seq=int(self.now), time=self.wall,
            workers=workers, streams=s.streams, unexpected=s.unexpected, refused=s.refused,
            binds=s.binds,
        )  # fmt: skip

    def metrics(self, workers: list[WorkerInfo]) -> dict[tuple[str, str], float]:
        """What /metrics serves: (family sample name, the stream's worker_id) -> value, for the
        per-stream samples (the reference writer, over the aggregator's fleet state)."""
        fs = FleetState()
        fs.update(self.snapshot(workers), self.wall)
        reg = CollectorRegistry(auto_describe=False)
        reg.register(FleetCollector(lambda: fs.view(self.wall), per_stream_detail=True))
        out: dict[tuple[str, str], float] = {}
        for fam in text_string_to_metric_families(generate_latest(reg).decode()):
            for s in fam.samples:
                if "worker_id" in s.labels and "dp_rank" in s.labels:
                    out[(s.name, f"{s.labels['worker_id']}#{s.labels['dp_rank']}")] = s.value
        return out

    def conditions(self, workers: list[WorkerInfo]) -> list[tuple[str, str]]:
        """The active conditions (kind, "worker_id#dp_rank") the page would show."""
        from kvobserve.analysis.conditions import active

        fs = FleetState()
        fs.update(self.snapshot(workers), self.wall)
        return [
            (c.kind, f"{dict(c.labels).get('worker_id', '')}#{dict(c.labels).get('dp_rank', '')}")
            for c in active(fs.view(self.wall))
        ]


# --- modes: how an engine is planned, connected, heard and lost --------------------------------


class Mode:
    """Connect mode: the collector's SUB connects to each publisher, which binds."""

    name = "connect"
    worker = "w"
    pods = False  # streams named {worker}/{pod}, created as they are planned or heard

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.specs: dict[Engine, StreamSpec] = {}

    def key(self, e: Engine) -> tuple[str, int]:
        """The stream key of an engine."""
        return (f"{self.worker}/{e.pod}" if self.pods else self.worker, e.rank)

    def spec(self, e: Engine) -> StreamSpec:
        replay = f"tcp://{e.ip}:{5657 + e.rank}" if e.has_replay else None
        wid = self.key(e)[0]
        return StreamSpec(wid, e.rank, "vllm", f"tcp://{e.ip}:{5557 + e.rank}", e.topic, replay)

    def plan(self, *engines: Engine) -> None:
        """Plan (and open) the engines' streams; the engines answer their replays."""
        for e in engines:
            self.specs[e] = self.spec(e)
        self.h.table.apply(list(self.specs.values()), None, self.h.now, self.h.wall)
        self.h.settle()
        for e in engines:
            if self.planned(e):
                self.h.engines[self.stream(e)] = e

    def stream(self, e: Engine) -> WatchedStream:
        """The engine's stream in the core."""
        return self.h.table.streams[self.key(e)]

    def planned(self, e: Engine) -> bool:
        """Whether the core watches the engine's stream (a refused one has no socket)."""
        return self.key(e) in self.h.table.streams

    def connect(self, e: Engine) -> None:
        """The TCP connection and ZMQ handshake to the engine's publisher."""
        e.alive = True
        if not self.planned(e):
            return
        st, h = self.stream(e), self.h
        for ev in (zmq.EVENT_CONNECT_DELAYED, zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED):
            h.table.on_monitor(st, ev, 0, h.now, h.wall)
        h.settle()

    def deliver(self, e: Engine, *messages: list[bytes]) -> None:
        """Messages the engine published, as one drain of the SUB reads them."""
        if not self.planned(e):
            return
        st, h = self.stream(e), self.h
        good = bad = 0
        reason, bad_frames = "", []
        for frames in messages:
            r = h.table.take(st, frames, h.now, h.wall)
            if r:
                bad, reason, bad_frames = bad + 1, r, frames
            else:
                good += 1
        h.table.drained(st, good, bad, reason, bad_frames, h.now, h.wall)
        h.settle()

    def disconnect(self, e: Engine) -> None:
        """The publisher went away (its process ended, or the network)."""
        if not self.planned(e):
            return
        st, h = self.stream(e), self.h
        h.table.on_monitor(st, zmq.EVENT_DISCONNECTED, 0, h.now, h.wall)
        h.settle()

    def forget(self, e: Engine) -> None:
        """The engine is no longer planned (a pod deleted)."""
        self.specs.pop(e, None)
        self.h.table.apply(list(self.specs.values()), None, self.h.now, self.h.wall)
        self.h.settle()

    def workers(self) -> list[WorkerInfo]:
        """What the collector declares (for the fleet's view)."""
        ids = sorted({self.key(e)[0] for e in self.specs})
        ranks = sorted({e.rank for e in self.specs})
        size = max(ranks) + 1 if ranks else 1
        return [WorkerInfo(w, "vllm", size, ranks, True, 0) for w in ids]


class PodsMode(Mode):
    """Kubernetes pods: each pod of a selector is planned as its own stream (connected as in
    connect mode), the plan following the pods as they come and go."""

    name = "pods"
    pods = True


class BindMode(Mode):
    """Bind mode: the collector binds one endpoint per rank and the publishers connect to it."""

    name = "bind"
    template = ""  # the topic: plain (a prefix)
    relay_to: str | None = None

    def __init__(self, h: Harness) -> None:
        super().__init__(h)
        self.fds: dict[Engine, int] = {}
        self.listens: dict[int, ListenSpec] = {}

    def listener(self, rank: int = 0) -> Listener:
        """The bound endpoint of a rank."""
        return self.h.table.listeners[(self.worker, rank)]

    def spec(self, e: Engine) -> StreamSpec:
        replay = "tcp://{pod_ip}:" + str(5657 + e.rank) if self.template else None
        if not self.template and e.has_replay:
            replay = f"tcp://{e.ip}:{5657 + e.rank}"
        return StreamSpec(self.worker, e.rank, "vllm", f"tcp://*:{5557 + e.rank}",
                          self.template or e.topic, replay, bound=True)  # fmt: skip

    def plan(self, *engines: Engine) -> None:
        h = self.h
        for e in engines:
            self.specs[e] = s = self.spec(e)
            self.listens[e.rank] = ListenSpec(
                self.worker, e.rank, "vllm", s.endpoint, s.topic, s.replay_endpoint,
                self.relay_to,
            )  # fmt: skip
        streams = [] if self.template else list({s.key: s for s in self.specs.values()}.values())
        h.table.apply(streams, list(self.listens.values()), h.now, h.wall)
        h.settle()
        if not self.template:
            for e in engines:
                if self.planned(e):
                    h.engines[self.stream(e)] = e

    def connect(self, e: Engine) -> None:
        e.alive = True
        h = self.h
        fd = self.fds[e] = next(_FDS)
        h.table.on_bound_monitor(
            self.listener(e.rank), zmq.EVENT_ACCEPTED, fd, f"{e.ip}:40{fd}", h.now, h.wall
        )
        h.settle()

    def deliver(self, e: Engine, *messages: list[bytes]) -> None:
        h = self.h
        lst = self.listener(e.rank)
        for frames in messages:  # what the shell does per message of a bound SUB
            st = lst.routes.get(frames[0])
            if st is None:
                st = h.table.route(lst, frames[0], self.fds.get(e), h.now, h.wall)
                if st is None:
                    continue
                h.engines[st] = e
                h.settle()  # a new pod's checkpoint before its first message, as the shell
            h.table.take_bound(st, frames, h.now, h.wall)
        h.table.bound_drained(lst, len(messages))
        h.settle()

    def disconnect(self, e: Engine) -> None:
        h = self.h
        fd = self.fds.pop(e)
        h.table.on_bound_monitor(self.listener(e.rank), zmq.EVENT_DISCONNECTED, fd, "", h.now,
                                 h.wall)  # fmt: skip
        h.settle()


class TemplateMode(BindMode):
    """llm-d's central mode: one bound endpoint, each pod a stream named by its topic."""

    name = "template"
    template = "kv@{pod}@{model}"
    pods = True

    def key(self, e: Engine) -> tuple[str, int]:
        return (f"{self.worker}/{e.pod}", e.rank)


class RelayMode(TemplateMode):
    """llm-d's central mode behind kvobserve's relay: the relay process binds, forwards, and
    hands each frame over; its statuses say which connection each topic came on."""

    name = "relay"
    relay_to = "tcp://scheduler:5556"

    def __init__(self, h: Harness) -> None:
        super().__init__(h)
        self.topics: dict[str, int] = {}

    def _status(self, rank: int) -> None:
        h = self.h
        conns = {str(fd): f"{e.ip}:40{fd}" for e, fd in self.fds.items() if e.rank == rank}
        n = len(conns)
        state, reason = ("connected", f"{n} publisher(s)") if n else ("listening", "listening")
        status: dict[str, Any] = {
            "lane": 1, "state": state, "reason": reason, "since": h.wall, "publishers": n,
            "note": "", "analysis_dropped": 0, "conns": conns,
            "topics": {t: fd for t, fd in self.topics.items()},
            "relay": {"state": "up", "reason": "forwarding", "since": h.wall, "forwarded": 0,
                      "filtered": 0, "dropped": {}, "last_drop_time": 0.0},
        }  # fmt: skip
        h.table.on_relay_status(self.listener(rank), status, h.now, h.wall)
        h.settle()

    def connect(self, e: Engine) -> None:
        e.alive = True
        self.fds[e] = next(_FDS)
        self._status(e.rank)

    def deliver(self, e: Engine, *messages: list[bytes]) -> None:
        h = self.h
        lst = self.listener(e.rank)
        new = False
        for frames in messages:
            st = lst.routes.get(frames[0])
            if st is None:
                st = h.table.route(lst, frames[0], None, h.now, h.wall)  # relayed: no SRCFD
                if st is None:
                    continue
                h.engines[st] = e
                h.settle()
                new = True
                self.topics[frames[0].hex()] = self.fds[e]
            h.table.take_bound(st, frames, h.now, h.wall)
        h.table.bound_drained(lst, len(messages))
        h.settle()
        if new:  # the relay's next status names the connection the topic came on
            self._status(e.rank)

    def disconnect(self, e: Engine) -> None:
        fd = self.fds.pop(e)
        self.topics = {t: f for t, f in self.topics.items() if f != fd}
        self._status(e.rank)


MODES: dict[str, Callable[[Harness], Mode]] = {
    m.name: m for m in (Mode, BindMode, TemplateMode, RelayMode, PodsMode)
}


def engine_for(mode: Mode, fmt: str = "vllm-0.33", rank: int = 0, pod: str = "a",
               **kw: Any) -> Engine:  # fmt: skip
    """An engine as the mode's publishers are: in llm-d's modes its topic names the pod by its
    address (`kv@10.0.3.1:8000@m`), as llm-d's deployments do."""
    e = Engine(fmt, rank, pod=pod, **kw)
    if isinstance(mode, TemplateMode):
        e.pod = f"{e.ip}:8000"
        e.topic = f"kv@{e.pod}@m"
    return e
