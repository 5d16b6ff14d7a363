"""The parts of a simulated engine's profile: what the simulator plays differently per engine.

The simulator is the other side of the wire: it keeps its own profiles, independent of
kvobserve's (kvobserve/engines/), and tests check that both name the same engines and versions
and the same event fields per version.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.core import Metric

from kvobserve.simulate.wire_format import WireFormat


@dataclass(frozen=True)
class RankLoad:
    """One rank's scheduler state now, as an engine's /metrics reports it."""

    rank: int
    running: int
    waiting: int
    held_tokens: int  # KV tokens the running requests hold
    hit_rate: float
    query_tokens: int  # prefix-cache lookups, cumulative
    hit_tokens: int
    batch_hit_rate: float = 0.0  # hit tokens / prompt tokens of the last prefill batch


@dataclass(frozen=True)
class NodeMetrics:
    """What one node's /metrics is made from."""

    fmt: WireFormat
    model_name: str
    capacity_tokens: int
    page_size: int
    ranks: list[RankLoad]
    # (prompt tokens, cached prompt tokens) of the whole worker, on the node serving its API
    api_totals: tuple[int, int] | None = None


@dataclass(frozen=True)
class SimEngine:
    """One engine as the simulator plays it."""

    name: str
    title: str
    formats: tuple[WireFormat, ...] = ()  # every version the simulator puts on the wire
    # without attention DP every rank's scheduler runs on node 0 (SGLang)
    pure_dp_on_leader: bool = False
    # What nodes >= 1 serve over HTTP: "stub" (the engine's dummy server, with follower_http:
    # SGLang) or "hybrid" (an API server of their own ranks with dp_lb hybrid: vLLM)
    followers: str = "hybrid"
    # an API server's /metrics reports every rank it manages, not only its node's (vLLM)
    reports_managed_ranks: bool = False
    kv_metrics: bool = False  # a KvMetrics PUSH per scheduler (SGLang)
    grpc: bool = False  # a gRPC mode whose /server_info lists each rank's source (SGLang)
    metrics: Callable[[NodeMetrics], list[Metric]] | None = None  # the engine's /metrics
    plane_versions: tuple[str, ...] = ()  # an event plane's versions (Dynamo: dynamo_encode.py)

    @property
    def versions(self) -> tuple[str, ...]:
        """The versions the simulator plays, oldest first."""
        return tuple(dict.fromkeys(f.release for f in self.formats)) or self.plane_versions
