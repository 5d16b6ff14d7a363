"""Read kvobserve.toml, KVOBSERVE_* env and flags into one frozen Config.

Precedence: defaults < file < KVOBSERVE_<SECTION>_<KEY> env (acts as the flag) < flags. A command
may replace a default (`collect` serves HTTP on 9478) through `load_config(defaults=...)`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
import ssl
import tomllib
from collections.abc import Iterable, Mapping
from typing import Any

from kvobserve.config.bind import check_bind_worker, check_pod_url
from kvobserve.config.dynamo import build_dynamo_worker, reject_dynamo_keys
from kvobserve.config.kubernetes import build_kubernetes_worker
from kvobserve.config.model import (
    MAX_SHARDS,
    SECTIONS,
    AggregatorConfig,
    CollectorConfig,
    Config,
    ConfigError,
    HttpConfig,
    NatsConfig,
    WorkerConfig,
    default_state_dir,
)
from kvobserve.config.values import (
    at_least,
    check_choice,
    check_host,
    check_pair,
    check_subject_token,
    check_type,
    check_url,
    check_zmq_endpoint,
    convert,
    did_you_mean,
    split_host_port,
)
from kvobserve.engines import NAMES, PROFILES, profile, titles

# Settings whose flag is not --<key-with-dashes> (--nats-<key> in [nats]); None: file/env only.
# Several spellings: the first is shown in --help, the others are accepted too.
_FLAG_NAMES: dict[str, tuple[str, ...] | None] = {
    "collector.id": ("--collector-id",),
    "collector.interval_s": ("--interval",),
    "collector.host": ("--collector-host",),
    "collector.checkpoint_interval_s": ("--checkpoint-interval",),
    "worker.id": ("--worker-id",),
    "worker.url": ("--engine-url",),
    "worker.version": ("--engine-version",),
    "aggregator.nats": None,
    "http.listen": ("--listen", "--collector-listen", "--aggregator-listen"),
    "http.user": ("--http-user",),
    "http.password": ("--http-password",),
    "http.tls_cert": ("--tls-cert",),
    "http.tls_key": ("--tls-key",),
    "nats.url": ("--nats",),
    "nats.jetstream_kv": ("--jetstream-kv",),
    "nats.connect_timeout_s": ("--nats-connect-timeout",),
    "aggregator.render_ahead_s": ("--render-ahead",),
}
# Settings that moved; naming the old spelling is an error that gives the new one.
_MOVED = {
    "collector.listen": "http.listen",
    "aggregator.listen": "http.listen",
    "tls.cert": "http.tls_cert",
    "tls.key": "http.tls_key",
}
# What Kubernetes injects for a Service named `kvobserve-<x>` (KVOBSERVE_<X>_SERVICE_HOST, ...).
_SERVICE_LINK = re.compile(r"^(service_host|service_port(_.+)?|port(_\d+_(tcp|udp|sctp)(_.+)?)?)$")
# Worker keys that a flag/env var sets on every worker; the others need at most one worker.
_ALL_WORKERS = frozenset({"allow_pickle", "passthrough_engine_metrics"})
# String settings that also take a TOML list of strings (kept comma-joined, as flags give them).
_LISTS = frozenset({("worker", "url")})


def _flags(dotted: str) -> tuple[str, ...]:
    """The command-line flag spellings of a setting (none: file and env only)."""
    if dotted in _FLAG_NAMES:
        return _FLAG_NAMES[dotted] or ()
    section, _, key = dotted.rpartition(".")
    return ("--" + (f"nats-{key}" if section == "nats" else key).replace("_", "-"),)


def _env_name(dotted: str) -> str:
    return "KVOBSERVE_" + dotted.replace(".", "_").upper()


def add_config_flags(parser: argparse.ArgumentParser, sections: Iterable[str]) -> None:
    """Add `-c` and the flags of `sections` ("" = top level); all default to None (unset)."""
    parser.add_argument("-c", "--config", metavar="FILE", help="kvobserve.toml")
    g = parser.add_argument_group("configuration (flags > KVOBSERVE_* env > file > defaults)")
    for section in sections:
        if "." in section:
            continue  # a nested table (`[worker.kubernetes]`): file only
        for key, typ in SECTIONS[section].items():
            dotted = f"{section}.{key}" if section else key
            names = _flags(dotted)
            if not names:
                continue
            kw: dict[str, Any] = {
                "dest": "cfg__" + dotted.replace(".", "__"),
                "default": None,
                "help": f"[{section or 'top level'}] {key} (env {_env_name(dotted)})",
            }
            if typ is bool:
                g.add_argument(*names, action=argparse.BooleanOptionalAction, **kw)
            else:
                g.add_argument(*names, type=str, metavar=key.upper(), **kw)


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The config flags that were given, as {"section.key": value}."""
    return {
        name[5:].replace("__", "."): value
        for name, value in vars(args).items()
        if name.startswith("cfg__") and value is not None
    }


