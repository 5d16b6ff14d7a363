"""Bind mode's pure parts: topic templates, the config checks, the plan, relay and endpoint state."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvobserve.config import ConfigError, load_config
from kvobserve.config.bind import TopicTemplate, fill_pod, pod_ip
from kvobserve.sources.bind import Listener
from kvobserve.sources.link import DEFAULT_LINK_TIMES
from kvobserve.sources.plan import ListenSpec, StreamSpec, plan_worker, pod_scheduler
from kvobserve.sources.relay import Relay, RelayLink
from kvobserve.sources.stream_events import RecentEvents
from kvobserve.sources.stream_state import WatchedStream, new_link

LLMD = "kv@{pod}@{model}"
ROOT = Path(__file__).resolve().parents[2]


def _cfg(node_rank: int = 0, nnodes: int = 1, **worker: Any) -> Any:
    flags = {f"worker.{k}": v for k, v in worker.items()}
    flags.update({"collector.node_rank": node_rank, "collector.nnodes": nnodes})
    return load_config(None, {"worker.engine": "vllm", **flags}, {})


# --- topic templates --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("topic", "fields"),
    [
        ("kv@10.0.0.1:8000@meta-llama/Llama-3.1-8B", {"pod": "10.0.0.1:8000",
                                                     "model": "meta-llama/Llama-3.1-8B"}),
        ("kv@[fd00::7]:8000@m", {"pod": "[fd00::7]:8000", "model": "m"}),
        ("kv@pod-a@m@x", {"pod": "pod-a", "model": "m@x"}),  # the model keeps what follows
        ("kv@@m", None),  # an empty pod is no pod
        ("kv@10.0.0.1:8000", None),
        ("kv-events", None),
        ("", None),
    ],
)  # fmt: skip
def test_the_llm_d_template_reads_pod_and_model_back(topic: str, fields: Any) -> None:
    t = TopicTemplate.parse(LLMD, "t")
    assert (t.templated, t.prefix) == (True, "kv@")
    assert t.match(topic) == fields


def test_a_plain_topic_is_a_prefix() -> None:
    t = TopicTemplate.parse("kv", "t")
    assert not t.templated
    assert t.match("kv-events") == {} and t.match("other") is None
    assert TopicTemplate.parse("", "t").match("anything") == {}


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("kv@{model}", "'kv@{model}' has no {pod}"),
        ("kv@{pod}@{mdl}", "unknown field {mdl} in 'kv@{pod}@{mdl}'"),
        ("kv@{pod}{model}", "two fields without text between them"),
        ("kv@{pod}@{pod}", "a field appears twice"),
        ("kv@{pod", "unbalanced brace in 'kv@{pod'"),
        ("kv}@{pod}", "unbalanced brace"),
    ],
)
def test_a_bad_template_names_the_field_and_value(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=r"^worker\[0\]\.topic: ") as exc:
        TopicTemplate.parse(text, "worker[0].topic")
    assert fragment in str(exc.value)


def test_pod_addresses_for_replay() -> None:
    assert pod_ip("10.0.0.1:8000") == "10.0.0.1"
    assert pod_ip("[fd00::1]:8000") == "fd00::1"
    assert pod_ip("pod-a") == "pod-a"
    assert fill_pod("tcp://{pod_ip}:5559", "10.0.0.1:8000") == "tcp://10.0.0.1:5559"
    assert fill_pod("tcp://{pod_ip}:5559", "[fd00::1]:8000") == "tcp://[fd00::1]:5559"


# --- config -----------------------------------------------------------------------------------


def test_the_llm_d_central_config_loads() -> None:
    w = _cfg(bind="tcp://*:5556", topic=LLMD, replay_endpoint="tcp://{pod_ip}:5559",
             relay_to="tcp://scheduler:5556").workers[0]  # fmt: skip
    assert (w.bind, w.relay_to, w.relay_queue, w.kv_endpoint) == (
        "tcp://*:5556",
        "tcp://scheduler:5556",
        10_000,
        None,
    )
    assert w.id == "vllm@*:5556"  # the default id names the bound endpoint


@pytest.mark.parametrize(
    ("worker", "fragment"),
    [
        ({"bind": "tcp://*:5557", "kv_endpoint": "tcp://*:5557"},
         "--kv-endpoint (worker[0].kv_endpoint): 'tcp://*:5557' with --bind"),
        ({"bind": "udp://*:5557"}, "--bind (worker[0].bind): expected a tcp:// or ipc://"),
        ({"bind": "tcp://*:0"}, "port 0 in 'tcp://*:0'"),
        ({"kv_endpoint": "tcp://*:5557", "topic": LLMD},
         "'kv@{pod}@{model}' is a template, which names each publisher"),
        ({"kv_endpoint": "tcp://*:5557", "relay_to": "tcp://s:5556"},
         "--relay-to (worker[0].relay_to): 'tcp://s:5556' forwards what a bound endpoint"),
        ({"bind": "tcp://*:5556", "relay_to": "tcp://*:5556"}, "wildcard host in 'tcp://*:5556'"),
        ({"bind": "tcp://*:5556", "relay_to": "tcp://localhost:5556"},
         "'tcp://localhost:5556' reaches --bind (worker[0].bind) 'tcp://*:5556' on this machine"),
        # any loopback address reaches a wildcard bind; rank 1 relays to 5557, which rank 1 binds
        ({"bind": "tcp://*:5556", "relay_to": "tcp://127.0.0.2:5556"}, "every frame would come back"),
        ({"bind": "tcp://*:5556", "relay_to": "tcp://127.0.0.1:5557", "dp_size": "2"},
         "(rank r binds and relays port + r, 2 ranks): every frame would come back"),
        # the engines' endpoint names the collector's node from outside: not bindable here
        ({"bind": "tcp://collector.invalid:5557"},
         "--bind (worker[0].bind): 'collector.invalid' in 'tcp://collector.invalid:5557' does "
         "not resolve here, so it cannot be bound: bind tcp://*:5557 (every address of this "
         "machine; the engines connect to its name)"),
        ({"bind": "tcp://192.0.2.7:5557"},  # TEST-NET-1: nobody's address
         "'192.0.2.7' in 'tcp://192.0.2.7:5557' is not an address of this machine"),
        ({"bind": "tcp://*:5556", "replay_endpoint": "tcp://{pod_ip}:5559"},
         "names {pod_ip}, which a topic template with {pod} gives"),
        ({"bind": "tcp://*:5556", "topic": LLMD, "replay_endpoint": "tcp://{pod}:5559"},
         "unknown field {pod} in 'tcp://{pod}:5559'"),
        ({"bind": "tcp://*:5556", "replay_endpoint": "tcp://*:5559"}, "wildcard host in 'tcp://*:5559'"),
        ({"bind": "tcp://*:5556", "relay_to": "tcp://s:5557", "relay_queue": "0"},
         "--relay-queue (worker[0].relay_queue): must be >= 1, got 0"),
        ({"engine": "dynamo", "bind": "tcp://*:5556"}, "does not apply to engine = 'dynamo'"),
    ],
)  # fmt: skip
def test_bind_config_errors_name_the_field_and_value(worker: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError) as exc:
        _cfg(**worker)
    assert fragment in str(exc.value)


@pytest.mark.parametrize(
    ("bind", "relay_to"),
    [("tcp://127.0.0.1:5556", "tcp://127.0.0.2:5556"),  # bound on one loopback address only
     ("tcp://*:5556", "tcp://127.0.0.1:5558"),  # past the 2 ranks' ports
     ("tcp://lo:5556", "tcp://scheduler:5556"),  # a network interface binds
     ("tcp://localhost:5556", "tcp://scheduler:5556")],  # a name of this machine's address
)  # fmt: skip
def test_binds_and_relays_that_do_not_loop_are_accepted(bind: str, relay_to: str) -> None:
    w = _cfg(bind=bind, relay_to=relay_to, dp_size="2").workers[0]
    assert (w.bind, w.relay_to) == (bind, relay_to)


def test_a_node_that_is_not_the_leader_binds_nothing_so_any_address_is_its_leaders() -> None:
    w = _cfg(node_rank=1, nnodes=2, bind="tcp://192.0.2.7:5557").workers[0]
    assert (w.leader, w.bind) == (False, "tcp://192.0.2.7:5557")


# --- the plan ---------------------------------------------------------------------------------


def test_the_leader_binds_every_rank_and_names_streams_by_rank() -> None:
    cfg = _cfg(bind="tcp://*:5557", replay_endpoint="tcp://10.0.0.7:5657", dp_size=2,
               id="v", relay_to="tcp://10.0.0.9:6000")  # fmt: skip
    p = plan_worker(0, cfg.workers[0], cfg.collector, None)
    assert [(x.endpoint, x.replay_endpoint, x.relay_to) for x in p.listens] == [
        ("tcp://*:5557", "tcp://10.0.0.7:5657", "tcp://10.0.0.9:6000"),
        ("tcp://*:5558", "tcp://10.0.0.7:5658", "tcp://10.0.0.9:6001"),
    ]
    assert p.streams == tuple(
        StreamSpec("v", r, "vllm", f"tcp://*:{5557 + r}", "", f"tcp://10.0.0.7:{5657 + r}",
                   bound=True)
        for r in (0, 1)
    )  # fmt: skip
    assert p.watched == list(p.streams) and not p.pods and p.probes == ()
    assert (p.info().ranks_owned, p.info().leader) == ([0, 1], True)


def test_with_a_template_the_streams_are_the_pods_that_send() -> None:
    cfg = _cfg(bind="tcp://*:5556", topic=LLMD, replay_endpoint="tcp://{pod_ip}:5559", dp_size=2,
               id="llmd")  # fmt: skip
    p = plan_worker(0, cfg.workers[0], cfg.collector, None)
    assert p.pods and p.streams == () and p.watched == []
    assert [x.replay_endpoint for x in p.listens] == ["tcp://{pod_ip}:5559", "tcp://{pod_ip}:5560"]


def test_a_metrics_url_template_is_each_pod_s_own() -> None:
    cfg = _cfg(bind="tcp://*:5556", topic=LLMD, metrics_url="http://{pod_ip}:8000/metrics",
               id="llmd")  # fmt: skip
    p = plan_worker(0, cfg.workers[0], cfg.collector, None)
    assert [(s.source, s.endpoints, s.scope) for s in p.scheduler] == [
        ("metrics", ("http://{pod_ip}:8000/metrics",), "pod")  # not read as one URL
    ]
    got = pod_scheduler(p, "llmd/10.0.0.7:8000")
    assert [(s.source, s.endpoints, s.scope) for s in got] == [
        ("metrics", ("http://10.0.0.7:8000/metrics",), "leader")
    ]
    assert pod_scheduler(p, "llmd/[fd00::7]:8000")[0].endpoints == (
        "http://[fd00::7]:8000/metrics",
    )


@pytest.mark.parametrize(
    ("worker", "fragment"),
    [
        ({"bind": "tcp://*:5556", "topic": "kv", "metrics_url": "http://{pod_ip}:8000/metrics"},
         "metrics_url): 'http://{pod_ip}:8000/metrics' names a pod's field, filled for "
         "each pod; pods are named by a topic template"),
        ({"kv_endpoint": "tcp://*:5557", "metrics_url": "http://{pod}/metrics"},
         "metrics_url): 'http://{pod}/metrics' names a pod's field"),
        ({"bind": "tcp://*:5556", "topic": LLMD, "metrics_url": "http://{model}:8000/metrics"},
         "metrics_url): unknown field {model} in 'http://{model}:8000/metrics'"),
    ],
)  # fmt: skip
def test_a_pod_s_metrics_url_needs_pods(worker: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError) as exc:
        _cfg(**worker)
    assert fragment in str(exc.value), str(exc.value)


def test_other_nodes_bind_nothing() -> None:
    cfg = _cfg(node_rank=1, nnodes=2, bind="tcp://*:5557", dp_size=2)
    p = plan_worker(0, cfg.workers[0], cfg.collector, None)
    assert (p.listens, p.watched_ranks, p.watched) == ((), (), [])
    assert p.info().ranks_owned == [] and not p.info().leader
    assert any("bound by the worker's leader" in n for n in p.notes)


def test_an_ipc_endpoint_cannot_be_offset_for_a_second_rank() -> None:
    cfg = _cfg(bind="ipc:///tmp/kv", dp_size=2)
    with pytest.raises(ConfigError, match=r"worker\[0\]\.bind: endpoint='ipc:///tmp/kv'"):
        plan_worker(0, cfg.workers[0], cfg.collector, None)


# --- a bound endpoint and its relay: state from socket events -----------------------------------


def _listener(topic: str = "", replay: str | None = None) -> Listener:
    spec = ListenSpec("w", 1, "vllm", "tcp://*:5558", topic, replay)
    return Listener(spec, RecentEvents(), 100.0)


def test_a_pod_topic_names_its_stream_and_replay_endpoint() -> None:
    lst = _listener(LLMD, "tcp://{pod_ip}:5560")
    spec = lst.pod_spec("kv@10.0.0.3:8000@m")
    assert spec == StreamSpec("w/10.0.0.3:8000", 1, "vllm", "tcp://*:5558", "kv@10.0.0.3:8000@m",
                              "tcp://10.0.0.3:5560", bound=True)  # fmt: skip
    assert lst.pod_spec("other") == "topic 'other' does not fit 'kv@{pod}@{model}'"


def test_the_endpoint_counts_connections_and_moves_its_stream() -> None:
    lst = _listener()
    spec = StreamSpec("w", 1, "vllm", "tcp://*:5558", bound=True)
    st = lst.stream = WatchedStream(spec, None)
    st.link = new_link(spec, DEFAULT_LINK_TIMES, RecentEvents(), 100.0)
    lst.on_monitor(zmq.EVENT_ACCEPTED, 11, "10.0.0.3:40001", 1.0, 101.0)
    lst.on_monitor(zmq.EVENT_ACCEPTED, 12, "10.0.0.4:40002", 1.0, 101.0)
    assert (lst.health.state, len(lst.conns)) == ("connected", 2)
    assert st.link.health.state == "waiting"
    st.link.on_data(1, 0, "", (), 2.0, 102.0)
    lst.on_monitor(zmq.EVENT_DISCONNECTED, 11, "", 3.0, 103.0)
    assert lst.health.reason == "1 publisher(s) connected to tcp://*:5558"
    assert st.link.health.state == "up"
    lst.on_monitor(zmq.EVENT_DISCONNECTED, 12, "", 4.0, 104.0)
    assert lst.health.state == "listening"
    assert st.link.health.state == "listening"
    assert st.link.health.reason.startswith("the publisher disconnected (engine stopped?)")
    assert not st.link.health.up
    assert not st.link.wants_probe(100.0)  # never a probe SUB to our own bound endpoint


def test_the_relay_is_up_only_while_its_target_is_connected_and_subscribed() -> None:
    r = RelayLink("tcp://sched:5556", 0.5)
    assert (r.state, r.reason, r.since) == ("connecting", "connecting to tcp://sched:5556", 0.5)
    r.on_monitor(zmq.EVENT_CONNECT_DELAYED, 0.0, 1.0)
    r.on_monitor(zmq.EVENT_CONNECT_RETRIED, 0.1, 1.1)
    assert r.reason == "connection refused: nothing listens at tcp://sched:5556"
    r.on_monitor(zmq.EVENT_CONNECT_DELAYED, 1.0, 2.0)
    r.on_monitor(zmq.EVENT_CONNECT_RETRIED, 2.5, 3.5)
    assert r.reason.startswith("no answer from tcp://sched:5556")
    assert r.since == 0.5  # the same state all along
    r.on_monitor(zmq.EVENT_HANDSHAKE_SUCCEEDED, 3.0, 4.0)
    assert (r.state, r.up, r.since) == ("waiting", False, 4.0)
    r.on_subscription(b"\x01kv@", 5.0)
    assert (r.state, r.up, r.subs) == ("up", True, (b"kv@",))
    assert r.reason == "forwarding to tcp://sched:5556 (it subscribes to 'kv@')"
    r.on_subscription(b"\x00kv@", 6.0)  # IMMEDIATE: the subscription ends with the connection
    r.on_monitor(zmq.EVENT_DISCONNECTED, 4.0, 6.0)
    assert (r.state, r.up) == ("connecting", False)
    assert r.reason == "disconnected: tcp://sched:5556 went away (restarted?)"
    r.drop("no_target", 7.0)
    assert (r.dropped, r.last_drop_time) == ({"no_target": 1, "queue_full": 0}, 7.0)


def test_a_relay_target_whose_name_does_not_resolve_is_named_so() -> None:
    """Issue 30: an unresolvable `relay_to` host was reported as "connection refused". libzmq
    resolves the name before each attempt; when that fails no TCP attempt starts, so the retry
    comes without a CONNECT_DELAYED before it."""
    r = RelayLink("tcp://sched.invalid:5556", 0.5)
    r.on_monitor(zmq.EVENT_CONNECT_RETRIED, 0.0, 1.0)
    assert (r.state, r.reason) == (
        "connecting",
        "cannot resolve 'sched.invalid' in tcp://sched.invalid:5556: no such host",
    )
    r.on_monitor(zmq.EVENT_CONNECT_DELAYED, 1.0, 2.0)  # the name resolves now; nothing listens
    r.on_monitor(zmq.EVENT_CONNECT_RETRIED, 1.1, 2.1)
    assert r.reason == "connection refused: nothing listens at tcp://sched.invalid:5556"
    # an address needs no resolving: a failure before any attempt is not a name's
    for target in ("tcp://10.0.0.9:5556", "tcp://[::1]:5556", "ipc:///run/sched.sock"):
        r = RelayLink(target, 0.5)
        r.on_monitor(zmq.EVENT_CONNECT_RETRIED, 0.0, 1.0)
        assert r.reason == f"connection refused: nothing listens at {target}"


def test_every_relay_has_endpoint_names_of_its_own() -> None:
    # a name closed a moment ago cannot be bound again yet: one per Relay, even when the one
    # before it was freed and the new one takes its place in memory
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        names = set()
        for _ in range(3):
            relay = Relay(ctx)
            names.add(relay.handoff_endpoint()[1])
            del relay
        assert len(names) == 3, names
    finally:
        ctx.term()


# the mistakes docs/configuration.md shows under "Bind mode", each with the file that makes it
DOC_MISTAKES = [
    {"bind": "tcp://collector.invalid:5557"},
    {"kv_endpoint": "tcp://*:5556", "topic": LLMD},
    {"bind": "tcp://*:5556", "relay_to": "tcp://127.0.0.1:5556"},
    {"kv_endpoint": "tcp://*:5557", "relay_to": "tcp://scheduler:5556"},
]


def test_the_mistakes_configuration_md_shows_are_what_check_prints(tmp_path: Path) -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text()
    block = doc.split("- **Mistakes `check` names.**", 1)[1].split("```\n", 2)[1]
    printed = []
    for worker in DOC_MISTAKES:
        path = tmp_path / "k.toml"
        keys = "".join(f"{k} = {json.dumps(v)}\n" for k, v in worker.items())
        path.write_text(f'[[worker]]\nengine = "vllm"\n{keys}')
        with pytest.raises(ConfigError) as exc:
            load_config(str(path), {}, {})
        printed.append(f"kvobserve check: error: {exc.value}")
    assert printed == block.splitlines()
