"""`[worker.kubernetes]`: the table's checks, the selector, and which pods are streams."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lightkube.core.decoders import decode_object
from lightkube.resources.core_v1 import Pod

from kvobserve.config import ConfigError, KubernetesConfig, load_config
from kvobserve.config.kubernetes import parse_selector
from kvobserve.sources.kubernetes import streams_of
from kvobserve.sources.plan import plan_pods

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kubernetes"
RS = "qwen-decode-7d4b9c6f5"


def load(tmp_path: Path, worker: str, table: str) -> KubernetesConfig:
    path = tmp_path / "kvobserve.toml"
    path.write_text(f'[[worker]]\nengine = "vllm"\n{worker}\n[worker.kubernetes]\n{table}\n')
    cfg = load_config(str(path), {}, {})
    (w,) = cfg.workers
    assert w.kubernetes is not None
    return w.kubernetes


def test_defaults_are_llm_d_s_and_the_worker_id_is_the_engine(tmp_path: Path) -> None:
    k = load(tmp_path, "", 'selector = "llm-d.ai/inference-serving=true"')
    assert k == KubernetesConfig(selector="llm-d.ai/inference-serving=true")
    assert (k.port, k.replay_port, k.topic, k.namespace, k.kubeconfig) == (5557, 0, "", "", "")
    cfg = load_config(str(tmp_path / "kvobserve.toml"), {}, {})
    assert (cfg.workers[0].id, cfg.workers[0].dp_size) == ("vllm", 1)


@pytest.mark.parametrize(
    ("worker", "table", "error"),
    [
        ("", 'namespace = "llm-d"', "worker[0].kubernetes.selector: missing; a label selector"),
        ("", 'selector = "app in vllm"', "worker[0].kubernetes.selector: cannot read 'app in vllm'"),
        ("", 'selector = "a=b,=c"', "worker[0].kubernetes.selector: cannot read '=c' in selector"),
        ("", 'selector = "a in (b, c d)"', "worker[0].kubernetes.selector: bad values in"),
        ("", 'selector = "a=b"\nport = 0', "worker[0].kubernetes.port: must be >= 1, got 0"),
        ("", 'selector = "a=b"\nport = "5557"', "worker[0].kubernetes.port: expected int, got '5557'"),
        ("dp_size = 4", 'selector = "a=b"\nport = 65534', "worker[0].kubernetes.port: 65534 + 4 ranks pass port 65535"),
        ("dp_size = 4", 'selector = "a=b"\nreplay_port = 5559', "worker[0].kubernetes.replay_port: 5559 overlaps the KV-event ports 5557-5560 of 4 ranks"),
        ("", 'selector = "a=b"\ntopic = "kv@{ip}"', "worker[0].kubernetes.topic: unknown field {ip} in 'kv@{ip}'"),
        ("", 'selector = "a=b"\ntopic = "kv@{pod"', "worker[0].kubernetes.topic: expected '}'"),
        ("", 'selector = "a=b"\nnamespace = "LLM_D"', "worker[0].kubernetes.namespace: not a Kubernetes namespace name: 'LLM_D'"),
        ("", 'selector = "a=b"\nkubeconfig = "/nonexistent/kc"', "worker[0].kubernetes.kubeconfig: no such file: '/nonexistent/kc'"),
        ("", 'selector = "a=b"\nselectors = "x"', "worker[0].kubernetes.selectors: unknown key (value 'x'); did you mean 'selector'?"),
        ('kv_endpoint = "tcp://*:5557"', 'selector = "a=b"', "worker[0].kv_endpoint: not with [worker.kubernetes] ('tcp://*:5557'); each Ready pod's IP"),
        ('topic = "kv@"', 'selector = "a=b"', "worker[0].topic: not with [worker.kubernetes] ('kv@'); set topic in [worker.kubernetes]"),
        ('url = "http://10.0.0.5:8000"', 'selector = "a=b"', "worker[0].url: not with [worker.kubernetes]"),
        ('id = "llm-d/qwen"', 'selector = "a=b"', "worker[0].id: 'llm-d/qwen': must be non-empty without '/'"),
        ('zmq_endpoints = ["tcp://a:1"]', 'selector = "a=b"', "worker[0].zmq_endpoints: only for engine = 'dynamo'"),
        ("dp_size = 0", 'selector = "a=b"', "worker[0].dp_size: must be >= 1, got 0"),
        ('metrics_url = "http://10.0.0.5:8000/metrics"', 'selector = "a=b"', "worker[0].metrics_url: 'http://10.0.0.5:8000/metrics' would be every pod's; name the pod's address, e.g. 'http://{pod_ip}:8000/metrics'"),
        ('metrics_url = "http://{ip}:8000/metrics"', 'selector = "a=b"', "worker[0].metrics_url: unknown field {ip} in 'http://{ip}:8000/metrics'; a URL may name {pod} and {pod_ip}"),
        ('metrics_url = "{pod_ip}:8000/metrics"', 'selector = "a=b"', "worker[0].metrics_url: expected http://host[:port], got '10.0.0.1:8000/metrics'"),
    ],
)  # fmt: skip
def test_errors_name_the_field_and_the_value(
    tmp_path: Path, worker: str, table: str, error: str
) -> None:
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, worker, table)
    assert str(exc.value).startswith(error), str(exc.value)


def test_a_dynamo_worker_cannot_have_pods(tmp_path: Path) -> None:
    path = tmp_path / "kvobserve.toml"
    path.write_text('[[worker]]\nengine = "dynamo"\n[worker.kubernetes]\nselector = "a=b"\n')
    with pytest.raises(ConfigError, match=r"^worker\[0\].engine: must be 'sglang' or 'vllm' with"):
        load_config(str(path), {}, {})


def test_the_selector_is_read_as_kubectl_reads_it() -> None:
    got = parse_selector(
        "app=vllm, tier!=cache,role in (decode, both),env notin (dev),gpu,!canary,x==y", "s"
    )
    assert got == (
        ("app", "=", ("vllm",)),
        ("tier", "!=", ("cache",)),
        ("role", "in", ("decode", "both")),
        ("env", "notin", ("dev",)),
        ("gpu", "exists", ()),
        ("canary", "!exists", ()),
        ("x", "=", ("y",)),
    )  # fmt: skip
    assert parse_selector("llm-d.ai/inference-serving=true", "s") == (
        ("llm-d.ai/inference-serving", "=", ("true",)),
    )
    assert parse_selector("app=", "s") == (("app", "=", ("",)),)  # an empty value is a value


def _at(rv: int) -> dict[str, Pod]:
    """Each pod as recorded at resourceVersion `rv`, the list's state first."""
    listed = json.loads((FIXTURES / "pods-list.json").read_text())["items"]
    events = [json.loads(x) for x in (FIXTURES / "pods-watch.jsonl").read_text().splitlines()]
    out = {p["metadata"]["name"]: p for p in listed}
    for e in events:
        obj = e["object"]
        if int(obj["metadata"]["resourceVersion"]) <= rv:
            if e["type"] == "DELETED":
                out.pop(obj["metadata"]["name"])
            else:
                out[obj["metadata"]["name"]] = obj
    return {n: decode_object(json.dumps(p).encode(), Pod) for n, p in out.items()}


