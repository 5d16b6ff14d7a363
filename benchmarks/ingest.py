"""Ingest throughput over ZMQ tcp 127.0.0.1: the collector pipeline against the Python limit.

Run: `python -m benchmarks.ingest [--sustain 60]`. A publisher process sends pre-encoded
SGLang 0.5.23-style batches (tagged-map events; 1 or 32 events per batch; BlockStored with 16
hashes + 256 token ids alternating with BlockRemoved of 16 hashes) as fast as it can to
(a) a bare consumer: recv of the frames + a msgspec decode that skips token_ids + a set update,
(b) kvobserve's IngestLoop: sequence tracking, block index, lifetimes, counters, and the cache
    analytics (docs/cache-analytics.md); `kvobserve-off` is the same loop with the analytics off,
(c) a naive consumer: everything decoded into typed structs, a Python loop per event and hash.
Consumer time runs from the first to the last batch; seq gaps are counted by every consumer.
Then a paced publisher at 50k batches/s (1 event each) for `--sustain` seconds into IngestLoop
with its default options, and the gap counters at the end.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import msgspec
import zmq
from msgspec import Struct

from benchmarks._common import (
    HASHES_PER_EVENT,
    TOPIC,
    Publisher,
    build_cycle,
    cpu_seconds,
    median,
)
from kvobserve.analysis.analytics import AnalyticsOptions, CacheAnalytics
from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.sources.ingest_options import IngestOptions
from kvobserve.sources.kv_stream import IngestLoop
from kvobserve.sources.plan import StreamSpec
from kvobserve.wire.kv_events import decode_payload

RECV_TIMEOUT_MS = 5_000  # no batch for this long: the rest were dropped


@dataclass
class Run:
    """One consumer run: batches seen, missing seqs, seconds from first to last batch."""

    batches: int
    gaps: int
    seconds: float

    @property
    def rate(self) -> float:
        """Batches per second."""
        return self.batches / self.seconds if self.seconds > 0 else 0.0


# --- (a) bare: only block_hashes materialized ---------------------------------------------------


class _BareStored(Struct, tag_field="type", tag="BlockStored", gc=False):
    block_hashes: list[int]


class _BareRemoved(Struct, tag_field="type", tag="BlockRemoved", gc=False):
    block_hashes: list[int]


class _BareBatch(Struct, array_like=True, gc=False):
    ts: float
    events: list[_BareStored | _BareRemoved]
    dp_rank: int | None = None


# --- (c) naive: every field materialized --------------------------------------------------------


class _FullStored(Struct, tag_field="type", tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class _FullRemoved(Struct, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class _FullBatch(Struct, array_like=True):
    ts: float
    events: list[_FullStored | _FullRemoved]
    dp_rank: int | None = None


def _sub(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, 0)  # the throughput runs must not drop: queue what is not read
    sock.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sock.connect(endpoint)
    return sock


def _consume(endpoint: str, count: int, handle: Callable[[bytes], None]) -> Run:
    """Receive until seq count-1 (or a timeout), calling `handle(payload)` per batch."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = _sub(ctx, endpoint)
    expected = gaps = seen = 0
    t0 = t1 = time.perf_counter()
    # the same receive loop as IngestLoop (recv_multipart minus its per-frame Enum conversion)
    recv, more, rcvmore = sock.recv, sock.get, int(zmq.RCVMORE)
    try:
        while expected < count:
            try:
                frames = [recv()]
            except zmq.Again:
                gaps += count - expected
                break
            while more(rcvmore):
                frames.append(recv())
            if seen == 0:
                t0 = time.perf_counter()
            seq = int.from_bytes(frames[1], "big")
            gaps += seq - expected
            expected = seq + 1
            handle(frames[2])
            seen += 1
        t1 = time.perf_counter()
    finally:
        ctx.destroy(linger=0)
    return Run(seen, gaps, t1 - t0)


