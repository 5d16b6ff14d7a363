"""kvobserve's NATS names: subjects and the JetStream KV bucket (docs/nats.md)."""

from __future__ import annotations

import re

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def subject_token(value: str) -> str:
    """`value` as one NATS subject token (and KV key): anything but [A-Za-z0-9_-] becomes '_'."""
    return _UNSAFE.sub("_", value) or "_"


def snapshot_subject(cluster: str, collector_id: str) -> str:
    """The subject one collector publishes its snapshots on."""
    return f"kvobserve.v1.{subject_token(cluster)}.snapshot.{subject_token(collector_id)}"


def snapshot_wildcard(cluster: str) -> str:
    """Every collector's snapshots of a cluster."""
    return f"kvobserve.v1.{subject_token(cluster)}.snapshot.*"


def event_subject(cluster: str, kind: str) -> str:
    """The subject condition transitions of `kind` are published on."""
    return f"kvobserve.v1.{subject_token(cluster)}.event.{subject_token(kind)}"


def event_wildcard(cluster: str) -> str:
    """Every condition transition of a cluster."""
    return f"kvobserve.v1.{subject_token(cluster)}.event.*"


def kv_bucket(cluster: str) -> str:
    """The JetStream KV bucket holding the last snapshot per collector."""
    return f"kvobserve_snapshots_{subject_token(cluster)}"
