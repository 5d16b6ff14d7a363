"""Where would a request hit: the per-rank lookup and the end-to-end API latency, in one run.

Run: `python -m benchmarks.overlap [--resident 65536] [--requests 300]`. Dynamo's KV indexer
answers the same question (which worker holds how much of this request's prefix) in about 8 µs
(its README: p99 under 10 µs); that is the reference the ratios are printed against.

In-process: a `BlockIndex` holding `--resident` blocks (chains of 256 blocks, signed 64-bit
hashes as SGLang publishes them) is asked `leading_blocks` for a request of 16, 64 and 256
blocks all held (the walk's longest path), and for one whose first block is missing; then one
collector's whole answer for 8 such ranks (`sources/overlap.py rank_overlaps`, what the ingest
thread runs per question), and its encoding.

Live: `kvobserve simulate` publishes an 8-rank SGLang worker over two loopback nodes (127.0.0.1:
ranks 0-3, 127.0.0.2: ranks 4-7) the whole time; two `kvobserve collect` processes (one per node)
and `kvobserve aggregate` run over a real nats-server. This process asks
`GET /api/v1/overlap?pool=...&hashes=...` `--requests` times over one keep-alive connection, for
the simulator's prompts (12-24 blocks), and `GET /healthz` as often on the same connection (the
HTTP round trip alone); every answer must list the 8 ranks with nobody missing.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import random
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec

from benchmarks._common import (
    HOSTS,
    NatsServer,
    free_port,
    median,
    node_collector_toml,
    percentile,
    sim_endpoints,
    spawn_kvobserve,
    stop_process,
)
from kvobserve.analysis.blocks import BlockIndex
from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.simulate import SimConfig
from kvobserve.simulate.cache import PromptLibrary
from kvobserve.sources.overlap import rank_overlaps
from kvobserve.wire.kv_events import decode_payload
from kvobserve.wire.overlap import OverlapReply, encode_overlap

CLUSTER = "bench"
DYNAMO_US = 8.0  # Dynamo's indexer per question (issue 23; its README: p99 under 10 µs)
CHAIN = 256  # blocks per stored chain
RANKS = 8


# --- in-process: the walk -----------------------------------------------------------------------


def chains(n_blocks: int, seed: int = 1) -> list[list[int]]:
    """`n_blocks` distinct signed 64-bit hashes in chains of CHAIN blocks."""
    rng = random.Random(seed)
    seen: set[int] = set()
    while len(seen) < n_blocks:
        seen.add(rng.getrandbits(64) - (1 << 63))
    flat = list(seen)
    return [flat[i : i + CHAIN] for i in range(0, n_blocks, CHAIN)]


def filled_index(stored: list[list[int]]) -> BlockIndex:
    """A BlockIndex holding `stored`, applied as the engines' batches (one chain a batch)."""
    idx = BlockIndex()
    enc = msgspec.msgpack.encode
    for seq, chain in enumerate(stored):
        ev = {"type": "BlockStored", "block_hashes": chain, "parent_block_hash": None,
              "token_ids": [], "block_size": 16, "lora_id": None, "medium": "GPU"}  # fmt: skip
        idx.apply_batch(decode_payload("kv-events", seq, enc([1.0 + seq, [ev], 0])))
    return idx


