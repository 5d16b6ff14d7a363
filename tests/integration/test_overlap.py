"""Acceptance: where would a request hit, exact for every rank across two nodes and collectors.

Two simulated workers over node 0 (127.0.0.1) and node 1 (127.0.0.2): SGLang 0.5.23 (signed
64-bit hashes, DP attention) and vLLM 0.33 (32-byte hashes), 4 ranks each, small caches so the
ranks hold different prefixes. Two `kvobserve collect` processes (one per node) and one
`kvobserve aggregate` over a real nats-server. Once the engines have published everything, for
every prompt of the simulators' libraries, /api/v1/overlap gives every rank exactly the leading
blocks its cache holds (the simulator's truth); a prefix held by no rank gives 0 everywhere;
`kvobserve overlap` prints the same, from arguments and from `kvobserve tap` piped in; then
node 1's collector stops and its ranks are reported missing. Embedded (both collectors and the
aggregator in one process, the local bus) answers the same.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import select
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvobserve.commands.embedded import start_embedded
from kvobserve.config import HttpConfig, load_config
from kvobserve.simulate import SimConfig, SimulatorGroup, nodes_of
from kvobserve.simulate.cache import PromptLibrary
from kvobserve.simulate.ports import free_port
from kvobserve.simulate.truth import hash_json
from kvobserve.sources.ingest_options import IngestOptions
from kvobserve.sources.kv_stream import IngestLoop
from tests.integration.conftest import NatsServer
from tests.integration.fleet_helpers import ROOT, Procs, clean_env, fetch, write_toml
from tests.polling import until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

HOSTS = ("127.0.0.1", "127.0.0.2")
MAX_BATCHES = 120
INTERVAL = 0.5
BASE = SimConfig(
    dp_size=4, nnodes=2, topic="kv-events", rate=40.0, max_batches=MAX_BATCHES, prompts=60,
    capacity_tokens=1024, start_delay_s=4.0, http_port=None, seed=11,
)  # fmt: skip
WORKERS = {
    "sg": dataclasses.replace(BASE, worker_id="sg", format="sglang-0.5.23"),
    "vl": dataclasses.replace(BASE, worker_id="vl", format="vllm-0.33", topic="", seed=12),
}
Chain = list[int | str]  # hashes as `kvobserve tap` prints them


@dataclasses.dataclass
class Fleet:
    """The simulated workers (one group of two nodes each) and their prompt libraries."""

    groups: dict[str, SimulatorGroup]

    def chains(self, wid: str) -> list[Chain]:
        """Every prompt of the worker's library as its block hashes in order."""
        c = WORKERS[wid]
        lib = PromptLibrary(c.seed, c.wire.hash_kind, c.page_size, c.prompts, c.prefixes, c.zipf_s)
        return [[hash_json(p.hash) for p in prompt] for prompt in lib.prompts]

    def resident(self, wid: str) -> dict[int, set[int | str]]:
        """dp_rank -> the GPU blocks its engine holds now (the truth)."""
        out: dict[int, set[int | str]] = {}
        for node in self.groups[wid].workers:
            for rank, st in node.truth()["ranks"].items():
                (inst,) = st["instances"]
                out[int(rank)] = set(inst["resident"]["GPU"])
        return out

    def batches(self) -> dict[tuple[str, int], int]:
        out = {}
        for wid, g in self.groups.items():
            for node in g.workers:
                for rank, st in node.truth()["ranks"].items():
                    out[(wid, int(rank))] = st["instances"][-1]["batches"]
        return out


def leading(chain: Sequence[int | str], resident: set[int | str]) -> int:
    """The truth: how many of `chain`, from the first, the rank holds."""
    n = 0
    for h in chain:
        if h not in resident:
            break
        n += 1
    return n


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    groups: dict[str, SimulatorGroup] = {}
    try:
        for wid, cfg in WORKERS.items():
            groups[wid] = SimulatorGroup(nodes_of(cfg, HOSTS)).start()
        yield Fleet(groups)
    finally:
        for g in groups.values():
            g.stop()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    p.stop_all()


