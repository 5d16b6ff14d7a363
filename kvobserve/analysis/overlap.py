"""Where would a request hit: the pool's ranks and the collectors' answers, put together.

The aggregator asks every collector (wire/overlap.py); each answers, for the ranks it watches,
how many leading blocks of the request the rank holds now (`BlockIndex.leading_blocks`, walked in
its ingest thread). This module decides whose answers to wait for and merges them with the
fleet view, so that no rank of the pool is silently left out: a rank whose collector did not
answer, whose stream is not up, or that no collector watches is listed with `leading_blocks`
None and the reason (docs/cache-analytics.md "Checking a router's decision").

A pool is the set of ranks a router could send a request to. Until workers declare the model
they serve, a pool is named by a worker id; without a name it is every rank of the fleet (the
hashes of one model's requests are never resident on another model's ranks, so those ranks
answer 0).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvobserve.analysis.views import FleetView
from kvobserve.wire.overlap import OverlapReply


class PoolError(ValueError):
    """A pool name that names nothing the fleet knows; the message says what it knows."""


@dataclass(frozen=True, slots=True)
class RankAnswer:
    """One rank of the pool: the leading blocks it holds, or None and why not."""

    worker_id: str
    dp_rank: int
    node_rank: int | None  # None: no collector watches the rank
    collector: str | None
    leading_blocks: int | None
    trust: str | None = None  # analysis/trust.py state; None while unknown
    reason: str = ""  # why leading_blocks is None ("" when answered)


@dataclass
class OverlapAnswer:
    """The whole answer: every rank of the pool, and the collectors that did not answer."""

    pool: str | None
    workers: list[str]
    hashes: int
    ranks: list[RankAnswer] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # collectors of pool ranks, no answer


def pool_workers(view: FleetView, pool: str | None) -> list[str]:
    """The workers of the pool named `pool` (None: every worker the fleet knows); `view`
    needs only its membership (`FleetState.membership`)."""
    known = sorted({w for w, _ in view.owners})  # every rank of every declared worker
    if pool is None:
        return known
    if pool in known:
        return [pool]
    shown = ", ".join(known[:20]) + (", ..." if len(known) > 20 else "")
    raise PoolError(f"pool {pool!r}: no worker of that id (workers: {shown or 'none yet'})")


def awaited_collectors(view: FleetView, workers: Iterable[str]) -> set[str]:
    """The collectors whose answers to wait for: the live owners of the pool's ranks (a down
    collector may still answer in that time; it is not waited for)."""
    mine = set(workers)
    return {cid for (w, _), ids in view.owners.items() if w in mine for cid in ids}


def merge_answers(
    view: FleetView,
    pool: str | None,
    workers: list[str],
    hashes: int,
    replies: Iterable[OverlapReply],
    timeout_s: float,
) -> OverlapAnswer:
    """Every rank of `workers`: as answered, or None with the reason."""
    mine = set(workers)
    out = OverlapAnswer(pool, workers, hashes)
    answered: set[tuple[str, int, str]] = set()  # (worker, rank, collector)
    failed: dict[str, str] = {}  # collector -> the error it answered with
    replied: set[str] = set()
    for reply in replies:
        cid = reply.collector_id
        replied.add(cid)
        if reply.error:
            failed[cid] = reply.error
            continue
        for r in reply.ranks:
            if r.worker_id not in mine:
                continue
            answered.add((r.worker_id, r.dp_rank, cid))
            if r.up:
                out.ranks.append(
                    RankAnswer(r.worker_id, r.dp_rank, reply.node_rank, cid, r.leading_blocks,
                               r.trust)
                )  # fmt: skip
            else:
                out.ranks.append(
                    RankAnswer(r.worker_id, r.dp_rank, reply.node_rank, cid, None, None,
                               "stream not up: its blocks are unknown")
                )  # fmt: skip
    node = {c.info.collector_id: c.info.node_rank for c in view.collectors}
    down = {c.info.collector_id: c.age_s for c in view.collectors if not c.up}
    missing: set[str] = set()
    for (w, rank), ids in view.owners.items():
        if w not in mine:
            continue
        owners = ids
        if not owners:
            last = view.last_owner.get((w, rank))
            owners = [last.info.collector_id] if last is not None else []
        if not owners:
            out.ranks.append(
                RankAnswer(w, rank, None, None, None, None, "no collector watches this rank")
            )
            continue
        for cid in owners:
            if (w, rank, cid) in answered:
                continue
            if cid in failed:
                why = f"collector {cid} could not answer: {failed[cid]}"
            elif cid in replied:  # its plan has no stream for the rank (yet)
                why = f"collector {cid} has no stream of this rank"
            elif cid in down:  # asked with the others when any was live; not waited for
                why = f"collector {cid} is down (no snapshot for {down[cid]:.0f} s)"
            else:
                why = f"collector {cid} did not answer within {timeout_s:g} s"
            if cid not in replied or cid in failed:
                missing.add(cid)
            out.ranks.append(RankAnswer(w, rank, node.get(cid), cid, None, None, why))
    out.ranks.sort(key=lambda r: (r.worker_id, r.dp_rank, r.collector or ""))
    out.missing = sorted(missing)
    return out
