"""The conditions of a fleet view: what is wrong now, each with its cause and since when.

One condition per row kind of analysis/alerting.py that the aggregator can see. Event kinds (gap,
loss, restart, decode errors, rank mismatch) hold for RECENT_S after their last occurrence, as the
alert rules' `increase(...[15m]) > 0` do. Pure: `now` is the view's.

`since` is when the condition began. Each condition takes it from its evidence (a collector's
last snapshot, a stream's state change, the first sign of a second publisher, ...); what
happened to one collector carries that collector's time in every condition it causes (its
collector_down, its streams' stream_down, its ranks' dp_rank_uncovered). Evidence that moves
while a condition lasts (the latest gap, the latest scheduler value) is held still by the
aggregator, which remembers when each condition was first active (`began`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kvobserve.analysis.alerting import KINDS, RECENT_S
from kvobserve.analysis.layout import ranged
from kvobserve.wire.snapshot import BindStats, DriftStats, StreamStats

if TYPE_CHECKING:
    from kvobserve.analysis.fleet import FleetView, StreamView

Labels = tuple[tuple[str, str], ...]
Key = tuple[str, Labels]  # a condition's identity across views: (kind, labels)
NEAR_FULL = 0.95  # scheduler token usage above this: cache_near_full (the rule's threshold)
# A stream counts as down after this long: a publisher restart's second of silence is no outage
# (the alert waits 5 minutes; the page shows the stream's state at once either way).
DOWN_AFTER_S = 5.0
# cache_thrash: a rank's top-tier restores / stores since its collector started, past this many
# stores (the rule, alerts/kvobserve-rules.yml, uses 15-minute rates per worker)
THRASH_RATIO = 0.3
THRASH_MIN_STORES = 1000
TOP_MEDIA = frozenset({"GPU", "DEVICE"})
# router_index_drift: phantom + missing above this share of the engine's blocks, and this many
DRIFT_SHARE = 0.05
DRIFT_MIN_BLOCKS = 10
MISMATCH = "layout_mismatch"  # the worker state (WorkerInfo.state) of the condition
WORKER_TROUBLE = frozenset({"undiscovered", MISMATCH})  # worker states with a condition
SOURCE_DOWN = frozenset({"down", "undecodable"})  # scheduler-source states that deliver nothing


def thrashing(st: StreamStats) -> tuple[int, int] | None:
    """(restored, stored) of the stream's top tier when they make it a cache_thrash, else None."""
    for m in st.media:
        stored, restored = m.stored_total, m.restored_total
        if (
            m.medium in TOP_MEDIA
            and stored >= THRASH_MIN_STORES
            and restored > THRASH_RATIO * stored
        ):
            return restored, stored
    return None


def drifted(d: DriftStats) -> bool:
    """Whether a drift comparison shows more disagreement than the threshold."""
    return d.phantom + d.missing > max(DRIFT_SHARE * d.engine_blocks, DRIFT_MIN_BLOCKS)


@dataclass(frozen=True)
class Condition:
    """An active problem, as shown on the status page and in /api/v1/alerts.

    `kind` is a row of analysis/alerting.py, which gives the severity, the alert and the runbook.
    """

    kind: str  # duplicate_stream, unexpected_stream, dp_rank_uncovered, ...
    severity: str  # critical, warning, info
    labels: Labels
    description: str
    since: float = field(default=0.0, compare=False)  # when its cause began (0: unknown)

    @classmethod
    def of(cls, kind: str, labels: Labels, description: str, since: float = 0.0) -> Condition:
        """A condition of `kind` with the table's severity (KeyError for a kind not in it)."""
        return cls(kind, KINDS[kind].severity, labels, description, since)

    @property
    def key(self) -> Key:
        """Identity of the condition across views (for transitions)."""
        return (self.kind, self.labels)


def labels(**kw: object) -> Labels:
    """Label pairs in the given order, values as strings."""
    return tuple((k, str(val)) for k, val in kw.items())


def began(c: Condition, active_since: float | None, first_seen: float = 0.0) -> Condition:
    """`c` with `since` = when it began: the earlier of when it was first active (None: new)
    and its own evidence; `first_seen` when neither is known (0 leaves it unknown)."""
    known = [t for t in (active_since, c.since) if t]
    since = min(known) if known else first_seen
    return c if since == c.since else replace(c, since=since)


