"""The conditions of a fleet view: what is wrong now, each kind declared once with its alert.

`KINDS` is the one table. A row names the condition (as on the page and in the API), its
Prometheus alert (the rule of the same name in alerts/kvobserve-rules.yml, which fires after its
`for:` and is routed by Alertmanager), the severity both carry, the runbook section
(docs/alerts.md) and the status page's cell it tints. A test holds the rule file's `severity`
labels and the runbook's sections to this table.

A stream's condition is found one stream at a time (`Kind.find`), with a pre-check (`Kind.may`):
a cheap test of the stream's stats alone that holds whenever `find` may find it. An event kind
(gap, loss, restart, decode errors, rank mismatch, silent loss) holds for RECENT_S after the
event's last occurrence, as the alert rules' `increase(...[15m]) > 0` do: its row names that
time field of StreamStats (`event_time`) and what to say (`describe`), and the pre-check is that
the time is recent. Any other stream condition (stream_down, duplicate_stream, ...) has its own
`check` and `precheck` beside each other below. The per-second check (`FleetState.conditions`,
analysis/fleet.py) builds views only of the streams some row's pre-check lets through
(`may_have_condition`): a pre-check that missed a case would leave a condition on the page that
never fires. A property test over generated fleets holds every row's pre-check to its check and
the per-second check to the whole view (tests/unit/test_condition_prechecks.py). Every other
row is found over the fleet's membership (collectors, workers, owners, leaders, scheduler
values, what collectors report of relays and drift, the pools' miss splits, unexpected streams)
by its row's own finder (`Kind.finds`), which both paths build whole: they need no pre-check.
Pure: `now` is the view's.

What follows from a cause is declared once (`FOLLOWS`): a lost collector's streams down and its
ranks uncovered, a worker that cannot be watched and its ranks uncovered, lost batches and the
gap they were missed in. `grouped` lists each condition under its cause, as the page, `kvobserve
status` and /api/v1/alerts show them; the example Alertmanager config inhibits the same alerts
under the same ones (alerts/alertmanager.yml, held to `FOLLOWS` by tests/unit/test_alert_table.py).

`since` is when the condition began. Each condition takes it from its evidence (a collector's
last snapshot, a stream's state change, the first sign of a second publisher, ...); what
happened to one collector carries that collector's time in every condition it causes (its
collector_down, its streams' stream_down, its ranks' dp_rank_uncovered). Evidence that moves
while a condition lasts (the latest gap, the latest scheduler value) is held still by the
aggregator, which remembers when each condition was first active (`began`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Final

from kvobserve.analysis.layout import ranged
from kvobserve.analysis.tiers import TOP_MEDIA
from kvobserve.analysis.views import (
    FleetView,
    Key,
    Labels,
    PoolSplit,
    RecentSplit,
    StreamView,
)
from kvobserve.config.model import HttpConfig
from kvobserve.wire.snapshot import CollectorInfo, DriftStats, StreamStats, WorkerInfo

SEVERITIES: Final = ("critical", "warning", "info")  # most severe first
RECENT_S: Final = 900.0  # event conditions hold this long after the event, like increase([15m])
DEFAULT_RUNBOOK_URL: Final = HttpConfig().runbook_url  # [http] runbook_url
NEAR_FULL = 0.95  # scheduler token usage above this: cache_near_full (the rule's threshold)
# A stream counts as down after this long: a publisher restart's second of silence is no outage
# (the alert waits 5 minutes; the page shows the stream's state at once either way).
DOWN_AFTER_S = 5.0
# cache_thrash: a rank's top-tier restores / stores since its collector started, past this many
# stores (the rule, alerts/kvobserve-rules.yml, uses 15-minute rates per worker)
THRASH_RATIO = 0.3
THRASH_MIN_STORES = 1000
# router_index_drift: phantom + missing above this share of the engine's blocks, and this many
DRIFT_SHARE = 0.05
DRIFT_MIN_BLOCKS = 10
# placement_misses: a pool's placement share of the misses over the last RECENT_S above this
# (random routing gives 8 % on 2 ranks and 16 % on 4 on the trace fixture, KV-aware 0 %:
# docs/alerts.md), judged once that many blocks missed in a window at least that long, with the
# split trusted; once active, it holds until a judged share falls under PLACEMENT_CLEAR (a share
# near the threshold, or a while of thin or untrusted evidence, does not make it flap)
PLACEMENT_SHARE = 0.05
PLACEMENT_CLEAR = 0.025
PLACEMENT_MIN_MISSES = 10_000
PLACEMENT_MIN_S = 300.0
# the kinds whose own check reads whether they were active already (FleetView.began)
STREAM_DOWN: Final = "stream_down"
UNCOVERED: Final = "dp_rank_uncovered"
PLACEMENT: Final = "placement_misses"
MISMATCH = "layout_mismatch"  # the worker state (WorkerInfo.state) of the condition
WORKER_TROUBLE = frozenset({"undiscovered", MISMATCH})  # worker states with a condition
SOURCE_DOWN = frozenset({"down", "undecodable"})  # scheduler-source states that deliver nothing
QUIET_STATES = ("waiting", "idle")  # connected, nothing arriving: stream_stalled may hold


def severity_rank(severity: str) -> int:
    """0 for critical, 1 warning, 2 info (sort key; unknown last)."""
    return SEVERITIES.index(severity) if severity in SEVERITIES else len(SEVERITIES)


@dataclass(frozen=True)
class Condition:
    """An active problem, as shown on the status page and in /api/v1/alerts.

    `kind` is a row of `KINDS`, which gives the severity, the alert and the runbook.
    """

    kind: str  # duplicate_stream, unexpected_stream, dp_rank_uncovered, ...
    severity: str  # critical, warning, info
    labels: Labels
    description: str
    since: float = field(default=0.0, compare=False)  # when its cause began (0: unknown)

    @property
    def key(self) -> Key:
        """Identity of the condition across views (for transitions)."""
        return (self.kind, self.labels)


class Around:
    """What a stream's check reads beside the stream: the view's time, when each condition
    began (FleetView.began), and the running requests the scheduler reports per rank."""

    __slots__ = ("_running", "began", "now", "scheduler", "unvouched_warn_s")

    def __init__(self, v: FleetView) -> None:
        self.now = v.now
        self.unvouched_warn_s = v.unvouched_warn_s
        self.began = v.began
        self.scheduler = v.scheduler
        self._running: dict[tuple[str, int], float | None] | None = None

    def recent(self, t: float) -> bool:
        """Whether an event at `t` (0: never) is within RECENT_S of the view's time."""
        return t > 0 and self.now - t <= RECENT_S

    def running(self, worker_id: str, dp_rank: int) -> float | None:
        """The rank's running requests (None: unknown); the table is built on first use."""
        if self._running is None:
            self._running = {
                (s.worker_id, s.dp_rank): s.running_requests for s, _ in self.scheduler
            }
        return self._running.get((worker_id, dp_rank))


