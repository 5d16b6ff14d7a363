"""`kvobserve check`: validate the config, resolve discovery, print what this node would watch."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from kvobserve.analysis.layout import offset_endpoint, watched_ranks
from kvobserve.config import Config, ConfigError, WorkerConfig, add_config_flags, load_config
from kvobserve.config import overrides_from_args as _overrides
from kvobserve.sources.discovery import DiscoveredEngine, DiscoveryError, discover
from kvobserve.sources.scheduler import SchedulerSources


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`check` flags: the shared config flags plus output options."""
    add_config_flags(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--no-discovery", action="store_true", help="do not contact engines with a `url`"
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="discovery timeout (s)")


async def _discover_all(cfg: Config, timeout_s: float) -> dict[str, DiscoveredEngine]:
    """Discovery for every worker with a url, concurrently."""
    todo = [w for w in cfg.workers if w.url]
    found = await asyncio.gather(
        *(discover(w.url or "", w.engine, timeout_s=timeout_s) for w in todo)
    )
    return {w.id: d for w, d in zip(todo, found, strict=True)}


def _ranged(ranks: range) -> str:
    """`0-3`, `5`, or `none`."""
    if not ranks:
        return "none"
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def worker_plan(
    i: int, w: WorkerConfig, cfg: Config, found: DiscoveredEngine | None
) -> dict[str, Any]:
    """Streams, owned ranks, probe endpoints and scheduler sources of one worker."""
    where = f"worker[{i}]"
    dp_size = w.dp_size or (found.dp_size if found else 1)
    notes = [] if w.dp_size or found else ["dp_size unknown without discovery; assuming 1"]
    if found and w.dp_size and w.dp_size != found.dp_size:
        notes.append(f"dp_size {w.dp_size} in config, the engine advertises {found.dp_size}")
    if found is None and not w.kv_endpoint:
        notes, dp_size = ["endpoints come from discovery at run time (--no-discovery)"], 0
    by_rank = {s.dp_rank: s for s in found.sources} if found else {}
    streams: list[dict[str, Any]] = []
    try:
        for r in range(dp_size):
            src = by_rank.get(r)
            ep = offset_endpoint(w.kv_endpoint, r, w.engine) if w.kv_endpoint else None
            replay = w.replay_endpoint and offset_endpoint(w.replay_endpoint, r, w.engine)
            if src is not None:  # configured endpoints win over advertised ones
                ep, replay = ep or src.endpoint, replay or src.replay_endpoint
            if ep is None:
                raise ConfigError(
                    f"{where}: no endpoint for dp_rank {r} (not advertised by {w.url})"
                )
            topic = w.topic or (src.topic if src else "")
            streams.append(
                {"dp_rank": r, "endpoint": ep, "replay_endpoint": replay, "topic": topic}
            )
        base = streams[0]["endpoint"] if streams else ""
        probes = [
            offset_endpoint(base, dp_size + k, w.engine)
            for k in range(w.probe_extra_ports)
            if base.startswith("tcp://")
        ]
        node = cfg.collector
        watched = (
            watched_ranks(w.engine, w.dp_attention, node.node_rank, node.nnodes, dp_size)
            if dp_size
            else range(0)
        )
    except ConfigError:
        raise
    except ValueError as exc:  # layout refuses e.g. an ipc:// endpoint with several ranks
        raise ConfigError(f"{where}.kv_endpoint: {exc}") from None
    load = found.load_endpoint_base if found else None
    sched = SchedulerSources(w, dp_size, load_endpoint=load).describe()
    # SGLang's `auto` load range starts at kv_base + dp_size: exactly the first probed port
    load_eps = {e for s, e in sched if s == "load"}
    for ep in [p for p in probes if p in load_eps]:
        probes.remove(ep)
        notes.append(f"probe {ep} skipped: it is the SGLang load publisher's port")
    sched = sched if w.leader else []
    return {
        "worker_id": w.id,
        "engine": w.engine,
        "dp_size": dp_size or None,
        "leader": w.leader,
        "discovered_from": found.url if found else None,
        "streams": streams,
        "watched_ranks": list(watched),
        "probe_endpoints": probes,
        "scheduler_sources": [{"source": s, "endpoint": e} for s, e in sched],
        "notes": notes,
    }


def _print_text(cfg: Config, plans: list[dict[str, Any]]) -> None:
    """The plan as a human-readable table; `*` marks the ranks this node watches."""
    c = cfg.collector
    print(f"config {cfg.path or '(flags/env only)'}: valid")
    print(f"cluster {cfg.cluster}  collector {c.id}  node_rank {c.node_rank} of {c.nnodes}")
    print(f"aggregator {cfg.aggregator.listen}  nats {cfg.nats.url if cfg.nats else 'embedded'}")
    for p in plans:
        src = f"  discovered from {p['discovered_from']}" if p["discovered_from"] else ""
        lead = "leader" if p["leader"] else "not leader"
        print(
            f"\nworker {p['worker_id']} ({p['engine']}, dp_size {p['dp_size'] or '?'}, {lead}){src}"
        )
        for note in p["notes"]:
            print(f"  note: {note}")
        watched = set(p["watched_ranks"])
        print("  dp_rank  endpoint                         replay                           topic")
        for s in p["streams"]:
            mark = "*" if s["dp_rank"] in watched else " "
            replay = s["replay_endpoint"] or "-"
            print(f" {mark}{s['dp_rank']:<7} {s['endpoint']:<32} {replay:<32} {s['topic']!r}")
        ranks = p["watched_ranks"]
        print(
            f"  ranks watched by this node (*): {_ranged(range(ranks[0], ranks[-1] + 1) if ranks else range(0))}"
        )
        print(f"  probe endpoints: {', '.join(p['probe_endpoints']) or 'none'}")
        sched = ", ".join(f"{s['source']} {s['endpoint']}" for s in p["scheduler_sources"])
        print(f"  scheduler sources: {sched or 'none'}")


def run(args: argparse.Namespace) -> int:
    """Exit 0 when the config is valid and resolvable, 2 with a one-line error otherwise."""
    try:
        cfg = load_config(args.config, _overrides(args), os.environ)
        found = {} if args.no_discovery else asyncio.run(_discover_all(cfg, args.timeout))
        plans = [worker_plan(i, w, cfg, found.get(w.id)) for i, w in enumerate(cfg.workers)]
    except (ConfigError, DiscoveryError) as exc:
        print(f"kvobserve check: error: {exc}".replace("\n", " "), file=sys.stderr)
        return 2
    if args.json:
        json.dump(
            {"config": cfg.path, "cluster": cfg.cluster, "workers": plans}, sys.stdout, indent=2
        )
        print()
    else:
        _print_text(cfg, plans)
    return 0