def _hint(dotted: str, key: str, known: Iterable[str]) -> str:
    """'; it moved to X' or '; did you mean Y?' for an unknown key, when there is one."""
    moved = _MOVED.get(re.sub(r"\[\d+\]", "", dotted))
    if moved:
        return f"; it moved to {moved}"
    return did_you_mean(key, known, cutoff=0.7)


def _unknown(key: str, value: Any, where: str, known: Iterable[str]) -> ConfigError:
    """The error for an unknown key in a file table (`where` is its path, "" at the top)."""
    dotted = f"{where}.{key}" if where else key
    return ConfigError(f"{dotted}: unknown key (value {value!r}){_hint(dotted, key, known)}")


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """KVOBSERVE_<SECTION>_<KEY> and KVOBSERVE_CLUSTER as override keys; typos are errors."""
    out: dict[str, Any] = {}
    for name, value in env.items():
        rest = name[len("KVOBSERVE_") :].lower() if name.startswith("KVOBSERVE_") else ""
        section, _, key = rest.partition("_")
        if rest == "cluster":
            out["cluster"] = value
        elif f"{section}.{key}" in _MOVED:
            new = _MOVED[f"{section}.{key}"]
            raise ConfigError(f"{name}: renamed to {_env_name(new)} ({new}) (value {value!r})")
        elif _SERVICE_LINK.match(key):
            continue  # Kubernetes' variables for a Service named kvobserve-<section>: not ours
        elif section and section in SECTIONS:  # other KVOBSERVE_* names belong to other parts
            if key not in SECTIONS[section]:
                hint = _hint(f"{section}.{key}", key, SECTIONS[section])
                raise ConfigError(
                    f"{name}: unknown key {key!r} in [{section}] (value {value!r}){hint}"
                )
            out[f"{section}.{key}"] = value
    return out


def _table(table: Any, section: str, where: str) -> dict[str, Any]:
    """A table holding only keys of the section, each of its type."""
    spec = SECTIONS[section]
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table, got {table!r}")
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key not in spec:
            raise _unknown(key, value, where, spec)
        if (section, key) in _LISTS and isinstance(value, list):
            for i, item in enumerate(value):
                check_type(item, str, f"{where}.{key}[{i}]")
            value = ",".join(value)
        out[key] = check_type(value, spec[key], f"{where}.{key}")
    return out


def _worker_table(i: int, t: Any) -> dict[str, Any]:
    """One [[worker]] table, with its nested `[worker.kubernetes]` table checked too."""
    where = f"worker[{i}]"
    nested = t.pop("kubernetes", None) if isinstance(t, dict) else None
    w = _table(t, "worker", where)
    if nested is not None:
        w["kubernetes"] = _table(nested, "worker.kubernetes", f"{where}.kubernetes")
    return w


