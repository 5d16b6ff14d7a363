"""Ports the simulator is not given: one socket binds port 0, a range comes from the block."""

from __future__ import annotations

import socket

import pytest

from kvobserve.simulate import SimConfig, SimulatedWorker, ports

pytestmark = pytest.mark.integration


def test_a_single_port_is_bound_as_port_0_and_a_range_in_the_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ports.ENV, "23000-23999")
    one = SimConfig(format="sglang-0.5.23", dp_size=1, http_port=None, replay_port=None)
    with SimulatedWorker(one) as w:  # one PUB: the port the system gave it, past the block
        assert w.kv_base >= ports.ephemeral_start()
        with pytest.raises(OSError), socket.create_server(("127.0.0.1", w.kv_base)):
            pass  # it is bound
    four = SimConfig(format="sglang-0.5.23", dp_size=4, http_port=None)
    with SimulatedWorker(four) as w:  # ranks on base + r: a range of the block
        assert w.kv_base >= 23000 and w.kv_base + 3 <= 23999
        assert w.replay_base is not None and 23000 <= w.replay_base <= 23999 - 3
        assert {p for p in range(w.kv_base, w.kv_base + 4)}.isdisjoint(
            range(w.replay_base, w.replay_base + 4)
        )
        # a port handed out afterwards is none of the engine's
        handed = ports.free_port_range("127.0.0.1", 2)
        assert 23000 <= handed <= 23998
        assert {handed, handed + 1}.isdisjoint(range(w.kv_base, w.kv_base + 4))
        assert {handed, handed + 1}.isdisjoint(range(w.replay_base, w.replay_base + 4))
