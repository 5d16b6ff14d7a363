"""`kvobserve check`: validate the config, resolve discovery, print what this node would watch."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from kvobserve.commands.common import fail, load
from kvobserve.config import SECTIONS, Config, ConfigError, add_config_flags
from kvobserve.sources.discovery import DiscoveredEngine, DiscoveryError, discover
from kvobserve.sources.dynamo_plan import DynamoPlan, plan_dynamo
from kvobserve.sources.plan import WorkerPlan, plan_worker


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`check` flags: the shared config flags plus output options."""
    add_config_flags(parser, SECTIONS)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--no-discovery", action="store_true", help="do not contact engines with a `url`"
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="discovery timeout (s)")


async def _discover_all(cfg: Config, timeout_s: float) -> dict[str, DiscoveredEngine]:
    """Discovery for every worker with a url, concurrently."""
    todo = [w for w in cfg.workers if w.url and w.engine != "dynamo"]
    found = await asyncio.gather(
        *(discover(w.url or "", w.engine, timeout_s=timeout_s) for w in todo)
    )
    return {w.id: d for w, d in zip(todo, found, strict=True)}


def _ranged(ranks: range) -> str:
    """`0-3`, `5`, or `none`."""
    if not ranks:
        return "none"
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


_STREAM_KEYS = ("dp_rank", "endpoint", "replay_endpoint", "topic")


def plan_json(p: WorkerPlan) -> dict[str, Any]:
    """One worker's plan as the JSON `check --json` prints."""
    w = p.worker
    return {
        "worker_id": w.id,
        "engine": w.engine,
        "dp_size": p.dp_size or None,
        "leader": w.leader,
        "discovered_from": p.discovered_from,
        "streams": [{k: getattr(s, k) for k in _STREAM_KEYS} for s in p.streams],
        "watched_ranks": list(p.watched_ranks),
        "probe_endpoints": [s.endpoint for s in p.probes],
        "scheduler_sources": [
            {"source": s.source, "endpoint": e} for s in p.scheduler for e in s.endpoints
        ],
        "notes": list(p.notes),
    }


def dynamo_json(p: DynamoPlan) -> dict[str, Any]:
    """One Dynamo plane's plan as `check --json` prints it."""
    w = p.worker
    return {
        "worker_id": w.id,
        "engine": "dynamo",
        "event_plane": p.event_plane,
        "url": p.shown,
        "namespace": w.namespace,
        "subjects": list(p.subjects),
        "endpoints": list(p.endpoints),
        "stream_worker_id": p.label("<dynamo worker_id>"),
        "keep_ranks": "all" if p.owned is None else list(p.owned),
        "dp_size": w.dp_size,
        "block_size": w.block_size,
        "indexer_url": w.indexer_url,
        "notes": list(p.notes),
    }


def _print_dynamo(p: dict[str, Any]) -> None:
    print(f"\nworker {p['worker_id']} (dynamo, {p['event_plane']} event plane {p['url']})")
    for note in p["notes"]:
        print(f"  note: {note}")
    for what in ("subjects", "endpoints"):
        for x in p[what]:
            print(f"  subscribe {x}")
    ranks = p["keep_ranks"]
    kept = "every rank received" if ranks == "all" else f"dp_ranks {ranks[0]}-{ranks[-1]}"
    print(f"  streams: {p['stream_worker_id']} per dp_rank, as events arrive; keeps {kept}")
    print(f"  drift against: {p['indexer_url'] or 'none'}")


def _print_text(cfg: Config, plans: list[dict[str, Any]]) -> None:
    """The plan as a human-readable table; `*` marks the ranks this node watches."""
    c = cfg.collector
    print(f"config {cfg.path or '(flags/env only)'}: valid")
    print(f"cluster {cfg.cluster}  collector {c.id}  node_rank {c.node_rank} of {c.nnodes}")
    print(f"http {cfg.http.listen or 'off'}  nats {cfg.nats.url if cfg.nats else 'embedded'}")
    for p in plans:
        if p["engine"] == "dynamo":
            _print_dynamo(p)
            continue
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
        cfg = load(args)
        found = {} if args.no_discovery else asyncio.run(_discover_all(cfg, args.timeout))
        node = cfg.collector
        plans = [
            dynamo_json(plan_dynamo(i, w, node))
            if w.engine == "dynamo"
            else plan_json(plan_worker(i, w, node, found.get(w.id)))
            for i, w in enumerate(cfg.workers)
        ]
    except (ConfigError, DiscoveryError) as exc:
        return fail("check", exc)
    if args.json:
        json.dump(
            {"config": cfg.path, "cluster": cfg.cluster, "workers": plans}, sys.stdout, indent=2
        )
        print()
    else:
        _print_text(cfg, plans)
    return 0
