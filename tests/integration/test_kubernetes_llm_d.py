"""deploy/kubernetes/llm-d-per-pod: the pod-discovery collector, its RBAC and the example llm-d
model server, checked offline like the stack (schemas of the pinned Kubernetes, kustomize, the
config read by kvobserve's own loader) and against each other: the Role grants exactly what the
collector does, where its config looks, and the selector and ports match the engine's flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvobserve.config.kubernetes import pod_topic
from tests.integration.k8s_helpers import (
    NAMESPACE,
    ROOT,
    Overlay,
    configmap_data,
    containers,
    expand,
    overlays,
)
from tests.integration.kube_api import selected
from tests.integration.test_kubernetes import KUBERNETES_VERSION, VERSION

pytestmark = pytest.mark.integration

OVERLAY = Overlay("llm-d-per-pod", "vllm-decode.yaml", "kvobserve-llm-d-pods-6d5f9-x2x7q")


def test_the_overlay_is_what_kustomize_builds_and_valid_for_the_pinned_kubernetes() -> None:
    assert OVERLAY.root in overlays()  # kept out of the stack's own checks (k8s_helpers.manifests)
    built = OVERLAY.built_as_listed()  # as written: no namespace rewriting
    assert sorted((o["kind"], o["metadata"]["namespace"]) for o in built) == [
        ("ConfigMap", NAMESPACE),
        ("Deployment", NAMESPACE),
        ("Role", "llm-d"),
        ("RoleBinding", "llm-d"),
        ("ServiceAccount", NAMESPACE),
    ]
    OVERLAY.validate(KUBERNETES_VERSION)


def test_the_role_grants_reading_pods_where_the_config_looks_and_nothing_else(
    tmp_path: Path,
) -> None:
    find = OVERLAY.find
    role, binding, account = find("Role"), find("RoleBinding"), find("ServiceAccount")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    (w,) = OVERLAY.config(tmp_path).workers
    assert w.kubernetes is not None
    assert (
        role["metadata"]["namespace"] == binding["metadata"]["namespace"] == w.kubernetes.namespace
    )
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"],
    }  # fmt: skip
    deployment = find("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": account["metadata"]["name"],
            "namespace": deployment["metadata"]["namespace"],
        }
    ]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    # the token is mounted into this pod only (the account's default is off)
    assert (account["automountServiceAccountToken"], pod["automountServiceAccountToken"]) == (
        False,
        True,
    )


def test_the_collector_pod_loads_its_config_and_is_locked_down(tmp_path: Path) -> None:
    OVERLAY.assert_locked_down(VERSION)
    c = OVERLAY.collector()
    probe = c["livenessProbe"]["httpGet"]
    assert (probe["path"], probe["port"]) == ("/healthz", c["ports"][0]["name"])
    cfg = OVERLAY.config(tmp_path)
    assert cfg.http.listen == f"0.0.0.0:{c['ports'][0]['containerPort']}"
    # the stack's NATS, through the stack's kvobserve-env ConfigMap (same namespace)
    assert (
        cfg.nats is not None
        and cfg.nats.url == configmap_data("kvobserve-env")["KVOBSERVE_NATS_URL"]
    )
    assert cfg.cluster == "prod-a" and cfg.collector.id == "llm-d-pods"
    # the image has the client: the Dockerfile installs the kubernetes extra
    assert 'pip install ".[kubernetes]"' in (ROOT / "Dockerfile").read_text()


def test_the_selector_and_ports_match_the_example_model_server(tmp_path: Path) -> None:
    (w,) = OVERLAY.config(tmp_path).workers
    k = w.kubernetes
    assert k is not None
    engine = OVERLAY.engine()
    assert engine["metadata"]["namespace"] == k.namespace
    template = engine["spec"]["template"]
    assert selected(template, k.selector)  # the engine's pods are the selected ones
    (c,) = containers(template["spec"])
    flags, text = OVERLAY.engine_flags()
    events = json.loads(text)
    assert events["publisher"] == "zmq"
    assert events["endpoint"] == f"tcp://*:{k.port}"  # binds on every pod
    assert events["replay_endpoint"] == f"tcp://*:{k.replay_port}"
    ports = {p["containerPort"] for p in c["ports"]}
    assert {*range(k.port, k.port + (w.dp_size or 1)), k.replay_port} <= ports
    # the topic of a pod at 10.4.2.17 as the kubelet expands it starts with the configured prefix
    env = {e["name"]: e.get("value", "") for e in c["env"]} | {"POD_IP": "10.4.2.17"}
    topic = expand(events["topic"], env)
    assert topic == "kv@10.4.2.17:8000@Qwen/Qwen3-32B"
    assert topic.startswith(pod_topic(k.topic, "qwen-decode-x", "10.4.2.17", k.namespace))
    assert f"--port={env['POD_PORT']}" in flags


def test_docs_name_the_overlay_files() -> None:
    OVERLAY.assert_docs_name_files()


@pytest.mark.parametrize(
    ("page", "heading"),
    [("deployment.md", "## llm-d per-pod with discovery"), ("kubernetes.md", "## Pod discovery")],
)
def test_the_docs_show_the_overlay_s_config_and_engine_flags(page: str, heading: str) -> None:
    text = (ROOT / "docs" / page).read_text()
    OVERLAY.assert_docs_show(text.split(heading, 1)[1].split("\n## ", 1)[0])
