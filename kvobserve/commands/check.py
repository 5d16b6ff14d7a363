"""`kvobserve check`: validate the config, resolve discovery, print what this node would watch.

A gate: exit 0 when the config is valid and the plan has no problem; 1 when it has one that
`run` would report (a layout the engine contradicts, an engine whose discovery does not answer,
a `relay_to` host that does not resolve), printed after the plan it could make; 2 on a config
error (one line). With --probe it also connects to every endpoint and URL for a few seconds and
says what it found per rank (commands/check_probe.py); something wrong there is a problem too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
from typing import Any, NamedTuple

from kvobserve.analysis.layout import ranged, rank_layout
from kvobserve.commands.check_probe import Found, probe_all
from kvobserve.commands.common import fail, load
from kvobserve.config import (
    COLLECT_DEFAULTS,
    SECTIONS,
    Config,
    ConfigError,
    WorkerConfig,
    add_config_flags,
)
from kvobserve.engines import profile
from kvobserve.sources.discovery import discover_urls
from kvobserve.sources.discovery_parse import DiscoveredEngine, DiscoveryError
from kvobserve.sources.dynamo_plan import DynamoPlan, plan_dynamo
from kvobserve.sources.kubernetes import PodWatch
from kvobserve.sources.plan import WorkerPlan, plan_pods, plan_worker


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`check` flags: the shared config flags plus output options."""
    add_config_flags(parser, SECTIONS)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--no-discovery",
        action="store_true",
        help="check the file alone: contact no engine `url` or Kubernetes API, resolve no "
        "`relay_to` host",
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


EXIT_PROBLEMS = 1  # the plan has a problem `run` would report (or --probe found one)
EXIT_CONFIG = 2  # the config (file, env, flags) is wrong: one line


class Problem(NamedTuple):
    """Something in the plan that `run` would report: the worker, the condition, why."""

    worker_id: str
    kind: str  # the condition `run` raises (layout_mismatch, worker_undiscovered) or relay_to
    reason: str

    def json(self) -> dict[str, str]:
        """As `check --json` lists it."""
        return self._asdict()


async def _unresolved(targets: dict[str, str], timeout_s: float) -> dict[str, str]:
    """Why each tcp:// target's host does not resolve, by worker id (the ones that do: absent)."""
    loop = asyncio.get_running_loop()

    async def one(target: str) -> str | None:
        host = target.partition("://")[2].rpartition(":")[0].strip("[]")
        try:  # the resolver's own word on a name Python's IDNA codec refuses (a long label)
            name = host.encode("idna")
        except UnicodeError:
            name = host.encode()
        try:
            await asyncio.wait_for(loop.getaddrinfo(name, None, type=socket.SOCK_STREAM), timeout_s)
        except (socket.gaierror, UnicodeError) as exc:
            return f"cannot resolve {host!r} in {target}: {getattr(exc, 'strerror', None) or exc}"
        except TimeoutError:
            return f"cannot resolve {host!r} in {target}: no answer in {timeout_s:g} s"
        return None

    tcp = {wid: t for wid, t in targets.items() if t.startswith("tcp://")}
    got = await asyncio.gather(*(one(t) for t in tcp.values()))
    return {wid: why for wid, why in zip(tcp, got, strict=True) if why is not None}


async def _discover_all(
    cfg: Config, timeout_s: float
) -> tuple[dict[str, DiscoveredEngine], dict[str, DiscoveryError]]:
    """Discovery for every worker with a url, concurrently: (found, failed) by worker id."""
    todo = [w for w in cfg.workers if w.urls and profile(w.engine).discovery]
    got = await asyncio.gather(
        *(discover_urls(w.urls, w.engine, timeout_s=timeout_s) for w in todo),
        return_exceptions=True,
    )
    found: dict[str, DiscoveredEngine] = {}
    failed: dict[str, DiscoveryError] = {}
    for w, d in zip(todo, got, strict=True):
        if isinstance(d, DiscoveryError):
            failed[w.id] = d
        elif isinstance(d, BaseException):
            raise d
        else:
            found[w.id] = d
    return found, failed


