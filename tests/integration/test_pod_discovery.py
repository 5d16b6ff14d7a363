"""Kubernetes pod discovery: streams follow the pods of a label selector (docs/kubernetes.md).

A local API server plays recorded list and watch responses (tests/fixtures/kubernetes): pods
added, modified to Ready, made not Ready, terminating, deleted, and a watch that expires (410
Gone) while two pods change unwatched. The pods' IPs are loopback addresses where simulated vLLM
engines (dp_size 2, llm-d's per-pod topics, replay) publish, so that a stream connected to the
wrong pod fails instead of passing by accident. Every engine is already publishing when its pod
becomes visible, as a real one is: it publishes 20 batches per rank, pauses, then 40 more, so
kvobserve joins each pod mid-stream (in the pause) and recovers the start by replay.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvobserve.collector import Collector
from kvobserve.config import Config, KubernetesConfig, load_config
from kvobserve.simulate import SimulatedWorker
from kvobserve.simulate.faults import FaultConfig
from kvobserve.simulate.ports import free_port_range
from kvobserve.sources.kubernetes import PodWatch
from kvobserve.wire.snapshot import Snapshot
from tests.certs import self_signed
from tests.integration.collector_helpers import (
    Sims,
    resident,
    running_collector,
    sim_config,
    sim_finished,
    truth_instance,
    truth_resident,
    wait_snapshot,
)
from tests.integration.kube_api import RecordedApi, recorded_events
from tests.polling import until_async

pytestmark = pytest.mark.integration

RS = "qwen-decode-7d4b9c6f5"
IPS = {"2xkqp": "127.0.0.2", "8mz4t": "127.0.0.3", "q7w2n": "127.0.0.4", "zk9fd": "127.0.0.5"}
SELECTOR = "llm-d.ai/inference-serving=true"
MAX_BATCHES = 60
BEFORE = 20  # batches per rank published before the pod shows, then a pause ...
PAUSE_S = 60.0  # ... that ends when the test has seen kvobserve join (SimulatedWorker.resume)
FAST = {"backoff_s": (0.05, 0.5)}  # PodWatch options: retry quickly on loopback


def pod_config(tmp_path: Path, api: RecordedApi, port: int, **k8s: object) -> Config:
    """One [worker.kubernetes] worker (dp_size 2, replay) reaching `api` through a kubeconfig."""
    table = {
        "selector": SELECTOR,
        "port": port,
        "replay_port": port + 2,
        "topic": "kv@{pod_ip}:8000@",
        "kubeconfig": str(api.kubeconfig(tmp_path / "kubeconfig")),
        **k8s,
    }
    lines = "\n".join(
        f"{k} = {v!r}" if isinstance(v, str) else f"{k} = {v}" for k, v in table.items()
    )
    text = (
        '[collector]\nid = "c0"\ninterval_s = 0.2\n\n'
        '[[worker]]\nid = "qwen"\nengine = "vllm"\ndp_size = 2\n\n'
        f"[worker.kubernetes]\n{lines}\n"
    ).replace("'", '"')
    path = tmp_path / "pods.toml"
    path.write_text(text)
    return load_config(str(path), {}, {})


async def engine(sims: Sims, pod: str, port: int) -> SimulatedWorker:
    """The vLLM engine of one pod (dp_size 2 on the pod's IP, llm-d's topic, replay), once it
    has published BEFORE batches per rank and paused."""
    ip = IPS[pod]
    sim = sims.start(
        sim_config(
            "vllm-0.33", worker_id=pod, host=ip, kv_port=port, replay_port=port + 2,
            topic=f"kv@{ip}:8000@Qwen/Qwen3-32B", max_batches=MAX_BATCHES, rate=300.0,
            start_delay_s=0.0, faults=FaultConfig(stall_after=BEFORE, stall_s=PAUSE_S),
        )  # type: ignore[arg-type]
    )  # fmt: skip
    await until_async(lambda: published(sim) >= BEFORE, 10, f"engine of {pod} published {BEFORE}")
    return sim


def published(sim: SimulatedWorker) -> int:
    """Batches the engine published on its slowest rank."""
    return min(s.seq for st in sim.ranks for s in st.streams)


async def joined(col: Collector, sim: SimulatedWorker, want: Callable[[Snapshot], bool]) -> None:
    """`want` holds while the engine still pauses: its streams joined it mid-stream; then the
    engine goes on."""
    await wait_snapshot(col, want, what=f"the streams of {sim.cfg.worker_id}")
    assert published(sim) == BEFORE, f"slow joiner: {sim.cfg.worker_id} went on before we joined"
    sim.resume()


def pods_streaming(snap: Snapshot) -> dict[str, list[tuple[int, str]]]:
    """Pod -> [(dp_rank, endpoint)] of the snapshot's streams."""
    out: dict[str, list[tuple[int, str]]] = {}
    for s in sorted(snap.streams, key=lambda s: (s.worker_id, s.dp_rank)):
        assert s.worker_id.startswith(f"qwen/{RS}-"), s.worker_id
        out.setdefault(s.worker_id.rsplit("-", 1)[1], []).append((s.dp_rank, s.endpoint))
    return out


