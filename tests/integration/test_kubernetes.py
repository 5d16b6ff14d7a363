"""deploy/kubernetes/: valid for a pinned Kubernetes, consistent with itself and its sources, built
by kustomize, the rules accepted by promtool, and the generated files current. No cluster needed."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvobserve.config import ConfigError, load_config
from tests.integration.k8s_helpers import (
    IMAGE_COMPONENT,
    IMAGE_NAME,
    K8S,
    LWS_EXAMPLE,
    LWS_GROUP_INDEX_LABEL,
    LWS_NAME_LABEL,
    LWS_SIZE_ANNOTATION,
    LWS_WORKER_INDEX_LABEL,
    NAMESPACE,
    ROOT,
    configmap_data,
    container_env,
    containers,
    find,
    generator,
    image,
    kustomize,
    kvobserve_args,
    lws,
    lws_pod,
    lws_templates,
    manifests,
    objects,
    overlays,
    pod_templates,
    promtool,
    shared_toml,
    with_image,
)

pytestmark = pytest.mark.integration

# The one pin: the Kubernetes version whose schemas (bundled by kubernetes-validate, test extras)
# every core object must satisfy. docs/kubernetes.md names it too.
KUBERNETES_VERSION = "1.37.0"
CORE_KINDS = {"Namespace", "ConfigMap", "Service", "StatefulSet", "NetworkPolicy"}
CRD_KINDS = {"LeaderWorkerSet", "ServiceMonitor", "PrometheusRule"}
# The sections of kvobserve.toml: a KVOBSERVE_<SECTION>_* variable is read as a setting.
KVOBSERVE_SECTIONS = ("cluster", "collector", "worker", "aggregator", "http", "nats")
DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def _validate(obj: dict[str, Any]) -> None:
    used = kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    assert used == KUBERNETES_VERSION.rsplit(".", 1)[0], f"validated against {used}"


def _as_pod_template(name: str, template: dict[str, Any]) -> dict[str, Any]:
    meta = {"name": name}
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": meta, "template": template}


def test_every_file_parses_and_the_kustomization_lists_the_stack() -> None:
    kinds = {o["kind"] for _, o in objects()}
    assert kinds == CORE_KINDS | CRD_KINDS
    seen: set[tuple[str, str]] = set()
    for name, obj in objects():
        key = (obj["kind"], obj["metadata"]["name"])
        assert key not in seen, f"{name}: duplicate {key}"
        seen.add(key)
        assert "namespace" not in obj["metadata"], f"{name}: the kustomization sets the namespace"
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["namespace"] == NAMESPACE
    listed = [r.split("#")[0].strip() for r in kustomization["resources"]]
    assert sorted(listed) == sorted(set(manifests()) - {LWS_EXAMPLE})


def test_core_objects_are_valid_for_the_pinned_kubernetes() -> None:
    validated = set()
    for name, obj in objects():
        if obj["kind"] in CORE_KINDS:
            try:
                _validate(obj)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{name} {obj['kind']}/{obj['metadata']['name']}: {exc.message}")
            validated.add(obj["kind"])
    assert validated == CORE_KINDS


def test_strict_validation_rejects_a_misspelled_field() -> None:
    broken = copy.deepcopy(find("StatefulSet", "kvobserve-aggregator"))
    spec = broken["spec"]["template"]["spec"]
    spec["containers"][0]["readinesProbe"] = spec["containers"][0].pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(broken)


def test_lws_pod_templates_are_valid_and_both_carry_the_collector_sidecar() -> None:
    obj = lws()
    assert obj["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert obj["spec"]["leaderWorkerTemplate"]["size"] == 2
    sidecars = {}
    for role, template in lws_templates().items():
        _validate(_as_pod_template(f"sglang-dp8-{role}", template))
        (sidecar,) = (c for c in containers(template["spec"]) if c["name"] == "kvobserve-collector")
        assert sidecar in template["spec"]["initContainers"], "a native sidecar: an initContainer"
        assert sidecar["restartPolicy"] == "Always"
        # A restart of any container recreates the whole LWS group: no liveness probe to trip.
        assert "livenessProbe" not in sidecar
        sidecars[role] = sidecar
    assert sidecars["leader"] == sidecars["worker"]
    env = {e["name"]: e for e in sidecars["leader"]["env"]}
    field = {n: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for n, e in env.items()}
    assert field["KVOBSERVE_COLLECTOR_ID"] == "metadata.name"
    assert field["KVOBSERVE_COLLECTOR_NODE_RANK"] == f"metadata.labels['{LWS_WORKER_INDEX_LABEL}']"
    assert field["KVOBSERVE_COLLECTOR_NNODES"] == f"metadata.annotations['{LWS_SIZE_ANNOTATION}']"
    assert field["POD_LWS_NAME"] == f"metadata.labels['{LWS_NAME_LABEL}']"
    assert field["POD_LWS_GROUP_INDEX"] == f"metadata.labels['{LWS_GROUP_INDEX_LABEL}']"


def test_pod_specs_are_self_consistent_and_locked_down() -> None:
    for where, template in pod_templates().items():
        spec = template["spec"]
        names = [c["name"] for c in containers(spec)]
        assert len(names) == len(set(names)), f"{where}: duplicate container names {names}"
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        assert spec["enableServiceLinks"] is False, f"{where}: service links shadow settings"
        assert spec["automountServiceAccountToken"] is False, where
        for c in containers(spec):
            ports = {p["name"] for p in c.get("ports", [])}
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{where}/{c['name']}: no volume {m['name']}"
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                port = c.get(probe, {}).get("httpGet", {}).get("port")
                assert port is None or port in ports, f"{where}/{c['name']} {probe}: {port}"
            for source in c.get("envFrom", []):
                configmap_data(source["configMapRef"]["name"])  # defined in the manifests
            if c["image"] != IMAGE_NAME and not c["image"].startswith("kvobserve:"):
                continue  # the engine placeholder and NATS are checked by the schema only
            # kustomize sets the image (image/): the manifests name no tag; the LWS example,
            # applied without kustomize, writes image/'s value out
            lws_example = where.startswith("LeaderWorkerSet/")
            assert c["image"] == (image() if lws_example else IMAGE_NAME), where
            assert image() == f"kvobserve:{VERSION}", f"image/: the tag vs pyproject {VERSION}"
            sc = {**spec.get("securityContext", {}), **c.get("securityContext", {})}
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] == 10001, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), where
            assert {"cpu", "memory"} <= set(c["resources"]["limits"]), where
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert volumes[mounts["/etc/kvobserve"]]["configMap"]["name"] == "kvobserve-config"
            assert "emptyDir" in volumes[mounts["/tmp"]], f"{where}: a writable /tmp"
            assert kvobserve_args(c)[1:] == ["-c", "/etc/kvobserve/kvobserve.toml"], where


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_services_select_their_pods_and_the_ports_match() -> None:
    templates = pod_templates()
    for service, owner in (
        ("kvobserve", "StatefulSet/kvobserve-aggregator"),
        ("kvobserve-shards", "StatefulSet/kvobserve-aggregator"),
        ("nats", "StatefulSet/nats"),
    ):
        svc = find("Service", service)
        selected = [
            w
            for w, t in templates.items()
            if _selects(svc["spec"]["selector"], t["metadata"]["labels"])
        ]
        assert selected == [owner], f"Service {service} selects {selected}"
        ports = {
            p["name"]: p for c in containers(templates[owner]["spec"]) for p in c.get("ports", [])
        }
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports, f"Service {service}: no container port {port}"
            assert ports[port["targetPort"]]["containerPort"] == port["port"]
    assert find("StatefulSet", "nats")["spec"]["serviceName"] == "nats"
    shards = find("StatefulSet", "kvobserve-aggregator")["spec"]["serviceName"]
    assert find("Service", shards)["spec"]["clusterIP"] == "None"  # the governing Service
    monitor = find("ServiceMonitor", "kvobserve")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    svc = find("Service", "kvobserve")
    scraped = [
        o["metadata"]["name"]
        for _, o in objects()
        if o["kind"] == "Service"
        and _selects(monitor["spec"]["selector"]["matchLabels"], o["metadata"]["labels"])
    ]
    assert scraped == ["kvobserve"], "each shard is scraped through one Service, once"
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["http"]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    nats = {p["name"]: p["port"] for p in find("Service", "nats")["spec"]["ports"]}
    assert configmap_data("kvobserve-env")["KVOBSERVE_NATS_URL"] == f"nats://nats:{nats['client']}"
    agg = find("StatefulSet", "kvobserve-aggregator")["spec"]["template"]["spec"]["containers"][0]
    listen = container_env(agg, "kvobserve-aggregator-0", POD_INDEX_0)["KVOBSERVE_HTTP_LISTEN"]
    assert listen == f"0.0.0.0:{svc['spec']['ports'][0]['port']}"


# What the StatefulSet controller puts on its pods (Kubernetes >= 1.28): the ordinal as a label.
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
POD_INDEX_0 = {POD_INDEX_LABEL: "0"}


def test_every_aggregator_pod_is_a_shard_of_as_many_as_there_are_replicas() -> None:
    sts = find("StatefulSet", "kvobserve-aggregator")
    replicas = sts["spec"]["replicas"]
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    for i in range(replicas):
        env = container_env(c, f"kvobserve-aggregator-{i}", {POD_INDEX_LABEL: str(i)})
        assert env["KVOBSERVE_AGGREGATOR_SHARD"] == str(i)
        assert int(env["KVOBSERVE_AGGREGATOR_SHARDS"]) == replicas
        # the pod's settings load: shard below shards, every variable a known setting
        cfg = load_config(None, {}, {k: v for k, v in env.items() if k.startswith("KVOBSERVE_")})
        assert (cfg.aggregator.shard, cfg.aggregator.shards) == (i, replicas)
    # a pod past the shard count (replicas raised alone) refuses to start
    env = container_env(c, "x", {POD_INDEX_LABEL: str(replicas)})
    with pytest.raises(ConfigError, match="must be < "):
        load_config(None, {}, {k: v for k, v in env.items() if k.startswith("KVOBSERVE_")})


def test_no_service_name_injects_a_kvobserve_setting() -> None:
    # Pods that keep service links get <NAME>_SERVICE_HOST, <NAME>_PORT, ... for every Service of
    # their namespace; under a kvobserve-<section> name those are KVOBSERVE_<SECTION>_* settings.
    for _, obj in objects():
        if obj["kind"] == "Service":
            prefix = obj["metadata"]["name"].upper().replace("-", "_") + "_"
            for section in KVOBSERVE_SECTIONS:
                assert not prefix.startswith(f"KVOBSERVE_{section.upper()}_"), prefix


def test_engine_flags_match_the_shared_config() -> None:
    cfg = shared_toml()
    (worker,) = cfg["worker"]
    assert cfg["collector"]["host"] == "127.0.0.1"  # the sidecar shares the engine pod's network
    args = {}
    for role, template in lws_templates().items():
        (engine,) = template["spec"]["containers"]
        args[role] = engine["args"]
    assert args["leader"] == args["worker"]
    flags = args["leader"]
    value = {flags[i]: flags[i + 1] for i in range(len(flags) - 1) if flags[i].startswith("--")}
    events = json.loads(value["--kv-events-config"])
    assert events["publisher"] == "zmq"
    assert events["endpoint"] == worker["kv_endpoint"]
    assert events["replay_endpoint"] == worker["replay_endpoint"]
    assert events["topic"] == worker["topic"]
    assert int(value["--dp-size"]) == worker["dp_size"] == 8
    assert ("--enable-dp-attention" in flags) == worker["dp_attention"] is True
    # every pod scrapes its own engine (a wildcard host): node 0's /metrics has node 0's ranks
    # only, and a node >= 1 serves its own with --enable-metrics
    assert worker["metrics_url"] == f"http://0.0.0.0:{value['--port']}/metrics"
    assert "--enable-metrics" in flags
    _, _, _, injected = lws_pod(0, 1)
    assert value["--nnodes"] == "$(LWS_GROUP_SIZE)" and injected["LWS_GROUP_SIZE"] == "2"
    assert value["--node-rank"] == "$(LWS_WORKER_INDEX)"


def test_prometheus_rule_is_the_rules_file_and_passes_promtool(tmp_path: Path) -> None:
    rule = find("PrometheusRule", "kvobserve")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    source = yaml.safe_load((ROOT / "alerts" / "kvobserve-rules.yml").read_text())
    assert rule["spec"] == source
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    proc = subprocess.run(
        [promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    alerts = sum(len(g["rules"]) for g in source["groups"])
    assert f"{alerts} rules found" in proc.stdout


def test_dashboard_configmaps_carry_the_sidecar_label_and_the_json() -> None:
    gen = generator()
    key, value = gen.DASHBOARD_LABEL
    files = DASHBOARDS
    maps = [
        o
        for _, o in objects()
        if o["kind"] == "ConfigMap" and o["metadata"]["labels"].get(key) == value
    ]
    assert sorted(name for m in maps for name in m["data"]) == [f.name for f in files]
    for m in maps:
        ((name, text),) = m["data"].items()
        assert text == (ROOT / "dashboards" / name).read_text()
        json.loads(text)
        # kubectl apply (client-side) keeps a copy in an annotation limited to 256 KiB.
        assert len(text.encode()) < 200_000, f"{name}: use kubectl apply --server-side"


def test_generated_files_are_current() -> None:
    stale = generator().stale(ROOT)
    assert stale == [], f"stale: {stale}; run python deploy/kubernetes/generate.py"


def test_the_staleness_check_sees_each_changed_source(tmp_path: Path) -> None:
    gen = generator()
    root = ["--root", str(tmp_path)]
    for rel in ("alerts/kvobserve-rules.yml", *(f"dashboards/{p.name}" for p in DASHBOARDS)):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    assert gen.main(root) == 0  # writes generated/ into the copy
    assert gen.stale(tmp_path) == [] and gen.main([*root, "--check"]) == 0
    edits = {
        "alerts/kvobserve-rules.yml": ("for: 2m", "for: 3m", "prometheusrule.yaml"),
        "dashboards/kvobserve-fleet.json": ("Fleet KV cache", "Fleet KV caches", "dashboards.yaml"),
    }
    for rel, (old, new, generated) in edits.items():
        source = tmp_path / rel
        assert old in source.read_text()
        source.write_text(source.read_text().replace(old, new, 1))
        assert list(map(str, gen.stale(tmp_path))) == [f"deploy/kubernetes/generated/{generated}"]
        assert gen.main([*root, "--check"]) == 1
        assert gen.main(root) == 0 and gen.stale(tmp_path) == []


def test_kustomize_builds_the_stack_and_expands_the_sidecar_alias(tmp_path: Path) -> None:
    built = kustomize(K8S)
    expected = [o for name, docs in manifests().items() if name != LWS_EXAMPLE for o in docs]
    assert len(built) == len(expected)
    for obj in built:
        want = with_image(find(obj["kind"], obj["metadata"]["name"]))
        if obj["kind"] != "Namespace":
            want = {**want, "metadata": {**want["metadata"], "namespace": NAMESPACE}}
        assert obj == want, f"{obj['kind']}/{obj['metadata']['name']} differs after kustomize"
    shutil.copy(K8S / LWS_EXAMPLE, tmp_path / LWS_EXAMPLE)
    (tmp_path / "kustomization.yaml").write_text(f"resources: [{LWS_EXAMPLE}]\n")
    (built_lws,) = kustomize(tmp_path)
    assert built_lws == lws()  # YAML aliases expanded exactly as a YAML parser does


def test_docs_name_the_pin_the_files_and_the_variables() -> None:
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    readme = (K8S / "README.md").read_text()
    assert f"Kubernetes {KUBERNETES_VERSION.rsplit('.', 1)[0]}" in doc
    image_file = f"{IMAGE_COMPONENT.name}/kustomization.yaml"
    for name in [*manifests(), image_file, "generate.py"]:
        assert name in doc, f"docs/kubernetes.md does not mention {name}"
        assert f"`{name}`" in readme, f"deploy/kubernetes/README.md does not list {name}"
    for overlay in overlays():
        assert f"`{overlay.name}/`" in readme, f"deploy/kubernetes/README.md: no {overlay.name}/"
    names = set(configmap_data("kvobserve-env"))
    for template in pod_templates().values():
        for c in containers(template["spec"]):
            names |= {e["name"] for e in c.get("env", []) if e["name"].startswith("KVOBSERVE_")}
    for name in sorted(names):
        assert name in doc, f"docs/kubernetes.md does not mention {name}"
