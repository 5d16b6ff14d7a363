"""Where the simulator takes the ports it is not given (simulate/ports.py): the block, per worker."""

from __future__ import annotations

import itertools

import pytest

from kvobserve.simulate import ports


def test_the_block_ends_below_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ports.ENV, raising=False)
    lo, hi = ports.port_block()
    assert (lo, hi + 1) == (ports.LOWEST, ports.ephemeral_start())
    monkeypatch.setenv(ports.ENV, "21000-21999")
    assert ports.port_block() == (21000, 21999)


@pytest.mark.parametrize("bad", ["21000", "22000-21000", "a-b", "0-10", "30000-70000"])
def test_a_bad_block_names_the_variable_and_its_value(
    monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    monkeypatch.setenv(ports.ENV, bad)
    with pytest.raises(ValueError, match=f"KVOBSERVE_SIM_PORTS: '{bad}' is not a port range"):
        ports.port_block()


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_the_workers_blocks_are_disjoint_and_cover_the_block(count: int) -> None:
    blocks = [ports.worker_block(i, count) for i in range(count)]
    assert blocks[0][0] == ports.LOWEST and blocks[-1][1] < ports.ephemeral_start()
    for (_, hi), (lo, _) in itertools.pairwise(blocks):
        assert lo == hi + 1  # adjacent, never overlapping
    assert len({hi - lo for lo, hi in blocks}) == 1  # equal sizes
    with pytest.raises(ValueError, match="index 5 is not below count"):
        ports.worker_block(5, count)


def test_a_draw_stays_in_the_block_and_skips_what_was_handed_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ports.ENV, "21000-21009")  # ten ports: two ranges of four fit at most
    ports.remember(range(21000, 21004))  # as if bound by this process
    seen = {ports.candidate_base(4) for _ in range(200)}
    assert None in seen  # draws that overlap a remembered port or another range are refused
    assert {b for b in seen if b is not None} <= set(range(21004, 21007))
    assert ports.candidate_base(4, avoid=(21005,)) is None  # every base left overlaps 21005
    monkeypatch.setenv(ports.ENV, "21000-21002")
    with pytest.raises(ValueError, match="holds fewer than 4 ports"):
        ports.candidate_base(4)
