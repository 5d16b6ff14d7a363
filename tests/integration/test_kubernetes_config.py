"""The shared kvobserve.toml of deploy/kubernetes, read by kvobserve's own loader with exactly the
environment each pod gets: the setting and variable names of the manifests are the loader's."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvobserve.config import load_config
from kvobserve.sources.plan import plan_worker
from tests.integration.k8s_helpers import (
    configmap_data,
    container_env,
    find,
    lws_sidecar_env,
)

pytestmark = pytest.mark.integration


def _shared_file(tmp_path: Path) -> str:
    path = tmp_path / "kvobserve.toml"
    path.write_text(configmap_data("kvobserve-config")["kvobserve.toml"])
    return str(path)


@pytest.mark.parametrize("worker", [0, 1])
def test_each_collector_pod_loads_the_shared_config(tmp_path: Path, worker: int) -> None:
    pod, env = lws_sidecar_env(0, worker)
    cfg = load_config(_shared_file(tmp_path), {}, env)
    assert cfg.cluster == "prod-a"
    assert cfg.collector.id == pod
    assert (cfg.collector.node_rank, cfg.collector.nnodes) == (worker, 2)
    assert cfg.collector.host == "127.0.0.1"
    (w,) = cfg.workers
    assert (w.id, w.engine, w.dp_size, w.dp_attention) == ("sglang-dp8-0", "sglang", 8, True)
    assert (w.kv_endpoint, w.replay_endpoint, w.topic) == (
        "tcp://*:5557",
        "tcp://*:5657",
        "kv-events",
    )
    assert w.leader is (worker == 0)
    plan = plan_worker(0, w, cfg.collector, None)
    assert list(plan.watched_ranks) == list(range(4 * worker, 4 * worker + 4))
    # each pod reads its own engine's /metrics (its ranks' scheduler values), the worker too
    assert [(s.source, s.scope, s.endpoints) for s in plan.scheduler] == [
        ("metrics", "node", ("http://127.0.0.1:30000/metrics",))
    ]
    assert cfg.nats is not None
    assert (cfg.nats.url, cfg.nats.jetstream_kv) == ("nats://nats:4222", True)


def test_the_aggregator_pod_loads_the_shared_config(tmp_path: Path) -> None:
    sts = find("StatefulSet", "kvobserve-aggregator")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    env = container_env(
        container,
        "kvobserve-aggregator-1",
        labels={"apps.kubernetes.io/pod-index": "1"},
    )
    env["KVOBSERVE_AGGREGATOR_SHARDS"] = "2"  # two replicas: the pod with index 1 is shard 1
    cfg = load_config(_shared_file(tmp_path), {}, env)
    assert (cfg.aggregator.shards, cfg.aggregator.shard) == (2, 1)
    assert cfg.http.listen == "0.0.0.0:9477"
    assert cfg.nats is not None and cfg.nats.url == "nats://nats:4222"
    assert cfg.nats.jetstream_kv is True
