"""kvobserve.toml + KVOBSERVE_* env + flags -> frozen config objects; errors name field and value.

Precedence: defaults < file < KVOBSERVE_<SECTION>_<KEY> env (acts as the flag) < flags.
"""

from __future__ import annotations

import argparse
import re
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit


class ConfigError(ValueError):
    """A bad configuration value; the message names the field and the value (one line)."""


@dataclass(frozen=True, slots=True)
class CollectorConfig:
    """This node's collector."""

    id: str
    node_rank: int = 0
    nnodes: int = 1
    interval_s: float = 1.0
    listen: str = "127.0.0.1:9478"


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One engine deployment (all its DP ranks); `dp_size` None = take it from discovery."""

    id: str
    engine: str
    url: str | None = None
    kv_endpoint: str | None = None
    replay_endpoint: str | None = None
    topic: str = ""
    dp_size: int | None = 1
    dp_attention: bool = False
    metrics_url: str | None = None
    leader: bool = True
    capacity_tokens: int = 0
    probe_extra_ports: int = 1
    load_endpoint: str | None = None
    kv_metrics_endpoint: str | None = None
    fpm_endpoint: str | None = None
    allow_pickle: bool = False
    passthrough_engine_metrics: bool = False
    version: str | None = None


@dataclass(frozen=True, slots=True)
class NatsConfig:
    """NATS connection and auth; used by `collect` (publish) and `aggregate` (subscribe)."""

    url: str
    user: str | None = None
    password: str | None = field(default=None, repr=False)  # secrets stay out of logs
    token: str | None = field(default=None, repr=False)
    creds: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    jetstream_kv: bool = False
    connect_timeout_s: float = 5.0


@dataclass(frozen=True, slots=True)
class AggregatorConfig:
    """The fleet aggregator; `nats` None = embedded (in-process bus)."""

    listen: str = "127.0.0.1:9477"
    nats: NatsConfig | None = None
    stale_intervals: int = 3
    otlp_endpoint: str | None = None


@dataclass(frozen=True, slots=True)
class Config:
    """Everything one kvobserve process needs; `nats` is the same object as `aggregator.nats`."""

    cluster: str
    collector: CollectorConfig
    workers: tuple[WorkerConfig, ...]
    aggregator: AggregatorConfig
    nats: NatsConfig | None = None
    path: str | None = None


def _spec(cls: type) -> dict[str, type]:
    """Key -> value type, read from a config dataclass (`int | None` -> int)."""
    names = {"bool": bool, "int": int, "float": float}
    return {f.name: names.get(str(f.type).split(" ")[0], str) for f in fields(cls)}


_TOP: dict[str, type] = {"cluster": str}
_SECTIONS: dict[str, dict[str, type]] = {
    "collector": _spec(CollectorConfig),
    "worker": _spec(WorkerConfig),
    "aggregator": {**_spec(AggregatorConfig), "nats": str},  # the URL shorthand
    "nats": _spec(NatsConfig),
}
# Flag names that are not simply --<key-with-dashes>; None = file/env only.
_FLAG_NAMES: dict[str, str | None] = {
    "collector.id": "--collector-id",
    "collector.interval_s": "--interval",
    "collector.listen": "--collector-listen",
    "worker.id": "--worker-id",
    "worker.url": "--engine-url",
    "worker.version": "--engine-version",
    "aggregator.listen": "--aggregator-listen",
    "aggregator.nats": None,
    "nats.url": "--nats",
    "nats.jetstream_kv": "--jetstream-kv",
    "nats.connect_timeout_s": "--nats-connect-timeout",
}
# Worker keys that a flag/env var sets on every worker; the others need at most one worker.
_ALL_WORKERS = frozenset({"allow_pickle", "passthrough_engine_metrics"})
_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", ""})  # bind-all: meaningless to connect to
_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def _flag(dotted: str) -> str | None:
    """The command-line flag of a setting."""
    if dotted in _FLAG_NAMES:
        return _FLAG_NAMES[dotted]
    section, _, key = dotted.rpartition(".")
    return "--" + (f"nats-{key}" if section == "nats" else key).replace("_", "-")


def add_config_flags(parser: argparse.ArgumentParser, *, require_config: bool = False) -> None:
    """Add `-c` and every config flag; all default to None so unset flags are told apart."""
    parser.add_argument("-c", "--config", metavar="FILE", required=require_config)
    g = parser.add_argument_group("configuration (flags > KVOBSERVE_* env > file > defaults)")
    for section, table in [("", _TOP), *_SECTIONS.items()]:
        for key, typ in table.items():
            dotted = f"{section}.{key}" if section else key
            flag = _flag(dotted)
            if flag is None:
                continue
            kw: dict[str, Any] = {
                "dest": "cfg__" + dotted.replace(".", "__"),
                "default": None,
                "help": f"[{dotted}]",
            }
            if typ is bool:
                g.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            else:
                g.add_argument(flag, type=str, metavar=key.upper(), **kw)


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The config flags that were given, as {"section.key": value}."""
    return {
        name[5:].replace("__", "."): value
        for name, value in vars(args).items()
        if name.startswith("cfg__") and value is not None
    }