def per_call_us(fn: Any, arg: Any, calls: int, rounds: int = 5) -> float:
    """The best of `rounds` of `calls` calls of fn(arg), in µs per call."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(arg)
        best = min(best, time.perf_counter() - t0)
    return best / calls * 1e6


def lookup_costs(resident: int, calls: int = 20_000) -> dict[str, float]:
    """µs per lookup: requests of 16, 64, 256 held blocks, a miss at the first block; one
    collector's answer over RANKS such ranks (64 blocks), and that answer's encoding."""
    stored = chains(resident)
    idx = filled_index(stored)
    want = stored[len(stored) // 2]
    out: dict[str, float] = {}
    for n in (16, 64, 256):
        request = want[:n]
        assert idx.leading_blocks(request) == n
        out[f"held {n}"] = per_call_us(idx.leading_blocks, request, max(1, calls * 16 // n))
    miss = [12345, *want[:63]]
    assert idx.leading_blocks(miss) == 0
    out["miss first"] = per_call_us(idx.leading_blocks, miss, calls)
    # the same blocks on every rank: each walks the whole request
    streams = [("w", r, StreamSequencer(r, replay=False, index=idx), True) for r in range(RANKS)]
    request = want[:64]
    out["answer"] = per_call_us(lambda h: rank_overlaps(streams, h), request, calls // 8)
    reply = OverlapReply("node-0", 0, rank_overlaps(streams, request))
    out["encode"] = per_call_us(encode_overlap, reply, calls)
    return out


# --- live: simulator, two collectors, NATS, the aggregator's API ---------------------------------


def _streams_up(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/api/v1/streams", timeout=5) as r:
            streams = json.load(r)
    except OSError:
        return False
    # complete: each index holds every block its engine stored (a lower bound otherwise)
    return len(streams) == RANKS and all(
        s["up"] and s["batches"] > 0 and s["trust"] == "complete" for s in streams
    )


def _timed_get(conn: http.client.HTTPConnection, path: str) -> tuple[float, bytes]:
    t0 = time.perf_counter()
    conn.request("GET", path)
    resp = conn.getresponse()
    body = resp.read()
    took = time.perf_counter() - t0
    if resp.status != 200:
        raise RuntimeError(f"GET {path[:80]}: HTTP {resp.status}: {body[:200]!r}")
    return took, body


async def nats_floor(url: str, requests: int) -> list[float]:
    """Latencies (s) of the same question over the same nats-server, answered at once by two
    answerers in this process: NATS's share of an answer."""
    from kvobserve.transport.nats import NatsTransport

    ends = [NatsTransport(url, "floor", name=f"floor-{i}") for i in range(3)]
    for t in ends:
        await t.connect()

    async def answer(data: bytes) -> bytes:
        return data

    try:
        for t in ends[1:]:
            await t.serve_overlap(t.servers[0], answer)
        out = []
        for _ in range(requests):
            got: list[bytes] = []

            def take(d: bytes, got: list[bytes] = got) -> bool:
                got.append(d)
                return len(got) == 2

            t0 = time.perf_counter()
            await ends[0].ask_overlap(b"?", 5.0, take)
            out.append(time.perf_counter() - t0)
            if len(got) != 2:
                raise RuntimeError("a floor answer did not come")
        return out
    finally:
        for t in ends:
            await t.close()