def _config(path: Path, fleet: Fleet, nats: str | None) -> Path:
    """One file for both nodes: wildcard endpoints, each collector connects to its own node."""
    workers = []
    for wid, g in fleet.groups.items():
        n0 = g.workers[0]
        w: dict[str, Any] = {
            "id": wid,
            "engine": n0.fmt.engine,
            "kv_endpoint": f"tcp://*:{n0.kv_base}",
            "replay_endpoint": f"tcp://*:{n0.replay_base}",
            "dp_size": BASE.dp_size,
        }
        if n0.cfg.topic:
            w["topic"] = n0.cfg.topic
        if n0.fmt.engine == "sglang":
            w["dp_attention"] = True
        workers.append(w)
    doc: dict[str, Any] = {
        "cluster": "ov",
        "collector": {"nnodes": 2, "interval_s": INTERVAL},
        "worker": workers,
    }
    if nats is not None:
        doc["nats"] = {"url": nats}
    return write_toml(path, doc)


def ask(base: str, chain: Chain, pool: str | None = None) -> dict[str, Any]:
    """GET /api/v1/overlap for `chain`."""
    query = {"hashes": ",".join(map(str, chain))} | ({"pool": pool} if pool else {})
    url = f"{base}/api/v1/overlap?{urllib.parse.urlencode(query)}"
    with urllib.request.urlopen(url, timeout=10) as r:
        doc: dict[str, Any] = json.loads(r.read())
    return doc


def counts(doc: dict[str, Any]) -> dict[tuple[str, int], int | None]:
    """(worker, dp_rank) -> leading_blocks of an answer (each rank once)."""
    out: dict[tuple[str, int], int | None] = {}
    for r in doc["ranks"]:
        key = (r["worker_id"], r["dp_rank"])
        assert key not in out, f"{key} answered twice: {doc}"
        out[key] = r["leading_blocks"]
    return out


def cli(*args: str, stdin_text: str | None = None) -> subprocess.CompletedProcess[str]:
    """`kvobserve overlap ARGS`, with `stdin_text` on its stdin (None: an empty stdin)."""
    return subprocess.run(
        [sys.executable, "-m", "kvobserve", "overlap", *args], capture_output=True, text=True,
        timeout=30, env=clean_env(), cwd=ROOT, input=stdin_text or "",
    )  # fmt: skip


def table(text: str) -> dict[tuple[str, int], int | None]:
    """(worker, dp_rank) -> LEADING of `kvobserve overlap`'s table."""
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("WORKER"))
    out: dict[tuple[str, int], int | None] = {}
    for line in lines[head + 1 :]:
        if not line.strip():
            break
        w, _node, rank, lead = line.split()[:4]
        out[(w, int(rank))] = None if lead == "-" else int(lead)
    return out


def settled(base: str, fleet: Fleet) -> bool:
    """Every rank up at the aggregator with every batch its engine published."""
    text = fetch(f"{base}/api/v1/streams")
    if text is None:
        return False
    got = {(s["worker_id"], s["dp_rank"]): (s["batches"], s["up"]) for s in json.loads(text)}
    want = {k: (n, True) for k, n in fleet.batches().items()}
    return got == want and all(n == MAX_BATCHES for n, _ in want.values())


