"""Memory per resident block in one stream's BlockIndex, at 1M and 10M blocks.

Run: `python -m benchmarks.memory [--sizes 1000000,10000000]`. Batches of 32 BlockStored events
of 16 hashes each (block_size 16, medium GPU) are applied to a fresh BlockIndex; one float
timestamp per batch, as the decoder gives it. Each size is measured with the cache analytics
off and on (docs/cache-analytics.md); with them on, every 7th event names a LoRA adapter, as
the simulator's requests do (LoRA blocks are the one per-block cost of the analytics). Two measures: the RSS delta of the process (what
an operator sees, allocator overhead included) and, with --tracemalloc, Python's own count of
the bytes still allocated (slower; 1M only by default). Hashes are random signed 64-bit ints
(SGLang, vLLM < 0.33) or, with --bytes-hashes, 32-byte strings (vLLM's sha256 hashes).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import random
import tracemalloc

from benchmarks._common import rss_bytes
from kvobserve.analysis.analytics import CacheAnalytics
from kvobserve.analysis.blocks import BlockIndex
from kvobserve.wire.kv_events import BlockHash, BlockStored, KvBatch

LORA_EVERY = 7  # events; as the simulator's requests


class _LoraStored(BlockStored, gc=False):
    """A BlockStored as the map decoder gives it with SGLang >= 0.5.22 / vLLM >= 0.17."""

    lora_name: str | None = None


EVENTS_PER_BATCH = 32
HASHES_PER_EVENT = 16


def fill(index: BlockIndex, blocks: int, bytes_hashes: bool, seed: int = 7) -> None:
    """Store `blocks` distinct random hashes into `index`, batch by batch."""
    rng = random.Random(seed)
    per_batch = EVENTS_PER_BATCH * HASHES_PER_EVENT
    ts = 1_795_291_773.0
    lora = index.analytics is not None
    n_ev = 0
    for start in range(0, blocks, per_batch):
        n = min(per_batch, blocks - start)
        hashes: list[BlockHash]
        if bytes_hashes:
            hashes = [rng.randbytes(32) for _ in range(n)]
        else:
            hashes = [rng.getrandbits(64) - (1 << 63) for _ in range(n)]
        events: list[BlockStored] = []
        for i in range(0, n, HASHES_PER_EVENT):
            n_ev += 1
            name = "sql-lora" if lora and n_ev % LORA_EVERY == 0 else None
            events.append(
                _LoraStored(hashes[i : i + HASHES_PER_EVENT], block_size=16, medium="GPU",
                            lora_name="".join(name) if name else None)  # a str per event
            )  # fmt: skip
        ts += 0.001
        index.apply_batch(KvBatch("kv-events", start // per_batch, ts, 0, list(events)))


def _index(analytics: bool) -> BlockIndex:
    index = BlockIndex()
    if analytics:
        index.analytics = CacheAnalytics()
    return index


def per_block_rss(blocks: int, bytes_hashes: bool, analytics: bool) -> float:
    """Bytes of RSS per resident block (delta over an empty index)."""
    gc.collect()
    before = rss_bytes(os.getpid())
    index = _index(analytics)
    fill(index, blocks, bytes_hashes)
    gc.collect()
    resident = sum(index.blocks.values())
    assert resident == blocks, (resident, blocks)  # random collisions would skew the figure
    per = (rss_bytes(os.getpid()) - before) / blocks
    del index
    return per


def per_block_traced(blocks: int, bytes_hashes: bool, analytics: bool) -> float:
    """Bytes per resident block that tracemalloc still counts as allocated after the fill."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = _index(analytics)
    fill(index, blocks, bytes_hashes)
    gc.collect()
    per = (tracemalloc.get_traced_memory()[0] - base) / blocks
    tracemalloc.stop()
    del index
    return per


def main(argv: list[str] | None = None) -> int:
    """Print bytes per resident block; returns 0."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__)
    p.add_argument("--sizes", default="1000000,10000000", help="comma-separated block counts")
    p.add_argument("--bytes-hashes", action="store_true", help="32-byte hashes (vLLM sha256)")
    p.add_argument("--tracemalloc", default="1000000", help="sizes also measured by tracemalloc")
    args = p.parse_args(argv)
    kind = "32-byte hashes" if args.bytes_hashes else "int64 hashes"
    traced = {int(x) for x in args.tracemalloc.split(",") if x}
    for n in (int(x) for x in args.sizes.split(",")):
        for on in (False, True):
            # a fresh process each: a second fill would reuse the first one's freed memory
            with mp.get_context("spawn").Pool(1) as pool:
                rss = pool.apply(per_block_rss, (n, args.bytes_hashes, on))
            line = (
                f"{n:>11,} blocks ({kind}), analytics {'on ' if on else 'off'}: "
                f"RSS delta {rss:6.1f} B/block"
            )
            if n in traced:
                line += f", tracemalloc {per_block_traced(n, args.bytes_hashes, on):6.1f} B/block"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
