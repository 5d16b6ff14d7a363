"""Config: file + env + flags precedence, defaults, and errors that name the field and value."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import pytest

from kvobserve.config import (
    SECTIONS,
    ConfigError,
    add_config_flags,
    load_config,
    overrides_from_args,
)
from tests.certs import self_signed

FULL = """
cluster = "prod-a"

[collector]
id = "node-0"
node_rank = 0
nnodes = 2
interval_s = 2

[[worker]]
id = "sglang-dp8"
engine = "sglang"
url = "http://10.0.0.5:30000"
kv_endpoint = "tcp://10.0.0.5:5557"
replay_endpoint = "tcp://10.0.0.5:5657"
topic = "kv-events"
dp_size = 8
dp_attention = true
metrics_url = "http://10.0.0.5:30000/metrics"
capacity_tokens = 0
probe_extra_ports = 2

[aggregator]
nats = "nats://127.0.0.1:4222"
stale_intervals = 5

[http]
listen = "0.0.0.0:9477"
"""


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "kvobserve.toml"
    p.write_text(text)
    return str(p)


def parse_flags(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, SECTIONS)
    return parser.parse_args(argv)


def test_full_file(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, FULL), {}, {})
    assert cfg.cluster == "prod-a"
    assert (cfg.collector.id, cfg.collector.node_rank, cfg.collector.nnodes) == ("node-0", 0, 2)
    assert cfg.collector.interval_s == 2.0 and isinstance(cfg.collector.interval_s, float)
    (w,) = cfg.workers
    assert (w.id, w.engine, w.dp_size, w.dp_attention, w.topic) == (
        "sglang-dp8",
        "sglang",
        8,
        True,
        "kv-events",
    )
    assert w.leader is True  # node_rank 0
    assert w.probe_extra_ports == 2 and w.allow_pickle is False
    assert cfg.nats is not None and cfg.nats.url == "nats://127.0.0.1:4222"
    assert cfg.aggregator.stale_intervals == 5.0
    assert (cfg.http.listen, cfg.http.basic_auth, cfg.http.tls) == ("0.0.0.0:9477", None, None)


def test_http_auth_and_tls_from_env(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    env = {
        "KVOBSERVE_HTTP_USER": "prometheus",
        "KVOBSERVE_HTTP_PASSWORD": "pw",
        "KVOBSERVE_HTTP_TLS_CERT": cert,
        "KVOBSERVE_HTTP_TLS_KEY": key,
    }
    cfg = load_config(write(tmp_path, FULL), {}, env)
    assert cfg.http.basic_auth == ("prometheus", "pw")
    assert cfg.http.tls == (cert, key)
    assert "pw" not in repr(cfg)
    # a key that does not belong to the cert is found at load time, naming both settings
    _, other = self_signed(tmp_path / "other")
    with pytest.raises(
        ConfigError, match=r"^KVOBSERVE_HTTP_TLS_CERT \(http.tls_cert\): .*KVOBSERVE_HTTP_TLS_KEY"
    ):
        load_config(None, {}, {**env, "KVOBSERVE_HTTP_TLS_KEY": other})


def test_kubernetes_service_links_are_not_settings() -> None:
    links = {
        "KVOBSERVE_AGGREGATOR_SERVICE_HOST": "10.96.0.7",
        "KVOBSERVE_AGGREGATOR_SERVICE_PORT_HTTP": "9477",
        "KVOBSERVE_AGGREGATOR_PORT": "tcp://10.96.0.7:9477",
        "KVOBSERVE_AGGREGATOR_PORT_9477_TCP_ADDR": "10.96.0.7",
    }
    assert load_config(None, {}, links) == load_config(None, {}, {})
    with pytest.raises(ConfigError, match="KVOBSERVE_AGGREGATOR_PORTS: unknown key"):
        load_config(None, {}, {"KVOBSERVE_AGGREGATOR_PORTS": "1"})


def test_a_command_default_is_replaced_but_not_a_given_value(tmp_path: Path) -> None:
    collect = {"http.listen": "127.0.0.1:9478"}
    assert load_config(None, {}, {}, defaults=collect).http.listen == "127.0.0.1:9478"
    assert (
        load_config(write(tmp_path, FULL), {}, {}, defaults=collect).http.listen == "0.0.0.0:9477"
    )
    env = {"KVOBSERVE_HTTP_LISTEN": "127.0.0.5:1"}
    assert load_config(None, {}, env, defaults=collect).http.listen == "127.0.0.5:1"


def test_render_ahead_flag_and_default() -> None:
    assert overrides_from_args(parse_flags(["--render-ahead", "0"])) == {
        "aggregator.render_ahead_s": "0"
    }
    assert load_config(None, {"aggregator.render_ahead_s": "0"}, {}).aggregator.render_ahead_s == 0
    assert load_config(None, {}, {}).aggregator.render_ahead_s == 2.0


def test_listen_flag_spellings_are_one_setting() -> None:
    for flag in ("--listen", "--collector-listen", "--aggregator-listen"):
        assert overrides_from_args(parse_flags([flag, "127.0.0.1:1"])) == {
            "http.listen": "127.0.0.1:1"
        }


def test_defaults_without_file() -> None:
    cfg = load_config(None, {}, {})
    assert cfg.workers == ()
    assert cfg.collector.node_rank == 0 and cfg.collector.nnodes == 1
    assert cfg.collector.interval_s == 1.0
    assert cfg.http.listen == "127.0.0.1:9477" and cfg.http.basic_auth is None
    assert cfg.aggregator.stale_intervals == 3.0
    assert cfg.nats is None
    assert cfg.collector.id  # hostname


def test_worker_defaults_and_leader_follows_node_rank() -> None:
    cfg = load_config(
        None,
        {
            "worker.engine": "vllm",
            "worker.kv_endpoint": "tcp://10.1.2.3:5557",
            "collector.nnodes": "2",
            "collector.node_rank": "1",
        },
        {},
    )
    (w,) = cfg.workers
    assert w.leader is False
    assert w.id == "vllm@10.1.2.3:5557"
    assert (w.topic, w.dp_size, w.probe_extra_ports, w.capacity_tokens) == ("", 1, 1, 0)


def test_dp_size_left_to_discovery_when_url_given() -> None:
    cfg = load_config(None, {"worker.engine": "sglang", "worker.url": "http://h:30000"}, {})
    assert cfg.workers[0].dp_size is None
    assert cfg.workers[0].dp_attention is None  # from discovery too


def test_collector_host_default_flag_env_and_ipv6() -> None:
    assert load_config(None, {}, {}).collector.host == "127.0.0.1"
    assert load_config(None, {}, {"KVOBSERVE_COLLECTOR_HOST": "10.0.0.6"}).collector.host == (
        "10.0.0.6"
    )
    args = parse_flags(["--collector-host", "[fd00::6]"])
    assert load_config(None, overrides_from_args(args), {}).collector.host == "fd00::6"


@pytest.mark.parametrize("host", ["*", "0.0.0.0", "[::]", ""])
def test_wildcard_endpoint_hosts_are_accepted(tmp_path: Path, host: str) -> None:
    text = (
        '[[worker]]\nengine = "sglang"\ndp_size = 8\n'
        f'kv_endpoint = "tcp://{host}:5557"\nreplay_endpoint = "tcp://{host}:5657"\n'
        f'load_endpoint = "tcp://{host}:5573"\nfpm_endpoint = "tcp://{host}:7000"\n'
    )
    (w,) = load_config(write(tmp_path, text), {}, {}).workers
    assert w.kv_endpoint == f"tcp://{host}:5557" and w.fpm_endpoint == f"tcp://{host}:7000"


def test_several_vllm_urls_as_a_list_or_comma_separated(tmp_path: Path) -> None:
    text = '[[worker]]\nengine = "vllm"\nurl = ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]\n'
    (w,) = load_config(write(tmp_path, text), {}, {}).workers
    assert w.urls == ("http://10.0.0.5:8000", "http://10.0.0.6:8000")
    assert w.id == "vllm@10.0.0.5:8000"  # from the first: the same on every node
    flag = {"worker.engine": "vllm", "worker.url": "http://10.0.0.5:8000, http://10.0.0.6:8000"}
    (w2,) = load_config(None, flag, {}).workers
    assert w2.urls == w.urls and w2.id == w.id


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    path = write(tmp_path, FULL)
    env = {"KVOBSERVE_COLLECTOR_NODE_RANK": "1", "KVOBSERVE_COLLECTOR_INTERVAL_S": "5"}
    cfg = load_config(path, {}, env)
    assert cfg.collector.node_rank == 1  # env over file
    assert cfg.collector.interval_s == 5.0
    assert cfg.workers[0].leader is False  # the default follows the final node_rank
    args = parse_flags(["-c", path, "--node-rank", "0", "--leader"])
    cfg = load_config(args.config, overrides_from_args(args), env)
    assert cfg.collector.node_rank == 0  # flag over env
    assert cfg.collector.interval_s == 5.0  # env still applies where no flag was given
    assert cfg.workers[0].leader is True


def test_flags_all_default_to_none() -> None:
    assert overrides_from_args(parse_flags([])) == {}
    args = parse_flags(
        [
            "--no-leader",
            "--dp-size",
            "4",
            "--nats",
            "nats://n:4222",
            "--allow-pickle",
            "--jetstream-kv",
        ]
    )
    assert overrides_from_args(args) == {
        "worker.leader": False,
        "worker.dp_size": "4",
        "nats.url": "nats://n:4222",
        "worker.allow_pickle": True,
        "nats.jetstream_kv": True,
    }


def test_all_worker_flags_apply_to_every_worker(tmp_path: Path) -> None:
    two = FULL + '\n[[worker]]\nid = "v"\nengine = "vllm"\nkv_endpoint = "tcp://10.0.0.6:5557"\n'
    cfg = load_config(write(tmp_path, two), {"worker.allow_pickle": True}, {})
    assert [w.allow_pickle for w in cfg.workers] == [True, True]
    with pytest.raises(ConfigError, match=r"--dp-size \(worker.dp_size\): '4' needs one worker"):
        load_config(write(tmp_path, two), {"worker.dp_size": "4"}, {})


def test_env_bool_and_nats_auth() -> None:
    env = {
        "KVOBSERVE_NATS_URL": "nats://a:4222,nats://b:4222",
        "KVOBSERVE_NATS_USER": "kv",
        "KVOBSERVE_NATS_PASSWORD": "s3cret",
        "KVOBSERVE_NATS_JETSTREAM_KV": "yes",
        "KVOBSERVE_OTHER_THING": "ignored",
    }
    cfg = load_config(None, {}, env)
    assert cfg.nats is not None
    assert (cfg.nats.user, cfg.nats.password, cfg.nats.jetstream_kv) == ("kv", "s3cret", True)
    assert "s3cret" not in repr(cfg)


BAD: list[tuple[str, dict[str, Any], dict[str, str], str]] = [
    # (file, flags, env, expected message fragment)
    (
        '[[worker]]\nengine = "sglang"\nkv_endpiont = "tcp://h:1"\n',
        {},
        {},
        "worker[0].kv_endpiont: unknown key (value 'tcp://h:1'); did you mean 'kv_endpoint'?",
    ),
    (
        "[collector]\nnode_rnk = 1\n",
        {},
        {},
        "collector.node_rnk: unknown key (value 1); did you mean 'node_rank'?",
    ),
    (
        "[colector]\nnode_rank = 1\n",
        {},
        {},
        "colector: unknown key (value {'node_rank': 1}); did you mean 'collector'?",
    ),
    ('clusterr = "x"\n', {}, {}, "clusterr: unknown key (value 'x')"),
    ('[collector]\nnode_rank = "one"\n', {}, {}, "collector.node_rank: expected int, got 'one'"),
    ("[collector]\nnode_rank = true\n", {}, {}, "collector.node_rank: expected int, got True"),
    (
        "[collector]\nnode_rank = 2\nnnodes = 2\n",
        {},
        {},
        "collector.node_rank: 2 must be < collector.nnodes (2)",
    ),
    ("[collector]\ninterval_s = 0\n", {}, {}, "collector.interval_s: must be > 0, got 0.0"),
    ('[http]\nlisten = "9478"\n', {}, {}, "http.listen: expected host:port, got '9478'"),
    (
        '[http]\nlisten = "localhost:http"\n',
        {},
        {},
        "http.listen: expected host:port, got 'localhost:http'",
    ),
    (
        '[collector]\nlisten = "127.0.0.1:9478"\n',
        {},
        {},
        "collector.listen: unknown key (value '127.0.0.1:9478'); it moved to http.listen",
    ),
    (
        "",
        {},
        {"KVOBSERVE_AGGREGATOR_LISTEN": "0.0.0.0:9477"},
        "KVOBSERVE_AGGREGATOR_LISTEN: renamed to KVOBSERVE_HTTP_LISTEN (http.listen)",
    ),
    (
        "",
        {},
        {"KVOBSERVE_TLS_CERT": "c.pem"},
        "KVOBSERVE_TLS_CERT: renamed to KVOBSERVE_HTTP_TLS_CERT (http.tls_cert)",
    ),
    ("", {"http.user": "u"}, {}, "http.password: missing (--http-user (http.user) is set)"),
    ("", {"http.tls_key": "k.pem"}, {}, "http.tls_cert: missing (--tls-key (http.tls_key) is set)"),
    ("[aggregator]\nstale_intervals = 0.5\n", {}, {}, "aggregator.stale_intervals: must be >= 1"),
    (
        "",
        {"aggregator.render_ahead_s": "-1"},
        {},
        "--render-ahead (aggregator.render_ahead_s): must be >= 0, got -1.0",
    ),
    (
        "",
        {"aggregator.render_ahead_s": "2s"},
        {},
        "--render-ahead (aggregator.render_ahead_s): expected float, got '2s'",
    ),
    (
        '[[worker]]\nengine = "sglang"\nkv_endpoint = "tcp://h:1"\ndp_size = -2\n',
        {},
        {},
        "worker[0].dp_size: must be >= 1, got -2",
    ),
    (
        '[[worker]]\nengine = "tgi"\nkv_endpoint = "tcp://h:1"\n',
        {},
        {},
        "worker[0].engine: must be one of sglang, vllm, dynamo, got 'tgi'",
    ),
    (
        '[[worker]]\nengine = "sglang"\nkv_endpoint = "udp://h:1"\n',
        {},
        {},
        "worker[0].kv_endpoint: expected a tcp:// or ipc:// or inproc:// endpoint, got 'udp://h:1'",
    ),
    (
        '[[worker]]\nengine = "sglang"\nkv_endpoint = "tcp://h"\n',
        {},
        {},
        "worker[0].kv_endpoint: expected tcp://host:port, got 'tcp://h'",
    ),
    (
        '[[worker]]\nengine = "sglang"\nkv_endpoint = "tcp://*"\n',
        {},
        {},
        "worker[0].kv_endpoint: expected tcp://host:port, got 'tcp://*'",
    ),
    ('[collector]\nhost = "*"\n', {}, {}, "collector.host: expected the address this node"),
    ("", {}, {"KVOBSERVE_COLLECTOR_HOST": "0.0.0.0"}, "KVOBSERVE_COLLECTOR_HOST (collector.host)"),
    (
        '[[worker]]\nengine = "sglang"\nurl = ["http://a:1", "http://b:1"]\n',
        {},
        {},
        "worker[0].url: 2 URLs for sglang; several URLs are for vLLM API servers",
    ),
    (
        '[[worker]]\nengine = "vllm"\nurl = ["http://a:1", 5]\n',
        {},
        {},
        "worker[0].url[1]: expected str, got 5",
    ),
    (
        '[[worker]]\nengine = "vllm"\nurl = "http://a:1,b:2"\n',
        {},
        {},
        "worker[0].url: expected http://host[:port], got 'b:2'",
    ),
    (
        '[[worker]]\nengine = "sglang"\nurl = "10.0.0.5:30000"\n',
        {},
        {},
        "worker[0].url: expected http://host[:port], got '10.0.0.5:30000'",
    ),
    (
        '[[worker]]\nengine = "sglang"\nurl = "http://h:port"\n',
        {},
        {},
        "worker[0].url: expected http://host[:port], got 'http://h:port'",
    ),
    (
        '[[worker]]\nengine = "sglang"\n',
        {},
        {},
        "worker[0]: needs kv_endpoint, bind (publishers connect) or url",
    ),
    (
        '[[worker]]\nid = "a"\nengine = "sglang"\nkv_endpoint = "tcp://h:1"\n[[worker]]\nid = "a"\nengine = "vllm"\nkv_endpoint = "tcp://h:2"\n',
        {},
        {},
        "worker[1].id: duplicate 'a' (also worker[0])",
    ),
    (
        'cluster = "prod.a"\n',
        {},
        {},
        "cluster: only letters, digits, '-' and '_' allowed, got 'prod.a'",
    ),
    ("", {"collector.nnodes": "two"}, {}, "--nnodes (collector.nnodes): expected int, got 'two'"),
    (
        "",
        {},
        {"KVOBSERVE_COLLECTOR_NODE_RANK": "x"},
        "KVOBSERVE_COLLECTOR_NODE_RANK (collector.node_rank): expected int, got 'x'",
    ),
    (
        "",
        {},
        {"KVOBSERVE_COLLECTOR_NODERANK": "1"},
        "KVOBSERVE_COLLECTOR_NODERANK: unknown key 'noderank' in [collector] (value '1'); did you mean 'node_rank'?",
    ),
    (
        "",
        {},
        {"KVOBSERVE_WORKER_LEADER": "maybe", "KVOBSERVE_WORKER_KV_ENDPOINT": "tcp://h:1"},
        "KVOBSERVE_WORKER_LEADER (worker.leader): expected bool, got 'maybe'",
    ),
    (
        "",
        {"nats.url": "http://n:4222"},
        {},
        "--nats (nats.url): expected nats://host[:port], got 'http://n:4222'",
    ),
    (
        "",
        {"nats.url": "nats://n:4222", "nats.user": "u"},
        {},
        "nats.password: missing (--nats-user (nats.user) is set)",
    ),
    (
        "",
        {"nats.url": "nats://n:4222", "nats.tls_cert": "c.pem"},
        {},
        "nats.tls_key: missing (--nats-tls-cert (nats.tls_cert) is set)",
    ),
    ('[nats]\ntoken = "t"\n', {}, {}, "nats.token: set, but nats.url is missing"),
    (
        "",
        {"nats.url": "nats://n:4222", "nats.connect_timeout_s": "0"},
        {},
        "--nats-connect-timeout (nats.connect_timeout_s): must be > 0, got 0.0",
    ),
    (
        "",
        {"nats.url": "nats://n:4222", "nats.token": "t", "nats.user": "u", "nats.password": "p"},
        {},
        "--nats-token (nats.token): set together with --nats-user (nats.user)",
    ),
]


@pytest.mark.parametrize(("text", "flags", "env", "fragment"), BAD)
def test_errors_name_field_and_value(
    tmp_path: Path, text: str, flags: dict[str, Any], env: dict[str, str], fragment: str
) -> None:
    path = write(tmp_path, text) if text else None
    with pytest.raises(ConfigError) as info:
        load_config(path, flags, env)
    msg = str(info.value)
    assert fragment in msg
    assert "\n" not in msg  # the CLI prints it on one line


def test_toml_syntax_error_keeps_position(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"line 1"):
        load_config(write(tmp_path, "[collector\n"), {}, {})


def test_missing_file_named() -> None:
    with pytest.raises(ConfigError, match=r"/nonexistent/kv.toml"):
        load_config("/nonexistent/kv.toml", {}, {})


def test_config_is_frozen(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, FULL), {}, {})
    with pytest.raises(AttributeError):
        cfg.collector.node_rank = 3  # type: ignore[misc]


def test_state_dir_defaults_to_the_xdg_state_dir_or_var_lib_for_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvobserve.config.load as config_load
    from kvobserve.config.model import default_state_dir

    monkeypatch.setattr(config_load, "default_state_dir", default_state_dir)  # not the test's own

    assert default_state_dir({}, root=True) == "/var/lib/kvobserve"
    assert default_state_dir({"XDG_STATE_HOME": "/s", "HOME": "/h"}, root=False) == "/s/kvobserve"
    # a relative XDG_STATE_HOME is invalid (the XDG spec): the home directory's default instead
    assert (
        default_state_dir({"XDG_STATE_HOME": "s", "HOME": "/h"}, False)
        == "/h/.local/state/kvobserve"
    )
    cfg = load_config(None, {}, {"XDG_STATE_HOME": str(tmp_path), "HOME": "/nowhere"})
    assert cfg.collector.state_dir == (
        "/var/lib/kvobserve" if os.geteuid() == 0 else str(tmp_path / "kvobserve")
    )
    assert cfg.collector.checkpoint_interval_s == 5.0
    assert not (tmp_path / "kvobserve").exists()  # created when a collector starts, not here


def test_state_dir_and_checkpoint_interval_from_file_env_and_flags(tmp_path: Path) -> None:
    path = write(tmp_path, '[collector]\nstate_dir = "state"\ncheckpoint_interval_s = 2\n')
    cfg = load_config(path, {}, {})
    assert cfg.collector.state_dir == os.path.abspath("state")  # absolute from here on
    assert cfg.collector.checkpoint_interval_s == 2.0
    env = {"KVOBSERVE_COLLECTOR_STATE_DIR": str(tmp_path / "e")}
    flags = overrides_from_args(parse_flags(["--checkpoint-interval", "0"]))
    cfg = load_config(path, flags, env)
    assert (cfg.collector.state_dir, cfg.collector.checkpoint_interval_s) == (
        str(tmp_path / "e"),
        0.0,
    )


def test_state_dir_and_checkpoint_interval_errors_name_the_key(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    path = write(tmp_path, f'[collector]\nstate_dir = "{tmp_path / "f"}"\n')
    with pytest.raises(
        ConfigError, match=r"^collector\.state_dir: '.*/f' exists and is not a directory$"
    ):
        load_config(path, {}, {})
    with pytest.raises(
        ConfigError,
        match=r"^--checkpoint-interval \(collector\.checkpoint_interval_s\): must be >= 0, got -1\.0$",
    ):
        load_config(None, overrides_from_args(parse_flags(["--checkpoint-interval", "-1"])), {})
    with pytest.raises(
        ConfigError, match=r"^--state-dir \(collector\.state_dir\): a NUL character"
    ):
        load_config(None, {"collector.state_dir": "a\0b"}, {})