def split_host_port(text: str) -> tuple[str, str]:
    """'host:port' or '[v6]:port' -> (host, port) without brackets; ('', '') when malformed."""
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        return (host, port) if sep else ("", "")
    host, sep, port = text.rpartition(":")
    return (host, port) if sep and ":" not in host else ("", "")


def _check_type(value: Any, typ: type, field: str) -> Any:
    """A value of the declared type (an int is accepted as float; a bool is not an int)."""
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{field}: expected {typ.__name__}, got {value!r}")
    return value


def _convert(value: Any, typ: type, field: str) -> Any:
    """A flag or env string converted to `typ`; non-strings are only type-checked."""
    if not isinstance(value, str) or typ is str:
        return _check_type(value, typ, field)
    text = value.strip().lower()
    try:
        return _BOOLS[text] if typ is bool else typ(text)
    except (KeyError, ValueError):
        raise ConfigError(f"{field}: expected {typ.__name__}, got {value!r}") from None


def _at_least(value: Any, low: int, field: str, *, strict: bool = False) -> Any:
    """`value` when >= low (> low when strict)."""
    if value < low or (strict and value == low):
        raise ConfigError(f"{field}: must be {'>' if strict else '>='} {low}, got {value!r}")
    return value


def _host_port(value: str, field: str, shown: str = "") -> str:
    """A listen address 'host:port' ('[::1]:9477' for IPv6); returns the host."""
    host, port = split_host_port(value)
    if not host or not (port.isdigit() and int(port) <= 65535):
        raise ConfigError(f"{field}: expected {shown}host:port, got {shown + value!r}")
    return host


def _url(value: str, field: str, schemes: tuple[str, ...] = ("http", "https")) -> str:
    """A URL of one of `schemes` with a host (and a numeric port, if any)."""
    try:
        parts = urlsplit(value)
        _ = parts.port  # raises on a non-numeric or out-of-range port
    except ValueError:
        parts = urlsplit("")
    if parts.scheme not in schemes or not parts.hostname:
        raise ConfigError(f"{field}: expected {schemes[0]}://host[:port], got {value!r}")
    return value


def _zmq_endpoint(value: str, field: str, schemes: tuple[str, ...], *, bind: bool) -> str:
    """A ZMQ endpoint of one of `schemes`; tcp needs host:port (a wildcard only where we bind)."""
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in schemes:
        want = " or ".join(f"{s}://" for s in schemes)
        raise ConfigError(f"{field}: expected a {want} endpoint, got {value!r}")
    if scheme != "tcp" and not rest:
        raise ConfigError(f"{field}: empty {scheme} address in {value!r}")
    if scheme == "tcp" and _host_port(rest, field, "tcp://") in WILDCARD_HOSTS and not bind:
        raise ConfigError(f"{field}: wildcard host in {value!r}; give the engine's address")
    return value


