"""What a simulated engine's HTTP discovery endpoints return, exactly as each version serves them.

Pure functions of a worker's configuration and bound ports (facts from the engines' code: SGLang
`entrypoints/http_server.py` and `utils/common.py`, vLLM's API server; see docs/simulator.md),
one per discovery route (`ANSWERS`; the routes a version serves are its format's `api_routes`):
SGLang `GET /server_info` (flat server args, the `kv_events` block from 0.5.13, the 0.5.22
attention-DP `dp_size` rewrite, `kv_event_sources` only in gRPC mode: the parts a version has are
its format's `server_info`) and vLLM `GET /kv_event_sources` (from 0.31; configured endpoints per
managed rank, wildcards kept).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvobserve.simulate.ranks import Node

WILDCARD = "*"  # every simulated engine is launched with the engines' default `tcp://*:port`
_WILDCARD_BINDS = {"*": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


def kv_events_config(w: Node) -> dict[str, Any]:
    """The `--kv-events-config` the engine was launched with: wildcard endpoints, rank 0's ports."""
    c = w.cfg
    cfg: dict[str, Any] = {
        "publisher": "zmq",
        "endpoint": f"tcp://{WILDCARD}:{w.kv_base}",
        "topic": c.topic,
        "buffer_steps": c.buffer_steps,
        "hwm": c.hwm,
    }
    if w.replay_base is not None:
        cfg["replay_endpoint"] = f"tcp://{WILDCARD}:{w.replay_base}"
    return cfg


def _launch_command(w: Node, raw_config: str) -> str:
    c = w.cfg
    args = ["python", "-m", "sglang.launch_server", "--model-path", c.model_name]
    args += ["--dp-size", str(c.dp_size), "--nnodes", str(c.nnodes), "--node-rank", "0"]
    args += ["--enable-dp-attention"] if c.dp_attention else []
    args += ["--page-size", str(c.page_size), "--kv-events-config", raw_config]
    if w.load_base is not None:
        args += ["--load-publish-endpoint", f"tcp://{WILDCARD}:{w.load_base}"]
    if c.grpc_port is not None:
        args += ["--grpc-port", str(c.grpc_port)]
    return shlex.join(args)


def server_info(w: Node) -> dict[str, Any]:
    """SGLang `GET /server_info` (`/get_server_info`) of node 0, as this version builds it."""
    c, parts = w.cfg, w.fmt.server_info
    raw = json.dumps(kv_events_config(w))
    if "attn_dp_size" in parts:
        # --dp-size N --enable-dp-attention resolves to attn_dp_size=N, dp_size=1 (sglang #41818)
        attn_dp = c.dp_size if c.dp_attention else 1
        dp = 1 if c.dp_attention else c.dp_size
        layout: dict[str, Any] = {
            "dp_size": dp,
            "attn_dp_size": attn_dp,
            "enable_dp_attention": attn_dp > 1,  # synthesized from attn_dp_size
        }
    else:
        layout = {"dp_size": c.dp_size, "enable_dp_attention": c.dp_attention}
    info: dict[str, Any] = {
        "model_path": c.model_name,
        "served_model_name": c.model_name,
        "host": c.host,
        "port": w.http_port,
        "tp_size": 1,
        "pp_size": 1,
        **layout,
        "nnodes": c.nnodes,
        "node_rank": c.node_rank,
        "page_size": c.page_size,
        "kv_events_config": raw,
        "enable_metrics": True,
        "max_total_num_tokens": c.capacity_tokens,
        "max_running_requests": c.max_running_requests,
        "version": w.fmt.release,
    }
    if "launch_command" in parts:  # resolved_dict() replaced asdict()
        info["launch_command"] = _launch_command(w, raw)
        info["frontend"] = "python"
    if "grpc" in parts:
        info["grpc_port"] = c.grpc_port
        if c.grpc_port is not None:
            info["kv_event_sources"] = _sglang_sources(w)
    if "kv_events" in parts:
        info["kv_events"] = _kv_events_block(w)
    return info


def _kv_events_block(w: Node) -> dict[str, Any]:
    c, parts = w.cfg, w.fmt.server_info
    block: dict[str, Any] = {
        "publisher": "zmq",
        "endpoint_host": WILDCARD,  # as launched; a subscriber substitutes the worker's host
        "endpoint_port_base": w.kv_base,
        "topic": c.topic,
        "block_size": c.page_size,
        "dp_size": c.dp_size,  # 0.5.22+: num_dp_ranks = dp_size * attn_dp_size; before: dp_size
    }
    if w.load_base is not None and "load_endpoint" in parts:
        block["load_endpoint_port_base"] = w.load_base
        block["load_topic"] = "load"
    if "replay_base" in parts and w.replay_base is not None:
        block["replay_endpoint_port_base"] = w.replay_base
    return block


def _bound(host: str, port: int) -> str:
    """The engine's `describe_local_source` endpoint: the bound address, wildcards as loopback."""
    h = _WILDCARD_BINDS.get(host, host)
    return f"tcp://[{h}]:{port}" if ":" in h else f"tcp://{h}:{port}"


def _sglang_sources(w: Node) -> list[dict[str, Any]]:
    """gRPC mode: this node's local schedulers' sources, sorted by rank."""
    c = w.cfg
    out = []
    for st in sorted(w.ranks, key=lambda s: s.rank):
        src: dict[str, Any] = {
            "dp_rank": st.rank,
            "endpoint": _bound(c.host, st.port),
            "topic": c.topic,
            "block_size": c.page_size,
        }
        if st.replay_port is not None:
            src["replay_endpoint"] = _bound(c.host, st.replay_port)
        out.append(src)
    return out


def kv_event_sources(w: Node) -> dict[str, Any]:
    """vLLM `GET /kv_event_sources`: `{dp_rank: KVEventsConfig}` for the ranks this server manages.

    `endpoint` is the configured endpoint offset by the rank: a wildcard host stays a wildcard.
    """
    c = w.cfg
    out: dict[str, Any] = {}
    for r in c.managed_ranks():
        replay = None if w.replay_base is None else f"tcp://{WILDCARD}:{w.replay_base + r}"
        out[str(r)] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://{WILDCARD}:{w.kv_base + r}",
            "replay_endpoint": replay,
            "buffer_steps": c.buffer_steps,
            "hwm": c.hwm,
            "max_queue_size": 100_000,
            "topic": c.topic,
        }
    return out


# The answer of each discovery route a simulated engine serves.
ANSWERS: dict[str, Callable[[Node], dict[str, Any]]] = {
    "/server_info": server_info,
    "/get_server_info": server_info,  # the name before SGLang 0.5 deprecated it
    "/kv_event_sources": kv_event_sources,
}
