"""Cache analytics against the simulator's ledger, exactly: ranks driven in the simulator's order."""

from __future__ import annotations

from typing import Any

import pytest

from kvobserve.analysis.analytics import AnalyticsOptions, CacheAnalytics
from kvobserve.analysis.blocks import BlockIndex
from kvobserve.analysis.placement import local_placement
from kvobserve.analysis.thrash import RESTORE_BUCKETS
from kvobserve.simulate.cache import PromptLibrary
from kvobserve.simulate.encoders import get_format
from kvobserve.simulate.faults import FaultConfig
from kvobserve.simulate.stream import SimStream
from kvobserve.wire.kv_events import decode_payload

# exact settings: every removal tracked, moves only while the source holds the block
EXACT = AnalyticsOptions(restore_cap=1_000_000, restore_window_s=1e9, move_window_s=0.0)


def _drive(fmt_name: str, batches: int, *, cpu: int, flush: int = 0, seed: int = 3) -> Any:
    fmt = get_format(fmt_name)
    lib = PromptLibrary(seed, fmt.hash_kind, 16, n_prompts=30)
    sims = [
        SimStream(fmt, f"{r}.0", "primary", r, r, b"", lib, seed * 10 + r, 1024, 16, 100,
                  FaultConfig(), flush_every=flush, cpu_tier_tokens=cpu)
        for r in range(2)
    ]  # fmt: skip
    indexes = []
    for _ in sims:
        idx = BlockIndex()
        idx.analytics = CacheAnalytics(EXACT)
        idx.analytics.trust.set("complete", "from_start")
        indexes.append(idx)
    for i, idx in enumerate(indexes):
        assert idx.analytics is not None
        idx.analytics.peers = [o.tiers for j, o in enumerate(indexes) if j != i]
    for tick in range(batches):
        ts = 1000.0 + tick * 0.25
        for r, s in enumerate(sims):  # the worker's order: rank 0, then rank 1, per tick
            s.peers = [o for o in sims if o is not s]
            out = s.next_batch(ts)
            if out is not None:
                indexes[r].apply_batch(decode_payload("", s.seq - 1, out[1]))
    return sims, indexes


def _buckets(gaps: list[float]) -> list[int]:
    return [sum(1 for g in gaps if g <= b) for b in RESTORE_BUCKETS]


@pytest.mark.parametrize("fmt_name", ["sglang-0.5.23", "vllm-0.33", "vllm-0.23", "sglang-0.5.12"])
def test_restores_moves_unread_lora_and_recomputes_equal_the_ledger(fmt_name: str) -> None:
    sims, indexes = _drive(fmt_name, 600, cpu=1536)
    total_moves = 0
    for s, idx in zip(sims, indexes, strict=True):
        a = idx.analytics
        assert a is not None
        led = s.ledger
        truth_res = {s.gpu: set(s.cache.nodes), s.cpu_medium: set(s.cpu.pages)}
        assert {m: r for m, r in idx.resident_hashes().items() if r} == truth_res
        assert {m: n for m, n in a.restored().items() if n} == led.restores
        assert led.restores.get(s.gpu, 0) > 0  # the run did thrash
        for medium, gaps in led.restore_gaps.items():
            h = a.recent[medium].gaps
            assert h.count == len(gaps)
            assert [c for _, c in h.cumulative()[:-1]] == _buckets(gaps)
        moves = {f"{src}>{dst}": n for (src, dst), n in a.moves.items() if n}
        assert moves == led.moves
        total_moves += sum(moves.values())
        assert {m: n for m, n in a.unread_removed.items() if n} == {
            m: n for m, n in led.unread_removed.items() if n
        }
        assert a.recomputed_elsewhere == led.recomputed_elsewhere
        lora = {n: k for n, k in a.lora_blocks.get(s.gpu, {}).items() if k}
        assert lora == led.lora_resident()
        assert a.silent_loss == {"remove_unknown": 0, "parent_unknown": 0}
    assert total_moves > 0
    assert sum(s.ledger.recomputed_elsewhere for s in sims) > 0
    if get_format(fmt_name).meta_fields & {"lora_name"}:
        assert any(s.ledger.lora_resident() for s in sims)


def test_flushes_forget_restores_and_adapters_like_the_engine() -> None:
    sims, indexes = _drive("sglang-0.5.23", 400, cpu=1024, flush=97)
    for s, idx in zip(sims, indexes, strict=True):
        a = idx.analytics
        assert a is not None
        assert {m: n for m, n in a.restored().items() if n} == s.ledger.restores
        assert a.lora_blocks.get("GPU", {}) == {
            n: k for n, k in a.lora_blocks.get("GPU", {}).items()
        }
        assert {n: k for n, k in a.lora_blocks.get("GPU", {}).items() if k} == (
            s.ledger.lora_resident()
        )


def test_placement_is_exact_within_one_collector() -> None:
    sims, indexes = _drive("vllm-0.33", 500, cpu=0)
    sets = [set(s.cache.nodes) for s in sims]
    p = local_placement(
        "w",
        {r: idx.resident_hashes()["GPU"] for r, idx in enumerate(indexes)},
        k=64,
        signed=False,
        sketch=False,
    )
    both = len(sets[0] & sets[1])
    assert p.blocks_sum == len(sets[0]) + len(sets[1])
    assert p.blocks_distinct == len(sets[0] | sets[1])
    assert p.replicated == ({2: both} if both else {})
    assert both > 0