def _subject_token(value: str, field: str) -> str:
    """Used in NATS subjects: letters, digits, '-' and '_' only."""
    if not _TOKEN.match(value):
        raise ConfigError(f"{field}: only letters, digits, '-' and '_' allowed, got {value!r}")
    return value


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """KVOBSERVE_<SECTION>_<KEY> and KVOBSERVE_CLUSTER as override keys; typos are errors."""
    out: dict[str, Any] = {}
    for name, value in env.items():
        rest = name[len("KVOBSERVE_") :].lower() if name.startswith("KVOBSERVE_") else ""
        section, _, key = rest.partition("_")
        if rest == "cluster":
            out["cluster"] = value
        elif section in _SECTIONS:  # other KVOBSERVE_* names belong to other parts
            if key not in _SECTIONS[section]:
                raise ConfigError(f"{name}: unknown key {key!r} in [{section}] (value {value!r})")
            out[f"{section}.{key}"] = value
    return out


def _table(table: Any, spec: Mapping[str, type], where: str) -> dict[str, Any]:
    """A table holding only keys of `spec`, each of its type."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table, got {table!r}")
    for key, value in table.items():
        if key not in spec:
            raise ConfigError(f"{where}.{key}: unknown key (value {value!r})")
    return {k: _check_type(v, spec[k], f"{where}.{k}") for k, v in table.items()}


def _apply_overrides(raw: dict[str, Any], overrides: Mapping[str, Any], origin: str) -> None:
    """Merge env or flag settings into the raw file dict, converting strings by type."""
    for dotted, value in overrides.items():
        section, _, key = dotted.rpartition(".")
        spec = _SECTIONS.get(section, {}) if section else _TOP
        if key not in spec:
            raise ConfigError(f"{origin} {dotted}: unknown setting (value {value!r})")
        name = "KVOBSERVE_" + dotted.replace(".", "_").upper() if origin == "env" else _flag(dotted)
        label = f"{name} ({dotted})"
        conv = _convert(value, spec[key], label)
        if section == "aggregator" and key == "nats":
            section, key = "nats", "url"
        if section == "worker":
            targets = raw.setdefault("worker", [])
            if isinstance(targets, list) and not targets and key not in _ALL_WORKERS:
                targets.append({})  # flags alone can describe a single worker
            if isinstance(targets, list) and len(targets) > 1 and key not in _ALL_WORKERS:
                raise ConfigError(
                    f"{label}: {value!r} needs one worker, the file has {len(targets)}"
                )
        else:
            targets = [raw.setdefault(section, {}) if section else raw]
        for t in targets if isinstance(targets, list) else [targets]:
            if not isinstance(t, dict):
                raise ConfigError(f"{section}: expected a table, got {t!r}")
            t[key] = conv


def _build_collector(raw: Any) -> CollectorConfig:
    """Validate [collector]."""
    c = _table(raw, _SECTIONS["collector"], "collector")
    host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname().split(".")[0])
    cid = _subject_token(c.get("id", host or "collector"), "collector.id")
    nnodes = _at_least(c.get("nnodes", 1), 1, "collector.nnodes")
    rank = _at_least(c.get("node_rank", 0), 0, "collector.node_rank")
    if rank >= nnodes:
        raise ConfigError(f"collector.node_rank: {rank} must be < collector.nnodes ({nnodes})")
    interval = _at_least(c.get("interval_s", 1.0), 0, "collector.interval_s", strict=True)
    listen = c.get("listen", "127.0.0.1:9478")
    _host_port(listen, "collector.listen")
    return CollectorConfig(cid, rank, nnodes, interval, listen)


def _build_worker(i: int, raw: Any, node_rank: int) -> WorkerConfig:
    """Validate one [[worker]] table."""
    where = f"worker[{i}]"
    w = _table(raw, _SECTIONS["worker"], where)
    engine = w.get("engine")
    if engine not in ("sglang", "vllm"):
        raise ConfigError(f"{where}.engine: must be 'sglang' or 'vllm', got {engine!r}")
    for key in ("url", "metrics_url"):
        if key in w:
            _url(w[key], f"{where}.{key}")
    url, kv = w.get("url"), w.get("kv_endpoint")
    if kv is None and url is None:
        raise ConfigError(f"{where}: needs kv_endpoint or url (discovery), has neither")
    for key, schemes, bind in (
        ("kv_endpoint", ("tcp", "ipc", "inproc"), False),
        ("replay_endpoint", ("tcp", "ipc", "inproc"), False),
        ("load_endpoint", ("tcp",), False),
        ("kv_metrics_endpoint", ("tcp", "ipc"), True),  # we bind the PULL the engine pushes to
        ("fpm_endpoint", ("tcp", "ipc"), False),
    ):
        if key in w:
            _zmq_endpoint(w[key], f"{where}.{key}", schemes, bind=bind)
    w["dp_size"] = _at_least(w["dp_size"], 1, f"{where}.dp_size") if "dp_size" in w else None
    if w["dp_size"] is None and url is None:
        w["dp_size"] = 1
    _at_least(w.get("capacity_tokens", 0), 0, f"{where}.capacity_tokens")
    _at_least(w.get("probe_extra_ports", 1), 0, f"{where}.probe_extra_ports")
    if "id" not in w:  # engine@host:port: the same on every node that watches this worker
        w["id"] = f"{engine}@{(url or kv or '').partition('://')[2].split('/')[0]}"
    if not w["id"].strip():
        raise ConfigError(f"{where}.id: must not be empty, got {w['id']!r}")
    return WorkerConfig(**{"leader": node_rank == 0, **w})


def _build_nats(raw: dict[str, Any]) -> NatsConfig | None:
    """Validate [nats] and the `[aggregator] nats = URL` shorthand."""
    n = _table(raw.get("nats", {}), _SECTIONS["nats"], "nats")
    agg = raw.get("aggregator")
    if isinstance(agg, dict) and "nats" in agg and "url" not in n:
        n["url"] = agg["nats"]
    if "url" not in n and n:
        raise ConfigError(f"nats.{sorted(n)[0]}: set, but nats.url is missing")
    if "url" not in n:
        return None
    _at_least(n.get("connect_timeout_s", 5.0), 0, "nats.connect_timeout_s", strict=True)
    for part in n["url"].split(","):  # a server list is allowed
        _url(part.strip(), "nats.url", ("nats", "tls"))
    if n.get("token") and (n.get("user") or n.get("creds")):  # values are secrets: not echoed
        raise ConfigError("nats.token: set together with nats.user or nats.creds; pick one")
    for a, b in (("user", "password"), ("password", "user"), ("tls_cert", "tls_key")):
        if n.get(a) and not n.get(b):
            raise ConfigError(f"nats.{b}: missing (nats.{a} is set); set both or neither")
    return NatsConfig(**n)


def load_config(path: str | None, overrides: Mapping[str, Any], env: Mapping[str, str]) -> Config:
    """Read the file (if any), apply env then flag settings, validate, and freeze."""
    raw: dict[str, Any] = {}
    try:  # TOML syntax errors keep tomllib's line and column
        if path:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config {path!r}: {getattr(exc, 'strerror', None) or exc}") from None
    for key, value in raw.items():
        if key not in _TOP and key not in _SECTIONS:
            raise ConfigError(f"{key}: unknown key (value {value!r})")
    _apply_overrides(raw, _env_overrides(env), "env")
    _apply_overrides(raw, overrides, "flag")
    cluster = _check_type(raw.get("cluster", "default"), str, "cluster")
    collector = _build_collector(raw.get("collector", {}))
    workers_raw = raw.get("worker", [])
    if not isinstance(workers_raw, list):
        raise ConfigError(f"worker: expected [[worker]] tables, got {workers_raw!r}")
    workers = tuple(_build_worker(i, t, collector.node_rank) for i, t in enumerate(workers_raw))
    seen: dict[str, int] = {}
    for i, w in enumerate(workers):
        if w.id in seen:
            raise ConfigError(f"worker[{i}].id: duplicate {w.id!r} (also worker[{seen[w.id]}])")
        seen[w.id] = i
    agg = _table(raw.get("aggregator", {}), _SECTIONS["aggregator"], "aggregator")
    nats = _build_nats(raw)
    agg.pop("nats", None)
    agg.setdefault("listen", "127.0.0.1:9477")
    _host_port(agg["listen"], "aggregator.listen")
    _at_least(agg.get("stale_intervals", 3), 1, "aggregator.stale_intervals")
    if "otlp_endpoint" in agg:
        _url(agg["otlp_endpoint"], "aggregator.otlp_endpoint")
    aggregator = AggregatorConfig(nats=nats, **agg)
    return Config(_subject_token(cluster, "cluster"), collector, workers, aggregator, nats, path)