async def _list_pods(i: int, w: WorkerConfig, timeout_s: float) -> PodWatch:
    """The pods of a `[worker.kubernetes]` worker, listed once; ConfigError when that fails."""
    assert w.kubernetes is not None
    watch = PodWatch(w.id, w.kubernetes)
    try:
        await watch.list_once(timeout_s)
    except Exception as exc:  # the reason, as the collector would report it
        _, reason = watch.describe(exc)
        raise ConfigError(
            f"worker[{i}].kubernetes: cannot list pods: {reason} (`check --no-discovery` checks "
            "the file without listing them)"
        ) from None
    return watch


def pods_json(w: WorkerConfig, watch: PodWatch | None) -> dict[str, Any]:
    """A `[worker.kubernetes]` worker as `check --json` prints it; its pods' plans follow it."""
    k = w.kubernetes
    assert k is not None
    return {
        "worker_id": w.id,
        "engine": w.engine,
        "dp_size": w.dp_size,
        "kubernetes": {
            "server": watch.server if watch else None,
            "namespace": (watch.namespace if watch else k.namespace) or None,
            "selector": k.selector,
            "port": k.port,
            "replay_port": k.replay_port or None,
            "topic": k.topic,
        },
        "stream_worker_id": f"{w.id}/<pod>",
        "pods": watch.summary() if watch else None,
    }


def _print_pods(p: dict[str, Any]) -> None:
    k = p["kubernetes"]
    where = f"namespace {k['namespace'] or '(the client context)'} -l {k['selector']}"
    server = f" at {k['server']}" if k["server"] else ""
    print(f"\nworker {p['worker_id']} ({p['engine']}, pods of {where}{server})")
    replay = f", replay port {k['replay_port']} + r" if k["replay_port"] else ", no replay"
    print(
        f"  each Running and Ready pod is worker {p['stream_worker_id']}: dp_size "
        f"{p['dp_size']}, rank r at the pod IP port {k['port']} + r{replay}, topic {k['topic']!r}"
    )
    pods = p["pods"]
    if pods is None:
        print("  pods: listed at run time (--no-discovery)")
        return
    streaming = sum(1 for x in pods if x["stream"])
    print(f"  pods now: {len(pods)} selected, {streaming} streaming")
    for x in pods:
        ready = "Ready" if x["ready"] else "not Ready"
        state = f"{x['phase']}, {ready}" + (", terminating" if x["terminating"] else "")
        mark = "*" if x["stream"] else " "
        print(f"   {mark}{x['name']:<40} {x['ip'] or '-':<16} {state}")


_STREAM_KEYS = ("dp_rank", "endpoint", "replay_endpoint", "topic")
_SCOPES = {"node": "this node's engine", "leader": "leader", "rank": "rank", "pod": "each pod"}


def plan_json(p: WorkerPlan) -> dict[str, Any]:
    """One worker's plan as the JSON `check --json` prints.

    Streams of other nodes' ranks keep the endpoint as configured or advertised: a wildcard host
    there is that node's own address, which only that node's collector knows.
    """
    w = p.worker
    watched = set(p.watched_ranks)
    return {
        "worker_id": w.id,
        "engine": w.engine,
        "dp_size": p.dp_size or None,
        "dp_attention": p.dp_attention,
        "leader": w.leader,
        "discovered_from": p.discovered_from,
        "block_size": p.block_size,
        "streams": [
            {
                **{k: getattr(s, k) for k in _STREAM_KEYS},
                "node_rank": p.owners[s.dp_rank] if s.dp_rank < len(p.owners) else None,
                "watched": s.dp_rank in watched,
            }
            for s in p.streams
        ],
        "watched_ranks": list(p.watched_ranks),
        # ranks the config gives this node that the engine runs elsewhere (or not at all)
        "elsewhere": list(p.elsewhere),
        "probe_endpoints": [s.endpoint for s in p.probes],
        "bind": w.bind,
        "topic": w.topic,
        "listens": [
            {
                "dp_rank": x.dp_rank,
                "endpoint": x.endpoint,
                "replay_endpoint": x.replay_endpoint,
                "relay_to": x.relay_to,
            }
            for x in p.listens
        ],
        "streams_from_topic": p.pods,
        "relay_queue": w.relay_queue if w.relay_to else None,
        "scheduler_sources": [
            {
                "source": s.source,
                "endpoint": e,
                "scope": s.scope,
                "dp_rank": s.ranks[i] if s.ranks else None,
            }
            for s in p.scheduler
            for i, e in enumerate(s.endpoints)
        ],
        "notes": list(p.notes),
    }