def streaming(*pods: str, port: int) -> Callable[[Snapshot], bool]:
    """Exactly these pods stream, each rank up at its pod's IP, and they are the declared workers."""
    want = {p: [(r, f"tcp://{IPS[p]}:{port + r}") for r in (0, 1)] for p in pods}

    def check(snap: Snapshot) -> bool:
        declared = {w.worker_id for w in snap.workers}
        return (
            pods_streaming(snap) == want
            and all(s.up for s in snap.streams)
            and declared == {f"qwen/{RS}-{p}" for p in pods}
        )

    return check


async def watched_up_to(col: Collector, resource_version: str) -> None:
    """Wait until the pod watch has applied the event of `resource_version`."""
    watch = col.pod_watches["qwen"]
    await until_async(
        lambda: watch.resource_version == resource_version,
        10,
        f"the watch at {resource_version}",
        lambda: f"watch at {watch.resource_version}",
    )


async def exact(col: Collector, sim: SimulatedWorker, pod: str) -> None:
    """Every rank of the pod's streams holds the engine's resident blocks and every batch."""
    await until_async(lambda: sim_finished(sim), 20, f"engine of {pod} finished")
    wid = f"qwen/{RS}-{pod}"

    def complete(snap: Snapshot) -> bool:
        mine = [s for s in snap.streams if s.worker_id == wid]
        return len(mine) == 2 and all(
            s.batches_total == MAX_BATCHES and not s.replaying for s in mine
        )

    snap = await wait_snapshot(col, complete, what=f"every batch of {pod}")
    for s in (s for s in snap.streams if s.worker_id == wid):
        # joined mid-stream: the first BEFORE batches came by one replay from seq 0
        assert s.replay_requests == {"ok": 1}, s
        assert (s.lost, s.restarts, s.state_complete) == (0, 0, True), s
        assert s.topic == f"kv@{IPS[pod]}:8000@"
    truth = sim.truth()
    for r in (0, 1):
        assert await resident(col, wid, r) == truth_resident(truth_instance(truth, r)), (pod, r)


