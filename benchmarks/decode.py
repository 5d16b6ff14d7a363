"""Decode throughput of kvobserve's KV-event decoder beside a bare msgspec decode of the same bytes.

Run: `python -m benchmarks.decode`. Batches of 1 and of 32 events, each event a BlockStored with
16 block hashes and 256 token ids, in the array form (SGLang <= 0.5.19, vLLM <= 0.23), the map
form (SGLang >= 0.5.20, vLLM >= 0.24), `v33` (maps with every field vLLM 0.33 sends set: group,
KV-cache spec kind, locality, session id, lookahead token ids) and `hybrid` (v33 maps of a hybrid
model: every other event belongs to a sliding-window KV-cache group, which the decoder sets
aside). Both decoders run in the same process, interleaved, and the figure is the median of
several repetitions. Ratio = ours / bare (> 1: ours is faster).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgspec

from kvobserve.wire.kv_events import decode_payload

HASHES_PER_EVENT = 16
TOKENS_PER_EVENT = 256


def build_payload(n_events: int, form: str, rng: random.Random) -> bytes:
    """One encoded batch `[ts, events, dp_rank]` of `n_events` BlockStored events."""
    events: list[Any] = []
    for _ in range(n_events):
        hashes = [rng.getrandbits(64) - (1 << 63) for _ in range(HASHES_PER_EVENT)]
        tokens = [rng.randrange(150_000) for _ in range(TOKENS_PER_EVENT)]
        parent = rng.getrandbits(64) - (1 << 63)
        if form == "array":
            events.append(["BlockStored", hashes, parent, tokens, 16, None, "GPU"])
            continue
        ev: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
        }
        if form in ("v33", "hybrid"):
            side = form == "hybrid" and len(events) % 2 == 1
            ev["lora_name"] = None
            ev["group_idx"] = 1 if side else 0
            ev["kv_cache_spec_kind"] = "sliding_window" if side else "full_attention"
            if side:
                ev["kv_cache_spec_sliding_window"] = 1024
            ev["locality"] = "LOCAL"
            ev["session_id"] = f"session-{rng.randrange(1000)}"
            ev["lookahead_token_ids"] = [[t] for t in tokens[16::16]] + [[]]
        events.append(ev)
    return msgspec.msgpack.encode([1_795_291_773.46, events, 0])


def _rate(fn: Callable[[bytes], object], payload: bytes, loops: int) -> float:
    """Calls per second of fn(payload) over `loops` calls."""
    start = time.perf_counter()
    for _ in range(loops):
        fn(payload)
    return loops / (time.perf_counter() - start)


def measure(payload: bytes, budget_s: float, repeats: int) -> tuple[float, float]:
    """Median batches/s of (ours, bare msgspec) on one payload, repetitions interleaved."""

    def ours(p: bytes) -> object:
        return decode_payload("kv-events", 0, p)

    bare = msgspec.msgpack.decode
    # size the loop so one repetition of both takes about budget_s / repeats
    probe = _rate(bare, payload, 50)
    loops = max(50, int(probe * budget_s / repeats / 2))
    ours_rates, bare_rates = [], []
    for _ in range(repeats):
        ours_rates.append(_rate(ours, payload, loops))
        bare_rates.append(_rate(bare, payload, loops))
    return statistics.median(ours_rates), statistics.median(bare_rates)


def main(argv: list[str] | None = None) -> int:
    """Print the table; returns 0."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode", description=__doc__)
    parser.add_argument("--budget", type=float, default=0.8, help="seconds per case")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    rng = random.Random(1)
    print(
        f"events: BlockStored, {HASHES_PER_EVENT} block hashes + {TOKENS_PER_EVENT} token ids each; "
        f"median of {args.repeats}; msgspec {msgspec.__version__}"
    )
    header = f"{'form':<6} {'events':>6} {'bytes':>7} | {'ours batch/s':>12} {'ours hash/s':>12}"
    header += f" | {'bare batch/s':>12} {'bare hash/s':>12} | ratio"
    print(header)
    print("-" * len(header))
    for form in ("array", "map", "v33", "hybrid"):
        for n_events in (1, 32) if form != "hybrid" else (32,):
            payload = build_payload(n_events, form, rng)
            batch = decode_payload("kv-events", 0, payload)
            kept = n_events // 2 if form == "hybrid" else n_events
            assert batch.unknown_events == 0
            assert len(batch.events) in (kept, n_events)  # n_events: a decoder without groups
            ours, bare = measure(payload, args.budget, args.repeats)
            per = n_events * HASHES_PER_EVENT
            print(
                f"{form:<6} {n_events:>6} {len(payload):>7} | {ours:>12,.0f} {ours * per:>12,.0f}"
                f" | {bare:>12,.0f} {bare * per:>12,.0f} | {ours / bare:.2f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