def bare_handler() -> tuple[Callable[[bytes], None], set[int]]:
    """(a): decode skipping token_ids, then one set update per event; (handler, resident)."""
    decode = msgspec.msgpack.Decoder(_BareBatch).decode
    resident: set[int] = set()

    def handle(payload: bytes) -> None:
        for ev in decode(payload).events:
            if type(ev) is _BareStored:
                resident.update(ev.block_hashes)
            else:
                resident.difference_update(ev.block_hashes)

    return handle, resident


def naive_handler() -> tuple[Callable[[bytes], None], dict[int, float]]:
    """(c): full typed decode, then a Python loop per event and per hash; (handler, resident)."""
    decode = msgspec.msgpack.Decoder(_FullBatch).decode
    resident: dict[int, float] = {}
    counts = {"stored": 0, "removed": 0}

    def handle(payload: bytes) -> None:
        batch = decode(payload)
        for ev in batch.events:
            if isinstance(ev, _FullStored):
                counts["stored"] += 1
                for h in ev.block_hashes:
                    resident[h] = batch.ts
            else:
                counts["removed"] += 1
                for h in ev.block_hashes:
                    resident.pop(h, None)

    return handle, resident


class _TimedIngest(IngestLoop):
    """IngestLoop that notes when its first and last drain ran (no per-batch cost)."""

    t_first: float | None = None
    t_last = 0.0

    def _drain(self, st, sock, now):  # type: ignore[no-untyped-def]
        if self.t_first is None:
            self.t_first = time.perf_counter()
        super()._drain(st, sock, now)
        self.t_last = time.perf_counter()


def run_ingest(
    endpoint: str, count: int, options: IngestOptions, idle_s: float = 5.0
) -> tuple[Run, dict[str, int]]:
    """(b): the real IngestLoop until it received `count` batches (or `idle_s` of silence)."""
    spec = StreamSpec("bench", 0, "sglang", endpoint, TOPIC.decode())
    loop = _TimedIngest([spec], options)
    loop.start()
    try:
        last, last_change = 0, time.monotonic()
        while loop.received_total < count:
            if loop.received_total != last:
                last, last_change = loop.received_total, time.monotonic()
            elif time.monotonic() - last_change > idle_s:
                break
            time.sleep(0.01)  # polling interval
        sq = loop.sequencer("bench", 0)
        assert sq is not None

        def counters() -> dict[str, int]:
            return {
                "applied": sq.batches_applied,
                "gaps": sq.gaps,
                "missed": sq.missed,
                "lost": sq.lost,
                "received": loop.received_total,
                "errors": loop.loop_errors,
            }

        c = loop.call(counters).result(timeout=10)
    finally:
        loop.stop()
    seconds = loop.t_last - (loop.t_first or loop.t_last)
    # batches never applied: seq gaps the sequencer saw, or a tail that never arrived
    return Run(c["applied"], max(count - c["applied"], c["missed"]), seconds), c


def measure(events_per_batch: int, count: int, which: str) -> Run:
    """One run of consumer `which` (bare, kvobserve, naive) against a fresh publisher."""
    pub = Publisher(events_per_batch, count)
    pub.start()
    try:
        if which in ("kvobserve", "kvobserve-off"):
            opts = IngestOptions(rcvhwm=0)
            if which == "kvobserve-off":
                opts = replace(opts, analytics=None)
            run, _ = run_ingest(pub.endpoint, count, opts)
        else:
            handler = bare_handler()[0] if which == "bare" else naive_handler()[0]
            run = _consume(pub.endpoint, count, handler)
        pub.join()
    finally:
        pub.stop()
    return run


def inprocess(events_per_batch: int, rounds: int = 9) -> dict[str, float]:
    """Decode + sequencer + block index per event, analytics off and on, in this thread's CPU
    time (the least of `rounds` interleaved passes over the cycle): steadier than the ZMQ runs
    on a shared machine, and the analytics' cost without the receive path around it."""
    cycle = build_cycle(events_per_batch)
    seqs = {}
    for name, opts in (("off", None), ("on", AnalyticsOptions())):
        sq = StreamSequencer(0, replay=False)
        if opts is not None:
            sq.index.analytics = CacheAnalytics(opts, sq.trust)
        seqs[name] = sq
    best = dict.fromkeys(seqs, float("inf"))
    seq = dict.fromkeys(seqs, 0)
    for r in range(rounds + 1):  # the first round fills the index
        for name, sq in seqs.items():
            t0 = time.thread_time()
            n = seq[name]
            for payload in cycle:
                sq.on_batch(decode_payload("kv-events", n, payload), payload, 0.0)
                n += 1
            seq[name] = n
            if r:
                took = (time.thread_time() - t0) / (len(cycle) * events_per_batch) * 1e6
                best[name] = min(best[name], took)
    return best


