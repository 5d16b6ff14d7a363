"""The llm-d overlays select the pods llm-d's own chart labels: the per-pod collector's default
selector and both NetworkPolicies' engine peers, evaluated with kubectl's own label-selector code
against the label sets llm-d's modelservice chart renders (tests/fixtures/llm-d/, which says
where each set comes from). The chart release they follow is the one the docs name."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvobserve.config.kubernetes import parse_selector
from tests.integration.k8s_helpers import (
    ROOT,
    Overlay,
    kubectl_selects,
    selector_string,
)
from tests.integration.kube_api import selected

pytestmark = pytest.mark.integration

FIXTURE = ROOT / "tests" / "fixtures" / "llm-d" / "modelservice-pod-labels.yaml"
PER_POD = Overlay("llm-d-per-pod", "vllm-decode.yaml", "kvobserve-llm-d-pods-6d5f9-x2x7q")
RELAY = Overlay("llm-d-relay", "vllm-decode-central.yaml", "kvobserve-llm-d-relay-7c9d8-q4wz2")


def _charts() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(FIXTURE.read_text())
    return doc


def _release(version: str) -> dict[str, Any]:
    (release,) = [c for c in _charts()["charts"] if c["version"] == version]
    return release


def _pods(version: str) -> dict[str, dict[str, str]]:
    """'default/decode', 'guide/decode', ... -> the labels chart `version` gives that pod."""
    release = _release(version)
    return {
        f"{values}/{role}": labels
        for values in ("default", "guide")
        for role, labels in release.get(values, {}).items()
    }


def _selects(selector: str, pods: dict[str, dict[str, str]], tmp: Path) -> dict[str, bool]:
    names = sorted(pods)
    return dict(zip(names, kubectl_selects(selector, [pods[n] for n in names], tmp), strict=True))


def _default_selector(tmp: Path) -> str:
    (w,) = PER_POD.config(tmp).workers
    assert w.kubernetes is not None
    selector: str = w.kubernetes.selector
    return selector


def test_the_default_selector_selects_the_decode_pods_of_the_chart_it_follows(
    tmp_path: Path,
) -> None:
    follows = _charts()["follows"]
    selector = _default_selector(tmp_path)
    got = _selects(selector, _pods(follows), tmp_path)
    # its decode pods, with the chart's own values and with llm-d's per-pod guide; not prefill
    assert got == {"default/decode": True, "default/prefill": False, "guide/decode": True}


def test_the_older_charts_label_needs_the_documented_selector(tmp_path: Path) -> None:
    # v0.4.4 and before label the pods llm-d.ai/inferenceServing: the default misses them, which
    # is what was seen; docs/kubernetes.md gives the selector for those, and it selects them
    old = _pods("v0.4.4")
    assert _selects(_default_selector(tmp_path), old, tmp_path) == {
        "default/decode": False, "default/prefill": False,
    }  # fmt: skip
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    (documented,) = re.findall(r'selector = "(llm-d\.ai/inferenceServing=[^"]+)"', doc)
    parse_selector(documented, "selector")  # kvobserve's config takes it
    assert _selects(documented, old, tmp_path) == {
        "default/decode": True, "default/prefill": False,
    }  # fmt: skip
    assert _selects(documented, _pods(_charts()["follows"]), tmp_path)["default/decode"] is False


@pytest.mark.parametrize("overlay", [PER_POD, RELAY], ids=["per-pod", "relay"])
def test_the_network_policies_engine_peers_are_the_chart_s_decode_pods(
    overlay: Overlay, tmp_path: Path
) -> None:
    spec = overlay.find("NetworkPolicy")["spec"]
    peers = [p for rule in spec["egress"] for p in rule.get("to", []) if p.get("podSelector")]
    peers += [p for rule in spec.get("ingress", []) for p in rule["from"]]
    pods = _pods(_charts()["follows"]) | {
        "example/decode": overlay.engine()["spec"]["template"]["metadata"]["labels"]
    }
    for peer in peers:
        if "namespaceSelector" in peer:
            continue  # the stack's NATS, checked in the overlays' own tests
        got = _selects(selector_string(peer["podSelector"]), pods, tmp_path)
        assert got == {
            "default/decode": True, "default/prefill": False, "guide/decode": True,
            "example/decode": True,
        }  # fmt: skip


def test_the_recorded_api_server_selects_as_kubectl_does(tmp_path: Path) -> None:
    # kube_api.py, which plays the API server in the pod-discovery tests, filters pods with its
    # own reading of a selector: it must agree with kubectl's on every label set here
    pods = _pods("v0.4.12") | {f"old/{k}": v for k, v in _pods("v0.4.4").items()}
    selectors = [
        _default_selector(tmp_path),
        "llm-d.ai/inferenceServing=true,llm-d.ai/role=decode",
        "llm-d.ai/role in (decode,prefill),!llm-d.ai/guide",
        "llm-d.ai/role!=prefill,llm-d.ai/model",
    ]
    for selector in selectors:
        ours = {
            n: selected({"metadata": {"labels": labels}}, selector) for n, labels in pods.items()
        }
        assert ours == _selects(selector, pods, tmp_path), selector


def test_the_docs_name_the_chart_release_and_where_its_labels_come_from() -> None:
    follows = _release(_charts()["follows"])
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    assert f"llm-d-modelservice {follows['version']}" in doc
    assert follows["commit"] in doc and "tests/fixtures/llm-d/" in doc
    readme = (FIXTURE.parent / "README.md").read_text()
    for release in _charts()["charts"]:
        assert release["commit"] in readme
    for path in (PER_POD.root / "collector.yaml", PER_POD.root / "kustomization.yaml"):
        assert follows["version"] in path.read_text(), path
