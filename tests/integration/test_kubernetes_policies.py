"""The stack's NetworkPolicies (deploy/kubernetes/networkpolicy.yaml) admit exactly the flows
kvobserve uses, decided with kubectl's own label-selector code over every pod template the
manifests make: NATS takes its client port from every pod that runs kvobserve with a NATS URL
(the aggregator, the collector sidecars' engine pods, the llm-d overlays' collectors) and from no
other; the aggregator takes its HTTP port from the Prometheus Operator's Prometheus pods only."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.k8s_helpers import (
    DNS,
    Obj,
    Overlay,
    configmap_data,
    containers,
    find,
    kubectl_selects,
    pod_templates,
    rule_ports,
    selector_string,
    tcp,
)

pytestmark = pytest.mark.integration

OVERLAYS = (
    Overlay("llm-d-per-pod", "vllm-decode.yaml", "kvobserve-llm-d-pods-6d5f9-x2x7q"),
    Overlay("llm-d-relay", "vllm-decode-central.yaml", "kvobserve-llm-d-relay-7c9d8-q4wz2"),
)
# The labels the Prometheus Operator gives the pods of a Prometheus (its StatefulSet's pod
# template: prometheus-operator, pkg/prometheus/server/statefulset.go, podSelectorLabels), for a
# Prometheus resource named k8s.
PROMETHEUS_POD = {
    "app.kubernetes.io/name": "prometheus",
    "app.kubernetes.io/managed-by": "prometheus-operator",
    "app.kubernetes.io/instance": "k8s",
    "prometheus": "k8s",
    "operator.prometheus.io/name": "k8s",
    "operator.prometheus.io/shard": "0",
}


def _all_templates() -> dict[str, Obj]:
    """Every pod template of the stack, the LWS example and both overlays (their example
    engines included): where -> template."""
    out = dict(pod_templates())
    for overlay in OVERLAYS:
        for name, o in overlay.objects():
            if o["kind"] == "Deployment":
                out[f"{overlay.root.name}/{name}"] = o["spec"]["template"]
    return out


def _connects_to_nats(template: Obj) -> bool:
    """A container of the pod gets KVOBSERVE_NATS_URL (its env, or the stack's ConfigMap)."""
    for c in containers(template["spec"]):
        names = {e["name"] for e in c.get("env", [])}
        for source in c.get("envFrom", []):
            names |= set(configmap_data(source["configMapRef"]["name"]))
        if "KVOBSERVE_NATS_URL" in names:
            return True
    return False


def _policy(name: str, owner: str, tmp: Path) -> Obj:
    """NetworkPolicy `name`, checked to isolate exactly the pods of `owner` among all templates."""
    policy = find("NetworkPolicy", name)
    templates = _all_templates()
    names = sorted(templates)
    got = kubectl_selects(
        selector_string(policy["spec"]["podSelector"]),
        [templates[n]["metadata"]["labels"] for n in names],
        tmp,
    )
    assert [n for n, s in zip(names, got, strict=True) if s] == [owner]
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    return policy


def _ports(owner: str) -> dict[str, int]:
    template = pod_templates()[owner]
    return {
        p["name"]: p["containerPort"]
        for c in containers(template["spec"])
        for p in c.get("ports", [])
    }


def test_nats_takes_its_client_port_from_exactly_the_pods_that_use_it(tmp_path: Path) -> None:
    policy = _policy("nats", "StatefulSet/nats", tmp_path)
    (rule,) = policy["spec"]["ingress"]
    client = {p["name"]: p["port"] for p in find("Service", "nats")["spec"]["ports"]}["client"]
    assert rule_ports(rule, _ports("StatefulSet/nats")) == tcp(client)  # not the monitor port
    (peer,) = rule["from"]
    assert peer["namespaceSelector"] == {}  # in any namespace: sidecars live with their engines
    templates = _all_templates()
    names = sorted(templates)
    admitted = kubectl_selects(
        selector_string(peer["podSelector"]),
        [templates[n]["metadata"]["labels"] for n in names],
        tmp_path,
    )
    users = [_connects_to_nats(templates[n]) for n in names]
    assert dict(zip(names, admitted, strict=True)) == dict(zip(names, users, strict=True))
    assert sum(users) == 5  # the aggregator, the LWS leader and worker, two llm-d collectors
    assert policy["spec"]["egress"] == []  # one server: it connects nowhere


def test_the_aggregator_takes_only_prometheus_and_reaches_only_nats_and_dns(
    tmp_path: Path,
) -> None:
    owner = "StatefulSet/kvobserve-aggregator"
    policy = _policy("kvobserve-aggregator", owner, tmp_path)
    (rule,) = policy["spec"]["ingress"]
    (endpoint,) = find("ServiceMonitor", "kvobserve")["spec"]["endpoints"]
    assert [p["port"] for p in rule["ports"]] == [endpoint["port"]]  # what the monitor scrapes
    assert rule_ports(rule, _ports(owner)) == tcp(9477)
    (peer,) = rule["from"]
    assert peer["namespaceSelector"] == {}  # wherever the Prometheus Operator runs it
    templates = _all_templates()
    labels = [PROMETHEUS_POD, *(t["metadata"]["labels"] for t in templates.values())]
    got = kubectl_selects(selector_string(peer["podSelector"]), labels, tmp_path)
    assert got == [True] + [False] * len(templates)
    nats, dns = policy["spec"]["egress"]
    (to,) = nats["to"]
    assert set(to) == {"podSelector"}  # NATS of its own namespace
    broker = pod_templates()["StatefulSet/nats"]["metadata"]["labels"]
    assert kubectl_selects(selector_string(to["podSelector"]), [broker], tmp_path) == [True]
    url = configmap_data("kvobserve-env")["KVOBSERVE_NATS_URL"]
    assert rule_ports(nats) == tcp(int(url.rpartition(":")[2]))
    assert "to" not in dns and rule_ports(dns) == DNS