def probe_targets(p: WorkerPlan) -> list[Found]:
    """Every endpoint and URL this node's collector would use for one worker, for --probe.

    Only the ranks this node owns: other nodes' ranks are reached by their own collectors.
    """
    wid = p.worker.id
    if p.worker.bind is not None:  # publishers connect to us: bound here, as the collector would
        out = [Found("bound", wid, x.dp_rank, x.endpoint, x.template.prefix) for x in p.listens]
        out += [Found("relay", wid, x.dp_rank, x.relay_to) for x in p.listens if x.relay_to]
        replays = [x for x in p.listens if x.replay_endpoint and "{" not in x.replay_endpoint]
        out += [Found("replay", wid, x.dp_rank, x.replay_endpoint or "") for x in replays]
        return out + [
            Found("metrics", wid, None, e)
            for sp in p.scheduler
            if sp.source == "metrics"
            for e in sp.endpoints
        ]
    mine = [s for s in p.streams if s.dp_rank in set(p.watched_ranks)]
    out = [Found("stream", wid, s.dp_rank, s.endpoint, s.topic) for s in mine]
    out += [Found("replay", wid, s.dp_rank, s.replay_endpoint) for s in mine if s.replay_endpoint]
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
        "engine": w.engine,
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
    print(f"\nworker {p['worker_id']} ({p['engine']}, {p['event_plane']} event plane {p['url']})")
    for note in p["notes"]:
        print(f"  note: {note}")
    for what in ("subjects", "endpoints"):
        for x in p[what]:
            print(f"  subscribe {x}")
    ranks = p["keep_ranks"]
    kept = "every rank received" if ranks == "all" else f"dp_ranks {ranks[0]}-{ranks[-1]}"
    print(f"  streams: {p['stream_worker_id']} per dp_rank, as events arrive; keeps {kept}")
    print(f"  drift against: {p['indexer_url'] or 'none'}")


def _print_bind(p: dict[str, Any]) -> None:
    """A bind-mode worker: what this node binds, how streams are named, where frames go."""
    wid, topic = p["worker_id"], p["topic"]
    if not p["listens"]:
        print(f"  bind mode: the worker's leader binds {p['bind']}; this node binds nothing")
        return
    print("  bind mode: the engines connect here (rank r to port + r); this node binds:")
    print(f"  {'dp_rank':<8} {'bind':<28} {'replay':<28} relay to")
    for x in p["listens"]:
        replay, relay = x["replay_endpoint"] or "-", x["relay_to"] or "-"
        print(f" *{x['dp_rank']:<8} {x['endpoint']:<28} {replay:<28} {relay}")
    if p["streams_from_topic"]:
        print(f"  streams: one per pod, worker_id {wid}/{{pod}} from the topic (e.g. "
              f"'kv@10.0.0.7:8000@llama' is {wid}/10.0.0.7:8000), as pods send")  # fmt: skip
    else:
        print(f"  streams: one per rank, worker_id {wid}, topic prefix {topic!r}; a second "
              "publisher on a rank's port is a duplicate stream")  # fmt: skip
    if p["relay_queue"]:
        print(f"  relay: every frame forwarded unchanged first, at most {p['relay_queue']} "
              "waiting for the target (more are dropped and counted)")  # fmt: skip
    _print_sources(p)


def _print_sources(p: dict[str, Any]) -> None:
    """A worker's scheduler sources, and what --probe found."""
    sched = p["scheduler_sources"]
    print("  scheduler sources:" + ("" if sched else " none"))
    for x in sched:
        rank = f"rank {x['dp_rank']}" if x["dp_rank"] is not None else _SCOPES[x["scope"]]
        print(f"    {x['source']:<10} {x['endpoint']:<40} ({rank})")
    if "probe" in p:
        print(f"  probed for {p['probe_seconds']:g} s:")
        _print_probe(p["probe_found"])


