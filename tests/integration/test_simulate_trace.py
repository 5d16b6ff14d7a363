"""A trace replayed by running simulated engines on two loopback nodes, over real sockets."""

from __future__ import annotations

import dataclasses
import heapq
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvobserve.analysis.blocks import BlockIndex
from kvobserve.analysis.misses import PoolMisses
from kvobserve.simulate import SimConfig, SimulatorGroup, nodes_of
from kvobserve.wire.kv_events import decode_message

pytestmark = pytest.mark.integration

FIXTURE = Path(__file__).parents[1] / "fixtures" / "traces" / "mooncake-conversation.jsonl.gz"
HOSTS = ["127.0.0.1", "127.0.0.2"]
KINDS = ("compulsory", "capacity", "placement")
STUCK_S = 30.0  # nothing received and no request served for this long: the replay is stuck
BASE = SimConfig(
    worker_id="trace", format="vllm-0.33", dp_size=4, nnodes=2, trace=str(FIXTURE),
    trace_seconds=180.0, speed=0.0, route="random", capacity_tokens=1_000_000, page_size=32,
    start_delay_s=1.0, rate=0.0, replay_port=None,
)  # fmt: skip


def _replay(group: SimulatorGroup) -> dict[str, Any]:
    (doc,) = group.truth()["replays"]
    return doc


def _vllm_queries(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        s.labels["engine"]: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "vllm:prefix_cache_queries_total"
    }


@pytest.mark.timeout(300)
def test_a_trace_on_two_nodes_puts_the_truth_on_the_wire() -> None:
    group = SimulatorGroup(nodes_of(BASE, hosts=HOSTS)).start()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        assert _replay(group)["requests_served"] == 0  # the start delay: observers first
        kv = {e.dp_rank: e.url for e in group.endpoints() if e.kind == "kv"}
        assert sorted(kv) == [0, 1, 2, 3]
        assert all(kv[r].startswith(f"tcp://{HOSTS[r // 2]}:") for r in kv)  # its node's address
        subs: dict[Any, int] = {}
        for r, url in kv.items():
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVHWM, 0)
            sub.connect(url)
            subs[sub] = r
        indexes = {r: BlockIndex() for r in kv}
        pool = PoolMisses()
        for r, ix in indexes.items():
            pool.attach(r, ix)
        last = dict.fromkeys(kv, -1)
        batches: dict[int, list[Any]] = {r: [] for r in kv}
        streams = {st.rank: st.streams[0] for w in group.workers for st in w.ranks}  # type: ignore[union-attr]
        poller = zmq.Poller()
        for sub in subs:
            poller.register(sub, zmq.POLLIN)
        # CPU-bound (the engines' threads and this decoder share one process): on a busy
        # machine it takes longer, so the deadline is on progress: it fails when neither the
        # replay nor any rank's batches moved for STUCK_S (pytest's timeout bounds the whole)
        moved, progress = time.monotonic(), None
        while True:
            doc = _replay(group)
            if (
                doc["done"]
                and doc["pending_events"] == 0
                and all(last[r] == streams[r].seq - 1 for r in kv)
            ):
                break
            now = (doc["requests_served"], tuple(last.values()))
            if now != progress:
                moved, progress = time.monotonic(), now
            assert time.monotonic() - moved < STUCK_S, (doc, last)
            for sock, _ in poller.poll(100):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    b = decode_message(frames)
                    r = subs[sock]
                    assert b.seq == last[r] + 1  # nothing lost on loopback
                    last[r] = b.seq
                    batches[r].append(b)
        # Applied in the order the publishers made them (their stamps), not the order this loop
        # read them: a loaded machine drains one socket far ahead of the others.
        made = heapq.merge(
            *([(r, b) for b in bs] for r, bs in batches.items()), key=lambda x: x[1].ts
        )
        for r, b in made:
            indexes[r].apply_batch(b)
        truth = _replay(group)
        assert truth["requests_served"] == truth["requests"] > 100
        pages = truth["pool"]["pages"]
        assert truth["pool"]["unstored_pages"] == 0
        for r, ix in indexes.items():
            assert ix.resident_hashes().get("GPU", set()) == set(streams[r].cache.nodes)
        got = pool.totals()
        assert got.total == sum(pages[k] for k in KINDS)  # every miss was one store
        for k in KINDS:  # the ranks' batches arrive in another order than they were made
            assert abs(getattr(got, k) - pages[k]) <= 0.02 * got.total, k
        assert pages["placement"] > 0.05 * got.total  # random routing recomputes elsewhere
        assert pages["capacity"] > 0
        # vLLM's prefix-cache queries count the prompt tokens of the requests each rank got
        http = next(e.url for e in group.endpoints() if e.kind == "http")
        queries = _vllm_queries(http)
        assert queries == {str(r): float(t["prompt_tokens"]) for r, t in truth["ranks"].items()}
    finally:
        ctx.destroy(linger=0)
        group.stop()


def test_the_replay_keeps_the_traces_time_at_its_speed() -> None:
    cfg = dataclasses.replace(BASE, format="sglang-0.5.23", trace_seconds=12.0, speed=4.0,
                              rate=100.0, start_delay_s=0.5)  # fmt: skip
    group = SimulatorGroup(nodes_of(cfg, hosts=HOSTS)).start()
    t0 = time.monotonic()
    try:
        reqs = _replay(group)["requests"]
        trace = group.replays[0].requests
        span = (trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1000 / cfg.speed
        assert span > 2.0
        seen_partial = False
        while not _replay(group)["done"]:
            served = _replay(group)["requests_served"]
            seen_partial |= 0 < served < reqs
            assert time.monotonic() - t0 < 30, served
            time.sleep(0.05)  # polling interval
        took = time.monotonic() - t0
        assert took >= cfg.start_delay_s + span - 0.1  # not before the trace's time
        assert seen_partial
        assert all(w.ranks for w in group.workers)  # the engines stay up after the last one
    finally:
        group.stop()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--trace", "nope.jsonl"], "trace: nope.jsonl"),
        (["--trace", str(FIXTURE), "--route", "nearest"], "route: 'nearest'"),
        (["--trace", str(FIXTURE), "--dp-size", "4", "--nnodes", "2"],
         "run all nodes in one process"),
        (["--trace", str(FIXTURE), "--page-size", "48"], "page_size: 48 must divide"),
    ],
)  # fmt: skip
def test_trace_mistakes_are_named(args: list[str], needle: str) -> None:
    cmd = [sys.executable, "-m", "kvobserve", "simulate", "--no-http", "--duration", "1", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert needle in proc.stderr
