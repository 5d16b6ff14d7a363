"""JSON views of KV-event batches: the hot-path fields, and every field on the wire (`tap`).

`batch_to_dict` renders what the hot-path decoder (`kv_events.py`) keeps. `batch_view` decodes
the payload a second time, generically, and names every field by each version's layout
(docs/wire.md has the table): `kvobserve tap` prints it, the hot path never runs it. Both keep
hashes as on the wire (integers; 32-byte hashes as lowercase hex).
"""

from __future__ import annotations

import datetime
from typing import Any

import msgspec

from kvobserve.engines import PROFILES
from kvobserve.engines.profile import opened
from kvobserve.wire.errors import WireError
from kvobserve.wire.kv_events import (
    MAIN_KV_CACHE_SPEC_KINDS,
    BlockRemoved,
    BlockStored,
    KvBatch,
    KvEvent,
    hash_json,
)

# Every field name of every version, from the engine profiles (kvobserve/engines/): per event,
# the positions of the longest array layout, the maps that sit at an array position
# (`{cache_salt}`: SGLang 0.5.18/19 puts one where vLLM has lora_name), and all names.
_VERSIONS = [v for p in PROFILES.values() if not p.event_plane for v in p.versions]
_ARRAY_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": max((v.stored for v in _VERSIONS if v.form == "array"), key=len),
    "BlockRemoved": max((v.removed for v in _VERSIONS if v.form == "array"), key=len),
    "AllBlocksCleared": (),
}
_ARRAY_MAPS: dict[str, dict[int, tuple[str, ...]]] = {
    tag: {
        i: opened(name)
        for v in _VERSIONS
        if v.form == "array"
        for i, name in enumerate(v.stored if tag == "BlockStored" else v.removed)
        if name.startswith("{")
    }
    for tag in ("BlockStored", "BlockRemoved")
}
# printed always (null when absent), in this order: the fields `tap` printed before the view
_CORE: dict[str, tuple[str, ...]] = {
    "BlockStored": ("block_hashes", "parent_block_hash", "block_size", "num_tokens", "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
_KNOWN: dict[str, frozenset[str]] = {
    "BlockStored": frozenset(n for v in _VERSIONS for f in v.stored for n in opened(f)),
    "BlockRemoved": frozenset(n for v in _VERSIONS for f in v.removed for n in opened(f)),
    "AllBlocksCleared": frozenset(),
}
# printed when set, in wire order: every known field but the core ones and the token ids
_OPTIONAL: dict[str, frozenset[str]] = {
    tag: _KNOWN[tag] - {*_CORE[tag], "token_ids"} for tag in _KNOWN
}


def event_to_dict(ev: KvEvent, token_ids: bool = False) -> dict[str, Any]:
    """The hot-path fields of one decoded event, normalized as in expected.json."""
    if isinstance(ev, BlockStored):
        d: dict[str, Any] = {
            "type": ev.kind,
            "block_hashes": [hash_json(h) for h in ev.block_hashes],
            "parent_block_hash": hash_json(ev.parent_block_hash),
            "block_size": ev.block_size,
            "num_tokens": ev.num_tokens,
            "medium": ev.medium,
        }
        lora_name = ev.lora()
        if lora_name is not None:
            d["lora_name"] = lora_name
        if token_ids:
            d["token_ids"] = ev.decoded_token_ids()
        return d
    if isinstance(ev, BlockRemoved):
        return {
            "type": ev.kind,
            "block_hashes": [hash_json(h) for h in ev.block_hashes],
            "medium": ev.medium,
        }
    return {"type": ev.kind}


def batch_to_dict(batch: KvBatch, token_ids: bool = False) -> dict[str, Any]:
    """The hot-path fields of one decoded batch."""
    return {
        "topic": batch.topic,
        "seq": batch.seq,
        "dp_rank": batch.dp_rank,
        "ts": batch.ts,
        "events": [event_to_dict(e, token_ids) for e in batch.events],
    }


def to_json(v: Any) -> Any:
    """A generically decoded msgpack value as JSON: bytes as hex, map keys as strings."""
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, list | tuple):
        return [to_json(x) for x in v]
    if isinstance(v, dict):
        return {str(to_json(k)): to_json(x) for k, x in v.items()}
    if isinstance(v, msgspec.msgpack.Ext):
        return {"ext": v.code, "data": bytes(v.data).hex()}
    if isinstance(v, datetime.datetime):  # the msgpack timestamp extension
        return v.isoformat()
    return v


def _named_fields(tag: str, values: list[Any]) -> tuple[dict[Any, Any], list[Any]]:
    """(fields by name, elements past the known positions) of an array-form event."""
    names = _ARRAY_FIELDS[tag]
    for at, inner in _ARRAY_MAPS.get(tag, {}).items():
        meta = values[at] if at < len(values) else None
        if not isinstance(meta, dict):
            continue
        # a version whose positions end with a map there (SGLang 0.5.18/19's metadata): no
        # name of the longer layouts applies at or after it
        fields: dict[Any, Any] = dict(zip(names[:at], values, strict=False))
        fields.update((k, meta.get(k)) for k in inner)
        other = {k: v for k, v in meta.items() if k not in inner}
        if other:
            fields["metadata"] = other  # not a known name: shown under unknown_fields
        return fields, values[at + 1 :]
    return dict(zip(names, values, strict=False)), values[len(names) :]


def _in_main_group(tag: str, fields: dict[Any, Any]) -> bool:
    """kv_events.in_main_group on a field dict, with the fields the hot path reads for `tag`."""
    if tag == "AllBlocksCleared":
        return True
    if fields.get("group_idx"):
        return False
    kind = fields.get("kv_cache_spec_kind") if tag == "BlockStored" else None
    return kind is None or kind in MAIN_KV_CACHE_SPEC_KINDS


def event_view(ev: list[Any] | dict[Any, Any], token_ids: bool = False) -> dict[str, Any]:
    """Every field of one generically decoded event: core fields, set fields, then the rest."""
    rest: list[Any] = []
    if isinstance(ev, list):
        tag = ev[0] if ev else None
        fields: dict[Any, Any] = {}
        if isinstance(tag, str) and tag in _ARRAY_FIELDS:
            fields, rest = _named_fields(tag, ev[1:])
        else:
            rest = ev[1:]
    else:
        tag = ev.get("type")
        fields = {k: v for k, v in ev.items() if k != "type"}
    if not isinstance(tag, str) or tag not in _ARRAY_FIELDS:
        shown = rest if isinstance(ev, list) else fields
        return {"type": to_json(tag), "unknown_event": True, "fields": to_json(shown)}
    out: dict[str, Any] = {"type": tag}
    tokens = fields.get("token_ids")
    for name in _CORE[tag]:
        if name == "block_hashes":
            hashes = fields.get(name)
            out[name] = [hash_json(h) for h in hashes] if isinstance(hashes, list) else None
        elif name == "parent_block_hash":
            out[name] = to_json(fields.get(name))
        elif name == "block_size":
            out[name] = fields.get(name, 0)
        elif name == "num_tokens":
            out[name] = len(tokens) if isinstance(tokens, list) else 0
        else:
            out[name] = to_json(fields.get(name))
    for name, value in fields.items():
        if name in _OPTIONAL[tag] and value is not None:
            out[name] = to_json(value)
    if not _in_main_group(tag, fields):
        out["other_group"] = True
    if token_ids and tag == "BlockStored":
        out["token_ids"] = to_json(tokens if tokens is not None else [])
    unknown = {k: v for k, v in fields.items() if k not in _KNOWN[tag]}
    if unknown:
        out["unknown_fields"] = to_json(unknown)
    if rest:
        out["trailing_fields"] = to_json(rest)
    return out


def batch_view(batch: KvBatch, payload: bytes, token_ids: bool = False) -> dict[str, Any]:
    """Every field of every event of a batch the hot path decoded from `payload`."""
    try:
        events = [event_view(ev, token_ids) for ev in msgspec.msgpack.decode(payload)[1]]
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        # token_ids and unused fields were skipped by the hot path, never checked
        raise WireError("msgpack", f"view: {exc}") from None
    except RecursionError:
        raise WireError("msgpack", "view: nesting too deep") from None
    return {
        "topic": batch.topic,
        "seq": batch.seq,
        "dp_rank": batch.dp_rank,
        "ts": batch.ts,
        "events": events,
    }
