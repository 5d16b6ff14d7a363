"""The simulator's encoders reproduce every engine capture byte for byte."""

from __future__ import annotations

import base64
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvobserve.simulate.cache import PromptLibrary
from kvobserve.simulate.encoders import (
    FORMATS,
    encode_batch,
    event_from_dict,
    get_format,
    live_frames,
    replay_end,
    replay_frames,
)
from kvobserve.simulate.faults import FaultConfig
from kvobserve.simulate.sidechannels import KvMetrics, LoadStat, encode_kv_metrics, encode_load
from kvobserve.simulate.stream import SimStream
from kvobserve.simulate.wire_format import RemoveMeta, StoreMeta
from kvobserve.wire.kv_events import decode_message, decode_payload
from kvobserve.wire.kv_view import batch_to_dict, batch_view

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
# formats with no capture of their own: the version whose capture has the same wire
SAME_WIRE = {"sglang-0.5.22": "sglang-0.5.23"}
FORMAT_FOLDER = {v: k for k, v in FOLDER_FORMAT.items()}
CASES = [*FOLDER_FORMAT.items(), *((FORMAT_FOLDER[v], k) for k, v in SAME_WIRE.items())]


def _lines(folder: Path) -> list[dict[str, Any]]:
    out = []
    for line in (folder / "frames.jsonl").read_text().splitlines():
        obj = json.loads(line)
        obj["frames"] = [base64.b64decode(f) for f in obj["frames"]]
        out.append(obj)
    return out


def test_every_format_has_a_capture() -> None:
    assert sorted([*FOLDER_FORMAT.values(), *SAME_WIRE]) == sorted(FORMATS)


@pytest.mark.parametrize(("folder", "name"), CASES)
def test_live_frames_are_byte_identical(folder: str, name: str) -> None:
    fmt = get_format(name)
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


@pytest.mark.parametrize(("folder", "name"), CASES)
def test_replay_replies_and_end_marker_are_byte_identical(folder: str, name: str) -> None:
    fmt = get_format(name)
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


# what each version's stores carry besides the core fields, per request share (n = 1155 hits
# every share: session 3, salt 5, LoRA 7, lookahead 11)
META_SHOWN = {
    "sglang-0.4": set(),
    "sglang-0.5.12": set(),
    "sglang-0.5.19": {"cache_salt"},
    "sglang-0.5.23": {"cache_salt", "session_id", "lora_name"},
    "sglang-0.5.22": {"cache_salt", "session_id", "lora_name"},
    "vllm-0.10": {"lora_id"},
    "vllm-0.23": {"lora_id", "lora_name", "extra_keys", "group_idx"},
    "vllm-0.33": {"lora_id", "lora_name", "extra_keys", "group_idx", "session_id"}
    | {"lookahead_token_ids"},
    "vllm-0.33-bytes": {"lora_id", "lora_name", "extra_keys", "group_idx", "session_id"}
    | {"lookahead_token_ids"},
}
CORE = {"type", "block_hashes", "parent_block_hash", "block_size", "num_tokens", "medium"}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_request_meta_reaches_the_wire_with_the_fields_of_the_version(name: str) -> None:
    fmt = get_format(name)
    assert sorted(META_SHOWN) == sorted(FORMATS)
    tokens = list(range(48))
    hashes: list[int | bytes] = [
        bytes([i]) * 32 if fmt.hash_kind == "bytes32" else i for i in (1, 2, 3)
    ]
    default_group = {"group_idx"} if fmt.group_idx is not None else set()
    for n, want in [(1, default_group), (1155, META_SHOWN[name])]:
        meta = fmt.request_meta(n, tokens, 16)
        payload = encode_batch(1.0, [fmt.stored(hashes, None, tokens, 16, "GPU", meta)], 0)
        batch = decode_payload("t", 0, payload)
        assert len(batch.events) == 1 and batch.other_group_events == 0
        shown = batch_view(batch, payload)["events"][0]
        assert set(shown) - CORE == want, (name, n)
    if "lookahead_token_ids" in want:
        assert shown["lookahead_token_ids"] == [[16], [32], []]  # the token after each block
    if "extra_keys" in want:  # LoRA on every block, the salt on the first only
        assert shown["extra_keys"] == [["sql-lora", "tenant-salt-3"], ["sql-lora"], ["sql-lora"]]


def test_vllm_033_offload_and_group_fields_round_trip() -> None:
    fmt = get_format("vllm-0.33")
    meta = StoreMeta(locality="REMOTE", ownership="tier-2", group_idx=1)
    meta = replace(meta, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=1024)
    events = [
        fmt.stored([5], None, list(range(16)), 16, "CPU", meta),
        fmt.removed([5], "CPU", RemoveMeta(group_idx=1, locality="REMOTE", ownership="tier-2")),
        fmt.removed([6], "CPU", RemoveMeta(locality="LOCAL")),
    ]
    payload = encode_batch(1.0, events, 0)
    batch = decode_payload("t", 0, payload)
    assert batch.other_group_events == 2 and len(batch.events) == 1  # group 0's remove stays
    stored, removed, main = batch_view(batch, payload)["events"]
    assert {k: stored[k] for k in ("locality", "ownership", "group_idx", "other_group")} == {
        "locality": "REMOTE", "ownership": "tier-2", "group_idx": 1, "other_group": True,
    }  # fmt: skip
    assert stored["kv_cache_spec_kind"] == "sliding_window"
    assert stored["kv_cache_spec_sliding_window"] == 1024
    assert removed == {
        "type": "BlockRemoved", "block_hashes": [5], "medium": "CPU", "group_idx": 1,
        "locality": "REMOTE", "ownership": "tier-2", "other_group": True,
    }  # fmt: skip
    assert main == {"type": "BlockRemoved", "block_hashes": [6], "medium": "CPU"} | {
        "group_idx": 0,
        "locality": "LOCAL",
    }


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        ("vllm-0.33", {"session_id", "lookahead_token_ids", "lora_name", "extra_keys"}),
        ("sglang-0.5.23", {"session_id", "cache_salt", "lora_name"}),
        ("sglang-0.5.19", {"cache_salt"}),
    ],
)
def test_simulated_streams_carry_the_new_fields_for_some_requests(
    name: str, fields: set[str]
) -> None:
    fmt = get_format(name)
    lib = PromptLibrary(7, fmt.hash_kind, 16, n_prompts=400, n_prefixes=4)
    stream = SimStream(fmt, "0.0", "primary", 0, 0, b"", lib, 11, 4096, 16, 100, FaultConfig())
    seen: dict[str, int] = dict.fromkeys(fields, 0)
    stores = 0
    for i in range(300):
        out = stream.next_batch(float(i))
        if out is None:
            continue
        batch = decode_payload("t", i, out[1])
        assert batch.other_group_events == batch.unknown_events == 0
        for ev in batch_view(batch, out[1])["events"]:
            stores += ev["type"] == "BlockStored"
            for f in fields & set(ev):
                seen[f] += 1
    assert stores > 100
    # every field shows up, on some stores only
    assert all(0 < n < stores for n in seen.values()), seen