def _apply_overrides(
    raw: dict[str, Any], overrides: Mapping[str, Any], origin: str, names: dict[str, str]
) -> None:
    """Merge env or flag settings into the raw file dict, converting strings by type.

    `names` gets, per field path, the flag or env variable that set it (for error messages).
    """
    for dotted, value in overrides.items():
        section, _, key = dotted.rpartition(".")
        spec = SECTIONS.get(section, {})
        if key not in spec:  # flags and env names were checked already: a caller's mistake
            raise ConfigError(f"{origin} {dotted}: unknown setting (value {value!r})")
        name = _env_name(dotted) if origin == "env" else _flags(dotted)[0]
        label = f"{name} ({dotted})"
        conv = convert(value, spec[key], label)
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
            names[f"worker[0].{key}"] = name
        else:
            targets = [raw.setdefault(section, {}) if section else raw]
            names[f"{section}.{key}" if section else key] = name
        for t in targets if isinstance(targets, list) else [targets]:
            if not isinstance(t, dict):
                raise ConfigError(f"{section}: expected a table, got {t!r}")
            t[key] = conv


def state_dir(value: str, env: Mapping[str, str]) -> str:
    """[collector] state_dir as an absolute path ("": the default, also for a Config built in
    code); created at start, not here."""
    path = value.strip() or default_state_dir(env, os.geteuid() == 0)
    if "\0" in path:
        raise ConfigError(f"collector.state_dir: a NUL character in {value!r}")
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"collector.state_dir: {path!r} exists and is not a directory")
    return path


def _build_collector(c: dict[str, Any], env: Mapping[str, str]) -> CollectorConfig:
    """Validate [collector]."""
    host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname().split(".")[0]) or "collector"
    cfg = CollectorConfig(**{"id": host, **c})
    check_subject_token(cfg.id, "collector.id")
    at_least(cfg.nnodes, 1, "collector.nnodes")
    at_least(cfg.node_rank, 0, "collector.node_rank")
    if cfg.node_rank >= cfg.nnodes:
        raise ConfigError(
            f"collector.node_rank: {cfg.node_rank} must be < collector.nnodes ({cfg.nnodes})"
        )
    at_least(cfg.interval_s, 0, "collector.interval_s", strict=True)
    at_least(cfg.checkpoint_interval_s, 0, "collector.checkpoint_interval_s")
    return dataclasses.replace(
        cfg,
        host=check_host(cfg.host, "collector.host"),
        state_dir=state_dir(cfg.state_dir, env),
    )


def _build_worker(i: int, w: dict[str, Any], node_rank: int) -> WorkerConfig:
    """Validate one [[worker]] table."""
    where = f"worker[{i}]"
    if "kubernetes" in w:  # pods found by a label selector (its own engine check)
        return build_kubernetes_worker(where, w, node_rank)
    engine = check_choice(w.get("engine"), NAMES, f"{where}.engine")
    if profile(engine).event_plane:  # its workers are found on the event plane
        return build_dynamo_worker(where, w, node_rank)
    reject_dynamo_keys(where, w, engine)
    urls = [u.strip() for u in str(w.get("url", "")).split(",")]
    if "url" in w:
        for u in urls:
            check_url(u, f"{where}.url")
        if len(urls) > 1 and not profile(engine).several_urls:
            several = titles([n for n, p in PROFILES.items() if p.several_urls])
            raise ConfigError(
                f"{where}.url: {len(urls)} URLs for {engine}; several URLs are for {several} API "
                "servers that each list their own ranks"
            )
        w["url"] = ",".join(urls)
    if "metrics_url" in w:  # may name {pod_ip}: checked against the topic with the bind keys
        check_pod_url(w["metrics_url"], f"{where}.metrics_url")
    url, kv = w.get("url"), w.get("kv_endpoint") or w.get("bind")
    if kv is None and url is None:
        raise ConfigError(
            f"{where}: needs kv_endpoint, bind (publishers connect) or url (discovery), has none"
        )
    for key, schemes in (
        ("kv_endpoint", ("tcp", "ipc", "inproc")),
        ("replay_endpoint", ("tcp", "ipc", "inproc")),
        ("load_endpoint", ("tcp",)),
        ("kv_metrics_endpoint", ("tcp", "ipc")),  # we bind the PULL the engine pushes to
        ("fpm_endpoint", ("tcp", "ipc")),
    ):
        if key in w:
            check_zmq_endpoint(w[key], f"{where}.{key}", schemes)
    if "dp_size" not in w and url is not None:
        w["dp_size"] = None  # from discovery
    if "id" not in w:  # engine@host:port: the same on every node that watches this worker
        w["id"] = f"{engine}@{(urls[0] if url else kv or '').partition('://')[2].split('/')[0]}"
    cfg = WorkerConfig(**{"leader": node_rank == 0, **w})
    if cfg.dp_size is not None:
        at_least(cfg.dp_size, 1, f"{where}.dp_size")
    at_least(cfg.capacity_tokens, 0, f"{where}.capacity_tokens")
    at_least(cfg.probe_extra_ports, 0, f"{where}.probe_extra_ports")
    if not cfg.id.strip():
        raise ConfigError(f"{where}.id: must not be empty, got {cfg.id!r}")
    check_bind_worker(where, cfg)
    return cfg


