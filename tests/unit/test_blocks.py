"""BlockIndex: per-medium residency, token counts, lifetimes, on synthetic and real batches."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvobserve.analysis.blocks import BlockIndex, LifetimeHistogram
from kvobserve.wire.kv_events import (
    BlockHash,
    KvBatch,
    KvEvent,
    _ClearedArr,
    _RemovedMap,
    _StoredMap,
    decode_message,
)

CAPTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engine-captures"
VERSIONS = sorted(p.name for p in CAPTURES.iterdir() if (p / "frames.jsonl").exists())


def stored(hashes: list[BlockHash], size: int = 16, medium: str | None = "GPU") -> KvEvent:
    return _StoredMap(block_hashes=hashes, block_size=size, medium=medium)


def removed(hashes: list[BlockHash], medium: str | None = "GPU") -> KvEvent:
    return _RemovedMap(block_hashes=hashes, medium=medium)


def cleared() -> KvEvent:
    return _ClearedArr()


def batch(seq: int, ts: float, *events: KvEvent, dp_rank: int | None = 0) -> KvBatch:
    return KvBatch("", seq, ts, dp_rank, list(events))


def capture_messages(version: str, source: str = "live") -> list[dict[str, Any]]:
    """The capture's messages of one source: dp_rank and decoded frames, in arrival order."""
    out = []
    with open(CAPTURES / version / "frames.jsonl") as f:
        for line in f:
            m = json.loads(line)
            if m["source"] == source:
                frames = [base64.b64decode(x) for x in m["frames"]]
                out.append({"dp_rank": m["dp_rank"], "frames": frames})
    return out


def expected_hash(h: int | str) -> BlockHash:
    return bytes.fromhex(h) if isinstance(h, str) else h


def truth_after_each_batch(
    version: str, rank: int
) -> list[tuple[dict[str, set[BlockHash]], dict[str, int]]]:
    """Resident hashes and tokens per medium after each batch, computed from expected.json."""
    batches = [
        b
        for b in json.loads((CAPTURES / version / "expected.json").read_text())
        if b["dp_rank"] == rank
    ]
    resident: dict[str, dict[BlockHash, int]] = {}
    out = []
    for b in sorted(batches, key=lambda b: b["seq"]):
        for ev in b["events"]:
            medium = ev.get("medium") or "GPU"
            if ev["type"] == "BlockStored":
                tier = resident.setdefault(medium, {})
                for h in ev["block_hashes"]:
                    tier.setdefault(expected_hash(h), ev["block_size"])
            elif ev["type"] == "BlockRemoved":
                for h in ev["block_hashes"]:
                    resident.get(medium, {}).pop(expected_hash(h), None)
            else:
                for tier in resident.values():
                    tier.clear()
        out.append(
            (
                {m: set(t) for m, t in resident.items()},
                {m: sum(t.values()) for m, t in resident.items()},
            )
        )
    return out


def test_store_counts_block_size_tokens_per_hash() -> None:
    idx = BlockIndex()
    idx.apply_batch(batch(0, 10.0, stored([1, 2, 3], size=16), stored([4], size=7)))
    assert idx.blocks == {"GPU": 4}
    assert idx.tokens == {"GPU": 3 * 16 + 7}
    assert idx.stored_total == {"GPU": 4}


def test_remove_returns_the_stored_size_including_short_pages() -> None:
    idx = BlockIndex()
    # a short page first: the usual size moves up to 16 later, the 7 must survive that
    idx.apply_batch(batch(0, 1.0, stored([1], size=7), stored([2, 3], size=16)))
    idx.apply_batch(batch(1, 2.0, removed([1])))
    assert idx.tokens == {"GPU": 32}
    idx.apply_batch(batch(2, 3.0, removed([2])))
    assert idx.tokens == {"GPU": 16}
    assert idx.blocks == {"GPU": 1}


def test_media_are_separate_and_none_is_gpu() -> None:
    idx = BlockIndex()
    idx.apply_batch(batch(0, 1.0, stored([1, 2], medium=None), stored([1], medium="CPU_PINNED")))
    idx.apply_batch(batch(1, 2.0, removed([1], medium="CPU_PINNED")))
    assert idx.resident_hashes() == {"GPU": {1, 2}, "CPU_PINNED": set()}
    assert idx.blocks == {"GPU": 2, "CPU_PINNED": 0}
    assert idx.removed_total == {"GPU": 0, "CPU_PINNED": 1}