def sustain(seconds: float, rate: float) -> dict[str, float]:
    """A paced publisher (SNDHWM 100k, vLLM's default) into IngestLoop with default options."""
    count = int(seconds * rate)
    pub = Publisher(1, count, rate=rate, hwm=100_000)
    pub.start()
    cpu0, t0 = cpu_seconds(os.getpid()), time.monotonic()
    try:
        _, c = run_ingest(pub.endpoint, count, IngestOptions(), idle_s=5.0)
        send_s = pub.join()
    finally:
        pub.stop()
    wall = time.monotonic() - t0
    return {
        "sent": count,
        "send_rate": count / send_s,
        "cpu_share": (cpu_seconds(os.getpid()) - cpu0) / wall,
        **c,
    }


def main(argv: list[str] | None = None) -> int:
    """Print the table, the ratios and the sustained run; returns 0."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.ingest", description=__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batches-1", type=int, default=100_000, help="batches per run, 1 event each")
    p.add_argument("--batches-32", type=int, default=6_000, help="batches per run, 32 events")
    p.add_argument("--sustain", type=float, default=10.0, help="seconds at --rate (0: skip)")
    p.add_argument("--rate", type=float, default=50_000.0)
    args = p.parse_args(argv)
    print(
        f"SGLang 0.5.23 map events, {HASHES_PER_EVENT} hashes each (stores + 256 token ids, "
        f"alternating with removes); median of {args.repeats}; msgspec {msgspec.__version__}"
    )
    head = f"{'events':>6} {'consumer':<13} {'batch/s':>10} {'hash/s':>12} {'gaps':>5}"
    print(head)
    print("-" * len(head))
    for n_ev, count in ((1, args.batches_1), (32, args.batches_32)):
        runs: dict[str, list[Run]] = {"bare": [], "kvobserve": [], "kvobserve-off": [], "naive": []}
        for _ in range(args.repeats):  # interleaved, so drift of the machine hits all alike
            for which in runs:
                runs[which].append(measure(n_ev, count, which))
        rates = {w: median([r.rate for r in rs]) for w, rs in runs.items()}
        for w, rs in runs.items():
            gaps = sum(r.gaps for r in rs)
            print(
                f"{n_ev:>6} {w:<13} {rates[w]:>10,.0f} "
                f"{rates[w] * n_ev * HASHES_PER_EVENT:>12,.0f} {gaps:>5}"
            )
        on, off = rates["kvobserve"] / rates["bare"], rates["kvobserve-off"] / rates["bare"]
        print(
            f"{n_ev:>6} ratios: kvobserve/bare {on:.2f} (analytics off: {off:.2f}, "
            f"drop {off - on:+.2f})  kvobserve/naive {rates['kvobserve'] / rates['naive']:.2f}"
        )
        cpu = inprocess(n_ev)
        print(
            f"{n_ev:>6} in-process CPU per event (decode + sequence + index): analytics off "
            f"{cpu['off']:.2f} us, on {cpu['on']:.2f} us ({cpu['on'] / cpu['off'] - 1:+.1%})"
        )
    if args.sustain > 0:
        s = sustain(args.sustain, args.rate)
        print(
            f"sustained {args.sustain:.0f} s at {args.rate:,.0f} batches/s (1 event each): "
            f"sent {s['sent']:,} at {s['send_rate']:,.0f}/s, received {s['received']:,}, "
            f"applied {s['applied']:,}, gaps {s['gaps']}, missed {s['missed']}, lost {s['lost']}, "
            f"consumer process CPU {s['cpu_share']:.2f} core"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
