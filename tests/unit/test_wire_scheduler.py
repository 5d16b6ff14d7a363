"""Scheduler side channels: LoadStat, KvMetrics (msgpack and restricted pickle), ForwardPassMetrics."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import msgspec
import pytest

import kvobserve.wire.scheduler as sched
from kvobserve.wire.errors import WireError
from kvobserve.wire.scheduler import (
    KV_METRICS_PICKLE_CLASSES,
    ForwardPassMetrics,
    KvMetrics,
    LoadStat,
    decode_forward_pass_message,
    decode_kv_metrics,
    decode_load_message,
    decode_load_stat,
)
from tests.unit.test_captures import CAPTURES, load_lines

SIDE = CAPTURES / "sglang-0.5.23"
S23_PATH = "sglang.srt.managers.scheduler_components.kv_events_publisher"


def as_dict(obj: Any) -> Any:
    """A decoded Struct as nested plain dicts."""
    if isinstance(obj, msgspec.Struct):
        return {k: as_dict(v) for k, v in msgspec.structs.asdict(obj).items()}
    return obj


def side_channel(name: str) -> list[tuple[dict[str, Any], list[bytes]]]:
    """(expected entry, frames) pairs of one side-channel capture."""
    expected = json.loads((SIDE / name / "expected.json").read_text())
    lines = load_lines(SIDE / name)
    assert len(lines) == len(expected) > 0
    return [(e, ln["frames"]) for e, ln in zip(expected, lines, strict=True)]


def message_fields(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in entry["message"].items() if k != "type"}


# --- the captures --------------------------------------------------------------------------


def test_load_capture_decodes_to_expected() -> None:
    for entry, frames in side_channel("load"):
        seq, stat = decode_load_message(frames)
        assert isinstance(stat, LoadStat)
        assert seq == entry["seq"]
        assert as_dict(stat) == message_fields(entry)
        assert stat.attn_dp_rank == entry["dp_rank"]


def test_kv_metrics_capture_decodes_to_expected() -> None:
    for entry, frames in side_channel("kv_metrics"):
        assert len(frames) == 1 and entry["seq"] is None
        metrics = decode_kv_metrics(frames[0])
        assert as_dict(metrics) == message_fields(entry)
        assert metrics.data_parallel_rank == entry["dp_rank"]


def test_forward_pass_metrics_capture_decodes_to_expected() -> None:
    pairs = side_channel("forward_pass_metrics")
    for entry, frames in pairs:
        seq, fpm = decode_forward_pass_message(frames)
        assert isinstance(fpm, ForwardPassMetrics)
        assert seq == entry["seq"] == fpm.counter_id
        assert as_dict(fpm) == entry["message"]
    heartbeat = [decode_forward_pass_message(f)[1] for e, f in pairs if e["heartbeat"]]
    assert len(heartbeat) == 1 and heartbeat[0].wall_time == 0.0


# --- LoadStat ------------------------------------------------------------------------------

LOAD_FRAMES = side_channel("load")[0][1]
LOAD_VALUES = msgspec.msgpack.decode(LOAD_FRAMES[2])


def test_load_stat_of_sglang_0_5_19_has_six_elements() -> None:
    stat = decode_load_stat(msgspec.msgpack.encode(LOAD_VALUES[:6]))
    assert (stat.num_running_reqs, stat.num_tokens, stat.max_total_num_tokens) == (3, 1000, 65536)
    assert stat.attn_dp_rank == 0
    assert stat.num_total_tokens is None and stat.total_prefill_busy_us is None


def test_load_stat_ignores_trailing_elements() -> None:
    stat = decode_load_stat(msgspec.msgpack.encode([*LOAD_VALUES, 7, "future"]))
    assert stat.total_prefill_busy_us == 250000


@pytest.mark.parametrize(
    ("values", "reason"),
    [
        (["KvMetrics", *LOAD_VALUES[1:]], "schema"),  # wrong tag
        (LOAD_VALUES[:4], "schema"),  # too short
        (["LoadStat", "three", *LOAD_VALUES[2:]], "schema"),  # wrong type
        ({"type": "LoadStat"}, "schema"),
    ],
)
def test_load_stat_bad_shapes(values: Any, reason: str) -> None:
    with pytest.raises(WireError) as info:
        decode_load_stat(msgspec.msgpack.encode(values))
    assert info.value.reason == reason


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        (LOAD_FRAMES[1:], "frame_count"),
        ([b"kv-events", *LOAD_FRAMES[1:]], "frame_count"),
        ([b"load", b"\x00", LOAD_FRAMES[2]], "seq_length"),
        ([b"load", LOAD_FRAMES[1], LOAD_FRAMES[2][:-3]], "msgpack"),
    ],
)
def test_load_message_bad_frames(frames: list[bytes], reason: str) -> None:
    with pytest.raises(WireError) as info:
        decode_load_message(frames)
    assert info.value.reason == reason


# --- ForwardPassMetrics --------------------------------------------------------------------

FPM_FRAMES = side_channel("forward_pass_metrics")[0][1]
FPM_MAP = msgspec.msgpack.decode(FPM_FRAMES[2])


def test_fpm_ignores_unknown_keys_and_key_order() -> None:
    reordered = {"future": [1, 2], **dict(reversed(list(FPM_MAP.items())))}
    reordered["scheduled_requests"] = {**FPM_MAP["scheduled_requests"], "new_counter": 5}
    fpm = decode_forward_pass_message([b"", FPM_FRAMES[1], msgspec.msgpack.encode(reordered)])[1]
    assert as_dict(fpm) == FPM_MAP


def test_fpm_missing_key_and_wrong_type_are_schema_errors() -> None:
    missing = {k: v for k, v in FPM_MAP.items() if k != "wall_time"}
    wrong = {**FPM_MAP, "queued_requests": [1, 2, 3]}
    for bad in (missing, wrong):
        with pytest.raises(WireError) as info:
            decode_forward_pass_message([b"", FPM_FRAMES[1], msgspec.msgpack.encode(bad)])
        assert info.value.reason == "schema"
    with pytest.raises(WireError) as info:
        decode_forward_pass_message([b"x", FPM_FRAMES[1], FPM_FRAMES[2]])
    assert info.value.reason == "frame_count"


# --- KvMetrics: msgpack, and pickles made by fake SGLang modules ---------------------------

KVM_PAYLOAD = side_channel("kv_metrics")[0][1][0]
KVM_FIELDS = message_fields(side_channel("kv_metrics")[0][0])
FIELD_NAMES = list(KvMetrics.__struct_fields__)


def test_kv_metrics_msgpack_ignores_trailing_and_checks_tag() -> None:
    values = msgspec.msgpack.decode(KVM_PAYLOAD)
    assert as_dict(decode_kv_metrics(msgspec.msgpack.encode([*values, 1.5]))) == KVM_FIELDS
    with pytest.raises(WireError) as info:
        decode_kv_metrics(msgspec.msgpack.encode(["LoadStat", *values[1:]]))
    assert info.value.reason == "schema"


def _fake_module(monkeypatch: pytest.MonkeyPatch, path: str) -> types.ModuleType:
    """Register `path` and its parent packages in sys.modules for this test only."""
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    return sys.modules[path]


def _plain_class_pickle(monkeypatch: pytest.MonkeyPatch, path: str) -> bytes:
    """A pickle of an old-style plain KvMetrics class (NEWOBJ + BUILD with the state dict)."""
    mod = _fake_module(monkeypatch, path)
    cls = type("KvMetrics", (), {"__module__": path, "__qualname__": "KvMetrics"})
    mod.KvMetrics = cls  # type: ignore[attr-defined]
    obj = cls()
    obj.__dict__.update(KVM_FIELDS)
    obj.spec_decode_stats = None  # an attribute we do not know is ignored
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _struct_pickle(monkeypatch: pytest.MonkeyPatch, kw_only: bool) -> bytes:
    """A pickle of S23's msgspec KvMetrics (kw_only: rebuild(cls, dict); else cls(*args))."""
    mod = _fake_module(monkeypatch, S23_PATH)
    cls = msgspec.defstruct(
        "KvMetrics",
        [(n, Any) for n in FIELD_NAMES],
        tag=True,
        kw_only=kw_only,
        array_like=True,
        module=S23_PATH,
    )
    mod.KvMetrics = cls  # type: ignore[attr-defined]
    return pickle.dumps(cls(**KVM_FIELDS))