def http_listens(cfg: Config, collect: Config | None) -> dict[str, str]:
    """Where each command this config is for serves HTTP ("off": nowhere), first the one this
    node runs: `run` without [nats]; with it `collect` (`collect`: the config as `collect` loads
    it, with its own default port) and `aggregate`."""
    if cfg.nats is None or collect is None:
        return {"run": cfg.http.listen or "off"}
    return {"collect": collect.http.listen or "off", "aggregate": cfg.http.listen or "off"}


def _print_text(cfg: Config, plans: list[dict[str, Any]], listens: dict[str, str]) -> None:
    """The plan as a human-readable table; `*` marks the ranks this node watches."""
    c = cfg.collector
    print(f"config {cfg.path or '(flags/env only)'}: valid")
    print(
        f"cluster {cfg.cluster}  collector {c.id}  node_rank {c.node_rank} of {c.nnodes}"
        f"  host {c.host}"
    )
    (command, listen), *rest = listens.items()
    also = "".join(f"; {other} {where}" for other, where in rest)
    nats = cfg.nats.url if cfg.nats else "embedded"
    print(f"http {listen} ({command}{also})  nats {nats}")
    for p in plans:
        if "event_plane" in p:
            _print_dynamo(p)
            continue
        if "kubernetes" in p:
            _print_pods(p)
            continue
        src = f"  discovered from {p['discovered_from']}" if p["discovered_from"] else ""
        lead = "leader" if p["leader"] else "not leader"
        shown = p["dp_attention"] and rank_layout(p["engine"]).dp_attention
        attn = ", DP attention" if shown else ""
        print(
            f"\nworker {p['worker_id']} ({p['engine']}, dp_size {p['dp_size'] or '?'}{attn},"
            f" {lead}){src}"
        )
        for note in p["notes"]:
            print(f"  note: {note}")
        if p["bind"] is not None:
            _print_bind(p)
            continue
        if p["streams"]:
            print(f"  {'dp_rank':<8} {'node':<5} {'endpoint':<32} {'replay':<32} topic")
        others: dict[int, list[int]] = {}
        for s in p["streams"]:
            if s["dp_rank"] in p["elsewhere"]:
                continue
            if not s["watched"]:
                others.setdefault(s["node_rank"], []).append(s["dp_rank"])
                continue
            replay = s["replay_endpoint"] or "-"
            print(
                f" *{s['dp_rank']:<8} {s['node_rank']:<5} {s['endpoint']:<32} {replay:<32}"
                f" {s['topic']!r}"
            )
        for node, ranks in sorted(others.items()):
            print(f"  {ranged(ranks):<8} {node:<5} (node {node}'s collector connects to these)")
        if p["elsewhere"]:
            print(
                f"  {ranged(p['elsewhere']):<8} {'-':<5} (not watched: the engine does not run "
                "them on this node)"
            )
        print(f"  ranks watched by this node (*): {ranged(p['watched_ranks'])}")
        print(f"  probe endpoints: {', '.join(p['probe_endpoints']) or 'none'}")
        _print_sources(p)


def _print_problems(problems: list[Problem]) -> None:
    print("\nproblems (`kvobserve run` would report these):")
    for p in problems:
        print(f"  worker {p.worker_id}: {p.kind}: {p.reason}")


class Checked(NamedTuple):
    """What `check` found before any probe: the plans as printed, the SGLang/vLLM plans beside
    their JSON (the probe's targets), the problems, and why each relay target's host does not
    resolve (by worker id)."""

    plans: list[dict[str, Any]]
    sglang_vllm: list[tuple[dict[str, Any], WorkerPlan]]
    problems: list[Problem]
    unresolved: dict[str, str]


