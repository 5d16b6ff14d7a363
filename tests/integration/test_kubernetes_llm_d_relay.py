"""deploy/kubernetes/llm-d-relay: the relaying collector, its Service and the example llm-d model
server in central mode, checked offline like the stack (schemas of the pinned Kubernetes,
kustomize, the config read by kvobserve's own loader) and against each other: the engines connect
where kvobserve binds, their topic is what its template reads, their replay port is where it asks,
and the relay target is not kvobserve itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvobserve.config.bind import TopicTemplate, fill_replay
from kvobserve.sources.plan import plan_worker
from tests.integration.k8s_helpers import (
    NAMESPACE,
    ROOT,
    Overlay,
    configmap_data,
    containers,
    expand,
    overlays,
)
from tests.integration.test_kubernetes import KUBERNETES_VERSION, VERSION

pytestmark = pytest.mark.integration

OVERLAY = Overlay("llm-d-relay", "vllm-decode-central.yaml", "kvobserve-llm-d-relay-7c9d8-q4wz2")


def test_the_overlay_is_what_kustomize_builds_and_valid_for_the_pinned_kubernetes() -> None:
    assert OVERLAY.root in overlays()
    built = OVERLAY.built_as_listed()
    assert sorted((o["kind"], o["metadata"]["namespace"]) for o in built) == [
        ("ConfigMap", NAMESPACE), ("Deployment", NAMESPACE), ("Service", NAMESPACE),
    ]  # fmt: skip
    OVERLAY.validate(KUBERNETES_VERSION)


def test_the_collector_pod_loads_its_config_binds_its_port_and_is_locked_down(
    tmp_path: Path,
) -> None:
    OVERLAY.assert_locked_down(VERSION)
    spec = OVERLAY.find("Deployment")["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False  # it reads no Kubernetes API
    c = OVERLAY.collector()
    cfg = OVERLAY.config(tmp_path)
    assert cfg.nats is not None
    assert cfg.nats.url == configmap_data("kvobserve-env")["KVOBSERVE_NATS_URL"]
    assert (cfg.cluster, cfg.collector.id) == ("prod-a", "llm-d-relay")
    (w,) = cfg.workers
    plan = plan_worker(0, w, cfg.collector, None)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    # every rank's bound port is a container port, and the pod is ready once the first is bound
    assert [int(x.endpoint.rpartition(":")[2]) for x in plan.listens] == [ports["kv-events"]]
    assert c["readinessProbe"]["tcpSocket"]["port"] == "kv-events"
    assert cfg.http.listen == f"0.0.0.0:{ports['http']}"
    assert c["livenessProbe"]["httpGet"]["port"] == "http"


def test_the_engines_connect_to_the_service_and_name_their_pod_in_the_topic(
    tmp_path: Path,
) -> None:
    (w,) = OVERLAY.config(tmp_path).workers
    service = OVERLAY.find("Service")
    (port,) = service["spec"]["ports"]
    selector = OVERLAY.find("Deployment")["spec"]["selector"]["matchLabels"]
    assert service["spec"]["selector"] == selector
    assert port["targetPort"] == "kv-events" and port["port"] == int(w.bind.rpartition(":")[2])
    flags, text = OVERLAY.engine_flags()
    events = json.loads(text)
    name, ns = service["metadata"]["name"], service["metadata"]["namespace"]
    # a named host: vLLM connects (it binds only *, :: and ipc:// endpoints)
    assert events["endpoint"] == f"tcp://{name}.{ns}.svc.cluster.local:{port['port']}"
    (c,) = containers(OVERLAY.engine()["spec"]["template"]["spec"])
    env = {e["name"]: e.get("value", "") for e in c["env"]} | {"POD_IP": "10.4.2.17"}
    topic = expand(events["topic"], env)
    fields = TopicTemplate.parse(w.topic, "topic").match(topic)
    assert fields == {"pod": "10.4.2.17:8000", "model": "Qwen/Qwen3-32B"}
    assert f"--port={fields['pod'].rpartition(':')[2]}" in [expand(a, env) for a in flags]
    # kvobserve asks the pod's own replay socket, at the port the engine binds and exposes
    replay_port = int(events["replay_endpoint"].rpartition(":")[2])
    assert events["replay_endpoint"] == f"tcp://*:{replay_port}"
    assert fill_replay(w.replay_endpoint, fields["pod"]) == f"tcp://10.4.2.17:{replay_port}"
    assert replay_port in {p["containerPort"] for p in c["ports"]}
    # the relay target is the scheduler's Service, another host than kvobserve's
    assert w.relay_to.startswith("tcp://llm-d-epp.llm-d.svc") and name not in w.relay_to


def test_docs_name_the_overlay_files() -> None:
    OVERLAY.assert_docs_name_files()


def test_the_docs_show_the_overlay_s_config_and_engine_flags() -> None:
    text = (ROOT / "docs" / "deployment.md").read_text()
    OVERLAY.assert_docs_show(
        text.split("## llm-d: central mode with a relay", 1)[1].split("\n## ", 1)[0]
    )
