"""Every frame of every engine capture decodes to exactly its expected.json batch."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from kvobserve.wire.kv_events import decode_message
from kvobserve.wire.kv_view import batch_to_dict, batch_view
from kvobserve.wire.replay import decode_replay_message, is_end_marker

CAPTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engine-captures"
KV_FOLDERS = sorted(p.name for p in CAPTURES.iterdir() if (p / "frames.jsonl").is_file())
TAP_BATCH_KEYS = ("topic", "seq", "dp_rank", "ts")


def load_lines(folder: Path) -> list[dict[str, Any]]:
    """The frames.jsonl lines of a capture folder, frames base64-decoded."""
    out = []
    for line in (folder / "frames.jsonl").read_text().splitlines():
        obj = json.loads(line)
        obj["frames"] = [base64.b64decode(f) for f in obj["frames"]]
        out.append(obj)
    return out


def expected_event(ev: dict[str, Any], token_ids: bool, view: bool = False) -> dict[str, Any]:
    """An expected.json event reduced to the hot-path fields, or (view) to what `tap` prints."""
    if view:
        # every field the capture set; lora_id is in expected.json even when null
        out = {k: v for k, v in ev.items() if k not in ("token_ids", "wire_variant")}
        if out.get("lora_id", 0) is None:
            del out["lora_id"]
        if token_ids and "token_ids" in ev:
            out["token_ids"] = ev["token_ids"]
        return out
    if ev["type"] == "BlockStored":
        keys = ["type", "block_hashes", "parent_block_hash", "block_size", "num_tokens", "medium"]
        keys += [k for k in ("lora_name",) if k in ev]
        keys += ["token_ids"] if token_ids else []
    elif ev["type"] == "BlockRemoved":
        keys = ["type", "block_hashes", "medium"]
    else:
        keys = ["type"]
    return {k: ev[k] for k in keys}


def expected_batch(
    exp: dict[str, Any], token_ids: bool = False, view: bool = False
) -> dict[str, Any]:
    """An expected.json batch reduced to the hot-path fields, or (view) to what `tap` prints."""
    out = {k: exp[k] for k in TAP_BATCH_KEYS}
    out["events"] = [expected_event(e, token_ids, view) for e in exp["events"]]
    return out


def test_all_eight_capture_folders_are_present() -> None:
    assert len(KV_FOLDERS) == 8, KV_FOLDERS


@pytest.mark.parametrize("name", KV_FOLDERS)
def test_capture_decodes_to_expected(name: str) -> None:
    folder = CAPTURES / name
    meta = json.loads((folder / "meta.json").read_text())
    expected = json.loads((folder / "expected.json").read_text())
    by_key = {(e["dp_rank"], e["seq"]): e for e in expected}
    assert len(by_key) == len(expected)
    lines = load_lines(folder)
    live = [ln for ln in lines if ln["source"] == "live"]
    replay = [ln for ln in lines if ln["source"] == "replay"]
    assert len(live) + len(replay) == len(lines)
    assert lines[: len(live)] == live, "live lines come first"

    # live: each published batch exactly once, in per-rank seq order, equal on every tap field
    seen: list[tuple[int | None, int]] = []
    hashes: list[int | bytes] = []
    for ln in live:
        assert len(ln["frames"]) == 3
        batch = decode_message(ln["frames"])
        assert batch.unknown_events == 0
        assert batch.dp_rank == ln["dp_rank"]
        exp = by_key[(batch.dp_rank, batch.seq)]
        assert batch.topic == meta["topic"] == exp["topic"]
        assert batch_to_dict(batch) == expected_batch(exp)
        assert batch_to_dict(batch, token_ids=True) == expected_batch(exp, token_ids=True)
        # the tap view: every field the engine set, nothing else
        payload = ln["frames"][2]
        assert batch_view(batch, payload) == expected_batch(exp, view=True)
        assert batch_view(batch, payload, True) == expected_batch(exp, True, view=True)
        seen.append((batch.dp_rank, batch.seq))
        hashes += [h for ev in batch.events for h in getattr(ev, "block_hashes", ())]
    assert sorted(seen) == sorted(by_key)
    counts = meta["hash_values"]
    assert len(hashes) == counts["n_hashes"]
    assert sum(1 for h in hashes if isinstance(h, int) and h < 0) == counts["negative"]
    assert sum(1 for h in hashes if isinstance(h, int) and h >= 2**63) == counts["ge_2_63"]
    assert sum(1 for h in hashes if isinstance(h, bytes) and len(h) == 32) == counts["bytes"]
    for rank in meta["dp_ranks"]:
        seqs = [s for r, s in seen if r == rank]
        assert seqs == list(range(len(seqs)))

    # replay: per rank, every batch from start_seq on, then the end marker, in the meta layout
    with_topic = "topic" in meta["replay_reply_layout"].split(";")[0]
    for req in meta["replay_requests"]:
        rank = req["dp_rank"]
        mine = [ln for ln in replay if ln["dp_rank"] == rank]
        assert len(mine) == req["messages"]
        assert all(len(ln["frames"]) == (4 if with_topic else 3) for ln in mine)
        assert [is_end_marker(ln["frames"]) for ln in mine] == [False] * (len(mine) - 1) + [True]
        assert decode_replay_message(mine[-1]["frames"], meta["topic"]) is None
        got_seqs = []
        for ln in mine[:-1]:
            # a wrong subscription topic shows up only in the 3-frame layout
            replayed = decode_replay_message(ln["frames"], meta["topic"])
            assert replayed is not None
            assert replayed.dp_rank == rank
            exp = by_key[(rank, replayed.seq)]
            assert batch_to_dict(replayed, token_ids=True) == expected_batch(exp, token_ids=True)
            view = batch_view(replayed, ln["frames"][-1], True)
            assert view == expected_batch(exp, True, view=True)
            if with_topic:
                other = decode_replay_message(ln["frames"], "not-the-topic")
                assert other is not None and other.topic == meta["topic"]
            got_seqs.append(replayed.seq)
        n_rank = sum(1 for r, _ in by_key if r == rank)
        assert got_seqs == list(range(req["start_seq"], n_rank))
    assert sorted({ln["dp_rank"] for ln in replay}) == sorted(meta["dp_ranks"])