# A stream's pre-check: (its stats, whether its collector is up, now) -> whether its check may
# find the condition. Its check: (the stream's view, the rest) -> (description, since) of the
# condition it found (since 0: unknown), or None. A fleet row's finder: the view -> (labels,
# description, since) of each condition it finds.
Found = tuple[str, float] | None
PreCheck = Callable[[StreamStats, bool, float], bool]
StreamCheck = Callable[[StreamView, Around], Found]
Finding = tuple[Labels, str, float]
FleetFinder = Callable[[FleetView], Iterable[Finding]]


@dataclass(frozen=True, slots=True)
class Kind:
    """One condition kind and the alert it shares its name, severity and runbook with."""

    kind: str  # the condition, as on the page and in the API (snake_case)
    alert: str  # the Prometheus alert name (CamelCase)
    severity: str  # critical pages, warning goes to chat, info is for dashboards
    title: str  # a few words for the page
    # what the status page tints with the severity: a column of the stream's row (state, gaps,
    # restarts, dup, index, errors, sched), the worker's or the scheduler source's row; None:
    # only the conditions table shows it
    cell: str | None = None
    # A fleet-wide condition: what finds it over the whole view.
    finds: FleetFinder | None = None
    # A stream's condition: an event kind holds for RECENT_S after the event's last occurrence,
    # the StreamStats time field `event_time`, as `describe` tells it (None: no condition after
    # all); any other has its own `check` and a cheap `precheck` (the module's docstring).
    event_time: str = ""
    describe: Callable[[StreamStats], str | None] | None = None
    precheck: PreCheck | None = None
    check: StreamCheck | None = None

    @property
    def per_stream(self) -> bool:
        """Whether it is a stream's condition: found stream by stream, with a pre-check."""
        return bool(self.event_time) or self.check is not None

    def may(self, st: StreamStats, live: bool, now: float) -> bool:
        """The pre-check: False only for a stream where `find` finds nothing."""
        if self.event_time:
            t: float = getattr(st, self.event_time)
            return t > 0 and now - t <= RECENT_S
        return self.precheck is not None and self.precheck(st, live, now)

    def find(self, s: StreamView, at: Around) -> Found:
        """The condition of this kind on the stream, (description, since), or None."""
        if not self.event_time:
            return None if self.check is None else self.check(s, at)
        st = s.stats
        t: float = getattr(st, self.event_time)
        if not (s.live and at.recent(t)) or self.describe is None:
            return None
        what = self.describe(st)
        return None if what is None else (f"{_name(st)}: {what}", t)

    @property
    def anchor(self) -> str:
        """The runbook section's anchor in docs/alerts.md (GitHub lowercases the heading)."""
        return self.alert.lower()

    def runbook(self, base: str = DEFAULT_RUNBOOK_URL) -> str:
        """The runbook link of this kind under `base` (the alerts.md URL)."""
        return f"{base}#{self.anchor}"