def plan_all(cfg: Config, args: argparse.Namespace) -> Checked:
    """Every worker's plan on this node, with discovery and pod listing unless --no-discovery;
    ConfigError when the config cannot be planned."""
    found, failed = ({}, {}) if args.no_discovery else asyncio.run(_discover_all(cfg, args.timeout))
    node = cfg.collector
    out = Checked([], [], [], {})
    for i, w in enumerate(cfg.workers):
        if profile(w.engine).event_plane:
            out.plans.append(dynamo_json(plan_dynamo(i, w, node)))
            continue
        if w.kubernetes is not None:  # the selector, then a plan per streaming pod
            watch = None if args.no_discovery else asyncio.run(_list_pods(i, w, args.timeout))
            out.plans.append(pods_json(w, watch))
            streams = watch.streams if watch else {}
            for wp in plan_pods(i, w, node, streams, watch.namespace if watch else ""):
                out.plans.append(plan_json(wp))
                out.sglang_vllm.append((out.plans[-1], wp))
            continue
        err = failed.get(w.id)
        wp = plan_worker(i, w, node, found.get(w.id))
        plan = plan_json(wp)
        if err is not None and not (w.kv_endpoint or w.bind):  # nothing to watch without it
            plan["notes"] = [f"{err}; no endpoint without it (the collector asks again every "
                             "30 s; or set kv_endpoint)"]  # fmt: skip
            out.problems.append(Problem(w.id, "worker_undiscovered", err.reason))
        elif err is not None:  # configured endpoints stand; the collector retries discovery
            plan["notes"].insert(0, f"{err}; using the configured endpoints")
        if wp.misplaced:  # what the collector raises as layout_mismatch
            text = "; ".join(m.text for m in wp.mismatches)
            out.problems.append(Problem(w.id, "layout_mismatch", text))
        out.plans.append(plan)
        out.sglang_vllm.append((plan, wp))
    relays = {wp.worker.id: wp.worker.relay_to or "" for _, wp in out.sglang_vllm if wp.listens}
    relays = {wid: t for wid, t in relays.items() if t}  # the leader's, which relays
    if relays and not args.no_discovery:
        out.unresolved.update(asyncio.run(_unresolved(relays, args.timeout)))
        out.problems.extend(Problem(wid, "relay_to", why) for wid, why in out.unresolved.items())
    return out


def run(args: argparse.Namespace) -> int:
    """0: the config is valid and the plan has no problem (with --probe: every endpoint as
    expected); 1: the plan has a problem, printed after it; 2: a config error, one line."""
    if args.probe_seconds <= 0:
        return fail("check", f"--probe-seconds {args.probe_seconds}: must be > 0")
    try:
        cfg = load(args)
        listens = http_listens(cfg, load(args, defaults=COLLECT_DEFAULTS) if cfg.nats else None)
        plans, sglang_vllm, problems, unresolved = plan_all(cfg, args)
    except ConfigError as exc:
        return fail("check", exc, EXIT_CONFIG)
    bad = 0
    if args.probe:  # the ZMQ endpoints and URLs of SGLang/vLLM workers (not Dynamo planes)
        targets = [probe_targets(wp) for _, wp in sglang_vllm]
        asyncio.run(probe_all([f for t in targets for f in t], args.probe_seconds))
        for f in (f for t in targets for f in t if f.role == "relay"):
            if f.worker_id in unresolved:  # the probe's socket cannot tell a name from a refusal
                f.state, f.reason = "unresolved", unresolved[f.worker_id]
        for (pj, _), t in zip(sglang_vllm, targets, strict=True):
            pj["probe"] = [f.json() for f in t]
            pj["probe_found"], pj["probe_seconds"] = t, args.probe_seconds
            bad += sum(1 for f in t if not f.ok)
    if args.json:
        c = cfg.collector
        doc = {
            "config": cfg.path,
            "cluster": cfg.cluster,
            "collector": {"id": c.id, "node_rank": c.node_rank, "nnodes": c.nnodes, "host": c.host},
            "http": listens,
            "workers": plans,
            "problems": [p.json() for p in problems],
        }
        for pj in plans:
            pj.pop("probe_found", None)
            pj.pop("probe_seconds", None)
        json.dump(doc, sys.stdout, indent=2)
        print()
    else:
        _print_text(cfg, plans, listens)
        if not args.probe:
            print("\nendpoints not contacted: `kvobserve check --probe` connects to each")
        elif bad:
            print(f"\n{bad} endpoint(s) not as expected (BAD above)")
        if problems:
            _print_problems(problems)
    return EXIT_PROBLEMS if bad or problems else 0
