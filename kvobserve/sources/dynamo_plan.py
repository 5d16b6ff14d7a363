"""What a collector subscribes to for one Dynamo event plane; opens no socket (`kvobserve check`).

A `[[worker]]` with `engine = "dynamo"` is a Dynamo deployment (a namespace), not one engine: its
workers appear on the plane as their events arrive. Each Dynamo worker becomes a kvobserve
worker `{id}/{dynamo worker_id}` with one stream per dp_rank. Ownership: with `keep_ranks =
"all"` this collector keeps every rank it receives (one collector per namespace on NATS; on ZMQ
each node lists its own node's publishers), with `"node"` only its node's contiguous share of
`dp_size` (every node's collector subscribes to the whole namespace and drops the rest).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from kvobserve.config import CollectorConfig, WorkerConfig
from kvobserve.wire.dynamo_subject import DEFAULT_TOPICS, subscription_subjects


def redact(url: str) -> str:
    """A URL (or comma-separated list) without user info: safe to print and to export."""
    out = []
    for part in url.split(","):
        p = urlsplit(part.strip())
        host = p.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = f"{host}:{p.port}" if p.port else host
        out.append(urlunsplit((p.scheme, netloc, p.path, p.query, p.fragment)))
    return ",".join(out)


def node_share(dp_size: int, node_rank: int, nnodes: int) -> range:
    """Node `node_rank`'s contiguous ranks of `dp_size` (the first nodes take one more if uneven)."""
    per, extra = divmod(dp_size, nnodes)
    start = node_rank * per + min(node_rank, extra)
    return range(start, start + per + (1 if node_rank < extra else 0))


@dataclass(frozen=True, slots=True)
class DynamoPlan:
    """One Dynamo plane on this node."""

    index: int  # the [[worker]] index
    worker: WorkerConfig
    event_plane: str  # nats | zmq
    url: str  # NATS URL as configured (may carry credentials: never print it, use `shown`)
    subjects: tuple[str, ...]  # NATS subscriptions
    endpoints: tuple[str, ...]  # ZMQ SUB endpoints (subscription: every topic)
    owned: range | None  # keep_ranks = "node": the ranks kept; None: every rank received
    notes: tuple[str, ...] = ()

    @property
    def shown(self) -> str:
        """Where events come from, without credentials."""
        return redact(self.url) if self.event_plane == "nats" else ",".join(self.endpoints)

    def keeps(self, dp_rank: int) -> bool:
        """Whether this collector keeps events of `dp_rank`."""
        return self.owned is None or dp_rank in self.owned

    def label(self, dynamo_worker_id: int | str) -> str:
        """The kvobserve `worker_id` of one Dynamo worker."""
        return f"{self.worker.id}/{dynamo_worker_id}"


def plan_dynamo(i: int, w: WorkerConfig, node: CollectorConfig) -> DynamoPlan:
    """The plan of Dynamo worker entry `i` on this node (the config is already validated)."""
    notes: list[str] = []
    owned = None
    if w.keep_ranks == "node":
        owned = node_share(w.dp_size or 1, node.node_rank, node.nnodes)
        notes.append(
            f"keeps dp_ranks {owned.start}-{owned.stop - 1} of every Dynamo worker "
            f"(node {node.node_rank} of {node.nnodes}, dp_size {w.dp_size}); drops the rest"
        )
    if not w.block_size:
        notes.append("block_size unknown: blocks are exact, resident tokens stay 0")
    if w.event_plane == "nats":
        subjects = tuple(subscription_subjects(w.namespace, DEFAULT_TOPICS, legacy=True))
        return DynamoPlan(i, w, "nats", w.event_plane_url or "", subjects, (), owned, tuple(notes))
    notes.append("ZMQ direct: endpoints as configured (Dynamo advertises them in its discovery)")
    return DynamoPlan(i, w, "zmq", "", (), w.zmq_endpoints, owned, tuple(notes))