@pytest.mark.parametrize("path", sorted(p for p, _ in KV_METRICS_PICKLE_CLASSES))
def test_plain_class_pickle_loads_only_when_allowed(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    payload = _plain_class_pickle(monkeypatch, path)
    assert payload[:1] == b"\x80" and path.encode() in payload
    with pytest.raises(WireError) as info:
        decode_kv_metrics(payload)
    assert info.value.reason == "pickle_refused"
    assert as_dict(decode_kv_metrics(payload, allow_pickle=True)) == KVM_FIELDS


@pytest.mark.parametrize("kw_only", [True, False])
def test_msgspec_struct_pickle_loads(monkeypatch: pytest.MonkeyPatch, kw_only: bool) -> None:
    payload = _struct_pickle(monkeypatch, kw_only)
    assert (b"rebuild" in payload) == kw_only
    assert as_dict(decode_kv_metrics(payload, allow_pickle=True)) == KVM_FIELDS


def test_pickle_with_missing_field_is_schema_error(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _fake_module(monkeypatch, S23_PATH)
    cls = type("KvMetrics", (), {"__module__": S23_PATH, "__qualname__": "KvMetrics"})
    mod.KvMetrics = cls  # type: ignore[attr-defined]
    obj = cls()
    obj.request_active_slots = 1
    with pytest.raises(WireError) as info:
        decode_kv_metrics(pickle.dumps(obj), allow_pickle=True)
    assert info.value.reason == "schema"


class _Evil:
    def __init__(self, func: Any, args: tuple[Any, ...]) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.func, self.args


def test_malicious_pickles_are_refused_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = [
        _Evil(os.system, (f"touch {marker}",)),
        _Evil(eval, (f"open({str(marker)!r}, 'w')",)),
        _Evil(subprocess.Popen, (["touch", str(marker)],)),
        _Evil(msgspec._utils.rebuild, (dict, {"a": 1})),  # type: ignore[attr-defined]
    ]
    for obj in evil:
        payload = pickle.dumps(obj)
        for allow in (False, True):
            with pytest.raises(WireError) as info:
                decode_kv_metrics(payload, allow_pickle=allow)
            assert info.value.reason == ("pickle_forbidden" if allow else "pickle_refused")
    assert not marker.exists()


def test_forbidden_global_nested_in_kv_metrics_state(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    mod = _fake_module(monkeypatch, S23_PATH)
    cls = type("KvMetrics", (), {"__module__": S23_PATH, "__qualname__": "KvMetrics"})
    mod.KvMetrics = cls  # type: ignore[attr-defined]
    obj = cls()
    obj.__dict__.update(KVM_FIELDS)
    obj.request_active_slots = _Evil(os.system, (f"touch {tmp_path / 'pwned'}",))
    with pytest.raises(WireError) as info:
        decode_kv_metrics(pickle.dumps(obj), allow_pickle=True)
    assert info.value.reason == "pickle_forbidden"
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize(
    "payload",
    [
        b"\x80",  # PROTO without a version
        b"\x80\x04\x95\xff\xff\xff\xff\xff\xff\x00\x00.",  # FRAME claiming 2^56 bytes
        b"\x80\x04\x8e\xff\xff\xff\xff\x00\x00\x00\x00.",  # BINBYTES8 claiming 2^32 bytes
        b"\x80\x04K\x01.",  # a pickled int, not a KvMetrics
        b"\x80\x04]\x94.",  # a pickled list
    ],
)
def test_malformed_pickles_are_schema_errors(payload: bytes) -> None:
    with pytest.raises(WireError) as info:
        decode_kv_metrics(payload, allow_pickle=True)
    assert info.value.reason == "schema"


def test_oversize_payloads_are_refused() -> None:
    for decode in (decode_kv_metrics, decode_load_stat):
        with pytest.raises(WireError) as info:
            decode(KVM_PAYLOAD, max_payload=len(KVM_PAYLOAD) - 1)
        assert info.value.reason == "oversize"


def _global(module: str, name: str) -> bytes:
    """Pickle opcodes pushing module.name (SHORT_BINUNICODE x2, STACK_GLOBAL)."""
    return (
        b"\x8c"
        + bytes([len(module)])
        + module.encode()
        + b"\x8c"
        + bytes([len(name)])
        + name.encode()
        + b"\x93"
    )


@pytest.mark.parametrize(
    ("target", "reason"),
    [(("msgspec._utils", "rebuild"), "pickle_forbidden"), ((S23_PATH, "KvMetrics"), "schema")],
)
def test_build_opcode_on_an_accepted_global_is_refused(
    target: tuple[str, str], reason: str
) -> None:
    # PROTO 4, <global>, {"x": 1}, BUILD, STOP: tries to set attributes on our own helpers
    payload = b"\x80\x04" + _global(*target) + b"}\x8c\x01xK\x01sb."
    with pytest.raises(WireError) as info:
        decode_kv_metrics(payload, allow_pickle=True)
    assert info.value.reason == reason
    assert not hasattr(sched._PickledKvMetrics, "x") and not hasattr(sched._rebuild, "x")
