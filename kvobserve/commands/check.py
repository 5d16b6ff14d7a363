"""`kvobserve check`: validate the config, resolve discovery, print what this node would watch.

With --probe it also connects to every endpoint and URL for a few seconds and says what it found
per rank (commands/check_probe.py); exit 1 when something there is wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from kvobserve.commands.check_probe import Found, probe_all
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
    parser.add_argument(
        "--probe",
        action="store_true",
        help="connect to every KV-event endpoint, replay endpoint and metrics URL and say what "
        "is there (exit 1 when something is wrong)",
    )
    parser.add_argument(
        "--probe-seconds", type=float, default=3.0, metavar="S", help="how long to listen (3)"
    )


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


def probe_targets(p: WorkerPlan) -> list[Found]:
    """Every endpoint and URL of one worker's plan, for --probe."""
    wid = p.worker.id
    out = [Found("stream", wid, s.dp_rank, s.endpoint, s.topic) for s in p.streams]
    out += [
        Found("replay", wid, s.dp_rank, s.replay_endpoint) for s in p.streams if s.replay_endpoint
    ]
    out += [Found("probe", wid, s.dp_rank, s.endpoint) for s in p.probes]
    out += [
        Found("metrics", wid, None, e)
        for sp in p.scheduler
        if sp.source == "metrics"
        for e in sp.endpoints
    ]
    return out


def _print_probe(found: list[Found]) -> None:
    for f in found:
        who = f"rank {f.dp_rank}" if f.dp_rank is not None else ""
        mark = "ok " if f.ok else "BAD"
        print(f"  {mark} {f.role:<8}{who:<8} {f.endpoint:<32} {f.summary()}")


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
        if "probe" in p:
            print(f"  probed for {p['probe_seconds']:g} s:")
            _print_probe(p["probe_found"])


def run(args: argparse.Namespace) -> int:
    """0: the config is valid and resolvable (and, with --probe, every endpoint as expected);
    1: --probe found something wrong; 2: a one-line error (bad config, discovery failed)."""
    if args.probe_seconds <= 0:
        return fail("check", f"--probe-seconds {args.probe_seconds}: must be > 0")
    try:
        cfg = load(args)
        found = {} if args.no_discovery else asyncio.run(_discover_all(cfg, args.timeout))
        node = cfg.collector
        plans: list[dict[str, Any]] = []
        sglang_vllm: list[tuple[dict[str, Any], WorkerPlan]] = []
        for i, w in enumerate(cfg.workers):
            if w.engine == "dynamo":
                plans.append(dynamo_json(plan_dynamo(i, w, node)))
                continue
            wp = plan_worker(i, w, node, found.get(w.id))
            plans.append(plan_json(wp))
            sglang_vllm.append((plans[-1], wp))
    except (ConfigError, DiscoveryError) as exc:
        return fail("check", exc)
    bad = 0
    if args.probe:  # the ZMQ endpoints and URLs of SGLang/vLLM workers (not Dynamo planes)
        targets = [probe_targets(wp) for _, wp in sglang_vllm]
        asyncio.run(probe_all([f for t in targets for f in t], args.probe_seconds))
        for (pj, _), t in zip(sglang_vllm, targets, strict=True):
            pj["probe"] = [f.json() for f in t]
            pj["probe_found"], pj["probe_seconds"] = t, args.probe_seconds
            bad += sum(1 for f in t if not f.ok)
    if args.json:
        doc = {"config": cfg.path, "cluster": cfg.cluster, "workers": plans}
        for pj in plans:
            pj.pop("probe_found", None)
            pj.pop("probe_seconds", None)
        json.dump(doc, sys.stdout, indent=2)
        print()
    else:
        _print_text(cfg, plans)
        if not args.probe:
            print("\nendpoints not contacted: `kvobserve check --probe` connects to each")
        elif bad:
            print(f"\n{bad} endpoint(s) not as expected (BAD above)")
    return 1 if bad else 0