def live(requests: int, workdir: Path) -> dict[str, list[float]]:
    """Latencies (s) of /api/v1/overlap, of /healthz and of NATS alone, on the running fleet."""
    cfg = SimConfig(worker_id=CLUSTER)  # the simulator's defaults: its prompt library
    lib = PromptLibrary(cfg.seed, "int64", cfg.page_size, cfg.prompts, cfg.prefixes, cfg.zipf_s)
    prompts = [",".join(str(p.hash) for p in prompt) for prompt in lib.prompts]
    procs: list[subprocess.Popen[bytes]] = []
    with NatsServer(workdir / "nats.log") as nats_server:
        try:
            sim = spawn_kvobserve(
                ["simulate", "--worker-id", CLUSTER, "--dp-size", str(RANKS), "--nnodes", "2",
                 "--all-nodes", "--node-hosts", ",".join(HOSTS), "--rate", "50",
                 "--start-delay", "4", "--no-http"],
                workdir / "sim.log", pipe=True,
            )  # fmt: skip
            procs.append(sim)
            urls = sim_endpoints(sim)
            kv, replay = (int(urls[k][0].rsplit(":", 1)[1]) for k in ("kv", "replay"))
            port = free_port()
            base = f"http://127.0.0.1:{port}"
            serve = ["aggregate", "--nats", nats_server.url, "--cluster", CLUSTER]
            serve += ["--listen", f"127.0.0.1:{port}"]
            procs.append(spawn_kvobserve(serve, workdir / "aggregate.log"))
            for node in (0, 1):
                toml = node_collector_toml(
                    workdir / f"node-{node}.toml", CLUSTER, node, RANKS, nats_server.url, kv, replay
                )
                argv = ["collect", "-c", str(toml), "--no-local-http"]
                procs.append(spawn_kvobserve(argv, workdir / f"n{node}.log"))
            deadline = time.monotonic() + 60
            while not _streams_up(base):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"8 streams not up in 60 s (logs in {workdir})")
                time.sleep(0.1)  # polling interval
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            out: dict[str, list[float]] = {"overlap": [], "healthz": [], "held": []}
            for i in range(requests):
                path = f"/api/v1/overlap?pool={CLUSTER}&hashes={prompts[i % len(prompts)]}"
                took, body = _timed_get(conn, path)
                doc = json.loads(body)
                if doc["missing"] or len(doc["ranks"]) != RANKS:
                    raise RuntimeError(f"an incomplete answer: {doc}")
                out["overlap"].append(took)
                out["held"].append(max(r["leading_blocks"] or 0 for r in doc["ranks"]))
                out["healthz"].append(_timed_get(conn, "/healthz")[0])
            conn.close()
            out["nats"] = asyncio.run(nats_floor(nats_server.url, requests))
            return out
        finally:
            for p in reversed(procs):
                stop_process(p)


# --- report ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run both parts; 0."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--resident", type=int, default=65_536, help="blocks in the index")
    p.add_argument("--requests", type=int, default=300, help="API requests in the live part")
    p.add_argument("--no-live", action="store_true", help="the in-process part only")
    args = p.parse_args(argv)
    print(f"where would a request hit (reference: Dynamo's indexer, ~{DYNAMO_US:g} µs a question)")
    c = lookup_costs(args.resident)
    print(f"per-rank lookup, BlockIndex.leading_blocks over {args.resident:,} resident blocks:")
    for n in (16, 64, 256):
        us = c[f"held {n}"]
        print(f"  {n:>3} blocks, all held   {us:7.2f} µs   {us / DYNAMO_US:5.2f}x Dynamo's")
    print(f"  first block missing      {c['miss first']:7.2f} µs")
    print(
        f"one collector's answer, {RANKS} ranks x 64 blocks: {c['answer']:.1f} µs in the ingest "
        f"thread, + {c['encode']:.1f} µs to encode"
    )
    if not args.no_live:
        with tempfile.TemporaryDirectory() as d:
            lat = live(args.requests, Path(d))
        ms = {k: [1e3 * x for x in v] for k, v in lat.items() if k != "held"}
        o, h, q = ms["overlap"], ms["healthz"], ms["nats"]
        print(
            f"GET /api/v1/overlap over NATS, 2 collectors ({', '.join(HOSTS)}), {RANKS} ranks, "
            f"{args.requests} requests of 12-24 blocks (at most {max(lat['held']):.0f} held):"
        )
        print(f"  p50 {median(o):.2f} ms  p99 {percentile(o, 0.99):.2f} ms  max {max(o):.2f} ms")
        print(
            f"  of which HTTP alone (/healthz) p50 {median(h):.2f} ms, NATS alone (the question "
            f"answered at once by 2 answerers here) p50 {median(q):.2f} ms p99 "
            f"{percentile(q, 0.99):.2f} ms"
        )
        print(
            f"  p50 {1e3 * median(o) / DYNAMO_US:,.0f}x Dynamo's in-process lookup; the rest is "
            "the collectors' turns (loop, ingest thread, loop) on a loaded machine"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