def labels(**kw: object) -> Labels:
    """Label pairs in the given order, values as strings."""
    return tuple((k, str(val)) for k, val in kw.items())


def began(c: Condition, active_since: float | None, first_seen: float = 0.0) -> Condition:
    """`c` with `since` = when it began: the earlier of when it was first active (None: new)
    and its own evidence; `first_seen` when neither is known (0 leaves it unknown)."""
    known = [t for t in (active_since, c.since) if t]
    since = min(known) if known else first_seen
    return c if since == c.since else replace(c, since=since)


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


def active(v: FleetView) -> list[Condition]:
    """Every active condition of the view, fleet-wide ones first, each with `since` = when it
    began (`v.began`: what the aggregator remembers)."""
    got = v.began.get
    return [began(c, got(c.key)) for c in _found(v)]


def may_have_condition(st: StreamStats, live: bool, now: float) -> bool:
    """Whether some row's pre-check holds for the stream (the per-second check's filter): the
    event kinds' in one read of their time fields (the latest is recent when any is), the
    others' one by one."""
    last = max(_EVENT_TIMES(st))
    if last > 0 and now - last <= RECENT_S:
        return True
    for pre in _PRECHECKS:  # noqa: SIM110 - any() over a generator costs ~1.5x per stream
        if pre(st, live, now):
            return True
    return False


def _found(v: FleetView) -> Iterable[Condition]:
    """The view's conditions in the table's order: each fleet row's finder, and at the first
    stream row every stream's conditions (stream by stream, its rows in the table's order)."""
    at: Around | None = None
    for k in _ROWS:
        if k.finds is not None:
            for where, what, since in k.finds(v):
                yield Condition(k.kind, k.severity, where, what, since)
        elif at is None:
            at = Around(v)
            yield from _streams(v, at)


def _streams(v: FleetView, at: Around) -> Iterable[Condition]:
    for s in v.streams:
        where: Labels | None = None
        for k in _PER_STREAM:
            found = k.find(s, at)
            if found is not None:
                where = where or _where(s)
                yield Condition(k.kind, k.severity, where, *found)


# --- found over the fleet's membership: each row's finder --------------------------------------
# A finder yields what it found, (labels, description, since) per condition (since 0: unknown);
# the table's loop makes each a condition of its row's kind.


def _collectors_down(v: FleetView) -> Iterable[Finding]:
    for c in v.collectors:
        if not c.up:
            yield (
                labels(collector=c.info.collector_id, node_rank=c.info.node_rank),
                f"collector {c.info.collector_id} ({c.info.hostname or '?'}) silent for "
                f"{c.age_s:.0f} s",
                c.snapshot.time,
            )


def _troubled(v: FleetView, state: str) -> Iterable[tuple[WorkerInfo, CollectorInfo, Labels]]:
    """Configured workers in `state` as a live collector reports them (docs/collector.md
    "Worker states"): one condition per worker and collector, not one per rank."""
    for w, info in v.workers:
        if w.state == state:
            yield (
                w,
                info,
                labels(
                    worker_id=w.worker_id, node_rank=info.node_rank, collector=info.collector_id
                ),
            )


