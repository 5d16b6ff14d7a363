"""deploy/kubernetes/llm-d-relay: the relaying collector, its Service, NetworkPolicy and
PodDisruptionBudget, and the example llm-d model server in central mode, checked offline like the
stack (schemas of the pinned Kubernetes, kustomize, the config read by kvobserve's own loader) and
against each other: everything in the one namespace the kustomization names, the engines connect
where kvobserve binds (a Service port per DP rank), their topic is what its template reads, their
replay port is where it asks, the relay target is not kvobserve itself, and the NetworkPolicy
admits exactly these flows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvobserve.config.bind import TopicTemplate, fill_pod
from kvobserve.sources.plan import plan_worker
from tests.integration.k8s_helpers import (
    ROOT,
    Overlay,
    container_env,
    containers,
    expand,
    kubectl_selects,
    overlays,
    rule_ports,
    selector_string,
    tcp,
)
from tests.integration.test_kubernetes import KUBERNETES_VERSION, VERSION

pytestmark = pytest.mark.integration

OVERLAY = Overlay("llm-d-relay", "vllm-decode-central.yaml", "kvobserve-llm-d-relay-7c9d8-q4wz2")


def test_the_overlay_is_what_kustomize_builds_and_valid_for_the_pinned_kubernetes() -> None:
    assert OVERLAY.root in overlays()
    built = OVERLAY.built_as_listed()  # as written, in the kustomization's namespace and image
    assert sorted(o["kind"] for o in built) == [
        "ConfigMap", "Deployment", "NetworkPolicy", "PodDisruptionBudget", "Service",
    ]  # fmt: skip
    OVERLAY.validate(KUBERNETES_VERSION)


def test_the_engines_namespace_is_set_in_one_place() -> None:
    OVERLAY.assert_in_one_namespace()


def test_the_collector_pod_loads_its_config_binds_its_port_and_is_locked_down(
    tmp_path: Path,
) -> None:
    OVERLAY.assert_locked_down(VERSION)
    spec = OVERLAY.find("Deployment")["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False  # it reads no Kubernetes API
    c = OVERLAY.collector()
    cfg = OVERLAY.config(tmp_path)
    assert cfg.nats is not None  # the stack's NATS (assert_nats_and_dns checks the Service)
    assert cfg.nats.url == container_env(c, OVERLAY.pod_name)["KVOBSERVE_NATS_URL"]
    assert (cfg.cluster, cfg.collector.id) == ("prod-a", "llm-d-relay")
    (w,) = cfg.workers
    plan = plan_worker(0, w, cfg.collector, None)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    # every rank's bound port is a container port, and the pod is ready once rank 0's is bound
    assert w.dp_size == 2 and len(plan.listens) == w.dp_size
    assert [int(x.endpoint.rpartition(":")[2]) for x in plan.listens] == [
        ports[f"kv-events-{r}"] for r in range(w.dp_size)
    ]
    assert c["readinessProbe"]["tcpSocket"]["port"] == "kv-events-0"
    assert cfg.http.listen == f"0.0.0.0:{ports['http']}"
    assert c["livenessProbe"]["httpGet"]["port"] == "http"


def test_the_engines_connect_to_the_service_and_name_their_pod_in_the_topic(
    tmp_path: Path,
) -> None:
    cfg = OVERLAY.config(tmp_path)
    (w,) = cfg.workers
    service = OVERLAY.find("Service")
    selector = OVERLAY.find("Deployment")["spec"]["selector"]["matchLabels"]
    assert service["spec"]["selector"] == selector
    # a Service port per DP rank, each the port that rank's listener binds, by container port
    plan = plan_worker(0, w, cfg.collector, None)
    bound = [int(x.endpoint.rpartition(":")[2]) for x in plan.listens]
    target = {p["name"]: p["containerPort"] for p in OVERLAY.collector()["ports"]}
    assert [(p["port"], target[p["targetPort"]]) for p in service["spec"]["ports"]] == [
        (b, b) for b in bound
    ]
    flags, text = OVERLAY.engine_flags()
    events = json.loads(text)
    name = service["metadata"]["name"]
    # a named host, the Service in the engines' own namespace: vLLM connects (it binds only *,
    # :: and ipc:// endpoints); rank r connects to the port + r, the Service's port r
    assert events["endpoint"] == f"tcp://{name}:{bound[0]}"
    assert f"--data-parallel-size={w.dp_size}" in flags
    (c,) = containers(OVERLAY.engine()["spec"]["template"]["spec"])
    env = {e["name"]: e.get("value", "") for e in c["env"]} | {"POD_IP": "10.4.2.17"}
    topic = expand(events["topic"], env)
    fields = TopicTemplate.parse(w.topic, "topic").match(topic)
    assert fields == {"pod": "10.4.2.17:8000", "model": "Qwen/Qwen3-32B"}
    assert f"--port={fields['pod'].rpartition(':')[2]}" in [expand(a, env) for a in flags]
    # kvobserve asks the pod's own replay sockets, at the ports the engine binds and exposes
    replay_port = int(events["replay_endpoint"].rpartition(":")[2])
    assert events["replay_endpoint"] == f"tcp://*:{replay_port}"
    assert fill_pod(w.replay_endpoint, fields["pod"]) == f"tcp://10.4.2.17:{replay_port}"
    assert {replay_port + r for r in range(w.dp_size)} <= {p["containerPort"] for p in c["ports"]}
    # and scrapes each pod's vLLM where it serves, named by the same topic
    assert w.metrics_url is not None
    assert fill_pod(w.metrics_url, fields["pod"]) == f"http://10.4.2.17:{env['POD_PORT']}/metrics"
    # the relay target is the scheduler's Service in the same namespace, another host
    assert w.relay_to == "tcp://llm-d-epp:5556" and name not in w.relay_to


def test_the_network_policy_admits_exactly_the_relay_s_flows(tmp_path: Path) -> None:
    cfg = OVERLAY.config(tmp_path)
    (w,) = cfg.workers
    plan = plan_worker(0, w, cfg.collector, None)
    port = {s: [int(str(getattr(x, s)).rpartition(":")[2]) for x in plan.listens]
            for s in ("endpoint", "relay_to")}  # fmt: skip
    policy = OVERLAY.policy(tmp_path)
    engine = OVERLAY.engine()["spec"]["template"]
    # in: the engine pods, to the ports the ranks bind
    (ingress,) = policy["spec"]["ingress"]
    (peer,) = ingress["from"]
    assert set(peer) == {"podSelector"}  # pods of the relay's own namespace
    labels = [
        engine["metadata"]["labels"],
        OVERLAY.find("Deployment")["spec"]["template"]["metadata"]["labels"],
    ]
    assert kubectl_selects(selector_string(peer["podSelector"]), labels, tmp_path) == [True, False]
    assert rule_ports(ingress) == tcp(*port["endpoint"])
    # out: the scheduler's ports (relay_to + rank) on its namespace's pods, the engine pods'
    # replay ports (replay_endpoint + rank) and metrics port, NATS, DNS
    rules = OVERLAY.assert_nats_and_dns(policy["spec"]["egress"], tmp_path)
    (scheduler,) = [r for r in rules if r["to"] == [{"podSelector": {}}]]
    assert rule_ports(scheduler) == tcp(*port["relay_to"])
    (engines,) = [r for r in rules if r is not scheduler]
    assert engines["to"] == [peer]  # the same pods that connect in
    (c,) = containers(engine["spec"])
    metrics = int(next(e["value"] for e in c["env"] if e["name"] == "POD_PORT"))  # its --port
    replay = int(str(w.replay_endpoint).rpartition(":")[2])
    assert rule_ports(engines) == tcp(range(replay, replay + w.dp_size), metrics)


def test_the_disruption_budget_makes_an_eviction_wait_for_you() -> None:
    OVERLAY.assert_pdb()


def test_docs_name_the_overlay_files() -> None:
    OVERLAY.assert_docs_name_files()


def test_the_docs_show_the_overlay_s_config_and_engine_flags() -> None:
    text = (ROOT / "docs" / "deployment.md").read_text()
    OVERLAY.assert_docs_show(
        text.split("## llm-d: central mode with a relay", 1)[1].split("\n## ", 1)[0]
    )