def conditions(v: FleetView) -> Iterable[Condition]:
    """Every active condition of the view, fleet-wide ones first."""
    for c in v.collectors:
        if not c.up:
            yield Condition.of(
                "collector_down",
                labels(collector=c.info.collector_id, node_rank=c.info.node_rank),
                f"collector {c.info.collector_id} ({c.info.hostname or '?'}) silent for "
                f"{c.age_s:.0f} s",
                c.snapshot.time,
            )
    yield from configured(v)
    # A worker that a live collector cannot watch as configured has one condition, not one per
    # rank left uncovered (the shipped Alertmanager config inhibits DPRankUncovered the same way)
    explained = {w.worker_id for w, _ in v.workers if w.state in WORKER_TROUBLE}
    for (w, r), ids in sorted(v.owners.items()):
        if not ids:
            if w in explained:
                continue
            yield _uncovered(v, w, r)
        elif len(ids) > 1:
            yield Condition.of(
                "dp_rank_multiple_owners",
                labels(worker_id=w, dp_rank=r),
                f"{w} rank {r} is owned by {len(ids)} collectors: {', '.join(ids)}",
            )
    for w, ids in sorted(v.leaders.items()):
        if len(ids) > 1:
            yield Condition.of(
                "multiple_scheduler_leaders",
                labels(worker_id=w),
                f"{w} has {len(ids)} scheduler-metrics leaders: {', '.join(ids)}",
            )
    down = {(s.stats.worker_id, s.stats.dp_rank) for s in v.streams if not s.up}
    for c in v.collectors:
        if not c.up:
            continue
        yield from _relays(c.snapshot.binds, c.info.collector_id, v.now)
        for d in c.snapshot.drift:
            if drifted(d) and (d.worker_id, d.dp_rank) not in down:  # a down stream: unknown
                yield Condition.of(
                    "router_index_drift",
                    labels(worker_id=d.worker_id, dp_rank=d.dp_rank, medium=d.medium),
                    f"{d.worker_id} rank {d.dp_rank} {d.medium}: the router's index holds "
                    f"{d.phantom} evicted blocks and lacks {d.missing} resident ones of "
                    f"{d.engine_blocks} ({d.method})",
                    d.at,
                )
    running = {(s.worker_id, s.dp_rank): s.running_requests for s, _ in v.scheduler}
    for s in v.streams:
        yield from _stream(s, v, running.get((s.stats.worker_id, s.stats.dp_rank)))
    for u, info in v.unexpected:
        if u.active:
            yield Condition.of(
                "unexpected_stream",
                labels(worker_id=u.worker_id, node_rank=info.node_rank, endpoint=u.endpoint),
                f"{u.worker_id}: KV events on {u.endpoint}, past the last rank (dp_size too small?)",
            )
    for sch, info in v.scheduler:
        if sch.token_usage_ratio is not None and sch.token_usage_ratio > NEAR_FULL:
            yield Condition.of(
                "cache_near_full",
                labels(worker_id=sch.worker_id, node_rank=info.node_rank, dp_rank=sch.dp_rank),
                f"{sch.worker_id} rank {sch.dp_rank}: running requests hold "
                f"{100 * sch.token_usage_ratio:.0f}% of the KV cache",
                sch.updated,
            )


def configured(v: FleetView) -> Iterable[Condition]:
    """Configured workers and scheduler sources a live collector cannot watch (docs/collector.md
    "Worker states"): one condition per worker and collector, not one per rank."""
    for w, info in v.workers:
        if w.state not in WORKER_TROUBLE:
            continue
        where = labels(worker_id=w.worker_id, node_rank=info.node_rank, collector=info.collector_id)
        on = f"{w.worker_id} on {info.collector_id}"
        if w.state == "undiscovered":
            yield Condition.of(
                "worker_undiscovered", where, f"{on}: undiscovered: {w.reason}", w.since
            )
        else:
            left = (
                f" (ranks {ranged(w.elsewhere)} are not watched here: the engine does not run them "
                "on this node)"
                if w.elsewhere
                else ""
            )
            yield Condition.of("layout_mismatch", where, f"{on}: {w.reason}{left}", w.since)
    for src, info in v.sources:
        # a failed scrape is retried at the next interval: down for DOWN_AFTER_S is an outage
        if src.state in SOURCE_DOWN and v.now - src.since >= DOWN_AFTER_S:
            yield Condition.of(
                "scheduler_source_down",
                labels(
                    worker_id=src.worker_id,
                    node_rank=info.node_rank,
                    collector=info.collector_id,
                    source=src.source,
                ),
                f"{src.worker_id} scheduler source {src.source} ({src.endpoint}) on "
                f"{info.collector_id} is {src.state}: {src.reason}",
                src.since,
            )


def _relays(binds: list[BindStats], collector: str, now: float) -> Iterable[Condition]:
    """relay_dropping: a relay that did not forward frames within RECENT_S, and why."""
    for b in binds:
        r = b.relay
        if r is None or not r.last_drop_time or now - r.last_drop_time > RECENT_S:
            continue
        drops = ", ".join(f"{k} {n}" for k, n in sorted(r.dropped.items()))
        yield Condition.of(
            "relay_dropping",
            labels(collector=collector, worker_id=b.worker_id, dp_rank=b.dp_rank),
            f"{b.worker_id} rank {b.dp_rank}: frames not forwarded to {r.target} ({drops}); "
            f"relay {r.state}: {r.reason}",
            r.last_drop_time,
        )