def test_store_of_resident_and_remove_of_unknown_are_counted_not_applied() -> None:
    idx = BlockIndex()
    idx.apply_batch(batch(0, 1.0, stored([1, 2])))
    idx.apply_batch(batch(1, 5.0, stored([2, 3]), removed([9, 1])))
    assert idx.store_of_resident_total == 1
    assert idx.remove_of_unknown_total == 1
    assert idx.resident_hashes() == {"GPU": {2, 3}}
    assert idx.stored_total == {"GPU": 3}
    assert idx.tokens == {"GPU": 32}
    # the re-stored block keeps its first store time: removal at 11 -> lifetime 10
    idx.apply_batch(batch(2, 11.0, removed([2])))
    assert idx.lifetime["GPU"].sum == pytest.approx(4.0 + 10.0)


def test_clear_empties_every_medium_and_observes_lifetimes() -> None:
    idx = BlockIndex(lifetime_buckets=(1.0, 10.0))
    idx.apply_batch(batch(0, 100.0, stored([1, 2]), stored([3], medium="CPU")))
    idx.apply_batch(batch(1, 105.0, stored([4])))
    idx.apply_batch(batch(2, 120.0, cleared()))
    assert idx.blocks == {"GPU": 0, "CPU": 0}
    assert idx.tokens == {"GPU": 0, "CPU": 0}
    assert idx.clears_total == 1
    assert idx.removed_total == {"GPU": 3, "CPU": 1}
    gpu = idx.lifetime["GPU"]
    assert (gpu.count, gpu.sum) == (3, pytest.approx(20 + 20 + 15))
    assert gpu.cumulative() == [(1.0, 0), (10.0, 0), (float("inf"), 3)]
    assert idx.events_total == {"stored": 3, "removed": 0, "cleared": 1}


def test_lifetime_histogram_buckets_are_cumulative_and_upper_inclusive() -> None:
    h = LifetimeHistogram((1.0, 5.0))
    for v in (0.5, 1.0, 3.0, 5.0, 7.0, -2.0):
        h.observe(v)
    assert h.cumulative() == [(1.0, 3), (5.0, 5), (float("inf"), 6)]
    assert h.sum == pytest.approx(16.5)


def test_reset_empties_but_keeps_counters() -> None:
    idx = BlockIndex()
    idx.apply_batch(batch(0, 1.0, stored([1, 2])))
    idx.apply_batch(batch(1, 2.0, removed([1])))
    idx.reset()
    assert idx.blocks == {"GPU": 0}
    assert idx.tokens == {"GPU": 0}
    assert idx.stored_total == {"GPU": 2}
    assert idx.removed_total == {"GPU": 1}
    assert idx.lifetime["GPU"].count == 1
    idx.apply_batch(batch(0, 3.0, stored([2], size=4)))
    assert idx.tokens == {"GPU": 4}


def test_batch_timestamp_is_shared_not_copied_per_block() -> None:
    idx = BlockIndex()
    b = batch(0, 1234.5, stored(list(range(100))))
    idx.apply_batch(b)
    stamps = {id(v) for v in idx._tiers["GPU"].resident.values()}
    assert stamps == {id(b.ts)}


@pytest.mark.parametrize("version", VERSIONS)
def test_real_capture_matches_expected_after_every_batch(version: str) -> None:
    live = capture_messages(version)
    assert live, version
    for rank in sorted({m["dp_rank"] for m in live}):
        truth = truth_after_each_batch(version, rank)
        idx = BlockIndex()
        msgs = [decode_message(m["frames"]) for m in live if m["dp_rank"] == rank]
        assert [b.seq for b in msgs] == list(range(len(truth)))
        for b, (hashes, tokens) in zip(msgs, truth, strict=True):
            idx.apply_batch(b)
            got = {m: s for m, s in idx.resident_hashes().items() if s or m in hashes}
            assert got == hashes, (version, rank, b.seq)
            assert {m: t for m, t in idx.tokens.items() if m in tokens} == tokens
        assert idx.store_of_resident_total == 0
        assert idx.remove_of_unknown_total == 0
        assert idx.clears_total == 1
        assert sum(idx.blocks.values()) == 1  # one root block stored after the clear


