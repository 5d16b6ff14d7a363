"""Checks of a `[[worker]]` with `engine = "dynamo"`: Dynamo's KV event plane as the source."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from kvobserve.config.model import ConfigError, WorkerConfig
from kvobserve.config.values import (
    at_least,
    check_choice,
    check_pair,
    check_url,
    check_zmq_endpoint,
)

EVENT_PLANES = ("nats", "zmq")
KEEP_RANKS = ("all", "node")
INDEXER_APIS = ("dump", "query")
# keys that only a Dynamo worker has, and the engine-stream keys a Dynamo worker does not take
DYNAMO_KEYS = frozenset(
    f.name for f in fields(WorkerConfig) if f.name.startswith(("event_plane", "drift_", "indexer_"))
) | {"namespace", "zmq_endpoints", "block_size", "keep_ranks"}
ENGINE_STREAM_KEYS = (
    "url",
    "kv_endpoint",
    "replay_endpoint",
    "topic",
    "metrics_url",
    "load_endpoint",
    "kv_metrics_endpoint",
    "fpm_endpoint",
    "probe_extra_ports",
    "dp_attention",
    "version",
    "bind",
    "relay_to",
    "relay_queue",
)


def reject_dynamo_keys(where: str, w: dict[str, Any], engine: str) -> None:
    """An SGLang/vLLM worker naming a Dynamo-only key is an error that says so."""
    for key in sorted(DYNAMO_KEYS & w.keys()):
        raise ConfigError(f"{where}.{key}: only for engine = 'dynamo' (this worker is {engine!r})")


def default_id(namespace: str | None) -> str:
    """The config id of a Dynamo plane when none is given; its streams are `{id}/{worker_id}`."""
    return f"dynamo-{namespace}" if namespace and namespace != "dynamo" else "dynamo"


def build_dynamo_worker(where: str, w: dict[str, Any], node_rank: int) -> WorkerConfig:
    """Validate one Dynamo `[[worker]]` table; every error names the field and the value."""
    for key in ENGINE_STREAM_KEYS:
        if key in w:
            raise ConfigError(
                f"{where}.{key}: does not apply to engine = 'dynamo' (got {w[key]!r}); "
                "Dynamo workers are found on the event plane"
            )
    plane = check_choice(w.get("event_plane", "nats"), EVENT_PLANES, f"{where}.event_plane")
    if plane == "nats":
        url = w.get("event_plane_url")
        if not url:
            raise ConfigError(f"{where}.event_plane_url: missing; the NATS server of Dynamo")
        for part in url.split(","):
            check_url(part.strip(), f"{where}.event_plane_url", ("nats", "tls"))
        if w.get("zmq_endpoints"):
            raise ConfigError(f"{where}.zmq_endpoints: only with event_plane = 'zmq'")
    else:
        eps = w.get("zmq_endpoints") or []
        if not eps:
            raise ConfigError(
                f"{where}.zmq_endpoints: missing; list the publishers' endpoints (Dynamo "
                "advertises them in its discovery store, v1/event_channels)"
            )
        for i, ep in enumerate(eps):
            check_zmq_endpoint(ep, f"{where}.zmq_endpoints[{i}]", ("tcp", "ipc"), wildcard_ok=False)
        if len(set(eps)) != len(eps):
            raise ConfigError(f"{where}.zmq_endpoints: an endpoint is listed twice in {eps!r}")
        for key in ("event_plane_url", "event_plane_creds", "event_plane_tls_ca"):
            if key in w:
                raise ConfigError(f"{where}.{key}: only with event_plane = 'nats'")
    check_pair(w, "event_plane_tls_cert", "event_plane_tls_key", where)
    ns = w.get("namespace")
    if ns is not None and not ns.strip():
        raise ConfigError(f"{where}.namespace: must not be empty, got {ns!r} (omit it for all)")
    for key, allowed in (("keep_ranks", KEEP_RANKS), ("indexer_api", INDEXER_APIS)):
        if key in w:
            check_choice(w[key], allowed, f"{where}.{key}")
    if w.get("keep_ranks") == "node" and not w.get("dp_size"):
        raise ConfigError(
            f"{where}.keep_ranks: 'node' needs dp_size (the ranks of one Dynamo worker) to know "
            "this node's share"
        )
    if "indexer_url" in w:
        check_url(w["indexer_url"], f"{where}.indexer_url")
    if "zmq_endpoints" in w:
        w["zmq_endpoints"] = tuple(w["zmq_endpoints"])
    w.setdefault("id", default_id(ns))
    w.setdefault("dp_size", None)  # learnt from the events unless given
    cfg = WorkerConfig(**{"leader": node_rank == 0, **w})
    if cfg.dp_size is not None:
        at_least(cfg.dp_size, 1, f"{where}.dp_size")
    at_least(cfg.block_size, 0, f"{where}.block_size")
    at_least(cfg.capacity_tokens, 0, f"{where}.capacity_tokens")
    at_least(cfg.drift_interval_s, 1, f"{where}.drift_interval_s")
    at_least(cfg.drift_lag_s, 0, f"{where}.drift_lag_s")
    if cfg.drift_lag_s * 2 >= cfg.drift_interval_s:
        raise ConfigError(
            f"{where}.drift_lag_s: {cfg.drift_lag_s} must be under half of drift_interval_s "
            f"({cfg.drift_interval_s}): one comparison waits it twice"
        )
    if not cfg.id.strip() or "/" in cfg.id:
        raise ConfigError(f"{where}.id: must be non-empty without '/', got {cfg.id!r}")
    return cfg
