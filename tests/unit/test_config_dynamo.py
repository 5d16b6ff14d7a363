"""`[[worker]] engine = "dynamo"`: the keys, their defaults, and errors that name the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvobserve.config import ConfigError, load_config
from kvobserve.sources.dynamo_plan import node_share, plan_dynamo, redact


def _load(tmp_path: Path, text: str, flags: dict[str, Any] | None = None) -> Any:
    p = tmp_path / "k.toml"
    p.write_text(text)
    return load_config(str(p), flags or {}, {})


NATS = '[[worker]]\nengine = "dynamo"\nevent_plane_url = "nats://127.0.0.1:4222"\n'


def test_nats_defaults(tmp_path: Path) -> None:
    w = _load(tmp_path, NATS).workers[0]
    assert (w.id, w.event_plane, w.namespace, w.dp_size, w.block_size) == (
        "dynamo", "nats", None, None, 0,
    )  # fmt: skip
    assert (w.keep_ranks, w.indexer_url, w.indexer_api, w.drift_interval_s) == (
        "all", None, "dump", 30.0,
    )  # fmt: skip
    assert "4222" not in repr(w)  # the URL may carry a password: kept out of reprs
    w = _load(tmp_path, NATS + 'namespace = "prod"\n').workers[0]
    assert w.id == "dynamo-prod"


def test_zmq_endpoints_from_file_env_and_flags(tmp_path: Path) -> None:
    text = '[[worker]]\nengine = "dynamo"\nevent_plane = "zmq"\nzmq_endpoints = ["tcp://127.0.0.1:1", "tcp://127.0.0.2:1"]\n'
    assert _load(tmp_path, text).workers[0].zmq_endpoints == (
        "tcp://127.0.0.1:1", "tcp://127.0.0.2:1",
    )  # fmt: skip
    env = {"KVOBSERVE_WORKER_ZMQ_ENDPOINTS": "tcp://127.0.0.1:7, tcp://127.0.0.2:7"}
    cfg = load_config(None, {"worker.engine": "dynamo", "worker.event_plane": "zmq"}, env)
    assert cfg.workers[0].zmq_endpoints == ("tcp://127.0.0.1:7", "tcp://127.0.0.2:7")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('[[worker]]\nengine = "dynamo"\n', "worker[0].event_plane_url: missing"),
        (NATS + 'event_plane = "jetstream"\n', "worker[0].event_plane: must be one of nats, zmq"),
        (
            '[[worker]]\nengine = "dynamo"\nevent_plane = "zmq"\n',
            "worker[0].zmq_endpoints: missing",
        ),
        (
            '[[worker]]\nengine = "dynamo"\nevent_plane = "zmq"\nzmq_endpoints = ["tcp://*:5"]\n',
            "worker[0].zmq_endpoints[0]: wildcard host",
        ),
        (
            '[[worker]]\nengine = "dynamo"\nevent_plane = "zmq"\nzmq_endpoints = [5]\n',
            "worker[0].zmq_endpoints[0]: expected str, got 5",
        ),
        (
            '[[worker]]\nengine = "dynamo"\nevent_plane = "zmq"\n'
            'zmq_endpoints = ["tcp://h:1", "tcp://h:1"]\n',
            "worker[0].zmq_endpoints: an endpoint is listed twice",
        ),
        (
            NATS + 'zmq_endpoints = ["tcp://h:1"]\n',
            "worker[0].zmq_endpoints: only with event_plane = 'zmq'",
        ),
        (
            NATS + 'kv_endpoint = "tcp://h:1"\n',
            "worker[0].kv_endpoint: does not apply to engine = 'dynamo'",
        ),
        (NATS + 'keep_ranks = "node"\n', "worker[0].keep_ranks: 'node' needs dp_size"),
        (
            NATS + 'keep_ranks = "rack"\n',
            "worker[0].keep_ranks: must be one of all, node, got 'rack'",
        ),
        (NATS + 'indexer_api = "tree"\n', "worker[0].indexer_api: must be one of dump, query"),
        (NATS + 'indexer_url = "ftp://x"\n', "worker[0].indexer_url: expected http://host[:port]"),
        (NATS + "drift_lag_s = 20.0\n", "worker[0].drift_lag_s: 20.0 must be under half"),
        (NATS + 'namespace = " "\n', "worker[0].namespace: must not be empty"),
        (NATS + 'id = "a/b"\n', "worker[0].id: must be non-empty without '/'"),
        (NATS + "block_size = -1\n", "worker[0].block_size: must be >= 0"),
        (NATS + 'event_plane_tls_cert = "c.pem"\n', "worker[0].event_plane_tls_key: missing"),
        (
            '[[worker]]\nengine = "sglang"\nkv_endpoint = "tcp://h:1"\nnamespace = "x"\n',
            "worker[0].namespace: only for engine = 'dynamo' (this worker is 'sglang')",
        ),
    ],
)
def test_errors_name_the_field(tmp_path: Path, text: str, error: str) -> None:
    with pytest.raises(ConfigError) as exc:
        _load(tmp_path, text)
    assert error in str(exc.value)


def test_plan_nats_node_share_and_labels(tmp_path: Path) -> None:
    text = (
        "[collector]\nnode_rank = 1\nnnodes = 2\n" + NATS.replace("127.0.0.1", "u:pw@127.0.0.1")
        + 'namespace = "a.b"\ndp_size = 8\nkeep_ranks = "node"\n'
    )  # fmt: skip
    cfg = _load(tmp_path, text)
    p = plan_dynamo(0, cfg.workers[0], cfg.collector)
    assert p.owned == range(4, 8) and p.keeps(4) and not p.keeps(3)
    assert p.shown == "nats://127.0.0.1:4222"  # credentials never shown
    assert p.subjects[0] == "namespace.a%2Eb.component.*.endpoint.*.kv-events"
    assert p.label(12345) == "dynamo-a.b/12345"
    assert node_share(7, 0, 2) == range(0, 4) and node_share(7, 1, 2) == range(4, 7)
    assert redact("nats://u:p@h:1,tls://[::1]:2") == "nats://h:1,tls://[::1]:2"


def test_a_dynamo_worker_next_to_engines(tmp_path: Path) -> None:
    text = NATS + '[[worker]]\nengine = "sglang"\nkv_endpoint = "tcp://127.0.0.1:5557"\n'
    cfg = _load(tmp_path, text)
    assert [w.engine for w in cfg.workers] == ["dynamo", "sglang"]


def test_check_prints_what_a_dynamo_worker_subscribes_to(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvobserve.cli import main

    text = (
        NATS.replace("127.0.0.1", "u:pw@127.0.0.1") + 'namespace = "dynamo"\n'
        '[[worker]]\nid = "z"\nengine = "dynamo"\nevent_plane = "zmq"\n'
        'zmq_endpoints = ["tcp://127.0.0.1:5", "tcp://127.0.0.2:5"]\n'
    )  # fmt: skip
    p = tmp_path / "k.toml"
    p.write_text(text)
    assert main(["check", "-c", str(p)]) == 0
    out = capsys.readouterr().out
    assert "subscribe namespace.dynamo.component.*.endpoint.*.kv-events" in out
    assert "subscribe tcp://127.0.0.2:5" in out and "pw" not in out
    assert "streams: dynamo/<dynamo worker_id> per dp_rank" in out
    assert main(["check", "-c", str(p), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    nats_plan, zmq_plan = doc["workers"]
    assert (nats_plan["engine"], nats_plan["url"], nats_plan["keep_ranks"]) == (
        "dynamo", "nats://127.0.0.1:4222", "all",
    )  # fmt: skip
    assert zmq_plan["endpoints"] == ["tcp://127.0.0.1:5", "tcp://127.0.0.2:5"]