def check_every_prompt(base: str, fleet: Fleet) -> None:
    """Every prompt of each library: every rank of the pool exactly as its engine holds it."""
    varied = partial = 0
    for wid in WORKERS:
        resident = fleet.resident(wid)
        for chain in fleet.chains(wid):
            doc = ask(base, chain, wid)
            assert doc["missing"] == [] and doc["hashes"] == len(chain)
            truth = {(wid, r): leading(chain, s) for r, s in resident.items()}
            assert counts(doc) == truth, chain
            nodes = {(r["dp_rank"], r["node_rank"], r["collector"]) for r in doc["ranks"]}
            assert nodes == {(r, r // 2, f"node-{r // 2}") for r in range(4)}
            varied += len(set(truth.values())) > 1
            partial += any(0 < n < len(chain) for n in truth.values())
    # the case the walk must get right: ranks that differ, prefixes held only in part
    assert varied >= 5 and partial >= 5, (varied, partial)


def test_overlap_over_nats_two_nodes_exact_then_a_collector_down(
    fleet: Fleet, nats_server: NatsServer, procs: Procs, tmp_path: Path
) -> None:
    cfg = _config(tmp_path / "kvobserve.toml", fleet, nats_server.url)
    agg_port = free_port()
    agg = f"http://127.0.0.1:{agg_port}"
    procs.kvobserve(
        "aggregate", "aggregate", "--nats", nats_server.url, "--cluster", "ov",
        "--listen", f"127.0.0.1:{agg_port}",
    )  # fmt: skip
    collectors = {}
    for k, host in enumerate(HOSTS):
        collectors[k] = procs.kvobserve(
            f"node-{k}", "collect", "-c", str(cfg), "--listen", f"127.0.0.1:{free_port()}",
            "--collector-id", f"node-{k}", "--node-rank", str(k), "--collector-host", host,
        )  # fmt: skip

    def logs() -> str:
        return "\n".join(f"--- {p.args}\n{log.read_text()[-1500:]}" for p, log in procs.started)

    until(lambda: settled(agg, fleet), 60, "every rank's batches at the aggregator", logs)
    check_every_prompt(agg, fleet)

    # --- held by no rank: a fresh first block stops the walk, however much follows ----------
    for wid, fresh in (("sg", 12345), ("vl", "ab" * 32)):
        chain = fleet.chains(wid)[0]
        assert any(leading(chain, s) for s in fleet.resident(wid).values())
        doc = ask(agg, [fresh, *chain], wid)
        assert counts(doc) == {(wid, r): 0 for r in range(4)}

    # --- no pool: every rank of the fleet; the other worker's ranks hold none of it ----------
    sg_chain = max(fleet.chains("sg"), key=lambda c: leading(c, fleet.resident("sg")[2]))
    doc = ask(agg, sg_chain)
    assert doc["pool"] is None and doc["workers"] == ["sg", "vl"]
    truth = {("sg", r): leading(sg_chain, s) for r, s in fleet.resident("sg").items()}
    truth |= {("vl", r): 0 for r in range(4)}
    assert counts(doc) == truth and truth[("sg", 2)] > 0

    # --- the CLI prints the same: hashes as arguments, and `kvobserve tap` piped in ----------
    got = cli("--url", agg, "--pool", "sg", *map(str, sg_chain))
    assert got.returncode == 0, got.stderr
    assert table(got.stdout) == {k: v for k, v in truth.items() if k[0] == "sg"}
    best = max(truth.values())
    assert f"most: {best} of {len(sg_chain)} blocks, on " in got.stdout
    js = cli("--url", agg, "--pool", "sg", "--json", *map(str, sg_chain))
    assert json.loads(js.stdout) == ask(agg, sg_chain, "sg")

    node1 = fleet.groups["vl"].workers[1]  # rank 2's first batch, replayed, fed to overlap
    tap = subprocess.run(
        [sys.executable, "-m", "kvobserve", "tap", f"tcp://{HOSTS[1]}:{node1.kv_base + 2}",
         "--replay-endpoint", f"tcp://{HOSTS[1]}:{node1.replay_base + 2}", "--from-seq", "0",
         "--count", "1", "--timeout", "10"],
        capture_output=True, text=True, timeout=30, env=clean_env(), cwd=ROOT,
    )  # fmt: skip
    assert tap.returncode == 0, tap.stderr
    stored = [
        h
        for ev in json.loads(tap.stdout)["events"]
        if ev["type"] == "BlockStored"
        for h in ev["block_hashes"]
    ]
    piped = cli("--url", agg, "--pool", "vl", stdin_text=tap.stdout)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.startswith(f"{len(stored)} hashes asked of pool vl (vl)")
    truth = {("vl", r): leading(stored, s) for r, s in fleet.resident("vl").items()}
    assert table(piped.stdout) == truth and any(truth.values())

    # --- node 1's collector stops: its ranks are reported, without a count -------------------
    rc, _ = procs.terminate(collectors[1])
    assert rc == 0
    resident = fleet.resident("sg")
    for chain in fleet.chains("sg")[:3]:
        doc = ask(agg, chain, "sg")
        assert doc["missing"] == ["node-1"]
        assert counts(doc) == {
            **{("sg", r): leading(chain, resident[r]) for r in (0, 1)},
            **{("sg", r): None for r in (2, 3)},
        }
        for r in doc["ranks"]:
            if r["dp_rank"] >= 2:
                assert r["collector"] == "node-1" and r["node_rank"] == 1
                assert "node-1" in r["reason"], r
    down = cli("--url", agg, "--pool", "sg", *map(str, fleet.chains("sg")[0]))
    assert down.returncode == 1, down.stdout + down.stderr
    assert "missing: node-1 did not answer" in down.stdout
    assert table(down.stdout)[("sg", 3)] is None


async def test_overlap_embedded_answers_through_the_local_bus(fleet: Fleet, tmp_path: Path) -> None:
    """Embedded mode (`kvobserve run`, `demo`): both nodes' collectors and the aggregator in one
    process, no NATS: the question goes to the collectors through the local bus."""
    configs = []
    for k, host in enumerate(HOSTS):
        path = _config(tmp_path / f"node-{k}.toml", fleet, None)
        text = path.read_text().replace(
            "[collector]\n", f'[collector]\nid = "node-{k}"\nnode_rank = {k}\nhost = "{host}"\n'
        )
        path.write_text(text)
        configs.append(load_config(str(path), {}, {}))
    listen = f"127.0.0.1:{free_port()}"
    emb = await start_embedded(configs, HttpConfig(listen=listen))
    try:
        base = f"http://{listen}"

        def answered() -> None:
            until(lambda: settled(base, fleet), 60, "every rank in the embedded aggregator")
            check_every_prompt(base, fleet)

        await asyncio.to_thread(answered)  # the loop serves while the checks ask
    finally:
        await emb.close()


def test_overlap_bad_requests_say_what_is_wrong(fleet: Fleet, procs: Procs, tmp_path: Path) -> None:
    """The usual mistakes, at the API (400 with the reason) and at the CLI (exit 2, one line)."""
    cfg = _config(tmp_path / "one.toml", fleet, None)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    pid = procs.kvobserve("run", "run", "-c", str(cfg), "--listen", f"127.0.0.1:{port}")
    until(
        lambda: fetch(f"{base}/api/v1/fleet") is not None, 30, "run serving", lambda: procs.log(pid)
    )

    def status_of(query: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"{base}/api/v1/overlap{query}", timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    code, text = status_of("")
    assert code == 400 and "hashes: required" in text
    code, text = status_of("?hashes=1,0xdeadbeef")
    assert code == 400 and "item 2" in text and "'0xdeadbeef'" in text
    code, text = status_of("?hashes=" + ",".join(["ab" * 32] * 4097))
    assert code == 400 and "4097 given, at most 4096" in text
    code, text = status_of("?hashes=" + ",".join(["ab" * 32] * 4096))
    assert code == 200, text
    code, text = status_of("?hashes=1&pool=nope")
    assert code == 400 and "pool 'nope'" in text

    bad = cli("--url", base, "12", "0x1f")
    assert bad.returncode == 2 and "hash 2 of 2" in bad.stderr and "'0x1f'" in bad.stderr
    short = cli("--url", base, "ab" * 31)
    assert short.returncode == 2 and repr("ab" * 31) in short.stderr
    pool = cli("--url", base, "--pool", "nope", "-5")  # a negative hash is not a flag
    assert pool.returncode == 2 and "HTTP 400" in pool.stderr and "pool 'nope'" in pool.stderr
    gone = cli("--url", f"127.0.0.1:{free_port()}", "1")
    assert gone.returncode == 2 and "cannot reach" in gone.stderr
    empty = cli("--url", base)
    assert empty.returncode == 2 and "no hashes on stdin" in empty.stderr


def test_a_call_wakes_the_ingest_thread_at_once() -> None:
    """An overlap question waits for no tick of the ingest loop: with a 60 s tick, a call is
    still answered (the socket pair wakes the poll)."""
    loop = IngestLoop([], IngestOptions(tick_s=60.0))
    loop.start()
    try:
        for i in range(3):  # each call wakes it again
            assert loop.call(lambda i=i: i).result(timeout=10) == i
        assert loop.overlap([1, 2]).result(timeout=10) == []
        # and the wake-up is read: a byte left behind would make every poll return at once,
        # the ingest thread spinning a whole core (zmq names a ready OS socket by its fd)
        until(
            lambda: not select.select([loop._wake_rx], [], [], 0)[0],
            10,
            "the wake-up byte read by the ingest thread",
        )
    finally:
        loop.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        loop.call(lambda: 0).result(timeout=1)


async def test_a_collector_answers_the_first_question_after_it_subscribed(
    nats_server: NatsServer,
) -> None:
    """serve_overlap returns once the server has the subscription: the very first question
    reaches every collector. With nats-py's flush() alone a question missed one now and then
    (its PING overtakes the buffered SUB), more often the busier the machine: 60 rounds."""
    from kvobserve.transport.nats import NatsTransport

    async def echo(data: bytes) -> bytes:
        return data

    for attempt in range(60):
        ends = [NatsTransport(nats_server.url, f"first{attempt}", name=f"t{i}") for i in range(3)]
        try:
            for t in ends:
                await t.connect()
            for t in ends[1:]:
                await t.serve_overlap("collector", echo)
            got: list[bytes] = []

            def take(data: bytes, got: list[bytes] = got) -> bool:
                got.append(data)
                return len(got) == 2

            await ends[0].ask_overlap(b"q", 5.0, take)
            assert got == [b"q", b"q"], f"attempt {attempt}: {len(got)} of 2 answered"
        finally:
            for t in ends:
                await t.close()