def test_a_pod_streams_from_running_and_ready_until_terminating_ready_or_not() -> None:
    short = {f"{RS}-{x}": x for x in ("2xkqp", "8mz4t", "q7w2n", "zk9fd")}
    short["qwen-epp-5f6d8c7b9-lq2vw"] = "epp"
    steps = []
    current: dict[str, str] = {}
    for rv in (48213, 48220, 48231, 48252, 48263, 48270, 48302):
        current = streams_of(_at(rv), current)
        steps.append(sorted(short[n] for n in current))
    assert steps == [
        ["2xkqp", "epp"],  # the list as this function sees it (the selector is the server's)
        ["2xkqp", "epp"],  # 8mz4t Running with an IP, not Ready: not yet
        ["2xkqp", "8mz4t", "epp"],  # Ready
        ["2xkqp", "8mz4t", "epp", "q7w2n"],
        ["2xkqp", "8mz4t", "epp", "q7w2n"],  # 8mz4t not Ready again: it stays
        ["8mz4t", "epp", "q7w2n"],  # 2xkqp terminating (deletionTimestamp), still Ready
        ["8mz4t", "epp", "zk9fd"],  # q7w2n deleted, zk9fd Ready
    ]
    # a pod first seen not Ready is not a stream, even with an IP
    (b,) = [p for n, p in _at(48263).items() if n.endswith("8mz4t")]
    assert streams_of({"b": b}, {}) == {}
    assert streams_of({"b": b}, {"b": "10.9.9.9"}) == {}  # a new IP: a new pod sandbox


