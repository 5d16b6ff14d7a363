"""deploy/kubernetes/llm-d-per-pod: the pod-discovery collector, its RBAC, NetworkPolicy and
PodDisruptionBudget, and the example llm-d model server, checked offline like the stack (schemas
of the pinned Kubernetes, kustomize, the config read by kvobserve's own loader) and against each
other: everything in the one namespace the kustomization names, the Role grants exactly what the
collector does, the selector and ports match the engine's flags, the topic prefix holds whatever
port the pod serves on, and the NetworkPolicy admits exactly the collector's flows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvobserve.config.kubernetes import parse_selector, pod_topic
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

OVERLAY = Overlay("llm-d-per-pod", "vllm-decode.yaml", "kvobserve-llm-d-pods-6d5f9-x2x7q")
KINDS = ["ConfigMap", "Deployment", "NetworkPolicy", "PodDisruptionBudget", "Role", "RoleBinding",
         "ServiceAccount"]  # fmt: skip


def test_the_overlay_is_what_kustomize_builds_and_valid_for_the_pinned_kubernetes() -> None:
    assert OVERLAY.root in overlays()  # kept out of the stack's own checks (k8s_helpers.manifests)
    built = OVERLAY.built_as_listed()  # as written, in the kustomization's namespace and image
    assert sorted(o["kind"] for o in built) == KINDS
    OVERLAY.validate(KUBERNETES_VERSION)


def test_the_engines_namespace_is_set_in_one_place(tmp_path: Path) -> None:
    OVERLAY.assert_in_one_namespace()
    (w,) = OVERLAY.config(tmp_path).workers
    assert w.kubernetes is not None and w.kubernetes.namespace == ""  # the collector's own


def test_the_role_grants_reading_pods_where_the_collector_runs_and_nothing_else() -> None:
    built = {o["kind"]: o for o in OVERLAY.built_as_listed()}
    role, binding, account = built["Role"], built["RoleBinding"], built["ServiceAccount"]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    deployment = built["Deployment"]
    ns = deployment["metadata"]["namespace"]
    # the pods the config watches (its own namespace's) are where the Role grants reading them
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == ns
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"],
    }  # fmt: skip
    pod = deployment["spec"]["template"]["spec"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": ns}
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
    # the stack's NATS, in the stack's namespace (assert_nats_and_dns checks the Service)
    env = container_env(c, OVERLAY.pod_name)
    assert cfg.nats is not None and cfg.nats.url == env["KVOBSERVE_NATS_URL"]
    assert cfg.cluster == "prod-a" and cfg.collector.id == "llm-d-pods"
    # the image has the client: the Dockerfile installs the kubernetes extra
    assert 'pip install ".[kubernetes]"' in (ROOT / "Dockerfile").read_text()


def test_the_selector_and_ports_match_the_example_model_server(tmp_path: Path) -> None:
    (w,) = OVERLAY.config(tmp_path).workers
    k = w.kubernetes
    assert k is not None
    engine = OVERLAY.engine()
    template = engine["spec"]["template"]
    # the engine's pods are the selected ones, as kubectl's own selector code decides
    assert kubectl_selects(k.selector, [template["metadata"]["labels"]], tmp_path) == [True]
    (c,) = containers(template["spec"])
    _, text = OVERLAY.engine_flags()
    events = json.loads(text)
    assert events["publisher"] == "zmq"
    assert events["endpoint"] == f"tcp://*:{k.port}"  # binds on every pod
    assert events["replay_endpoint"] == f"tcp://*:{k.replay_port}"
    ports = {p["containerPort"] for p in c["ports"]}
    assert {*range(k.port, k.port + (w.dp_size or 1)), k.replay_port} <= ports
    # each pod's vLLM is scraped where it serves: POD_PORT, at the pod's own address
    env = {e["name"]: e.get("value", "") for e in c["env"]}
    assert w.metrics_url == f"http://{{pod_ip}}:{env['POD_PORT']}/metrics"
    assert int(env["POD_PORT"]) in ports


@pytest.mark.parametrize("pod_port", ["8000", "8200"])
def test_the_topic_prefix_holds_whatever_port_the_pod_serves_on(pod_port: str) -> None:
    (c,) = containers(OVERLAY.engine()["spec"]["template"]["spec"])
    flags, text = OVERLAY.engine_flags()
    topic_template = json.loads(text)["topic"]
    # one value, POD_PORT, is both the port vLLM serves on and the port in its topic
    assert "--port=$(POD_PORT)" in flags and ":$(POD_PORT)@" in topic_template
    # a pod at 10.4.2.17 serving on `pod_port` (8200: the modelservice chart's vLLM port behind
    # its routing proxy), as the kubelet expands it, starts with the collector's prefix
    env = {e["name"]: e.get("value", "") for e in c["env"]} | {
        "POD_IP": "10.4.2.17",
        "POD_PORT": pod_port,
    }
    topic = expand(topic_template, env)
    assert topic == f"kv@10.4.2.17:{pod_port}@Qwen/Qwen3-32B"
    assert f"--port={pod_port}" in [expand(a, env) for a in flags]
    k = OVERLAY.config_text()
    prefix_template = k.split('topic = "', 1)[1].split('"', 1)[0]
    prefix = pod_topic(prefix_template, "qwen-decode-x", "10.4.2.17", "llm-d")
    assert topic.startswith(prefix) and pod_port not in prefix
    # and the portless form of llm-d's older per-pod guide, kv@<pod ip>@<model>
    assert "kv@10.4.2.17@Qwen/Qwen3-32B".startswith(prefix)


def test_the_network_policy_admits_exactly_the_collector_s_flows(tmp_path: Path) -> None:
    policy = OVERLAY.policy(tmp_path)
    assert policy["spec"]["ingress"] == []  # nothing connects to it (probes: its node)
    rules = OVERLAY.assert_nats_and_dns(policy["spec"]["egress"], tmp_path)
    engines = [r for r in rules if r.get("to")]
    (api,) = [r for r in rules if not r.get("to")]
    assert rule_ports(api) == tcp(443, 6443)  # the Kubernetes API, wherever it listens
    (to_engines,) = engines
    (peer,) = to_engines["to"]
    assert set(peer) == {"podSelector"}  # pods of the collector's own namespace
    (w,) = OVERLAY.config(tmp_path).workers
    k = w.kubernetes
    assert k is not None
    # the pods the collector discovers are exactly those the policy lets it reach
    peer_selector = selector_string(peer["podSelector"])
    assert sorted(parse_selector(peer_selector, "p")) == sorted(parse_selector(k.selector, "s"))
    engine = OVERLAY.engine()["spec"]["template"]
    (c,) = containers(engine["spec"])
    dp = w.dp_size or 1
    metrics = int(next(e["value"] for e in c["env"] if e["name"] == "POD_PORT"))  # its --port
    assert rule_ports(to_engines) == tcp(
        range(k.port, k.port + dp), range(k.replay_port, k.replay_port + dp), metrics
    )


def test_the_disruption_budget_makes_an_eviction_wait_for_you() -> None:
    OVERLAY.assert_pdb()


def test_docs_name_the_overlay_files() -> None:
    OVERLAY.assert_docs_name_files()


@pytest.mark.parametrize(
    ("page", "heading"),
    [("deployment.md", "## llm-d per-pod with discovery"), ("kubernetes.md", "## Pod discovery")],
)
def test_the_docs_show_the_overlay_s_config_and_engine_flags(page: str, heading: str) -> None:
    text = (ROOT / "docs" / page).read_text()
    OVERLAY.assert_docs_show(text.split(heading, 1)[1].split("\n## ", 1)[0])