def test_media_past_the_cap_are_refused_and_counted() -> None:
    idx = BlockIndex(max_media=2)
    events: list[KvEvent] = [
        _StoredMap(block_hashes=[1], block_size=16, medium="GPU"),
        _StoredMap(block_hashes=[2], block_size=16, medium="CPU"),
        _StoredMap(block_hashes=[3], block_size=16, medium="junk-1"),
        _RemovedMap(block_hashes=[3], medium="junk-2"),
    ]
    idx.apply_batch(KvBatch("", 0, 1.0, 0, events))
    assert idx.blocks == {"GPU": 1, "CPU": 1}
    assert idx.media_refused_events == 2
    assert idx.events_total["stored"] == 2 and idx.events_total["removed"] == 0


def test_hybrid_model_side_groups_stay_out_of_the_main_residency() -> None:
    # vLLM hashes the same tokens alike in every KV-cache group; without the decoder setting the
    # sliding-window group aside, its early removal would take block 2 out of the main residency
    def ev(kind: str, hashes: list[int], group: int, spec: str | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"type": kind, "block_hashes": hashes, "medium": "GPU"}
        d["group_idx"] = group
        if kind == "BlockStored":
            d |= {"parent_block_hash": None, "token_ids": [7] * 32, "block_size": 16}
            d |= {"lora_id": None, "kv_cache_spec_kind": spec}
        return d

    events = [
        ev("BlockStored", [1, 2], 0, "full_attention"),
        ev("BlockStored", [1, 2], 1, "sliding_window"),
        ev("BlockRemoved", [2], 1),
    ]
    payload = msgspec.msgpack.encode([1.0, events, 0])
    idx = BlockIndex()
    idx.apply_batch(decode_message([b"", (0).to_bytes(8, "big"), payload]))
    assert idx.resident_hashes() == {"GPU": {1, 2}}
    assert idx.tokens == {"GPU": 32}
    assert idx.events_total == {"stored": 1, "removed": 0, "cleared": 0, "other_group": 2}
    assert idx.store_of_resident_total == 0 and idx.remove_of_unknown_total == 0


def test_other_group_appears_only_once_there_was_one() -> None:
    idx = BlockIndex()
    idx.apply_batch(batch(0, 1.0, stored([1])))
    assert "other_group" not in idx.events_total  # no new series for engines without groups


def test_tokens_are_the_stored_sizes_not_blocks_times_the_page_size() -> None:
    """Issue 21: docs/metrics.md said kv_tokens = blocks x block size, yet 1,125 blocks showed
    16,376 tokens. Real SGLang bytes: the last page of a request is shorter than the page size
    and its BlockStored says so (block_size 7 of 16); each block counts what its store gave."""
    from kvobserve.export.catalog import BY_NAME

    live = capture_messages("sglang-0.5.23")
    page = max(
        ev.block_size
        for m in live
        for ev in decode_message(m["frames"]).events
        if isinstance(ev, _StoredMap)
    )
    short = 0
    for rank in sorted({m["dp_rank"] for m in live}):
        idx, sizes = BlockIndex(), {}
        for m in (m for m in live if m["dp_rank"] == rank):
            b = decode_message(m["frames"])
            idx.apply_batch(b)
            for ev in b.events:
                if isinstance(ev, _StoredMap):
                    for h in ev.block_hashes:
                        sizes.setdefault(h, ev.block_size)
            resident = idx.resident_hashes().get("GPU", set())
            assert idx.tokens.get("GPU", 0) == sum(sizes[h] for h in resident)
            assert idx.tokens.get("GPU", 0) <= page * idx.blocks.get("GPU", 0)
            short += idx.tokens.get("GPU", 0) < page * idx.blocks.get("GPU", 0)
    assert page == 16 and short > 0  # the rule of the old help text was wrong on real bytes
    text = BY_NAME["kvobserve_kv_tokens"].help
    assert "at most blocks x block size" in text and "BlockStored" in text
