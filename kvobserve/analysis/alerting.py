"""The one table of conditions and their Prometheus alerts: name, severity and runbook anchor.

A condition is what the aggregator shows now (status page, /api/v1/alerts, `kvobserve status`);
its alert is the rule of the same meaning in alerts/kvobserve-rules.yml, which fires after its
`for:` and is routed by Alertmanager. Both carry the severity written here; a test holds the rule
file's `severity` labels and the docs/alerts.md sections to this table. To add an alert: add a
row here, the rule to the YAML file and a section to docs/alerts.md (and, when the aggregator can
see it, yield the condition in analysis/conditions.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from kvobserve.config.model import HttpConfig

SEVERITIES: Final = ("critical", "warning", "info")  # most severe first
RECENT_S: Final = 900.0  # event conditions hold this long after the event, like increase([15m])
DEFAULT_RUNBOOK_URL: Final = HttpConfig().runbook_url  # [http] runbook_url


@dataclass(frozen=True, slots=True)
class Kind:
    """One condition kind and the alert it shares its name, severity and runbook with."""

    kind: str  # the condition, as on the page and in the API (snake_case)
    alert: str  # the Prometheus alert name (CamelCase)
    severity: str  # critical pages, warning goes to chat, info is for dashboards
    title: str  # a few words for the page

    @property
    def anchor(self) -> str:
        """The runbook section's anchor in docs/alerts.md (GitHub lowercases the heading)."""
        return self.alert.lower()

    def runbook(self, base: str = DEFAULT_RUNBOOK_URL) -> str:
        """The runbook link of this kind under `base` (the alerts.md URL)."""
        return f"{base}#{self.anchor}"


_ROWS: Final = (
    Kind("stream_down", "KVEventStreamDown", "critical", "stream down"),
    Kind("events_lost", "KVEventsLost", "critical", "batches lost"),
    Kind("sequence_gap", "KVEventSequenceGap", "warning", "sequence gap"),
    Kind("duplicate_stream", "KVEventDuplicateStream", "warning", "two publishers"),
    Kind("rank_mismatch", "KVEventRankMismatch", "warning", "wrong rank in batches"),
    Kind("unexpected_stream", "KVEventUnexpectedStream", "warning", "events past the last rank"),
    Kind("publisher_restarted", "KVEventPublisherRestarted", "info", "publisher restarted"),
    Kind("stream_stalled", "KVEventStreamStalled", "warning", "stream stalled"),
    Kind("decode_errors", "KVEventDecodeErrors", "warning", "undecodable messages"),
    Kind("cache_near_full", "KVCacheNearFull", "warning", "running requests fill the cache"),
    Kind("index_incomplete", "KVIndexIncomplete", "info", "block index incomplete"),
    Kind("dp_rank_uncovered", "DPRankUncovered", "critical", "rank not watched"),
    Kind("dp_rank_multiple_owners", "DPRankMultipleOwners", "warning", "rank watched twice"),
    Kind("multiple_scheduler_leaders", "MultipleSchedulerLeaders", "warning", "several leaders"),
    Kind("collector_down", "KVObserveCollectorDown", "critical", "collector down"),
    Kind("silent_loss", "KVEventSilentLoss", "warning", "events lost without a gap"),
    Kind("cache_thrash", "KVCacheThrash", "warning", "evicted blocks stored again"),
    Kind("router_index_drift", "KVRouterIndexDrift", "warning", "router index drifted"),
    # configured parts that cannot be watched (docs/collector.md "Worker states")
    Kind("worker_undiscovered", "KVWorkerUndiscovered", "critical", "worker not discovered"),
    Kind("layout_mismatch", "KVWorkerLayoutMismatch", "critical", "engine layout differs"),
    Kind("scheduler_source_down", "KVSchedulerSourceDown", "warning", "scheduler source down"),
    Kind("relay_dropping", "KVRelayDropping", "warning", "relay dropping frames"),
)
KINDS: Final[dict[str, Kind]] = {k.kind: k for k in _ROWS}
BY_ALERT: Final[dict[str, Kind]] = {k.alert: k for k in _ROWS}


def severity_rank(severity: str) -> int:
    """0 for critical, 1 warning, 2 info (sort key; unknown last)."""
    return SEVERITIES.index(severity) if severity in SEVERITIES else len(SEVERITIES)
