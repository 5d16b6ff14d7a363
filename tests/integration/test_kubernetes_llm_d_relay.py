"""deploy/kubernetes/llm-d-relay: the relaying collector, its Service and the example llm-d model
server in central mode, checked offline like the stack (schemas of the pinned Kubernetes,
kustomize, the config read by kvobserve's own loader) and against each other: the engines connect
where kvobserve binds, their topic is what its template reads, their replay port is where it asks,
and the relay target is not kvobserve itself."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from kvobserve.config import load_config
from kvobserve.config.bind import TopicTemplate, fill_replay
from kvobserve.sources.plan import plan_worker
from tests.integration.k8s_helpers import (
    K8S,
    NAMESPACE,
    ROOT,
    configmap_data,
    container_env,
    containers,
    expand,
    kustomize,
    kvobserve_args,
    manifests,
    overlays,
)
from tests.integration.test_kubernetes import KUBERNETES_VERSION, VERSION

pytestmark = pytest.mark.integration

OVERLAY = K8S / "llm-d-relay"
EXAMPLE = "vllm-decode-central.yaml"
Obj = dict[str, Any]


def _objects() -> list[tuple[str, Obj]]:
    return [(name, o) for name, docs in manifests(OVERLAY).items() for o in docs]


def _find(kind: str) -> Obj:
    (found,) = [o for name, o in _objects() if o["kind"] == kind and name != EXAMPLE]
    return found


def _engine() -> Obj:
    (obj,) = manifests(OVERLAY)[EXAMPLE]
    return obj


def _collector() -> Obj:
    (c,) = _find("Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def _config(tmp_path: Path) -> Any:
    """The collector's kvobserve.toml, loaded with the environment its pod gets."""
    (text,) = _find("ConfigMap")["data"].values()
    path = tmp_path / "kvobserve.toml"
    path.write_text(text)
    env = container_env(_collector(), "kvobserve-llm-d-relay-7c9d8-q4wz2")
    return load_config(str(path), {}, {k: v for k, v in env.items() if k.startswith("KVOBSERVE_")})


def _kv_events(engine: Obj) -> dict[str, Any]:
    (c,) = containers(engine["spec"]["template"]["spec"])
    flags = c["args"]
    events: dict[str, Any] = json.loads(flags[flags.index("--kv-events-config") + 1])
    return events


def test_the_overlay_is_what_kustomize_builds_and_valid_for_the_pinned_kubernetes() -> None:
    assert OVERLAY in overlays()
    built = kustomize(OVERLAY)
    listed = [o for name, docs in manifests(OVERLAY).items() if name != EXAMPLE for o in docs]

    def key(o: Obj) -> tuple[str, str]:
        return o["kind"], o["metadata"]["name"]

    assert sorted(built, key=key) == sorted(listed, key=key)
    assert sorted((o["kind"], o["metadata"]["namespace"]) for o in built) == [
        ("ConfigMap", NAMESPACE), ("Deployment", NAMESPACE), ("Service", NAMESPACE),
    ]  # fmt: skip
    for _, obj in _objects():
        used = kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        assert used == KUBERNETES_VERSION.rsplit(".", 1)[0]


def test_the_collector_pod_loads_its_config_binds_its_port_and_is_locked_down(
    tmp_path: Path,
) -> None:
    deployment = _find("Deployment")
    assert (deployment["spec"]["replicas"], deployment["spec"]["strategy"]["type"]) == (
        1, "Recreate",
    )  # fmt: skip
    spec = deployment["spec"]["template"]["spec"]
    c = _collector()
    assert c["image"] == f"kvobserve:{VERSION}"
    assert kvobserve_args(c) == ["collect", "-c", "/etc/kvobserve/kvobserve.toml"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    config_map = volumes[mounts["/etc/kvobserve"]]["configMap"]["name"]
    assert config_map == _find("ConfigMap")["metadata"]["name"]
    sc = {**spec["securityContext"], **c["securityContext"]}
    assert (sc["runAsNonRoot"], sc["runAsUser"], sc["readOnlyRootFilesystem"]) == (
        True,
        10001,
        True,
    )
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert spec["enableServiceLinks"] is False and spec["automountServiceAccountToken"] is False
    cfg = _config(tmp_path)
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
    (w,) = _config(tmp_path).workers
    service = _find("Service")
    (port,) = service["spec"]["ports"]
    assert service["spec"]["selector"] == _find("Deployment")["spec"]["selector"]["matchLabels"]
    assert port["targetPort"] == "kv-events" and port["port"] == int(w.bind.rpartition(":")[2])
    engine = _engine()
    events = _kv_events(engine)
    name, ns = service["metadata"]["name"], service["metadata"]["namespace"]
    # a named host: vLLM connects (it binds only *, :: and ipc:// endpoints)
    assert events["endpoint"] == f"tcp://{name}.{ns}.svc.cluster.local:{port['port']}"
    (c,) = containers(engine["spec"]["template"]["spec"])
    env = {e["name"]: e.get("value", "") for e in c["env"]} | {"POD_IP": "10.4.2.17"}
    topic = expand(events["topic"], env)
    fields = TopicTemplate.parse(w.topic, "topic").match(topic)
    assert fields == {"pod": "10.4.2.17:8000", "model": "Qwen/Qwen3-32B"}
    assert f"--port={fields['pod'].rpartition(':')[2]}" in [expand(a, env) for a in c["args"]]
    # kvobserve asks the pod's own replay socket, at the port the engine binds and exposes
    replay_port = int(events["replay_endpoint"].rpartition(":")[2])
    assert events["replay_endpoint"] == f"tcp://*:{replay_port}"
    assert fill_replay(w.replay_endpoint, fields["pod"]) == f"tcp://10.4.2.17:{replay_port}"
    assert replay_port in {p["containerPort"] for p in c["ports"]}
    # the relay target is the scheduler's Service, another host than kvobserve's
    assert w.relay_to.startswith("tcp://llm-d-epp.llm-d.svc") and name not in w.relay_to


def test_docs_name_the_overlay_files() -> None:
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    for name in [*manifests(OVERLAY), "kustomization.yaml"]:
        assert f"llm-d-relay/{name}" in doc, f"docs/kubernetes.md does not mention {name}"


def test_the_docs_show_the_overlay_s_config_and_engine_flags() -> None:
    text = (ROOT / "docs" / "deployment.md").read_text()
    section = text.split("## llm-d: central mode with a relay", 1)[1].split("\n## ", 1)[0]
    (shown,) = re.findall(r"```toml\n(.*?)```", section, re.S)
    (deployed,) = _find("ConfigMap")["data"].values()
    assert tomllib.loads(shown)["worker"] == tomllib.loads(deployed)["worker"]
    events = _engine()["spec"]["template"]["spec"]["containers"][0]["args"]
    flags = events[events.index("--kv-events-config") + 1]
    assert f"--kv-events-config \\\n  '{flags}'" in section