def _build_nats(n: dict[str, Any]) -> NatsConfig | None:
    """Validate [nats] (with the `[aggregator] nats = URL` shorthand already folded in)."""
    if "url" not in n:
        if n:
            raise ConfigError(f"nats.{sorted(n)[0]}: set, but nats.url is missing")
        return None
    cfg = NatsConfig(**n)
    at_least(cfg.connect_timeout_s, 0, "nats.connect_timeout_s", strict=True)
    for part in cfg.url.split(","):  # a server list is allowed
        check_url(part.strip(), "nats.url", ("nats", "tls"))
    if cfg.token and (cfg.user or cfg.creds):  # values are secrets: not echoed
        raise ConfigError("nats.token: set together with nats.user or nats.creds; pick one")
    check_pair(n, "user", "password", "nats")
    check_pair(n, "tls_cert", "tls_key", "nats")
    return cfg


def _build_http(h: dict[str, Any]) -> HttpConfig:
    """Validate [http]; the TLS files must load (found now, not at the first request)."""
    cfg = HttpConfig(**h)
    if cfg.listen:
        try:
            split_host_port(cfg.listen)
        except ValueError:
            raise ConfigError(f"http.listen: expected host:port, got {cfg.listen!r}") from None
    check_pair(h, "user", "password", "http")
    check_pair(h, "tls_cert", "tls_key", "http")
    check_url(cfg.runbook_url, "http.runbook_url")
    if cfg.tls is not None:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(*cfg.tls)
        except (OSError, ssl.SSLError) as exc:
            detail = getattr(exc, "strerror", None) or exc
            raise ConfigError(
                f"http.tls_cert: {cfg.tls_cert!r} with http.tls_key {cfg.tls_key!r}: {detail}"
            ) from None
    return cfg


def load_config(
    path: str | None,
    overrides: Mapping[str, Any],
    env: Mapping[str, str],
    *,
    defaults: Mapping[str, Any] | None = None,
) -> Config:
    """Read the file (if any), apply env then flag settings, validate, and freeze.

    `defaults` ({"section.key": value}) replaces built-in defaults for one command.
    """
    raw: dict[str, Any] = {}
    try:  # TOML syntax errors keep tomllib's line and column
        if path:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config {path!r}: {getattr(exc, 'strerror', None) or exc}") from None
    for key, value in raw.items():
        if key not in SECTIONS and key not in SECTIONS[""]:
            raise _unknown(key, value, "", [*SECTIONS, *SECTIONS[""]])
    for dotted, value in (defaults or {}).items():
        section, _, key = dotted.rpartition(".")
        table = raw.setdefault(section, {}) if section else raw
        if isinstance(table, dict):
            table.setdefault(key, value)
    names: dict[str, str] = {}  # field -> the flag or env variable that set it
    _apply_overrides(raw, _env_overrides(env), "env", names)
    _apply_overrides(raw, overrides, "flag", names)
    try:
        return _build(raw, path, env)
    except ConfigError as exc:  # name the flags or variables the user typed, with the fields
        text = str(exc)
        for field, name in names.items():
            text = re.sub(rf"(?<![\w.\[]){re.escape(field)}(?![\w.\]])", f"{name} ({field})", text)
        raise ConfigError(text) from None


