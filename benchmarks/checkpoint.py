"""Checkpoints of many streams: write time, bytes per resident block on disk, added CPU, restore.

Run: `python -m benchmarks.checkpoint [--streams 4096] [--blocks 1000] [--interval 5]
[--steady 30] [--dir DIR]`. Each stream is a StreamSequencer whose BlockIndex holds `--blocks` GPU
blocks with random signed 64-bit hashes (SGLang's), stored `--per-batch` to a batch (one engine
time per batch), and whose last batch payload is a real SGLang 0.5.23 batch (the anchor). The
rounds run as a collector runs them: `CheckpointWriter.tick` on this thread every millisecond
(the ingest thread's share: copying, within its block budget per tick) and the writer thread
packing and writing each file (temp file, fsync, rename) into a real directory.

Printed, all from one run:
- bytes per resident block on disk, with and without the anchors (the target is <= 16);
- one round of every stream with no CPU cap: its wall time (the write time) and CPU, per stream
  split into the ingest thread's copies and the writer's packing and file I/O, and what that
  would cost with every stream busy every interval;
- `--steady` seconds with every stream busy every interval under the default CPU cap (2 % of a
  core), after one interval that spends the budget held at the start: the CPU the checkpoints
  used (thread CPU of both threads) and how often each stream's checkpoint is then written;
- the restore: every file read, decoded, checked and turned into a new BlockIndex.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from kvobserve.analysis.blocks import BlockIndex
from kvobserve.analysis.checkpoint import StreamCopy, copy_stream, restore_index, state_mark
from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.sources.checkpoint_store import CheckpointStore, config_fingerprint
from kvobserve.sources.checkpoint_writer import CheckpointWriter
from kvobserve.wire.checkpoint import StreamIdentity
from kvobserve.wire.kv_events import BlockHash, BlockRemoved, BlockStored, KvBatch

CONFIG = config_fingerprint("bench")
T0 = 1_795_291_773.0


@dataclass
class Stream:
    """One stream as the stream core offers it to the writer."""

    ident: StreamIdentity
    sq: StreamSequencer
    anchor: bytes
    rng: random.Random
    per_batch: int
    ts: float = T0

    @property
    def checkpoint_key(self) -> tuple[str, int]:
        return self.ident.key

    def checkpoint_mark(self) -> object:
        return state_mark(self.sq)

    def checkpoint_copy(self) -> StreamCopy | None:
        return copy_stream(self.ident, self.sq, self.anchor, CONFIG)

    def step(self, evict: bool = True) -> None:
        """One batch: `per_batch` new blocks, and as many of the oldest gone (the size stays)."""
        hashes: list[BlockHash] = [
            self.rng.getrandbits(64) - (1 << 63) for _ in range(self.per_batch)
        ]
        events: list[BlockStored | BlockRemoved] = [
            BlockStored(hashes, block_size=16, medium="GPU")
        ]
        resident = self.sq.index.tiers["GPU"].resident if self.sq.index.tiers else {}
        if evict and resident:
            events.append(BlockRemoved(list(resident)[: self.per_batch], medium="GPU"))
        self.ts += 0.01
        seq = 0 if self.sq.last_seq is None else self.sq.last_seq + 1
        payload = sglang_payload(self.ts, hashes, self.ident.dp_rank)
        self.sq.on_batch(
            KvBatch("kv-events", seq, self.ts, self.ident.dp_rank, events), payload, 0.0
        )  # type: ignore[arg-type]
        self.anchor = payload


def sglang_payload(ts: float, hashes: list[BlockHash], rank: int) -> bytes:
    """The bytes SGLang 0.5.23 publishes for one store of these blocks (16 tokens each)."""
    ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
          "token_ids": list(range(1000, 1000 + 16 * len(hashes))), "block_size": 16,
          "lora_id": None, "medium": "GPU", "cache_salt": None, "session_id": None,
          "lora_name": None}  # fmt: skip
    return msgspec.msgpack.encode([ts, [ev], rank])


def build(streams: int, blocks: int, per_batch: int, seed: int = 7) -> list[Stream]:
    """`streams` streams of `blocks` resident blocks each."""
    out = []
    for r in range(streams):
        ident = StreamIdentity(f"sglang-{r // 8}", r % 8, "sglang", f"tcp://10.0.{r // 256}.{r % 256}:5557", "kv-events", "tcp://10.0.0.1:5657")  # fmt: skip
        s = Stream(
            ident, StreamSequencer(r % 8, replay=True), b"", random.Random(seed + r), per_batch
        )
        for _ in range(-(-blocks // per_batch)):
            s.step(evict=False)
        out.append(s)
    return out


@dataclass
class RoundCost:
    """One checkpoint round."""

    streams: int  # streams written
    wall_s: float  # first tick to the directory's fsync
    ingest_cpu_s: float  # this thread's CPU in the ticks (the ingest thread's share)
    process_cpu_s: float  # both threads
    ticks: int
    longest_tick_s: float


def one_round(
    w: CheckpointWriter, streams: list[Stream], now: float, tick_s: float = 0.001
) -> RoundCost:
    """Tick as an ingest loop does (every `tick_s` here) until the round is written."""
    written = w.store.written
    cpu0, wall0 = time.process_time(), time.perf_counter()
    ingest, longest, ticks = 0.0, 0.0, 0
    deadline = wall0 + 3600.0  # a shared machine may starve the writer for a long time
    while time.perf_counter() < deadline:
        t0 = time.thread_time()
        w.tick(now, streams)
        dt = time.thread_time() - t0
        ingest, longest, ticks = ingest + dt, max(longest, dt), ticks + 1
        if w.wait_round(0.0):
            break
        time.sleep(tick_s)  # the ingest loop's next wake-up (the writer works meanwhile)
    assert w.wait_round(0.0), "round not written in an hour"
    return RoundCost(w.store.written - written, time.perf_counter() - wall0, ingest,
                     time.process_time() - cpu0, ticks, longest)  # fmt: skip


def restore_all(directory: str, streams: list[Stream]) -> tuple[float, int]:
    """(seconds, blocks): every stream's file loaded, checked and restored into a new index."""
    store = CheckpointStore(directory)
    assert store.open()
    t0 = time.perf_counter()
    blocks = 0
    for s in streams:
        ck = store.load(s.ident, CONFIG)
        assert ck is not None, s.ident
        blocks += restore_index(ck, BlockIndex())
    took = time.perf_counter() - t0
    store.close()
    return took, blocks


