"""NATS subjects of NVIDIA Dynamo's event plane: parse them and build kvobserve's subscriptions.

Every form below was seen on the wire (tests/fixtures/dynamo-captures) unless marked:
- endpoint scope (1.6.x): `namespace.{ns}.component.{comp}.endpoint.{ep}.{topic}`
- component scope (1.2.x KV events and FPM): `namespace.{ns}.component.{comp}.{topic}`
- namespace scope (1.2.x `kv_metrics`): `namespace.{ns}.{topic}`
- component scope `kv_events` with a JSON body (<= 2025 core NATS; documented, not captured)
- JetStream stream subjects with a JSON body (0.7.x `{stream}.queue`, 1.2.x `{stream}.kv-events`),
  `{stream}` = `namespace-{ns}-component-{comp}-kv-events`.
Segments are percent-encoded by Dynamo: bytes outside [A-Za-z0-9_-] become `%XX` (uppercase hex),
so a segment never contains a dot and the token count tells the scope apart.
"""

from __future__ import annotations

from typing import Literal

from msgspec import Struct

from kvobserve.wire.errors import WireError

KV_EVENTS_TOPIC = "kv-events"
KV_METRICS_TOPIC = "kv_metrics"
FPM_TOPIC = "forward-pass-metrics"
LEGACY_KV_EVENTS_TOPIC = "kv_events"  # <= 2025, JSON body
JETSTREAM_QUEUE_TOPIC = "queue"  # 0.7.x JetStream queue subject, JSON body
DEFAULT_TOPICS: tuple[str, ...] = (KV_EVENTS_TOPIC, KV_METRICS_TOPIC, FPM_TOPIC)

Scope = Literal["endpoint", "component", "namespace", "jetstream"]

_KEEP = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_HEX = frozenset("0123456789ABCDEFabcdef")
_STREAM_PREFIX, _STREAM_SUFFIX, _STREAM_SEP = "namespace-", "-kv-events", "-component-"


class Subject(Struct, frozen=True, gc=False):
    """A parsed event-plane subject; names are decoded (not percent-encoded)."""

    scope: Scope
    namespace: str
    topic: str
    component: str | None = None
    endpoint: str | None = None


def encode_segment(name: str) -> str:
    """Percent-encode one subject segment the way Dynamo does."""
    return "".join(chr(b) if b in _KEEP else f"%{b:02X}" for b in name.encode("utf-8"))


def decode_segment(segment: str) -> str:
    """Undo `encode_segment`; other characters are taken as they are."""
    if "%" not in segment:
        return segment
    out = bytearray()
    i, n = 0, len(segment)
    while i < n:
        c = segment[i]
        if c == "%":
            pair = segment[i + 1 : i + 3]
            if len(pair) != 2 or not _HEX.issuperset(pair):
                raise WireError("schema", f"subject segment {segment!r}: bad escape at {i}")
            out.append(int(pair, 16))
            i += 3
        else:
            out += c.encode("utf-8")
            i += 1
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError:
        raise WireError("schema", f"subject segment {segment!r}: not UTF-8") from None


def _stream_names(stream: str) -> tuple[str, str] | None:
    """(namespace, component) from a JetStream stream name, None unless it splits one way only."""
    if not (stream.startswith(_STREAM_PREFIX) and stream.endswith(_STREAM_SUFFIX)):
        return None
    inner = stream[len(_STREAM_PREFIX) : -len(_STREAM_SUFFIX)]
    if inner.count(_STREAM_SEP) != 1:
        return None
    ns, comp = inner.split(_STREAM_SEP)
    return (ns, comp) if ns and comp else None


def parse_subject(subject: str) -> Subject:
    """Parse an event-plane subject; WireError("schema") when it is none of the known forms."""
    t = subject.split(".")
    n = len(t)
    if n >= 3 and t[0] == "namespace":
        if n == 7 and t[2] == "component" and t[4] == "endpoint":
            d = decode_segment
            return Subject("endpoint", d(t[1]), d(t[6]), d(t[3]), d(t[5]))
        if n == 5 and t[2] == "component":
            return Subject(
                "component", decode_segment(t[1]), decode_segment(t[4]), decode_segment(t[3])
            )
        if n == 3:
            return Subject("namespace", decode_segment(t[1]), decode_segment(t[2]))
    elif n == 2 and t[1] in (KV_EVENTS_TOPIC, JETSTREAM_QUEUE_TOPIC):
        names = _stream_names(t[0])
        if names is not None:
            return Subject("jetstream", names[0], t[1], names[1])
    raise WireError("schema", f"not a Dynamo event-plane subject: {subject[:200]!r}")


def subject_for(namespace: str, component: str, endpoint: str, topic: str) -> str:
    """The endpoint-scoped subject a current Dynamo worker publishes `topic` on."""
    e = encode_segment
    return f"namespace.{e(namespace)}.component.{e(component)}.endpoint.{e(endpoint)}.{e(topic)}"


def subscription_subjects(
    namespace: str | None = None,
    topics: tuple[str, ...] = DEFAULT_TOPICS,
    *,
    legacy: bool = False,
    jetstream: bool = False,
) -> list[str]:
    """NATS subscriptions covering `topics` of one namespace (None: every namespace).

    `legacy` adds the 1.2.x component/namespace scopes and the <= 2025 `kv_events` subject.
    `jetstream` adds the JetStream-era `*.kv-events` and `*.queue` (any namespace: a stream name
    is one token, so it cannot be narrowed; parse_subject rejects subjects that are not Dynamo's).
    """
    ns = "*" if namespace is None else encode_segment(namespace)
    enc = [encode_segment(t) for t in topics]
    out = [f"namespace.{ns}.component.*.endpoint.*.{t}" for t in enc]
    if legacy:
        out += [f"namespace.{ns}.component.*.{t}" for t in enc]
        if KV_METRICS_TOPIC in topics:
            out.append(f"namespace.{ns}.{KV_METRICS_TOPIC}")
        if KV_EVENTS_TOPIC in topics:
            out.append(f"namespace.{ns}.component.*.{LEGACY_KV_EVENTS_TOPIC}")
    if jetstream and KV_EVENTS_TOPIC in topics:
        out += [f"*.{KV_EVENTS_TOPIC}", f"*.{JETSTREAM_QUEUE_TOPIC}"]
    return out
