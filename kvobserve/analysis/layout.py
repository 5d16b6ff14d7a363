"""DP-rank ownership across collector nodes, and the engines' per-rank port rules.

The engines' rules, as docs/collector.md states them: rank r publishes on port base + r (both
engines' `offset_endpoint_port`); an SGLang scheduler publishes as its attention-DP rank under DP
attention, else as its DP rank (from 0.5.16, `select_kv_publisher_dp_rank`); pure-DP SGLang runs
every rank's scheduler on the leader node. A wildcard host in an endpoint means the node that
owns the rank (`on_node`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from kvobserve.config import WILDCARD_HOSTS

ENGINES: Final = ("sglang", "vllm")
# SGLang 0.5.16 added select_kv_publisher_dp_rank (PR #29211); before, pure DP collided on rank 0
SGLANG_DP_RANK_SELECTION: Final = (0, 5, 16)


def _check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}: must be one of {', '.join(ENGINES)}")


def _check_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r}: must be an integer")
    if value < minimum:
        raise ValueError(f"{name}={value}: must be >= {minimum}")


def owned_ranks(node_rank: int, nnodes: int, dp_size: int) -> range:
    """The contiguous DP ranks node `node_rank` of `nnodes` owns; every rank is owned exactly once."""
    # uneven: the first dp_size % nnodes nodes own one more (6 over 4: 2, 2, 1, 1);
    # dp_size < nnodes: the last nodes own none
    _check_int("nnodes", nnodes, 1)
    _check_int("dp_size", dp_size, 1)
    _check_int("node_rank", node_rank, 0)
    if node_rank >= nnodes:
        raise ValueError(f"node_rank={node_rank}: must be < nnodes={nnodes}")
    per_node, extra = divmod(dp_size, nnodes)
    start = node_rank * per_node + min(node_rank, extra)
    return range(start, start + per_node + (1 if node_rank < extra else 0))


def watched_ranks(
    engine: str, dp_attention: bool, node_rank: int, nnodes: int, dp_size: int
) -> range:
    """The DP ranks whose KV-event streams this node's collector watches."""
    # Pure-DP SGLang (no DP attention) runs every rank's scheduler on the leader node: node 0
    # watches all, the others none. DP-attention SGLang and vLLM split the ranks contiguously
    # over the nodes.
    _check_engine(engine)
    ranks = owned_ranks(node_rank, nnodes, dp_size)  # validates the numbers
    if engine == "sglang" and not dp_attention:
        return range(dp_size) if node_rank == 0 else range(0)
    return ranks


def offset_endpoint(endpoint: str, rank: int, engine: str) -> str:
    """The endpoint DP rank `rank` publishes on (the engines' `offset_endpoint_port`)."""
    # rank 0 or empty: unchanged; tcp: port + rank (IPv6 [..] hosts work; vLLM leaves port 0, an
    # OS-chosen port, alone); inproc: name_dp{rank}; anything else (ipc too) raises, as both do
    _check_engine(engine)
    _check_int("rank", rank, 0)
    if rank == 0 or not endpoint:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if not endpoint.startswith("tcp://"):
        raise ValueError(
            f"endpoint={endpoint!r}: only tcp:// and inproc:// endpoints can be offset per DP rank"
        )
    host, sep, port_text = endpoint.rpartition(":")
    if not sep or host == "tcp" or not port_text.isdigit():
        raise ValueError(f"endpoint={endpoint!r}: no port after the last ':'")
    port = int(port_text)
    if port == 0 and engine == "vllm":
        return endpoint
    if port + rank > 65535:
        raise ValueError(f"endpoint={endpoint!r}: port {port} + dp rank {rank} exceeds 65535")
    return f"{host}:{port + rank}"


def publisher_rank(
    engine: str,
    version_tuple: tuple[int, ...],
    dp_attention: bool,
    attn_dp_rank: int,
    dp_rank: int | None,
) -> int:
    """The rank whose port (and batch rank field) a scheduler publishes KV events on."""
    # vLLM: its DP rank. SGLang >= 0.5.16 (select_kv_publisher_dp_rank): attn_dp_rank under DP
    # attention, else dp_rank (0 when unset). Older SGLang always used attn_dp_rank, which is 0
    # on every scheduler under pure DP: all ranks collide on the base port (PR #29211).
    _check_engine(engine)
    if engine == "vllm":
        return dp_rank or 0
    if dp_attention or tuple(version_tuple) < SGLANG_DP_RANK_SELECTION:
        return attn_dp_rank
    return dp_rank or 0


def parse_version(text: str) -> tuple[int, ...]:
    """`"0.5.16"` or `"0.5.16.post1"` -> (0, 5, 16); the leading numeric parts only."""
    parts: list[int] = []
    for piece in text.strip().lstrip("v").split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break
    if not parts:
        raise ValueError(f"version={text!r}: no leading number")
    return tuple(parts)


def endpoint_host(endpoint: str) -> str | None:
    """The host of a `tcp://host:port` endpoint, brackets dropped ("" when absent); else None."""
    scheme, sep, rest = endpoint.partition("://")
    if scheme != "tcp" or not sep:
        return None
    if rest.startswith("["):
        host, sep, port = rest[1:].partition("]:")
    else:
        host, sep, port = rest.rpartition(":")
    return host if sep and port.isdigit() else None


def on_node(endpoint: str, host: str) -> str:
    """The endpoint as the node that owns the rank reaches it.

    A wildcard (`*`, `0.0.0.0`, `::`) or absent tcp host means "the node that owns the rank":
    it becomes `host` (that node's `[collector] host`). Any other endpoint is used as given.
    """
    h = endpoint_host(endpoint)
    if h is None or h not in WILDCARD_HOSTS:
        return endpoint
    port = endpoint.rpartition(":")[2]
    return f"tcp://{bracket(host)}:{port}"


def bracket(host: str) -> str:
    """IPv6 literals are bracketed in endpoints and URLs."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def is_node_local(endpoint: str) -> bool:
    """A tcp endpoint with a wildcard or absent host: each node connects at its own address."""
    return endpoint_host(endpoint) in WILDCARD_HOSTS


def ranged(ranks: Iterable[int]) -> str:
    """`0-3`, `5`, `0-1, 4` or `none`."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ", ".join(str(x[0]) if len(x) == 1 else f"{x[0]}-{x[-1]}" for x in runs) or "none"
