"""Placement sketches: kvobserve's bottom-k (KMV) against Apache DataSketches' theta sketch.

Run: `python -m benchmarks.sketch [--seeds 20] [--blocks 50000]`. Each seed builds 4 ranks of
`--blocks` resident hashes (30% shared by all four, the rest per rank), split over two
collectors (ranks 0-1, 2-3), sketches each collector's ranks, merges, and compares with the exact
union: the relative error of distinct blocks and of blocks on all four ranks (max and RMS over
the seeds), the bytes a collector ships per worker, and the build time per million resident
blocks. DataSketches (`pip install datasketches==5.2.0`) is measured only when installed: a
theta sketch estimates the union, not how many ranks hold a block, so its row has no
multiplicity column; it cannot delete either, so both are rebuilt from the resident set.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from kvobserve.analysis.placement import bottom_k, local_placement, merge_placement


def _ranks(seed: int, n: int, overlap: float = 0.3) -> list[dict[int, float]]:
    rng = random.Random(seed)
    shared = {rng.getrandbits(64) - (1 << 63) for _ in range(int(n * overlap))}
    out = []
    for _ in range(4):
        own = {rng.getrandbits(64) - (1 << 63) for _ in range(n - len(shared))}
        out.append(dict.fromkeys(shared | own, 0.0))
    return out


def _kmv(ranks: list[dict[int, float]], k: int) -> tuple[float, float, int, float]:
    t0 = time.perf_counter()
    for s in ranks:  # the sketch alone (local_placement also counts the exact local placement)
        bottom_k(s, k, True)
    took = time.perf_counter() - t0
    parts = [
        local_placement("w", {r: ranks[r] for r in rs}, k=k, signed=True, sketch=True)
        for rs in ((0, 1), (2, 3))
    ]
    est = merge_placement(parts)
    union = set().union(*ranks)
    all4 = sum(1 for h in union if all(h in s for s in ranks))
    size = max(len(p.sketch) + len(p.sketch_counts) for p in parts)
    return (
        est.blocks_distinct / len(union) - 1,
        est.replicated.get(4, 0.0) / all4 - 1,
        size,
        took / sum(len(s) for s in ranks) * 1e6,
    )


def _theta(ds: Any, ranks: list[dict[int, float]], lg_k: int) -> tuple[float, int, float]:
    t0 = time.perf_counter()
    compact = []
    for rs in ((0, 1), (2, 3)):
        sk = ds.update_theta_sketch(lg_k)
        for r in rs:
            update = sk.update
            for h in ranks[r]:
                update(h)
        compact.append(sk.compact())
    took = time.perf_counter() - t0
    u = ds.theta_union(lg_k)
    for c in compact:
        u.update(c)
    union = set().union(*ranks)
    size = max(len(c.serialize()) for c in compact)
    return (
        u.get_result().get_estimate() / len(union) - 1,
        size,
        took / sum(len(s) for s in ranks) * 1e6,
    )


def _stats(errors: list[float]) -> str:
    rms = (sum(e * e for e in errors) / len(errors)) ** 0.5
    return f"max {max(abs(e) for e in errors) * 100:5.2f}%  rms {rms * 100:5.2f}%"


def main(argv: list[str] | None = None) -> int:
    """Print the comparison; returns 0."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.sketch", description=__doc__)
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--blocks", type=int, default=50_000, help="resident blocks per rank")
    p.add_argument("--k", default="256,1024,4096", help="KMV sizes (theta: the same nominal)")
    args = p.parse_args(argv)
    try:
        import datasketches as ds  # optional: measured only when installed
    except ImportError:
        ds = None
    data = [_ranks(seed, args.blocks) for seed in range(args.seeds)]
    print(f"{args.seeds} seeds, 4 ranks x {args.blocks:,} blocks (30% on all four), 2 collectors")
    for k in (int(x) for x in args.k.split(",")):
        runs = [_kmv(r, k) for r in data]
        print(
            f"KMV   k={k:<5} distinct {_stats([e for e, _, _, _ in runs])} | on 4 ranks "
            f"{_stats([e for _, e, _, _ in runs])} | {max(s for _, _, s, _ in runs):>6,} B "
            f"| {sum(t for *_, t in runs) / len(runs) * 1e3:6.0f} ms per 1M blocks"
        )
        if ds is not None:
            lg = k.bit_length() - 1
            th = [_theta(ds, r, lg) for r in data]
            print(
                f"theta lg_k={lg:<2} distinct {_stats([e for e, _, _ in th])} | on 4 ranks   n/a"
                f"{'':>24}| {max(s for _, s, _ in th):>6,} B "
                f"| {sum(t for *_, t in th) / len(th) * 1e3:6.0f} ms per 1M blocks"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
