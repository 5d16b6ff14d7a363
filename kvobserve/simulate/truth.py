"""Ground truth of a simulated worker: what each publisher instance published and holds."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from kvobserve.simulate.cache import Hash

if TYPE_CHECKING:
    from kvobserve.simulate.ranks import RankState
    from kvobserve.simulate.stream import SimStream
    from kvobserve.simulate.worker import SimulatedWorker

TRUTH_VERSION = 1


def hash_json(h: Hash) -> int | str:
    """A hash as `tap` prints it: the integer, or lowercase hex for 32-byte hashes."""
    return h.hex() if isinstance(h, bytes) else h


def stream_truth(s: SimStream) -> dict[str, Any]:
    """One publisher instance: counters, dropped seqs and the resident block set per medium."""
    medium = s.gpu  # a version without medium means the GPU tier
    resident = {medium: [hash_json(h) for h in sorted(s.cache.nodes, key=_sort_key)]}
    tokens = {medium: s.cache.used_tokens}
    if s.cpu is not None:
        resident[s.cpu_medium] = [hash_json(h) for h in sorted(s.cpu.pages, key=_sort_key)]
        tokens[s.cpu_medium] = s.cpu.used_tokens
    return {
        "instance": s.instance,
        "kind": s.kind,
        "rank_label": s.label,
        "batches": s.seq,  # seqs assigned: 0 .. batches-1
        "batches_sent": s.batches_sent,
        "events": s.events,
        "live_dropped_seqs": list(s.live_dropped),
        "ring_dropped_seqs": list(s.ring_dropped),
        "malformed_seqs": list(s.malformed),
        "ended_by_restart": s.ended,
        "resident": resident,
        "resident_tokens": tokens,
        "held_tokens": s.held_tokens,  # held by running requests: the scheduler's usage * capacity
        "preempted_requests": s.preempted,
        "requests": s.requests,
        "prefix_cache_hit_rate": round(s.hit_rate, 6),
        "batches_made": s.made,  # numbered or not
        "unnumbered_dropped": list(s.unnumbered_dropped),  # `made` indexes lost before numbering
        **s.ledger.truth(),  # restores, recomputed_elsewhere, tier_moves, unread_removed, LoRA
    }


def _sort_key(h: Hash) -> Any:
    return h


def _rank_truth(st: RankState) -> dict[str, Any]:
    return {
        "port": st.port,
        "replay_port": st.replay_port,
        "mirror_of": st.mirror_of,
        "restarts": st.restarts,
        "replay_requests": st.replay_requests,  # answered, with `replay_batches` batches in all
        "replay_batches": st.replay_batches,
        "instances": [stream_truth(s) for s in (*st.past, *st.streams)],
    }


def build_truth(w: SimulatedWorker) -> dict[str, Any]:
    """The whole truth document of one worker node."""
    c = w.cfg
    return {
        "truth_version": TRUTH_VERSION,
        "worker_id": c.worker_id,
        "format": c.format,
        "engine": w.fmt.engine,
        "node_rank": c.node_rank,
        "nnodes": c.nnodes,
        "dp_size": c.dp_size,
        "topic": c.topic,
        "capacity_tokens": c.capacity_tokens,
        "page_size": c.page_size,
        "seed": c.seed,
        "kv_port_base": w.kv_base,
        "replay_port_base": w.replay_base,
        "ranks": {str(st.rank): _rank_truth(st) for st in w.ranks},
        "stray": _rank_truth(w.stray) if w.stray is not None else None,
        "bind_failures": list(w.bind_failures),
    }


def write_truth(path: str, data: dict[str, Any]) -> None:
    """Write atomically (temp file + rename) so a reader never sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