def _undiscovered(v: FleetView) -> Iterable[Finding]:
    for w, info, where in _troubled(v, "undiscovered"):
        yield where, f"{w.worker_id} on {info.collector_id}: undiscovered: {w.reason}", w.since


def _mismatched(v: FleetView) -> Iterable[Finding]:
    for w, info, where in _troubled(v, MISMATCH):
        left = (
            f" (ranks {ranged(w.elsewhere)} are not watched here: the engine does not run them "
            "on this node)"
            if w.elsewhere
            else ""
        )
        yield where, f"{w.worker_id} on {info.collector_id}: {w.reason}{left}", w.since


def _sources_down(v: FleetView) -> Iterable[Finding]:
    """Scheduler sources a live collector cannot read."""
    for src, info in v.sources:
        # a failed scrape is retried at the next interval: down for DOWN_AFTER_S is an outage
        if src.state in SOURCE_DOWN and v.now - src.since >= DOWN_AFTER_S:
            yield (
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


def _uncovered(v: FleetView) -> Iterable[Finding]:
    """Ranks no live collector owns, with the collector that owned the rank last when that one
    is down: its labels tie the rank to that collector's collector_down (FOLLOWS, and the
    Alertmanager inhibition), and its last snapshot is when the rank lost its owner. A rank
    with no such collector counts after DOWN_AFTER_S without an owner, as a stream does: the
    collectors of a fleet that starts send their first snapshots a moment apart."""
    for (w, r), ids in sorted(v.owners.items()):
        if ids:
            continue
        last = v.last_owner.get((w, r))
        if last is None:
            where = labels(worker_id=w, dp_rank=r)
            since = v.uncovered_since.get((w, r), 0.0)
            if since and v.now - since < DOWN_AFTER_S and (UNCOVERED, where) not in v.began:
                continue
            yield where, f"{w} rank {r} is watched by no live collector", since
            continue
        i = last.info
        yield (
            labels(worker_id=w, dp_rank=r, node_rank=i.node_rank, collector=i.collector_id),
            f"{w} rank {r} is watched by no live collector: its collector {i.collector_id} "
            f"(node_rank {i.node_rank}) is down",
            last.snapshot.time,
        )


def _owned_twice(v: FleetView) -> Iterable[Finding]:
    for (w, r), ids in sorted(v.owners.items()):
        if len(ids) > 1:
            yield (
                labels(worker_id=w, dp_rank=r),
                f"{w} rank {r} is owned by {len(ids)} collectors: {', '.join(ids)}",
                0.0,
            )


def _leaders(v: FleetView) -> Iterable[Finding]:
    for w, ids in sorted(v.leaders.items()):
        if len(ids) > 1:
            yield (
                labels(worker_id=w),
                f"{w} has {len(ids)} scheduler-metrics leaders: {', '.join(ids)}",
                0.0,
            )


def _relays(v: FleetView) -> Iterable[Finding]:
    """relay_dropping: a live collector's relay that did not forward frames within RECENT_S,
    and why."""
    for c in v.collectors:
        if not c.up:
            continue
        for b in c.snapshot.binds:
            r = b.relay
            if r is None or not r.last_drop_time or v.now - r.last_drop_time > RECENT_S:
                continue
            drops = ", ".join(f"{k} {n}" for k, n in sorted(r.dropped.items()))
            yield (
                labels(collector=c.info.collector_id, worker_id=b.worker_id, dp_rank=b.dp_rank),
                f"{b.worker_id} rank {b.dp_rank}: frames not forwarded to {r.target} ({drops}); "
                f"relay {r.state}: {r.reason}",
                r.last_drop_time,
            )


def _drift(v: FleetView) -> Iterable[Finding]:
    """router_index_drift of a live collector's comparisons, except of ranks that are down
    (their index is not known now)."""
    down = {(s.stats.worker_id, s.stats.dp_rank) for s in v.streams if not s.up}
    for c in v.collectors:
        if not c.up:
            continue
        for d in c.snapshot.drift:
            if drifted(d) and (d.worker_id, d.dp_rank) not in down:
                yield (
                    labels(worker_id=d.worker_id, dp_rank=d.dp_rank, medium=d.medium),
                    f"{d.worker_id} rank {d.dp_rank} {d.medium}: the router's index holds "
                    f"{d.phantom} evicted blocks and lacks {d.missing} resident ones of "
                    f"{d.engine_blocks} ({d.method})",
                    d.at,
                )


def _checkpoints(v: FleetView) -> Iterable[Finding]:
    """Live collectors that cannot write their checkpoints (docs/reliability.md)."""
    for c in v.collectors:
        ck = c.snapshot.checkpoint
        if c.up and ck is not None and ck.state == "failing":
            yield (
                labels(collector=c.info.collector_id, node_rank=c.info.node_rank),
                f"collector {c.info.collector_id} cannot write its checkpoints ({ck.reason}): "
                f"{ck.detail}; a restart now resumes from older ones or none",
                ck.since,
            )


def _placement(v: FleetView) -> Iterable[Finding]:
    """placement_misses: a pool whose misses were resident on another of its ranks (a router
    that knew would have hit) more than PLACEMENT_SHARE of the time, judged on enough evidence
    (`_unjudged`); once active it holds until judged evidence shows the share under
    PLACEMENT_CLEAR, or the pool misses nothing in the window."""
    for name, p in v.misses.items():
        r = p.recent
        if r is None:
            continue
        where = labels(pool=name)
        share = r.share("placement")
        why_not = _unjudged(p, r)
        if (PLACEMENT, where) not in v.began:
            if not why_not and share is not None and share > PLACEMENT_SHARE:
                yield where, _placement_said(name, share, r.seconds), 0.0
            continue
        if share is None or (not why_not and share < PLACEMENT_CLEAR):
            continue  # nothing missed, or the share is down for good
        held = f"; not judged now ({why_not}), so it holds" if why_not else ""
        yield where, _placement_said(name, share, r.seconds) + held, 0.0


def _unjudged(p: PoolSplit, r: RecentSplit) -> str:
    """Why the pool's window is not enough evidence to judge its placement share ("": it is):
    the split trusted, PLACEMENT_MIN_MISSES missed blocks over PLACEMENT_MIN_S at least."""
    if not p.trusted:
        return f"the split is not trusted: {p.reason or ', '.join(p.reasons)}"
    if r.total_misses < PLACEMENT_MIN_MISSES:
        return f"{r.total_misses:,.0f} missed blocks in the window, under {PLACEMENT_MIN_MISSES:,}"
    if r.seconds < PLACEMENT_MIN_S:
        return f"{_span(r.seconds)} of misses, under {_span(PLACEMENT_MIN_S)}"
    return ""


def _placement_said(pool: str, share: float, seconds: float) -> str:
    return (
        f"pool {pool}: {100 * share:.1f}% of its misses in the last {_span(seconds)} were "
        "resident on another of its ranks (the router does not send requests where their "
        "prefix is cached)"
    )


def _near_full(v: FleetView) -> Iterable[Finding]:
    """cache_near_full: running requests hold more than NEAR_FULL of a rank's cache."""
    for sch, info in v.scheduler:
        if sch.token_usage_ratio is not None and sch.token_usage_ratio > NEAR_FULL:
            yield (
                labels(worker_id=sch.worker_id, node_rank=info.node_rank, dp_rank=sch.dp_rank),
                f"{sch.worker_id} rank {sch.dp_rank}: running requests hold "
                f"{100 * sch.token_usage_ratio:.0f}% of the KV cache",
                sch.updated,
            )


def _unexpected(v: FleetView) -> Iterable[Finding]:
    """unexpected_stream: KV events on a port past a worker's last rank."""
    for u, info in v.unexpected:
        if u.active:
            yield (
                labels(worker_id=u.worker_id, node_rank=info.node_rank, endpoint=u.endpoint),
                f"{u.worker_id}: KV events on {u.endpoint}, past the last rank (dp_size too "
                "small?)",
                0.0,
            )


def _span(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


# --- a stream's conditions: each a pre-check and a check -------------------------------------
# A check (or an event kind's `describe`) returns what it found, a description and since when;
# the table's loop makes it a condition of its row's kind, labelled with the stream. A pre-check
# reads only the stream's stats and is looser than its check: cheap, and plainly true wherever
# the check finds its condition. A stream of a silent collector has stream_down and nothing
# else: nothing newer is known.


def _where(s: StreamView) -> Labels:
    """A stream's labels: its rank, node and the collector that watches it (what ties a
    stream_down to its collector's collector_down: FOLLOWS)."""
    st = s.stats
    return labels(
        worker_id=st.worker_id,
        node_rank=s.collector.node_rank,
        dp_rank=st.dp_rank,
        collector=s.collector.collector_id,
    )


def _name(st: StreamStats) -> str:
    return f"{st.worker_id} rank {st.dp_rank}"


def _maybe_down(st: StreamStats, live: bool, now: float) -> bool:
    return not (live and st.up)


def _down_since(s: StreamView) -> float:
    """When a stream of a silent collector went down: with its collector (the collector's last
    snapshot, as collector_down says), unless it was down already then (a settled outage)."""
    st, lost = s.stats, s.collector_last_seen
    if not st.up and st.state != "starting" and 0 < st.state_since <= lost - DOWN_AFTER_S:
        return st.state_since
    return lost


def _down(s: StreamView, at: Around) -> Found:
    st = s.stats
    if not s.live:
        why = f"its collector {s.collector.collector_id} is silent"
        return f"{_name(st)} is down: {why}", _down_since(s)
    if st.up:
        return None
    # its first connect under way, or it just went (a restart): not down yet; a stream that
    # is down already stays down while its state changes (one outage, one start)
    settling = st.state == "starting" or at.now - st.state_since < DOWN_AFTER_S
    if settling and (STREAM_DOWN, _where(s)) not in at.began:
        return None
    why = f"{st.state or 'down'}: {st.reason}" if st.reason else st.state or "not connected"
    return f"{_name(st)} is down: {why}", st.state_since


def _maybe_duplicate(st: StreamStats, live: bool, now: float) -> bool:
    return st.duplicate_stream


def _duplicate(s: StreamView, at: Around) -> Found:
    st = s.stats
    if not (s.up and st.duplicate_stream):  # a down stream's flag is its last value
        return None
    # `last_duplicate_time` from older collectors
    since = st.duplicate_since or st.last_duplicate_time
    return f"{_name(st)}: two publishers (interleaved or mirrored)", since


def _maybe_incomplete(st: StreamStats, live: bool, now: float) -> bool:
    return not st.vouched


def _incomplete(s: StreamView, at: Around) -> Found:
    """The index has not vouched for its blocks, tokens and usage for `unvouched_warn_s`: they
    are not served (analysis/vouch.py), and kvobserve cannot see this rank's cache."""
    st = s.stats
    # during a replay its outcome is not known yet
    if not (s.up and not st.vouched and not st.replaying):
        return None
    since = st.vouched_since
    if at.now - since < at.unvouched_warn_s:
        return None
    why = st.incomplete_reason or st.vouch_reason or "joined mid-stream or lost batches"
    return (
        f"{_name(st)}: kvobserve cannot see this rank's cache for {(at.now - since) / 60:.0f} "
        f"min ({why}); its blocks and usage are not served, at least "
        f"{st.lower_tokens:,} tokens are resident",
        since,
    )


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {n}" for k, n in sorted(counts.items()))


# What each event kind says (the row's `describe`); its time field is in the table.


def _lost(st: StreamStats) -> str:
    return f"batches lost for good ({st.lost} in total, not recovered by replay)"


def _gap(st: StreamStats) -> str:
    told = (
        f"{st.gaps} in total: {st.missed} batches missed, {st.recovered} recovered, {st.lost} lost"
    )
    if st.missed and st.recovered == st.missed:  # what is lost is events_lost's (critical)
        return f"sequence gap, every missed batch recovered by replay ({told})"
    return f"sequence gap ({told})"


def _restarted(st: StreamStats) -> str:
    return f"publisher restarted ({st.restarts} in total); block index reset"


def _undecodable(st: StreamStats) -> str:
    return f"messages that do not decode, skipped ({_counts(st.decode_errors) or 'see counters'})"


def _mislabelled(st: StreamStats) -> str:
    return f"{st.rank_mismatch_batches} batches name another DP rank (port rule?)"


def _silent_loss(st: StreamStats) -> str | None:
    if not st.silent_loss:
        return None  # the time is set, the evidence is not (an older collector)
    return f"evidence of events lost without a sequence gap ({_counts(st.silent_loss)})"


def _maybe_thrash(st: StreamStats, live: bool, now: float) -> bool:
    return thrashing(st) is not None


def _thrash(s: StreamView, at: Around) -> Found:
    thrash = thrashing(s.stats) if s.live else None
    if thrash is None:
        return None
    restored, stored = thrash
    return (
        f"{_name(s.stats)}: {restored} of {stored} top-tier block stores restored a block "
        "evicted minutes before",
        0.0,
    )


def _maybe_stalled(st: StreamStats, live: bool, now: float) -> bool:
    return st.state in QUIET_STATES


def _stalled(s: StreamView, at: Around) -> Found:
    st = s.stats
    quiet_since = st.last_message_time or st.state_since
    if not (
        s.live
        and st.state in QUIET_STATES
        and quiet_since
        and at.now - quiet_since >= RECENT_S
        and at.running(st.worker_id, st.dp_rank) != 0  # not known to be idle
    ):
        return None
    return (
        f"{_name(st)}: connected, no batch for {(at.now - quiet_since) / 60:.0f} min "
        "and the rank is not known to be idle",
        quiet_since,
    )


# --- the table ----------------------------------------------------------------------------------
# In the order the API lists a severity's conditions: fleet-wide ones, then each stream's (its
# rows in this order, stream by stream), then unexpected streams and full caches.

_ROWS: Final = (
    Kind("collector_down", "KVObserveCollectorDown", "critical", "collector down",
         finds=_collectors_down),
    # configured parts that cannot be watched (docs/collector.md "Worker states")
    Kind("worker_undiscovered", "KVWorkerUndiscovered", "critical", "worker not discovered",
         cell="worker", finds=_undiscovered),
    Kind("layout_mismatch", "KVWorkerLayoutMismatch", "critical", "engine layout differs",
         cell="worker", finds=_mismatched),
    Kind("scheduler_source_down", "KVSchedulerSourceDown", "warning", "scheduler source down",
         cell="source", finds=_sources_down),
    Kind(UNCOVERED, "DPRankUncovered", "critical", "rank not watched",
         finds=_uncovered),
    Kind("dp_rank_multiple_owners", "DPRankMultipleOwners", "warning", "rank watched twice",
         finds=_owned_twice),
    Kind("multiple_scheduler_leaders", "MultipleSchedulerLeaders", "warning", "several leaders",
         finds=_leaders),
    Kind("relay_dropping", "KVRelayDropping", "warning", "relay dropping frames",
         finds=_relays),
    Kind("checkpoint_failing", "KVObserveCheckpointFailing", "warning", "checkpoints not written",
         finds=_checkpoints),
    Kind("router_index_drift", "KVRouterIndexDrift", "warning", "router index drifted",
         finds=_drift),
    Kind(PLACEMENT, "KVCachePlacementMisses", "info", "misses another rank held",
         cell="pool", finds=_placement),
    # a stream's conditions
    Kind(STREAM_DOWN, "KVEventStreamDown", "critical", "stream down",
         cell="state", precheck=_maybe_down, check=_down),
    Kind("duplicate_stream", "KVEventDuplicateStream", "warning", "two publishers",
         cell="dup", precheck=_maybe_duplicate, check=_duplicate),
    Kind("index_incomplete", "KVIndexIncomplete", "warning", "cache not seen whole",
         cell="index", precheck=_maybe_incomplete, check=_incomplete),
    Kind("events_lost", "KVEventsLost", "critical", "batches lost",
         cell="gaps", event_time="last_loss_time", describe=_lost),
    Kind("sequence_gap", "KVEventSequenceGap", "info", "sequence gap",
         cell="gaps", event_time="last_gap_time", describe=_gap),
    Kind("publisher_restarted", "KVEventPublisherRestarted", "info", "publisher restarted",
         cell="restarts", event_time="last_restart_time", describe=_restarted),
    Kind("decode_errors", "KVEventDecodeErrors", "warning", "undecodable messages",
         cell="errors", event_time="last_decode_error_time", describe=_undecodable),
    Kind("rank_mismatch", "KVEventRankMismatch", "warning", "wrong rank in batches",
         cell="errors", event_time="last_rank_mismatch_time", describe=_mislabelled),
    Kind("silent_loss", "KVEventSilentLoss", "warning", "events lost without a gap",
         event_time="last_silent_loss_time", describe=_silent_loss),
    Kind("cache_thrash", "KVCacheThrash", "warning", "evicted blocks stored again",
         precheck=_maybe_thrash, check=_thrash),
    Kind("stream_stalled", "KVEventStreamStalled", "warning", "stream stalled",
         cell="state", precheck=_maybe_stalled, check=_stalled),
    # the rest of the fleet
    Kind("unexpected_stream", "KVEventUnexpectedStream", "warning", "events past the last rank",
         finds=_unexpected),
    Kind("cache_near_full", "KVCacheNearFull", "warning", "running requests fill the cache",
         cell="sched", finds=_near_full),
)  # fmt: skip
KINDS: Final[dict[str, Kind]] = {k.kind: k for k in _ROWS}
BY_ALERT: Final[dict[str, Kind]] = {k.alert: k for k in _ROWS}
_PER_STREAM: Final = tuple(k for k in _ROWS if k.per_stream)
_EVENT_TIMES: Final = attrgetter(*(k.event_time for k in _PER_STREAM if k.event_time))
_PRECHECKS: Final = tuple(k.precheck for k in _PER_STREAM if k.precheck is not None)


# --- what follows from what -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Follows:
    """A condition of kind `then` follows from one of kind `cause` whose labels `on` are the
    same: one of the example Alertmanager config's inhibit_rules (source: the cause's alert,
    target: the consequence's, equal: `on` with `job` and `instance`, the aggregator that saw
    both)."""

    cause: str
    then: str
    on: tuple[str, ...]

    def key(self, c: Condition) -> tuple[str, ...]:
        """The values of `on` in `c`'s labels ("" where it has none, as Alertmanager compares)."""
        got = dict(c.labels)
        return tuple(got.get(name, "") for name in self.on)


FOLLOWS: Final = (
    # a lost collector (or node): its streams' stream_down, the ranks it owned last uncovered
    Follows("collector_down", STREAM_DOWN, ("collector",)),
    Follows("collector_down", UNCOVERED, ("collector",)),
    # batches lost for good: the gap they were missed in; a stream down: its index
    Follows("events_lost", "sequence_gap", ("worker_id", "node_rank", "dp_rank")),
    Follows(STREAM_DOWN, "index_incomplete", ("worker_id", "node_rank", "dp_rank")),
    # an index incomplete because batches were lost, or because a second publisher wrote into it
    Follows("events_lost", "index_incomplete", ("worker_id", "node_rank", "dp_rank")),
    Follows("duplicate_stream", "index_incomplete", ("worker_id", "node_rank", "dp_rank")),
    # a worker a collector cannot watch as configured: the ranks it leaves uncovered
    Follows("worker_undiscovered", UNCOVERED, ("worker_id",)),
    Follows("layout_mismatch", UNCOVERED, ("worker_id",)),
)


def _known(follows: tuple[Follows, ...]) -> dict[str, tuple[Follows, ...]]:
    """Each consequence's kind -> its rules, in order (ValueError at import for a kind that is
    not in the table)."""
    out: dict[str, list[Follows]] = {}
    for f in follows:
        for kind in (f.cause, f.then):
            if kind not in KINDS:
                raise ValueError(f"FOLLOWS: {kind!r} is not a condition kind")
        out.setdefault(f.then, []).append(f)
    return {k: tuple(v) for k, v in out.items()}


_FOLLOWING: Final = _known(FOLLOWS)
_CAUSING: Final = {f.cause: tuple(g for g in FOLLOWS if g.cause == f.cause) for f in FOLLOWS}


def grouped(conditions: list[Condition]) -> list[tuple[Condition, list[Condition]]]:
    """Each condition that follows from no other (FOLLOWS), in the given order, with those that
    follow from it listed under it, in the given order (one that follows from a consequence
    goes under that one's cause)."""
    causes: dict[tuple[Follows, tuple[str, ...]], int] = {}  # the first of each cause
    for i, c in enumerate(conditions):
        for f in _CAUSING.get(c.kind, ()):
            causes.setdefault((f, f.key(c)), i)
    cause_of: dict[int, int] = {}
    if causes:
        for i, c in enumerate(conditions):
            for f in _FOLLOWING.get(c.kind, ()):
                j = causes.get((f, f.key(c)))
                if j is not None:
                    cause_of[i] = j
                    break
    under: dict[int, list[Condition]] = {i: [] for i in range(len(conditions)) if i not in cause_of}
    for i in sorted(cause_of):
        root, seen = cause_of[i], {i}
        while root in cause_of and root not in seen:  # FOLLOWS has no cycle; this never loops
            seen.add(root)
            root = cause_of[root]
        under.setdefault(root, []).append(conditions[i])
    return [(conditions[i], under[i]) for i in sorted(under)]