def measure(streams: int, blocks: int, per_batch: int, interval_s: float, directory: str,
            steady_s: float = 30.0, cpu_share: float = 0.02) -> dict[str, float]:  # fmt: skip
    """Every figure the benchmark prints."""
    ss = build(streams, blocks, per_batch)
    resident = sum(len(s.sq.index.tiers["GPU"].resident) for s in ss)
    out: dict[str, float] = {"streams": streams, "resident": resident}
    # 1. every stream new, no CPU cap: the write time and what one round costs
    w = CheckpointWriter(CheckpointStore(directory), interval_s, cpu_share=1.0)
    w.start()
    try:
        first = one_round(w, ss, 0.0)
        assert first.streams == streams
    finally:
        w.close(10.0)
    files = list(Path(directory).glob("*.ckpt"))
    size = sum(f.stat().st_size for f in files)
    anchors = sum(len(s.anchor) for s in ss)
    out.update(bytes_per_block=size / resident, bytes_per_block_no_anchor=(size - anchors) / resident,
               first_wall_s=first.wall_s, first_ingest_cpu_s=first.ingest_cpu_s,
               first_cpu_s=first.process_cpu_s, longest_tick_ms=first.longest_tick_s * 1e3,
               ticks=first.ticks, copy_cpu_s=w.copy_cpu_s, write_cpu_s=w.write_cpu_s)  # fmt: skip
    # 2. the collector's own cap, every stream changed every interval: the CPU and how often
    # each stream is written then (what the replay rings must reach back over)
    w = CheckpointWriter(CheckpointStore(directory), interval_s, cpu_share=cpu_share)
    w.start()
    churn = 0.0
    try:
        start = time.monotonic()
        due, t0, cpu0, written0 = start, 0.0, 0.0, 0
        # the first interval spends the budget held at the start (one interval's worth): the
        # figures are of what follows, the long-run rate
        while (now := time.monotonic()) - start < interval_s + steady_s:
            if not t0 and now - start >= interval_s:
                t0, cpu0, written0 = now, w.copy_cpu_s + w.write_cpu_s, w.store.written
            if now >= due:  # every stream gets a batch each interval: all of them busy
                c0 = time.thread_time()
                for s in ss:
                    s.step()
                churn += time.thread_time() - c0
                due += interval_s
            w.tick(now, ss)
            time.sleep(0.001)  # the ingest loop's next wake-up
        took = time.monotonic() - t0
        cpu = w.copy_cpu_s + w.write_cpu_s - cpu0
        per_s = (w.store.written - written0) / took
    finally:
        w.close(10.0)
    out.update(capped_core_pct=100 * cpu / took, capped_written_per_s=per_s,
               capped_age_s=max(interval_s, streams / per_s) if per_s else float("inf"),
               churn_s=churn, steady_s=took)  # fmt: skip
    took, restored = restore_all(directory, ss)
    assert restored == resident
    out.update(restore_s=took, restore_us_per_block=took / resident * 1e6)
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the figures; returns 0."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint", description=__doc__)
    p.add_argument("--streams", type=int, default=4096)
    p.add_argument("--blocks", type=int, default=1000, help="resident blocks per stream")
    p.add_argument("--per-batch", type=int, default=4, help="blocks stored per batch")
    p.add_argument("--interval", type=float, default=5.0, help="checkpoint_interval_s")
    p.add_argument("--steady", type=float, default=30.0, help="seconds of the capped phase")
    p.add_argument("--dir", default="", help="where state_dir goes (default: a temporary dir)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir or None) as d:
        r = measure(args.streams, args.blocks, args.per_batch, args.interval,
                    os.path.join(d, "state"), args.steady)  # fmt: skip
    n, blocks = int(r["streams"]), int(r["resident"])
    per = r["first_cpu_s"] / n
    print(f"{n:,} streams x {blocks // n:,} blocks = {blocks:,} resident blocks (int64 hashes, "
          f"{args.per_batch} per batch); checkpoint_interval_s {args.interval:g}")  # fmt: skip
    print(f"on disk: {r['bytes_per_block']:.2f} B per resident block, "
          f"{r['bytes_per_block_no_anchor']:.2f} without the anchors (each stream's last batch, "
          f"kept whole); target <= 16")  # fmt: skip
    print(f"write, every stream at once (no CPU cap): {r['first_wall_s']:.2f} s wall, "
          f"{r['first_cpu_s']:.2f} s CPU = {per * 1e3:.2f} ms per stream: copies "
          f"{r['copy_cpu_s'] / n * 1e6:.0f} us (the ingest thread: {int(r['ticks'])} ticks, the "
          f"longest {r['longest_tick_ms']:.1f} ms), packing and files {r['write_cpu_s'] / n * 1e6:.0f} us")  # fmt: skip
    print(f"  uncapped, all {n:,} streams busy every {args.interval:g} s would take "
          f"{100 * r['first_cpu_s'] / args.interval:.0f} % of a core; ratio to the 2 % target "
          f"{r['first_cpu_s'] / args.interval / 0.02:.1f}")  # fmt: skip
    print(f"capped at 2 % (the default), every stream busy, {r['steady_s']:.0f} s: checkpoints "
          f"used {r['capped_core_pct']:.2f} % of a core, {r['capped_written_per_s']:.0f} streams "
          f"written per second: each stream every {r['capped_age_s']:.0f} s (the replay rings must "
          f"reach back that far for an exact resume after SIGKILL)")  # fmt: skip
    print(
        f"restore: {r['restore_s']:.2f} s for every stream ({r['restore_us_per_block']:.2f} us "
        f"per block); restore / uncapped write wall {r['restore_s'] / r['first_wall_s']:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