def _uncovered(v: FleetView, w: str, r: int) -> Condition:
    """dp_rank_uncovered, with the collector that owned the rank last when that one is down:
    its labels let Alertmanager inhibit the alert under that collector's KVObserveCollectorDown,
    and its last snapshot is when the rank lost its owner."""
    last = v.last_owner.get((w, r))
    if last is None:
        return Condition.of(
            "dp_rank_uncovered",
            labels(worker_id=w, dp_rank=r),
            f"{w} rank {r} is watched by no live collector",
        )
    i = last.info
    return Condition.of(
        "dp_rank_uncovered",
        labels(worker_id=w, dp_rank=r, node_rank=i.node_rank, collector=i.collector_id),
        f"{w} rank {r} is watched by no live collector: its collector {i.collector_id} "
        f"(node_rank {i.node_rank}) is down",
        last.snapshot.time,
    )


def _down_since(s: StreamView) -> float:
    """When a stream of a silent collector went down: with its collector (the collector's last
    snapshot, as collector_down says), unless it was down already then (a settled outage)."""
    st, lost = s.stats, s.collector_last_seen
    if not st.up and st.state != "starting" and 0 < st.state_since <= lost - DOWN_AFTER_S:
        return st.state_since
    return lost


def _stream(s: StreamView, v: FleetView, running: float | None) -> Iterable[Condition]:
    st = s.stats
    where = labels(worker_id=st.worker_id, node_rank=s.collector.node_rank, dp_rank=st.dp_rank)
    name = f"{st.worker_id} rank {st.dp_rank}"
    if not s.live:
        why = f"its collector {s.collector.collector_id} is silent"
        yield Condition.of("stream_down", where, f"{name} is down: {why}", _down_since(s))
        return  # nothing newer is known
    # its first connect under way, or it just went (a restart): not down yet; a stream that
    # is down already stays down while its state changes (one outage, one start)
    now = v.now
    settling = st.state == "starting" or now - st.state_since < DOWN_AFTER_S
    if not s.up and (not settling or ("stream_down", where) in v.began):
        why = f"{st.state or 'down'}: {st.reason}" if st.reason else st.state or "not connected"
        yield Condition.of("stream_down", where, f"{name} is down: {why}", st.state_since)
    if st.duplicate_stream and s.up:  # a down stream's flag is its last value
        yield Condition.of(
            "duplicate_stream",
            where,
            f"{name}: two publishers (interleaved or mirrored)",
            st.duplicate_since or st.last_duplicate_time,  # the latter from older collectors
        )
    # before any batch the index is simply empty; during a replay its outcome is not known yet
    if s.up and not st.state_complete and st.batches_total and not st.replaying:
        why = st.incomplete_reason or "joined mid-stream or lost batches"
        yield Condition.of("index_incomplete", where, f"{name}: block index incomplete: {why}")

    def recent(t: float) -> bool:
        return t > 0 and now - t <= RECENT_S

    if recent(st.last_loss_time):
        yield Condition.of(
            "events_lost",
            where,
            f"{name}: batches lost for good ({st.lost} in total, not recovered by replay)",
            st.last_loss_time,
        )
    if recent(st.last_gap_time):
        yield Condition.of(
            "sequence_gap",
            where,
            f"{name}: sequence gap ({st.gaps} in total: {st.missed} batches missed, "
            f"{st.recovered} recovered, {st.lost} lost)",
            st.last_gap_time,
        )
    if recent(st.last_restart_time):
        yield Condition.of(
            "publisher_restarted",
            where,
            f"{name}: publisher restarted ({st.restarts} in total); block index reset",
            st.last_restart_time,
        )
    if recent(st.last_decode_error_time):
        reasons = ", ".join(f"{k} {n}" for k, n in sorted(st.decode_errors.items()))
        yield Condition.of(
            "decode_errors",
            where,
            f"{name}: messages that do not decode, skipped ({reasons or 'see counters'})",
            st.last_decode_error_time,
        )
    if recent(st.last_rank_mismatch_time):
        yield Condition.of(
            "rank_mismatch",
            where,
            f"{name}: {st.rank_mismatch_batches} batches name another DP rank (port rule?)",
            st.last_rank_mismatch_time,
        )
    if recent(st.last_silent_loss_time) and st.silent_loss:
        reasons = ", ".join(f"{k} {n}" for k, n in sorted(st.silent_loss.items()))
        yield Condition.of(
            "silent_loss",
            where,
            f"{name}: evidence of events lost without a sequence gap ({reasons})",
            st.last_silent_loss_time,
        )
    thrash = thrashing(st)
    if thrash is not None:
        yield Condition.of(
            "cache_thrash",
            where,
            f"{name}: {thrash[0]} of {thrash[1]} top-tier block stores restored a block "
            "evicted minutes before",
        )
    quiet_since = st.last_message_time or st.state_since
    if (
        st.state in ("waiting", "idle")
        and quiet_since
        and now - quiet_since >= RECENT_S
        and running != 0
    ):
        yield Condition.of(
            "stream_stalled",
            where,
            f"{name}: connected, no batch for {(now - quiet_since) / 60:.0f} min "
            "and the rank is not known to be idle",
            quiet_since,
        )
