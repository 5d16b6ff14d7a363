"""What engines advertise about their KV-event publishers, parsed per version (no I/O).

SGLang `GET /server_info`: per-rank `kv_event_sources` (gRPC mode, 0.5.22+), else the `kv_events`
port bases (0.5.13+), else the raw `--kv-events-config` JSON string with the port rule of its
era. vLLM `GET /kv_event_sources` (0.31+): `{dp_rank: KVEventsConfig}` for the ranks one API
server manages; several servers' lists are merged. Hosts are kept as the engine's own: a wildcard
or loopback host becomes `*`, "the node that owns the rank" (analysis/layout.py `on_node`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvobserve.analysis.layout import (
    SGLANG_DP_RANK_SELECTION,
    endpoint_host,
    offset_endpoint,
    parse_version,
    publisher_rank,
)
from kvobserve.config import WILDCARD_HOSTS


class DiscoveryError(Exception):
    """Discovery failed; names the URL and the field (or `connection`, `status`, `body`)."""

    def __init__(self, url: str, field: str, detail: str) -> None:
        super().__init__(f"discovery {url}: {field}: {detail}")
        self.url, self.field, self.detail = url, field, detail

    @property
    def reason(self) -> str:
        """One line for a person: `connection refused at http://10.0.0.5:30000/server_info`."""
        plain = self.field in ("connection", "status")  # else the field of the answer
        return f"{'' if plain else self.field + ': '}{self.detail} at {self.url}"


@dataclass(frozen=True, slots=True)
class DiscoveredSource:
    """One DP rank's KV-event publisher; a `tcp://*:port` host is the rank's own node."""

    dp_rank: int
    endpoint: str
    replay_endpoint: str | None
    topic: str
    block_size: int | None


@dataclass(frozen=True, slots=True)
class DiscoveredEngine:
    """What an engine advertises; equal objects mean nothing moved."""

    engine: str
    url: str
    dp_size: int
    sources: tuple[DiscoveredSource, ...]
    block_size: int | None = None
    load_endpoint_base: str | None = None  # SGLang load PUB of rank 0; rank r = port + r
    load_topic: str | None = None
    version: str | None = None
    dp_attention: bool | None = None  # SGLang: attention DP (ranks split over the nodes)
    nnodes: int | None = None  # SGLang: nodes the engine runs on
    notes: tuple[str, ...] = ()
    node_rank: int | None = None  # SGLang: the node whose HTTP server answered (node 0's)


def advertised(endpoint: str) -> str:
    """A wildcard or loopback tcp host (the engine's own node) as `*`; anything else as given."""
    host = endpoint_host(endpoint)
    if host is None or not (host in WILDCARD_HOSTS or _is_loopback(host)):
        return endpoint
    return f"tcp://*:{endpoint.rpartition(':')[2]}"


def _is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: SGLang writes a bound wildcard as 127.0.0.1."""
    return host.startswith("127.") or host in ("::1", "localhost")


def _get(
    obj: dict[str, Any], key: str, typ: type, url: str, where: str, required: bool = True
) -> Any:
    """obj[key] of type `typ`, or a DiscoveryError naming `where.key`."""
    value = obj.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise DiscoveryError(url, f"{where}{key}", f"expected {typ.__name__}, got {value!r}")
    return value


def _version(body: dict[str, Any]) -> tuple[str | None, tuple[int, ...] | None]:
    text = body.get("version")
    if not isinstance(text, str):
        return None, None
    try:
        return text, parse_version(text)
    except ValueError:
        return text, None


def _layout(body: dict[str, Any], url: str) -> tuple[bool | None, int | None, int | None]:
    """(attention DP, nnodes, attn_dp_size) from the flat server args, where present."""
    attn = _get(body, "attn_dp_size", int, url, "", required=False)  # 0.5.22+
    flag = _get(body, "enable_dp_attention", bool, url, "", required=False)
    nnodes = _get(body, "nnodes", int, url, "", required=False)
    return (attn > 1 if attn is not None else flag), nnodes, attn


def parse_sglang_server_info(url: str, body: Any) -> DiscoveredEngine:
    """SGLang `/server_info`: `kv_event_sources` where listed, else `kv_events`, else the raw config."""
    if not isinstance(body, dict):
        raise DiscoveryError(url, "body", f"expected a JSON object, got {type(body).__name__}")
    version, vt = _version(body)
    dp_attention, nnodes, attn = _layout(body, url)
    kv, listed = body.get("kv_events"), body.get("kv_event_sources") or []
    if not isinstance(listed, list):
        raise DiscoveryError(url, "kv_event_sources", f"expected a list, got {listed!r}")
    by_rank: dict[int, DiscoveredSource] = {}
    for i, item in enumerate(listed):
        where = f"kv_event_sources[{i}]."
        if not isinstance(item, dict):
            raise DiscoveryError(url, where[:-1], f"expected an object, got {item!r}")
        rank = _get(item, "dp_rank", int, url, where)
        replay = _get(item, "replay_endpoint", str, url, where, required=False)
        by_rank[rank] = DiscoveredSource(
            rank,
            advertised(_get(item, "endpoint", str, url, where)),
            advertised(replay) if replay else None,
            _get(item, "topic", str, url, where, required=False) or "",
            _get(item, "block_size", int, url, where, required=False),
        )
    dp_size, block_size, load_base, load_topic = max(by_rank, default=-1) + 1, None, None, None
    notes: list[str] = []
    if kv is not None:
        if not isinstance(kv, dict):
            raise DiscoveryError(url, "kv_events", f"expected an object, got {kv!r}")
        w = "kv_events."
        n = _get(kv, "dp_size", int, url, w)  # 0.5.22+: num_dp_ranks, the publishers
        base = _get(kv, "endpoint_port_base", int, url, w)
        replay_base = _get(kv, "replay_endpoint_port_base", int, url, w, required=False)
        ehost = _get(kv, "endpoint_host", str, url, w)
        ehost = "*" if ehost.strip("[]") in WILDCARD_HOSTS or _is_loopback(ehost) else ehost
        topic = _get(kv, "topic", str, url, w, required=False) or ""
        block_size = _get(kv, "block_size", int, url, w, required=False)
        ranks = _publishers(n, dp_attention, vt, notes, assume=(0, 5, 16))
        dp_size = max(dp_size, ranks)
        for r in range(ranks):
            if r not in by_rank:
                replay = f"tcp://{ehost}:{replay_base + r}" if replay_base is not None else None
                by_rank[r] = DiscoveredSource(
                    r, f"tcp://{ehost}:{base + r}", replay, topic, block_size
                )
        load_port = _get(kv, "load_endpoint_port_base", int, url, w, required=False)
        if load_port is not None:
            load_base = f"tcp://{ehost}:{load_port}"
            load_topic = _get(kv, "load_topic", str, url, w, required=False) or "load"
    elif not by_rank:  # 0.5.12 and older: only the raw --kv-events-config string
        block_size = _get(body, "page_size", int, url, "", required=False)
        by_rank = _from_raw_config(url, body, dp_attention, attn, vt, block_size, notes)
        dp_size = len(by_rank)
    if dp_size < 1:
        raise DiscoveryError(url, "kv_events.dp_size", f"must be >= 1, got {dp_size}")
    sources = tuple(by_rank[r] for r in sorted(by_rank))
    return DiscoveredEngine(
        "sglang", url, dp_size, sources, block_size, load_base, load_topic, version,
        dp_attention, nnodes, tuple(notes), _get(body, "node_rank", int, url, "", required=False),
    )  # fmt: skip


def _publishers(
    n: int,
    dp_attention: bool | None,
    vt: tuple[int, ...] | None,
    notes: list[str],
    assume: tuple[int, ...],
) -> int:
    """Publishers of `n` DP ranks: one under pure DP before SGLang 0.5.16 (all on rank 0's port)."""
    dpa = bool(dp_attention)  # rank 1's scheduler: attn_dp_rank 1 under attention DP, else 0
    if n < 2 or publisher_rank("sglang", vt or assume, dpa, int(dpa), 1) != 0:
        return n
    notes.append(
        f"SGLang {'.'.join(map(str, vt or assume))} pure DP: all {n} schedulers publish on rank "
        f"0's port (before {'.'.join(map(str, SGLANG_DP_RANK_SELECTION))}); only one binds it"
    )
    return 1


def _from_raw_config(
    url: str,
    body: dict[str, Any],
    dp_attention: bool | None,
    attn: int | None,
    vt: tuple[int, ...] | None,
    block_size: int | None,
    notes: list[str],
) -> dict[int, DiscoveredSource]:
    """The raw `kv_events_config` JSON string with top-level `dp_size` (SGLang <= 0.5.12)."""
    raw = body.get("kv_events_config")
    cfg = None
    if isinstance(raw, str) and raw.strip() not in ("", "null"):
        try:
            cfg = json.loads(raw)
        except ValueError as exc:
            raise DiscoveryError(url, "kv_events_config", f"not JSON ({exc})") from None
    elif raw is not None and not isinstance(raw, str):
        raise DiscoveryError(url, "kv_events_config", f"expected a JSON string, got {raw!r}")
    if cfg is None:
        raise DiscoveryError(url, "kv_events", "null: the engine runs without --kv-events-config")
    if not isinstance(cfg, dict):
        raise DiscoveryError(url, "kv_events_config", f"expected a JSON object, got {cfg!r}")
    w = "kv_events_config."
    publisher = _get(cfg, "publisher", str, url, w, required=False) or "null"
    if publisher != "zmq":
        raise DiscoveryError(url, f"{w}publisher", f"{publisher!r}: no ZMQ publisher")
    endpoint = _get(cfg, "endpoint", str, url, w, required=False) or "tcp://*:5557"
    replay = _get(cfg, "replay_endpoint", str, url, w, required=False)
    topic = _get(cfg, "topic", str, url, w, required=False) or ""
    dp = _get(body, "dp_size", int, url, "", required=False) or 1
    ranks = _publishers(dp * (attn or 1), dp_attention, vt, notes, assume=(0, 5, 12))
    out: dict[int, DiscoveredSource] = {}
    for r in range(ranks):
        try:
            ep = advertised(offset_endpoint(endpoint, r, "sglang"))
            rp = advertised(offset_endpoint(replay, r, "sglang")) if replay else None
        except ValueError as exc:
            raise DiscoveryError(url, f"{w}endpoint", str(exc)) from None
        out[r] = DiscoveredSource(r, ep, rp, topic, block_size)
    return out


def parse_vllm_kv_event_sources(url: str, body: Any) -> DiscoveredEngine:
    """vLLM `/kv_event_sources`: `{dp_rank: KVEventsConfig}` for the ranks this server manages."""
    if not isinstance(body, dict) or not body:
        raise DiscoveryError(
            url, "body", f"expected a non-empty object {{dp_rank: config}}, got {body!r}"
        )
    sources: list[DiscoveredSource] = []
    for key, cfg in body.items():
        if not str(key).isdigit():
            raise DiscoveryError(url, f"[{key!r}]", "key is not a DP rank")
        where = f"[{key}]."
        if not isinstance(cfg, dict):
            raise DiscoveryError(url, where[:-1], f"expected an object, got {cfg!r}")
        if cfg.get("enable_kv_cache_events") is False or cfg.get("publisher") == "null":
            continue
        replay = _get(cfg, "replay_endpoint", str, url, where, required=False)
        sources.append(
            DiscoveredSource(
                int(key),
                advertised(_get(cfg, "endpoint", str, url, where)),
                advertised(replay) if replay else None,
                _get(cfg, "topic", str, url, where, required=False) or "",
                None,
            )
        )
    if not sources:
        raise DiscoveryError(url, "enable_kv_cache_events", "no DP rank publishes KV events")
    sources.sort(key=lambda s: s.dp_rank)
    return DiscoveredEngine("vllm", url, sources[-1].dp_rank + 1, tuple(sources))


def vllm_block_sizes(text: str) -> dict[int, int]:
    """`vllm:cache_config_info{block_size, engine}` of an API server's /metrics: rank -> size."""
    out: dict[int, int] = {}
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name != "vllm:cache_config_info":
                    continue
                size, rank = s.labels.get("block_size", ""), s.labels.get("engine", "0")
                if size.isdigit() and rank.isdigit():
                    out[int(rank)] = int(size)
    except Exception:  # the parser raises several types; the block size is optional
        return {}
    return out


def with_block_sizes(found: DiscoveredEngine, sizes: dict[int, int]) -> DiscoveredEngine:
    """vLLM sources with the block size each engine reports (none reported: unchanged)."""
    if not sizes:
        return found
    sources = tuple(
        DiscoveredSource(
            s.dp_rank, s.endpoint, s.replay_endpoint, s.topic, sizes.get(s.dp_rank, s.block_size)
        )
        for s in found.sources
    )
    common = set(sizes.values())
    block = common.pop() if len(common) == 1 else found.block_size
    return DiscoveredEngine(found.engine, found.url, found.dp_size, sources, block)


def merge(found: list[DiscoveredEngine]) -> DiscoveredEngine:
    """Several vLLM API servers' partial lists as one engine; every rank must be listed."""
    first = found[0]
    if len(found) == 1:
        return first
    by_rank: dict[int, DiscoveredSource] = {}
    for f in found:
        for s in f.sources:
            by_rank.setdefault(s.dp_rank, s)  # a rank listed twice: the first server's
    dp_size = max(by_rank) + 1
    urls = ", ".join(f.url for f in found)
    missing = [r for r in range(dp_size) if r not in by_rank]
    if missing:
        raise DiscoveryError(urls, "dp_rank", f"ranks {missing} are listed by none of the servers")
    sizes = {f.block_size for f in found if f.block_size is not None}
    block = sizes.pop() if len(sizes) == 1 else None
    sources = tuple(by_rank[r] for r in range(dp_size))
    return DiscoveredEngine(first.engine, urls, dp_size, sources, block)
