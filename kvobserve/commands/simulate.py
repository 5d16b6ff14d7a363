"""`kvobserve simulate`: simulated engine workers from flags or a TOML file, with faults and truth."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading
import time
import tomllib
from typing import Any

from kvobserve.simulate.config import (
    DP_LB_MODES,
    EVENT_PLANES,
    INDEXER_MODES,
    SimConfig,
    worker_from_dict,
)
from kvobserve.simulate.encoders import FORMATS
from kvobserve.simulate.faults import parse_int_list, parse_pairs
from kvobserve.simulate.group import SimulatorGroup, nodes_of
from kvobserve.simulate.profiles import DEFAULT_PERIOD_S, PROFILES, period_batches, profile
from kvobserve.simulate.replay import ROUTES

# flag dest -> SimConfig field (None default = not given, the file or the default applies)
_WORKER_FLAGS: dict[str, tuple[str, type, str]] = {
    "worker_id": ("--worker-id", str, "worker id (default sim-0)"),
    "format": ("--format", str, f"wire format: {', '.join(FORMATS)}"),
    "dp_size": ("--dp-size", int, "DP ranks of the worker (default 2)"),
    "nnodes": ("--nnodes", int, "nodes of the worker (default 1)"),
    "node_rank": ("--node-rank", int, "which node this process is (default 0)"),
    "host": ("--host", str, "bind host (default 127.0.0.1)"),
    "kv_port": ("--kv-port", int, "KV PUB base port, rank r on base+r (0 = free range)"),
    "kv_connect": (
        "--connect",
        str,
        "the KV PUBs connect to this endpoint (rank r: port + r) instead of binding --kv-port, "
        "as vLLM does with a concrete host and llm-d's central mode",
    ),
    "replay_port": ("--replay-port", int, "replay ROUTER base port (0 = free range)"),
    "http_port": ("--http-port", int, "HTTP /metrics + discovery port (0 = free)"),
    "dp_lb": (
        "--dp-lb",
        str,
        "vLLM DP load balancing: internal (node 0 serves every rank) or "
        "hybrid (an API server per node for its own ranks)",
    ),
    "grpc_port": (
        "--grpc-port",
        int,
        "SGLang as launched with --grpc-port: /server_info lists "
        "kv_event_sources (0.5.22+); nothing listens on it",
    ),
    "load_port": ("--load-port", int, "SGLang load PUB base port (0 = free range; off if unset)"),
    "kv_metrics_endpoint": ("--kv-metrics-endpoint", str, "SGLang KvMetrics PUSH connects here"),
    "topic": ("--topic", str, "topic frame (default empty, the engines' default)"),
    "rate": ("--rate", float, "batches per second per rank (<= 0: as fast as possible)"),
    "max_batches": (
        "--max-batches",
        int,
        "stop publishing after N batches per rank (0 = no limit)",
    ),
    "buffer_steps": ("--buffer-steps", int, "replay ring size in batches (default 10000)"),
    "capacity_tokens": ("--capacity-tokens", int, "KV capacity per rank in tokens"),
    "cpu_tier_tokens": (
        "--cpu-tier-tokens",
        int,
        "a CPU tier of N tokens per rank: offload on eviction, onboard on a hit (0 = none)",
    ),
    "page_size": ("--page-size", int, "tokens per page / block (default 16)"),
    "prompts": ("--prompts", int, "prompt library size"),
    "zipf_s": ("--zipf-s", float, "Zipf exponent of prompt popularity"),
    "requests_per_batch": ("--requests-per-batch", int, "request arrivals per batch"),
    "output_tokens": ("--output-tokens", int, "mean generated tokens per request"),
    "flush_every": ("--flush-every", int, "AllBlocksCleared every N batches (0 = never)"),
    "seed": ("--seed", int, "seed of all simulated content"),
    "model_name": ("--model-name", str, "model_name label"),
    "event_plane": (
        "--event-plane",
        str,
        "publish as a Dynamo worker on its event plane: nats or zmq (direct); default: the "
        "engine's own ZMQ streams",
    ),
    "event_plane_url": ("--event-plane-url", str, "Dynamo mode, nats: the NATS server"),
    "namespace": ("--namespace", str, "Dynamo namespace (default dynamo)"),
    "indexer_port": ("--indexer-port", int, "serve a simulated Dynamo KV indexer (0 = free)"),
    "indexer_mode": (
        "--indexer-mode",
        str,
        "faithful, lag, lose_removals or miss_worker (default faithful)",
    ),
    "indexer_lag_events": ("--indexer-lag-events", int, "lag: events per rank not applied"),
    "indexer_miss_worker": ("--indexer-miss-worker", str, "miss_worker: the worker id it lacks"),
    "start_delay_s": (
        "--start-delay",
        float,
        "publish nothing (and replay no trace) for S seconds after start: observers connect first",
    ),
    "trace": (
        "--trace",
        str,
        "replay a Mooncake-format trace (.jsonl or .jsonl.gz) across every rank of the worker "
        "instead of the prompt library",
    ),
    "speed": (
        "--speed",
        float,
        "trace seconds per wall second (default 1; 0 = as fast as it goes)",
    ),
    "trace_seconds": ("--trace-seconds", float, "replay only the trace's first S seconds"),
    "route": ("--route", str, f"trace router: {', '.join(ROUTES)} (default round_robin)"),
    "decode_tokens_per_s": (
        "--decode-tokens-per-s",
        float,
        "a trace request holds its pages for output_length / this seconds of trace time "
        "(default 20; 0 = released after the prefill)",
    ),
    "truth_capacities": (
        "--truth-capacities",
        str,
        "with --trace: once it is replayed, the truth of one cache of each of these factors x "
        "the pool's total capacity (e.g. 1,2,4), in --truth's `capacities`",
    ),
}
_FAULT_FLAGS: dict[str, tuple[str, str]] = {
    "drop_seqs": ("--drop-seqs", "seqs dropped on the wire, kept in the replay ring (3,4)"),
    "drop_rate": ("--drop-rate", "probability a batch is dropped on the wire (kept in the ring)"),
    "ring_drop_seqs": ("--ring-drop-seqs", "seqs dropped on the wire and from the ring"),
    "ring_drop_rate": ("--ring-drop-rate", "probability of a drop beyond the ring"),
    "malformed_seqs": ("--malformed-seqs", "seqs whose payload is malformed"),
    "malformed_rate": ("--malformed-rate", "probability of a malformed payload"),
    "restart_every": ("--restart-every", "restart the publisher every N batches"),
    "stall_after": ("--stall-after", "after N batches, publish nothing for --stall-seconds"),
    "stall_s": ("--stall-seconds", "length of the stall"),
    "ranks": ("--fault-ranks", "ranks the seq/rate/restart/stall faults hit (default all)"),
    "second_publisher": ("--second-publisher", "ranks with a second, interleaved publisher"),
    "mirror": ("--mirror", "SRC:DST: DST's port carries SRC's batches"),
    "wrong_rank": ("--wrong-rank", "RANK:LABEL: RANK writes LABEL at batch position 2"),
    "unnumbered_drops": (
        "--unnumbered-drops",
        "batches (counting every batch made) dropped before numbering: no seq gap shows",
    ),
    "unnumbered_drop_rate": ("--unnumbered-drop-rate", "probability of a drop before numbering"),
    "drop_event_ids": ("--drop-event-ids", "Dynamo mode: lose the messages carrying these ids"),
}


# the flags whose value is one of a few names (argparse checks them and suggests the closest)
_CHOICES: dict[str, tuple[str, ...]] = {
    "format": tuple(FORMATS),
    "dp_lb": DP_LB_MODES,
    "event_plane": EVENT_PLANES,
    "indexer_mode": INDEXER_MODES,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `simulate` flags."""
    parser.add_argument("-c", "--config", help="TOML file with [[worker]] tables")
    for dest, (flag, typ, help_text) in _WORKER_FLAGS.items():
        choices = _CHOICES.get(dest)
        parser.add_argument(flag, dest=dest, type=typ, default=None, help=help_text,
                            choices=choices, metavar=dest.upper() if choices else None)  # fmt: skip
    parser.add_argument("--no-dp-attention", dest="dp_attention", action="store_false", default=None,
                        help="SGLang pure DP: every rank on the leader node (old versions collide)")  # fmt: skip
    parser.add_argument("--no-replay", action="store_true", help="no replay ROUTER")
    parser.add_argument("--no-http", action="store_true", help="no HTTP server")
    parser.add_argument(
        "--all-nodes", action="store_true", help="run every node of the worker here"
    )
    parser.add_argument(
        "--node-hosts",
        help="H0,H1,...: node k binds on Hk (every node with --all-nodes, else --node-rank's)",
    )
    parser.add_argument(
        "--follower-http",
        dest="follower_http",
        action="store_true",
        default=None,
        help="SGLang nodes >= 1 serve the engine's dummy HTTP server (--all-nodes)",
    )
    parser.add_argument(
        "--duration", type=float, default=0.0, help="exit after S seconds (0 = run)"
    )
    parser.add_argument("--truth", help="write the ground truth here (JSON) on shutdown")
    parser.add_argument("--truth-interval", type=float, default=0.0, help="also every S seconds")
    g = parser.add_argument_group("faults")
    g.add_argument("--profile", choices=tuple(PROFILES), metavar="PROFILE",
                   help=f"a named fault profile ({', '.join(PROFILES)}); "
                   "the fault flags below override it")  # fmt: skip
    g.add_argument("--fault-period", type=float, default=None,
                   help="repeat the seq-based faults and the stall every S seconds at --rate "
                   f"(default {DEFAULT_PERIOD_S:g} with --profile, else once; 0 = once)")  # fmt: skip
    for dest, (flag, help_text) in _FAULT_FLAGS.items():
        g.add_argument(flag, dest=f"fault_{dest}", default=None, help=help_text)
    g.add_argument("--stray-publisher", dest="fault_stray_publisher", action="store_true",
                   default=None, help="an extra publisher on the port past the last rank")  # fmt: skip