async def test_streams_follow_pods_through_ready_delete_and_an_expired_watch(
    tmp_path: Path, sims: Sims
) -> None:
    events = recorded_events()
    port = free_port_range(tuple(IPS.values()), 4)
    api = await RecordedApi().start()
    engines = {"2xkqp": await engine(sims, "2xkqp", port)}  # Running and Ready in the first list
    try:
        async with running_collector(pod_config(tmp_path, api, port), pod_watch=FAST) as col:
            # The first list: the Ready pod streams; the Pending pod and the scheduler's own
            # pod (Ready, not selected) do not.
            await joined(col, engines["2xkqp"], streaming("2xkqp", port=port))
            (src,) = (await col.snapshot()).sources
            assert (src.worker_id, src.source, src.state) == ("qwen", "kubernetes", "up")
            assert src.endpoint == f"{api.url} pods in llm-d -l {SELECTOR}"
            assert api.requests[0] == ("list", {"labelSelector": SELECTOR})
            await exact(col, engines["2xkqp"], "2xkqp")

            # 8mz4t runs (and publishes) before its readiness probe passes: no stream yet ...
            engines["8mz4t"] = b = await engine(sims, "8mz4t", port)
            api.apply(events[0])
            await watched_up_to(col, "48220")
            assert pods_streaming(await col.snapshot()).keys() == {"2xkqp"}
            # ... Ready: its streams join
            api.apply(events[1])
            await joined(col, b, streaming("2xkqp", "8mz4t", port=port))
            await exact(col, b, "8mz4t")

            # q7w2n is created (Pending), then runs Ready
            api.apply(events[2])
            await watched_up_to(col, "48240")
            engines["q7w2n"] = await engine(sims, "q7w2n", port)
            api.apply(events[3])
            want = streaming("2xkqp", "8mz4t", "q7w2n", port=port)
            await joined(col, engines["q7w2n"], want)
            await exact(col, engines["q7w2n"], "q7w2n")

            # 8mz4t's readiness probe fails: its publisher goes on, so its streams stay, with
            # their sequence and block index (no restart, nothing re-counted)
            api.apply(events[4])
            await watched_up_to(col, "48263")
            assert want(await col.snapshot())
            await exact(col, b, "8mz4t")

            # 2xkqp terminates, then is deleted: its streams end at the first of the two
            api.apply(events[5])
            await wait_snapshot(col, streaming("8mz4t", "q7w2n", port=port), what="2xkqp ends")
            engines["2xkqp"].stop()
            api.apply(events[6])
            await watched_up_to(col, "48275")

            # The watch expires: meanwhile q7w2n was deleted and zk9fd came up Ready, unwatched.
            # kvobserve lists again: q7w2n's streams end, zk9fd's begin.
            engines["zk9fd"] = await engine(sims, "zk9fd", port)
            api.expire(events[7:9])
            engines["q7w2n"].stop()
            await joined(col, engines["zk9fd"], streaming("8mz4t", "zk9fd", port=port))
            watch = col.pod_watches["qwen"]
            assert (watch.expired_total, watch.lists_total) == (1, 2)

            # the new list's streams are up before the collector asks its next watch: wait
            # for that request, then nothing else may have come between
            def verbs() -> list[tuple[str, str | None]]:
                return [(verb, q.get("resourceVersion")) for verb, q in api.requests]

            await until_async(
                lambda: ("watch", "48302") in verbs(), 10, "the watch from the new list", verbs
            )
            expired = verbs().index(("watch", "48275"))
            assert verbs()[expired + 1 :] == [("list", None), ("watch", "48302")]
            await exact(col, engines["zk9fd"], "zk9fd")

            # the watch goes on from the new list: 8mz4t Ready again changes nothing
            api.apply(events[9])
            await watched_up_to(col, "48310")
            snap = await col.snapshot()
            assert streaming("8mz4t", "zk9fd", port=port)(snap)
            await exact(col, b, "8mz4t")
            said = [e.message for e in snap.events if e.kind == "discovery"]
            assert f"pod {RS}-2xkqp terminating: its streams end" in said
            assert f"pod {RS}-q7w2n deleted: its streams end" in said
            assert f"pod {RS}-zk9fd Running and Ready at 127.0.0.5: watching it" in said
            assert any(m.startswith("watch expired (410 Gone: too old resource") for m in said)
    finally:
        await api.close()


def source(snap: Snapshot) -> tuple[str, str]:
    """(state, reason) of the pod discovery of worker qwen."""
    (src,) = [s for s in snap.sources if s.source == "kubernetes"]
    return src.state, src.reason


async def test_an_api_server_that_fails_is_a_state_and_the_streams_stay(tmp_path: Path) -> None:
    port = free_port_range(tuple(IPS.values()), 4)
    api = RecordedApi()  # not serving yet
    cfg = pod_config(tmp_path, api, port)
    async with running_collector(cfg, pod_watch=FAST) as col:
        # nothing answers: connecting, with the reason; no stream, no crash
        snap = await wait_snapshot(col, lambda s: source(s)[0] == "connecting", what="refused")
        assert source(snap)[1].startswith(f"cannot reach {api.url}: ")
        assert snap.streams == [] and snap.workers == []
        # the server answers 403 (no RBAC): down, saying what the service account needs
        api.forbidden = True
        await api.start()
        snap = await wait_snapshot(col, lambda s: source(s)[0] == "down", what="forbidden")
        assert "HTTP 403 listing pods in llm-d" in source(snap)[1]
        assert 'cannot list resource "pods"' in source(snap)[1]
        assert "get, list and watch on pods" in source(snap)[1]
        # RBAC granted: the Ready pod's streams are watched (its engine is not up: connecting)
        api.forbidden = False
        snap = await wait_snapshot(col, lambda s: source(s)[0] == "up", what="granted")
        assert pods_streaming(snap).keys() == {"2xkqp"}
        # the API server goes away: the pods' streams stay (their engines do not depend on it)
        await api.close()
        snap = await wait_snapshot(col, lambda s: source(s)[0] == "connecting", what="API gone")
        assert pods_streaming(snap).keys() == {"2xkqp"}
        # and comes back: the watch resumes from where it was, no list needed
        again = await RecordedApi(port=api.port).start()
        try:
            api.apply(recorded_events()[0])  # the old instance: nobody hears it
            again.apply(recorded_events()[0])
            again.apply(recorded_events()[1])
            await wait_snapshot(col, lambda s: pods_streaming(s).keys() == {"2xkqp", "8mz4t"})
            assert source(await col.snapshot())[0] == "up"
            assert [verb for verb, _ in again.requests] == ["watch"]
        finally:
            await again.close()