def _check_curve(workers: tuple[WorkerConfig, ...]) -> None:
    """The capacity curve's sizes, when given, are positive numbers (0 is not a tier)."""
    for i, w in enumerate(workers):
        for key in ("kv_bytes_per_token", "tier_tokens"):
            value = getattr(w, key)
            if value is not None:
                at_least(value, 0, f"worker[{i}].{key}", strict=True)


def _check_pools(workers: tuple[WorkerConfig, ...]) -> None:
    """A pool's name is a label value; its workers are of engines whose block hashes compare
    (the same hash type): a router chooses among ranks of one model and one engine."""
    first: dict[str, tuple[int, WorkerConfig]] = {}
    for i, w in enumerate(workers):
        if w.pool != w.pool.strip():
            raise ConfigError(f"worker[{i}].pool: leading or trailing spaces in {w.pool!r}")
        pool = w.pool_id
        had = first.setdefault(pool, (i, w))
        j, other = had
        if profile(w.engine).signed_hashes != profile(other.engine).signed_hashes:
            raise ConfigError(
                f"worker[{i}].pool: {pool!r} holds {other.engine} (worker[{j}]) and {w.engine} "
                "workers, whose block hashes never compare; a pool is the ranks one router "
                "chooses among, of one engine"
            )


def _build(raw: dict[str, Any], path: str | None, env: Mapping[str, str]) -> Config:
    """Validate the merged settings and freeze them."""
    top = _table({k: v for k, v in raw.items() if k in SECTIONS[""]}, "", "")
    tables = {s: _table(raw.get(s, {}), s, s) for s in ("collector", "aggregator", "http", "nats")}
    collector = _build_collector(tables["collector"], env)
    workers_raw = raw.get("worker", [])
    if not isinstance(workers_raw, list):
        raise ConfigError(f"worker: expected [[worker]] tables, got {workers_raw!r}")
    workers = tuple(
        _build_worker(i, _worker_table(i, t), collector.node_rank)
        for i, t in enumerate(workers_raw)
    )
    seen: dict[str, int] = {}
    for i, w in enumerate(workers):
        if w.id in seen:
            raise ConfigError(f"worker[{i}].id: duplicate {w.id!r} (also worker[{seen[w.id]}])")
        seen[w.id] = i
    _check_pools(workers)
    _check_curve(workers)
    agg = tables["aggregator"]
    if "nats" in agg:
        tables["nats"].setdefault("url", agg.pop("nats"))
    aggregator = AggregatorConfig(**agg)
    at_least(aggregator.stale_intervals, 1, "aggregator.stale_intervals")
    at_least(aggregator.unvouched_warn_s, 0, "aggregator.unvouched_warn_s")
    at_least(aggregator.shards, 1, "aggregator.shards")
    if aggregator.shards > MAX_SHARDS:
        raise ConfigError(f"aggregator.shards: must be <= {MAX_SHARDS}, got {aggregator.shards!r}")
    at_least(aggregator.shard, 0, "aggregator.shard")
    at_least(aggregator.render_ahead_s, 0, "aggregator.render_ahead_s")
    if aggregator.shard >= aggregator.shards:
        raise ConfigError(
            f"aggregator.shard: {aggregator.shard} must be < aggregator.shards ({aggregator.shards})"
        )
    if aggregator.otlp_endpoint:
        check_url(aggregator.otlp_endpoint, "aggregator.otlp_endpoint")
    cfg = Config(
        collector=collector,
        workers=workers,
        aggregator=aggregator,
        http=_build_http(tables["http"]),
        nats=_build_nats(tables["nats"]),
        path=path,
        **top,
    )
    check_subject_token(cfg.cluster, "cluster")
    return cfg