def _fault_overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dest, (flag, _) in _FAULT_FLAGS.items():
        raw = getattr(args, f"fault_{dest}")
        if raw is None:
            continue
        if dest in (
            "drop_seqs",
            "ring_drop_seqs",
            "malformed_seqs",
            "drop_event_ids",
            "unnumbered_drops",
        ):
            out[dest] = frozenset(parse_int_list(flag, raw))
        elif dest in ("ranks", "second_publisher"):
            out[dest] = parse_int_list(flag, raw)
        elif dest in ("mirror", "wrong_rank"):
            out[dest] = parse_pairs(flag, raw)
        elif dest in ("restart_every", "stall_after"):
            out[dest] = _number(flag, raw, int)
        else:
            out[dest] = _number(flag, raw, float)
    if args.fault_stray_publisher:
        out["stray_publisher"] = True
    return out


def _number(flag: str, raw: str, typ: type) -> Any:
    try:
        return typ(raw)
    except ValueError:
        raise ValueError(f"{flag}: {raw!r} is not a {typ.__name__}") from None


def build_configs(args: argparse.Namespace) -> list[SimConfig]:
    """Worker configs from the file (if any) with flags on top; ValueError names the field."""
    tables: list[dict[str, Any]] = [{}]
    if args.config:
        try:
            with open(args.config, "rb") as f:
                doc = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"--config: {args.config}: {exc}") from None
        unknown = set(doc) - {"worker"}
        if unknown:
            raise ValueError(f"{sorted(unknown)[0]}: unknown top-level key in {args.config}")
        tables = list(doc.get("worker", [])) or [{}]
    flags = {k: getattr(args, k) for k in (*_WORKER_FLAGS, "dp_attention", "follower_http")}
    flags = {k: v for k, v in flags.items() if v is not None}
    if args.node_hosts:
        flags["node_hosts"] = tuple(h.strip() for h in args.node_hosts.split(",") if h.strip())
    if args.truth_capacities:
        flags["truth_capacities"] = tuple(
            _number("--truth-capacities", f.strip(), float)
            for f in args.truth_capacities.split(",")
            if f.strip()
        )
    if args.no_replay:
        flags["replay_port"] = None
    if args.no_http:
        flags["http_port"] = None
    faults = _fault_overrides(args)
    period_s = args.fault_period
    out: list[SimConfig] = []
    for i, table in enumerate(tables):
        cfg = worker_from_dict(table, {"worker_id": f"sim-{i}"})
        cfg = dataclasses.replace(cfg, **flags)
        over = dict(faults)
        if args.profile:  # the period is in batches: each worker's own rate converts it
            p = DEFAULT_PERIOD_S if period_s is None else period_s
            cfg = dataclasses.replace(cfg, faults=profile(args.profile, cfg.rate, p))
        elif period_s is not None:
            over["period"] = period_batches(period_s, cfg.rate)
        if over:
            cfg = dataclasses.replace(cfg, faults=dataclasses.replace(cfg.faults, **over))
        cfg.validate()
        if args.all_nodes and cfg.nnodes > 1:
            out.extend(nodes_of(cfg))
        else:
            out.append(_on_own_host(cfg, args.host or table.get("host")))
    return out


