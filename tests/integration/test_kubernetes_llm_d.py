"""deploy/kubernetes/llm-d-per-pod: the pod-discovery collector, its RBAC and the example llm-d
model server, checked offline like the stack (schemas of the pinned Kubernetes, kustomize, the
config read by kvobserve's own loader) and against each other: the Role grants exactly what the
collector does, where its config looks, and the selector and ports match the engine's flags."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from kvobserve.config import load_config
from kvobserve.config.kubernetes import pod_topic
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
from tests.integration.kube_api import selected
from tests.integration.test_kubernetes import KUBERNETES_VERSION, VERSION

pytestmark = pytest.mark.integration

OVERLAY = K8S / "llm-d-per-pod"
EXAMPLE = "vllm-decode.yaml"
Obj = dict[str, Any]


def _objects() -> list[tuple[str, Obj]]:
    return [(name, o) for name, docs in manifests(OVERLAY).items() for o in docs]


def _find(kind: str) -> Obj:
    (found,) = [o for _, o in _objects() if o["kind"] == kind and o is not _engine()]
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
    env = container_env(_collector(), "kvobserve-llm-d-pods-6d5f9-x2x7q")
    return load_config(str(path), {}, {k: v for k, v in env.items() if k.startswith("KVOBSERVE_")})


def test_the_overlay_is_what_kustomize_builds_and_valid_for_the_pinned_kubernetes() -> None:
    assert OVERLAY in overlays()  # kept out of the stack's own checks (k8s_helpers.manifests)
    built = kustomize(OVERLAY)
    listed = [o for name, docs in manifests(OVERLAY).items() if name != EXAMPLE for o in docs]

    def key(o: Obj) -> tuple[str, str]:
        return o["kind"], o["metadata"]["name"]

    # as written: no namespace rewriting, each object says where it lives
    assert sorted(built, key=key) == sorted(listed, key=key)
    assert sorted((o["kind"], o["metadata"]["namespace"]) for o in built) == [
        ("ConfigMap", NAMESPACE),
        ("Deployment", NAMESPACE),
        ("Role", "llm-d"),
        ("RoleBinding", "llm-d"),
        ("ServiceAccount", NAMESPACE),
    ]
    for _, obj in _objects():
        used = kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        assert used == KUBERNETES_VERSION.rsplit(".", 1)[0]


def test_the_role_grants_reading_pods_where_the_config_looks_and_nothing_else(
    tmp_path: Path,
) -> None:
    role, binding, account = _find("Role"), _find("RoleBinding"), _find("ServiceAccount")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    (w,) = _config(tmp_path).workers
    assert w.kubernetes is not None
    assert (
        role["metadata"]["namespace"] == binding["metadata"]["namespace"] == w.kubernetes.namespace
    )
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"],
    }  # fmt: skip
    deployment = _find("Deployment")
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
    deployment = _find("Deployment")
    assert (deployment["spec"]["replicas"], deployment["spec"]["strategy"]["type"]) == (
        1,
        "Recreate",
    )
    spec = deployment["spec"]["template"]["spec"]
    c = _collector()
    assert c["image"] == f"kvobserve:{VERSION}"
    assert kvobserve_args(c) == ["collect", "-c", "/etc/kvobserve/kvobserve.toml"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert (
        volumes[mounts["/etc/kvobserve"]]["configMap"]["name"]
        == _find("ConfigMap")["metadata"]["name"]
    )
    assert "emptyDir" in volumes[mounts["/tmp"]]
    sc = {**spec["securityContext"], **c["securityContext"]}
    assert (sc["runAsNonRoot"], sc["runAsUser"], sc["readOnlyRootFilesystem"]) == (
        True,
        10001,
        True,
    )
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert spec["enableServiceLinks"] is False
    probe = c["livenessProbe"]["httpGet"]
    assert (probe["path"], probe["port"]) == ("/healthz", c["ports"][0]["name"])
    cfg = _config(tmp_path)
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
    (w,) = _config(tmp_path).workers
    k = w.kubernetes
    assert k is not None
    engine = _engine()
    assert engine["metadata"]["namespace"] == k.namespace
    template = engine["spec"]["template"]
    assert selected(template, k.selector)  # the engine's pods are the selected ones
    (c,) = containers(template["spec"])
    flags = c["args"]
    events = json.loads(flags[flags.index("--kv-events-config") + 1])
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
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    for name in [*manifests(OVERLAY), "kustomization.yaml"]:
        assert f"llm-d-per-pod/{name}" in doc, f"docs/kubernetes.md does not mention {name}"


@pytest.mark.parametrize(
    ("page", "heading"),
    [("deployment.md", "## llm-d per-pod with discovery"), ("kubernetes.md", "## Pod discovery")],
)
def test_the_docs_show_the_overlay_s_config_and_engine_flags(page: str, heading: str) -> None:
    text = (ROOT / "docs" / page).read_text()
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    (shown,) = re.findall(r"```toml\n(.*?)```", section, re.S)
    (deployed,) = _find("ConfigMap")["data"].values()
    assert tomllib.loads(shown)["worker"] == tomllib.loads(deployed)["worker"]
    flags = _engine()["spec"]["template"]["spec"]["containers"][0]["args"]
    events = flags[flags.index("--kv-events-config") + 1]
    assert f"--kv-events-config \\\n  '{events}'" in section