def test_each_streaming_pod_is_a_worker_with_its_ranks_at_its_ip(tmp_path: Path) -> None:
    path = tmp_path / "kvobserve.toml"
    path.write_text(
        '[collector]\nnode_rank = 1\nnnodes = 2\n\n[[worker]]\nid = "qwen"\nengine = "vllm"\n'
        'dp_size = 2\n[worker.kubernetes]\nselector = "a=b"\nreplay_port = 5559\n'
        'topic = "kv@{pod_ip}:8000@{namespace}/{pod}"\n'
    )
    cfg = load_config(str(path), {}, {})
    pods = {"p-2": "10.4.2.17", "p-1": "fd00::17"}
    plans = plan_pods(0, cfg.workers[0], cfg.collector, pods, "llm-d")
    assert [p.worker.id for p in plans] == ["qwen/p-1", "qwen/p-2"]
    (v6, v4) = plans
    # node_rank 1 of 2 still watches every rank of a pod: a pod is its own node
    assert v4.watched_ranks == (0, 1) and v4.dp_size == 2
    assert [(s.dp_rank, s.endpoint, s.replay_endpoint, s.topic) for s in v4.streams] == [
        (0, "tcp://10.4.2.17:5557", "tcp://10.4.2.17:5559", "kv@10.4.2.17:8000@llm-d/p-2"),
        (1, "tcp://10.4.2.17:5558", "tcp://10.4.2.17:5560", "kv@10.4.2.17:8000@llm-d/p-2"),
    ]
    assert v6.streams[1].endpoint == "tcp://[fd00::17]:5558"
    # the probe past the last rank would be rank 0's replay port: skipped, and said
    assert v4.probes == ()
    assert "probe tcp://10.4.2.17:5559 skipped: it is rank 0's replay port" in v4.notes
    assert v4.info().worker_id == "qwen/p-2" and v4.info().ranks_owned == [0, 1]


def test_each_pod_s_engine_is_scraped_at_its_own_address(tmp_path: Path) -> None:
    path = tmp_path / "kvobserve.toml"
    path.write_text(
        '[[worker]]\nid = "qwen"\nengine = "vllm"\nmetrics_url = "http://{pod_ip}:8000/metrics"\n'
        '[worker.kubernetes]\nselector = "a=b"\n'
    )
    cfg = load_config(str(path), {}, {})
    plans = plan_pods(0, cfg.workers[0], cfg.collector, {"p-1": "fd00::17", "p-2": "10.4.2.17"}, "")
    assert [[(s.source, s.endpoints, s.scope) for s in p.scheduler] for p in plans] == [
        [("metrics", ("http://[fd00::17]:8000/metrics",), "leader")],
        [("metrics", ("http://10.4.2.17:8000/metrics",), "leader")],
    ]
