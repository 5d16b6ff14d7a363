"""Acceptance (issue 30, item 1): every pod has its hit rate, in both llm-d modes.

Two pods in llm-d's central mode (a topic template on an endpoint kvobserve binds) and two pods
found through Kubernetes (the fixture API server), each a simulated vLLM serving `/metrics` on its
own pod address: with `metrics_url = "http://{pod_ip}:PORT/metrics"` each pod's engine is scraped
at its own address, so each pod's prefix-cache counters reach `/metrics`
(`kvobserve_worker_kv_lookups_total{result="hit"}`), `/api/v1/misses` and the status page, and the
miss split's hit tokens equal what each pod's engine counted.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvobserve.commands.embedded import start_embedded
from kvobserve.config import load_config
from kvobserve.simulate import SimConfig, SimulatedWorker
from kvobserve.simulate.ports import free_port, free_port_range
from tests.integration.collector_helpers import Sims, sim_finished
from tests.integration.fleet_helpers import fetch, scrape
from tests.integration.kube_api import RecordedApi, recorded_list

pytestmark = pytest.mark.integration
CENTRAL = ("127.0.0.6", "127.0.0.7")  # llm-d central mode: they connect to kvobserve
DISCOVERED = {
    "qwen-decode-7d4b9c6f5-2xkqp": "127.0.0.2",
    "qwen-decode-7d4b9c6f5-q7w2n": "127.0.0.4",
}
BATCHES = 300


def _listing() -> dict[str, Any]:
    """The recorded PodList with two Ready decode pods at DISCOVERED's addresses."""
    doc = recorded_list()
    (ready,) = [p for p in doc["items"] if p["metadata"]["name"].endswith("-2xkqp")]
    items = []
    for name, ip in DISCOVERED.items():
        pod = copy.deepcopy(ready)
        pod["metadata"]["name"] = name
        pod["status"]["podIP"] = ip
        pod["status"]["podIPs"] = [{"ip": ip}]
        items.append(pod)
    doc["items"] = items
    return doc


def _engine_hits(sim: SimulatedWorker, http: int) -> tuple[float, float]:
    """(hit tokens, query tokens) the pod's engine serves on its own /metrics."""
    text = fetch(f"http://{sim.cfg.host}:{http}/metrics")
    assert text is not None, f"{sim.cfg.host}: no /metrics"
    got = {"hits": 0.0, "queries": 0.0}
    for line in text.splitlines():
        for key in got:
            if line.startswith(f"vllm:prefix_cache_{key}_total"):
                got[key] += float(line.rsplit(" ", 1)[1])
    return got["hits"], got["queries"]


def _misses(base: str) -> dict[str, tuple[float, float]]:
    """worker_id -> (hit_tokens, query_tokens) in /api/v1/misses."""
    with urllib.request.urlopen(f"{base}/api/v1/misses", timeout=5.0) as r:
        doc = json.load(r)
    return {
        w["worker_id"]: (w["hit_tokens"], w["query_tokens"])
        for p in doc["pools"]
        for w in p["workers"]
        if w["hit_tokens"] is not None
    }


async def test_every_pod_has_its_hit_rate_in_both_llm_d_modes(tmp_path: Path, sims: Sims) -> None:
    ips = [*CENTRAL, *DISCOVERED.values()]
    http = free_port_range(ips, 1)  # every pod's engine serves HTTP on this port, its own address
    bind = free_port_range("127.0.0.1", 1)
    kv = free_port_range(list(DISCOVERED.values()), 2)  # discovered pods: KV port, replay + 1
    replay = free_port_range(list(CENTRAL), 1)
    api = await RecordedApi(listing=_listing()).start()
    listen = free_port()
    toml = f"""
[collector]
id = "c0"
interval_s = 0.2

[http]
listen = "127.0.0.1:{listen}"

[[worker]]
id = "llmd"
engine = "vllm"
dp_size = 1
bind = "tcp://127.0.0.1:{bind}"
topic = "kv@{{pod}}@{{model}}"
replay_endpoint = "tcp://{{pod_ip}}:{replay}"
metrics_url = "http://{{pod_ip}}:{http}/metrics"

[[worker]]
id = "qwen"
engine = "vllm"
dp_size = 1
metrics_url = "http://{{pod_ip}}:{http}/metrics"

[worker.kubernetes]
selector = "llm-d.ai/inference-serving=true"
port = {kv}
replay_port = {kv + 1}
topic = "kv@{{pod_ip}}:8000@"
kubeconfig = "{api.kubeconfig(tmp_path / "kubeconfig")}"
"""
    path = tmp_path / "kvobserve.toml"
    path.write_text(toml)
    cfg = load_config(str(path), {}, {})
    common = dict(format="vllm-0.33", dp_size=1, rate=300.0, max_batches=BATCHES,
                  http_port=http, prompts=40)  # fmt: skip
    pods = {
        f"llmd/{ip}:8000": sims.start(
            SimConfig(worker_id=f"c{i}", host=ip, kv_connect=f"tcp://127.0.0.1:{bind}",
                      replay_port=replay, topic=f"kv@{ip}:8000@m", start_delay_s=1.0, seed=i,
                      **common)  # type: ignore[arg-type]
        )
        for i, ip in enumerate(CENTRAL)
    }  # fmt: skip
    pods |= {
        f"qwen/{name}": sims.start(
            SimConfig(worker_id=name, host=ip, kv_port=kv, replay_port=kv + 1,
                      topic=f"kv@{ip}:8000@", start_delay_s=1.0, seed=10 + i, **common)  # type: ignore[arg-type]
        )
        for i, (name, ip) in enumerate(DISCOVERED.items())
    }  # fmt: skip
    emb = await start_embedded([cfg], cfg.http)
    try:
        end = time.monotonic() + 60.0
        while not all(sim_finished(s) for s in pods.values()):
            assert time.monotonic() < end, "the engines did not finish"
            await asyncio.sleep(0.1)  # polling interval, not synchronization
        engines = {wid: _engine_hits(s, http) for wid, s in pods.items()}
        assert all(h > 0 for h, _ in engines.values()), engines  # hits to compare
        base = f"http://127.0.0.1:{listen}"
        got: dict[str, tuple[float, float]] = {}
        while got != engines:  # the miss split's hit tokens are each pod engine's own
            assert time.monotonic() < end, f"/api/v1/misses {got} != the engines' {engines}"
            await asyncio.sleep(0.1)  # polling interval, not synchronization
            got = await asyncio.to_thread(_misses, base)
        s = await asyncio.to_thread(scrape, base)
        assert s is not None
        served = {
            labels["worker_id"]: v
            for labels, v in s.samples.get("kvobserve_worker_kv_lookups_total", [])
            if labels["result"] == "hit"
        }
        assert set(served) == set(pods), served  # every pod's hits on /metrics
        page = await asyncio.to_thread(fetch, f"{base}/")
        assert page is not None
        for wid, (hits, _) in engines.items():
            assert wid in page
            assert served[wid] == pytest.approx(hits / 16)  # in blocks of 16 tokens
        assert "hit rate" in page
    finally:
        await emb.close()
        await api.close()