async def test_in_a_pod_the_service_account_token_and_ca_are_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = self_signed(tmp_path / "tls")
    api = await RecordedApi(token="token-1", tls=(cert, key)).start()
    account = tmp_path / "serviceaccount"  # what the kubelet mounts
    account.mkdir()
    (account / "token").write_text("token-1")
    (account / "ca.crt").write_text(Path(cert).read_text())
    (account / "namespace").write_text("llm-d")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(api.port))
    # no namespace in the config: the pod's own, from its service account
    watch = PodWatch(
        "qwen",
        KubernetesConfig(selector=SELECTOR),
        service_account=str(account),
        backoff_s=(0.05, 0.5),
    )
    try:
        await watch.start()
        await until_async(
            lambda: watch.streams == {f"{RS}-2xkqp": "127.0.0.2"}, 10, "the first list"
        )
        assert (watch.server, watch.namespace) == (f"https://127.0.0.1:{api.port}", "llm-d")
        # the kubelet rotates the token: the server takes only the new one, the client reads it
        api.token = "token-2"
        (account / "token").write_text("token-2")
        api.expire(recorded_events()[:2])  # the watch ends; resuming gets 410, then a list
        await until_async(
            lambda: watch.lists_total == 2 and len(watch.streams) == 2, 10, "relisted"
        )
        assert (watch.health.state, watch.errors_total) == ("up", 0)
        refused = [q for verb, q in api.requests if verb == "watch"]
        assert len(refused) >= 2  # the resumed watch was asked twice: old token, new token
    finally:
        await watch.close()
        await api.close()


async def test_a_certificate_the_ca_did_not_sign_is_refused(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path / "server")
    other, _ = self_signed(tmp_path / "other")
    api = await RecordedApi(tls=(cert, key)).start()
    cfg = KubernetesConfig(
        selector=SELECTOR, kubeconfig=str(api.kubeconfig(tmp_path / "kubeconfig", ca=other))
    )
    watch = PodWatch("qwen", cfg, backoff_s=(0.05, 0.5))
    try:
        await watch.start()
        await until_async(lambda: watch.health.state == "connecting", 10, "refused")
        assert "CERTIFICATE_VERIFY_FAILED" in watch.health.reason, watch.health.reason
        assert watch.streams == {} and api.requests == []
    finally:
        await watch.close()
        await api.close()


def test_without_the_client_the_config_error_names_the_extra(tmp_path: Path) -> None:
    path = tmp_path / "pods.toml"
    path.write_text('[[worker]]\nengine = "vllm"\n[worker.kubernetes]\nselector = "app=vllm"\n')
    hide = "import sys; sys.modules['lightkube'] = None"  # as if not installed
    run = f"{hide}; from kvobserve.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", run, "check", "-c", str(path), "--no-discovery"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "kvobserve check: error: worker[0].kubernetes: pod discovery needs the Kubernetes "
        "client lightkube, which is not installed: pip install 'kvobserve[kubernetes]'"
    )


def test_check_outside_a_cluster_says_what_is_missing_and_how_to_check_the_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "pods.toml"
    path.write_text('[[worker]]\nengine = "vllm"\n[worker.kubernetes]\nselector = "app=vllm"\n')
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    env["HOME"] = str(tmp_path)  # no ~/.kube/config, no service account: not in a cluster
    argv = [sys.executable, "-m", "kvobserve", "check", "-c", str(path)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (
        "kvobserve check: error: worker[0].kubernetes: cannot list pods: no Kubernetes client "
        "configuration (Configuration file ~/.kube/config not found): outside a pod, set "
        "[worker.kubernetes] kubeconfig or $KUBECONFIG (`check --no-discovery` checks the file "
        "without listing them)"
    )
    proc = subprocess.run([*argv, "--no-discovery"], capture_output=True, text=True, timeout=60,
                          env=env)  # fmt: skip
    assert proc.returncode == 0 and "pods: listed at run time (--no-discovery)" in proc.stdout