def _on_own_host(cfg: SimConfig, host: str | None) -> SimConfig:
    """One node run alone binds on its own entry of `node_hosts` (node k on Hk), as `nodes_of`
    puts each node of a group; a `host` given as well must be that one."""
    if not cfg.node_hosts:
        return cfg
    mine = cfg.node_hosts[cfg.node_rank]
    if host is not None and host != mine:
        raise ValueError(
            f"host: {host!r}, but node_hosts puts node_rank {cfg.node_rank} on {mine!r}: "
            "give one of them"
        )
    return dataclasses.replace(cfg, host=mine)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / Ctrl-C or --duration; print one `endpoint ...` line per endpoint."""
    try:
        configs = build_configs(args)
        group = SimulatorGroup(configs, args.truth).start()
    except (ValueError, OSError) as exc:
        print(f"kvobserve simulate: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for e in group.endpoints():
            print(e.line())
        print(f"ready workers={len(group.workers)}", flush=True)
        end = time.monotonic() + args.duration if args.duration > 0 else float("inf")
        step = args.truth_interval if args.truth_interval > 0 else 0.2
        while not stop.is_set() and time.monotonic() < end:
            stop.wait(min(step, max(end - time.monotonic(), 0.0)))
            if args.truth_interval > 0:
                group.write_truth()
    finally:
        group.stop()
        for s, h in previous.items():
            signal.signal(s, h)
    print("stopped", flush=True)
    return 0
