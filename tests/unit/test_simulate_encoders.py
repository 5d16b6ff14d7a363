"""The simulator's encoders reproduce every engine capture byte for byte."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from kvobserve.simulate.encoders import (
    FORMATS,
    encode_batch,
    event_from_dict,
    get_format,
    live_frames,
    replay_end,
    replay_frames,
)
from kvobserve.simulate.sidechannels import KvMetrics, LoadStat, encode_kv_metrics, encode_load
from kvobserve.wire.kv_events import decode_message, decode_payload
from kvobserve.wire.kv_view import batch_to_dict

CAPTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engine-captures"
FOLDER_FORMAT = {
    "sglang-0.4.7": "sglang-0.4",
    "sglang-0.5.12": "sglang-0.5.12",
    "sglang-0.5.19": "sglang-0.5.19",
    "sglang-0.5.23": "sglang-0.5.23",
    "vllm-0.10.0": "vllm-0.10",
    "vllm-0.23.0": "vllm-0.23",
    "vllm-0.33.0": "vllm-0.33",
    "vllm-0.33.0-bytes-hashes": "vllm-0.33-bytes",
}


def _lines(folder: Path) -> list[dict[str, Any]]:
    out = []
    for line in (folder / "frames.jsonl").read_text().splitlines():
        obj = json.loads(line)
        obj["frames"] = [base64.b64decode(f) for f in obj["frames"]]
        out.append(obj)
    return out


def test_every_format_has_a_capture() -> None:
    assert sorted(FOLDER_FORMAT.values()) == sorted(FORMATS)


@pytest.mark.parametrize("folder", sorted(FOLDER_FORMAT))
def test_live_frames_are_byte_identical(folder: str) -> None:
    fmt = get_format(FOLDER_FORMAT[folder])
    expected = json.loads((CAPTURES / folder / "expected.json").read_text())
    live = {}
    for ln in _lines(CAPTURES / folder):
        if ln["source"] == "live":
            live[(ln["dp_rank"], int.from_bytes(ln["frames"][1], "big"))] = ln["frames"]
    assert len(live) == len(expected)
    for exp in expected:
        events = [event_from_dict(fmt, ev) for ev in exp["events"]]
        payload = encode_batch(exp["ts"], events, exp["dp_rank"])
        frames = live_frames(exp["topic"].encode(), exp["seq"], payload)
        real = live[(exp["dp_rank"], exp["seq"])]
        assert frames == real, f"{folder} seq {exp['seq']} rank {exp['dp_rank']} ({exp['step']})"
        ours = batch_to_dict(decode_payload(exp["topic"], exp["seq"], payload), token_ids=True)
        assert ours == batch_to_dict(decode_message(real), token_ids=True)


@pytest.mark.parametrize("folder", sorted(FOLDER_FORMAT))
def test_replay_replies_and_end_marker_are_byte_identical(folder: str) -> None:
    fmt = get_format(FOLDER_FORMAT[folder])
    meta = json.loads((CAPTURES / folder / "meta.json").read_text())
    lines = _lines(CAPTURES / folder)
    live = {
        (ln["dp_rank"], ln["frames"][1]): ln["frames"][2] for ln in lines if ln["source"] == "live"
    }
    topic = meta["topic"].encode()
    for rank in meta["dp_ranks"]:
        replay = [
            ln["frames"] for ln in lines if ln["source"] == "replay" and ln["dp_rank"] == rank
        ]
        assert replay[-1] == replay_end(fmt)
        seqs = sorted(seq for (r, seq) in live if r == rank and int.from_bytes(seq, "big") >= 2)
        ours = [replay_frames(fmt, topic, s, live[(rank, s)]) for s in seqs] + [replay_end(fmt)]
        assert ours == replay
        assert len(replay[0]) == (4 if fmt.replay_with_topic else 3)


@pytest.mark.parametrize(
    ("channel", "cls", "encode", "frame"),
    [("load", LoadStat, encode_load, 2), ("kv_metrics", KvMetrics, encode_kv_metrics, 0)],
)
def test_side_channels_are_byte_identical(channel: str, cls: Any, encode: Any, frame: int) -> None:
    folder = CAPTURES / "sglang-0.5.23" / channel
    expected = json.loads((folder / "expected.json").read_text())
    lines = _lines(folder)
    assert len(lines) == len(expected) > 0
    for exp, ln in zip(expected, lines, strict=True):
        fields = {k: v for k, v in exp["message"].items() if k != "type"}
        assert encode(cls(**fields)) == ln["frames"][frame]
        if channel == "load":
            assert ln["frames"][:2] == [b"load", exp["seq"].to_bytes(8, "big")]


def test_vllm_033_store_uses_map16_and_sglang_023_fixmap() -> None:
    v33, s23 = get_format("vllm-0.33"), get_format("sglang-0.5.23")
    p = encode_batch(1.0, [v33.stored([1], None, [1, 2], 2)], 0)
    assert p[11:14] == b"\xde\x00\x09"  # map16 with 9 keys present
    p = encode_batch(1.0, [s23.stored([1], None, [1, 2], 2)], 0)
    assert p[11] == 0x87  # fixmap, None optionals omitted


def test_unknown_format_names_the_value() -> None:
    with pytest.raises(ValueError, match="sglang-9"):
        get_format("sglang-9")
